"""``fedfs demo``: the whole story on a laptop CPU in a few minutes.

1. generates SynthFaces identities (public / clients / new users);
2. pre-trains a small ξ on the public identities (CosFace; cached);
3. on the cross-domain scenario (ξ pre-trained on SynthFaces 'studio', clients on 'phone',
   docs/personalization.md) runs ξ, the honest references (local-compact, norm-adapt, the
   supervised oracle), FedFS (the paper's configuration) and the default FedFS+FedUV side
   by side on the same 100 clients (same seed, same sampled participants);
4. enrolls one client with :func:`fedfs_sdk.runtime.enrollment.enroll` on the verifier its
   do-no-harm check chose, with τ set for FAR 1e-3 on the run's public impostor set (or, when
   that would accept fewer than q = 0.9 of its own photos, FedUV's warm-up τ), prints that
   operating point (TAR, FAR) and the accept rate of the other clients' held-out photos, and
   verifies one of its own held-out images and one stranger's image;
5. prints the table (also written to ``--out``: results.json, results.md, roc.png).
"""
from __future__ import annotations

import argparse
import time

import torch

from fedfs_sdk.errors import OperatingPointError
from fedfs_sdk.runtime.enrollment import enroll, score, verify
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.runtime.operating_point import describe

from . import cli_simulate
from .experiment import ExperimentConfig
from .experiment_resolve import experiment_from_args
from .federation import Federation
from .population import Population
from .report import headroom_line, markdown_table
from .scenarios import SCENARIOS

DEMO_DEFAULTS = dict(clients=100, new_users=10, public=300, train_per_client=20, test_per_client=10,
                     public_images=20, rounds=20, participation=0.5, pretrain_epochs=10, image_size=32,
                     scenario="cross-domain")
DEMO_METHODS = ["pretrained", "local-compact", "norm-adapt", "oracle", "fedfs", "fedfs+feduv"]
"""ξ, the honest references (docs/personalization.md), FedFS (its default is the paper's
configuration) and the default FedFS+FedUV."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEMO_DEFAULTS
    p.add_argument("--out", default="runs/demo", help="output directory for results.json, results.md and roc.png "
                   "(a relative path is relative to the current directory)")
    p.add_argument("--clients", type=int, default=d["clients"], help="federated clients, one SynthFaces identity each")
    p.add_argument("--new-users", type=int, default=d["new_users"], help="identities never seen in training")
    p.add_argument("--public", type=int, default=d["public"], help="public identities for pre-training ξ")
    p.add_argument("--train-per-client", type=int, default=d["train_per_client"], help="local training images per client")
    p.add_argument("--test-per-client", type=int, default=d["test_per_client"], help="held-out test images per client")
    p.add_argument("--public-images", type=int, default=d["public_images"], help="images per public identity")
    p.add_argument("--rounds", type=int, default=d["rounds"], help="federated rounds T")
    p.add_argument("--participation", type=float, default=d["participation"], help="fraction of clients per round")
    p.add_argument("--pretrain-epochs", type=int, default=d["pretrain_epochs"], help="epochs of ξ pre-training")
    p.add_argument("--method", nargs="+", default=DEMO_METHODS,
                   help="methods to run side by side (see fedfs simulate --help)")
    p.add_argument("--scenario", default=d["scenario"], choices=sorted(SCENARIOS),
                   help="where ξ is pre-trained and where the clients live (see fedfs simulate --help)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="federation seed (sampling, init, local shuffles)")
    p.add_argument("--cache-dir", default=None,
                   help="ξ cache (default $FEDFS_CACHE_DIR/pretrained or ~/.cache/fedfs/pretrained)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def simulate_config(args: argparse.Namespace) -> ExperimentConfig:
    """The resolved config of ``fedfs simulate`` with the demo's options."""
    p = argparse.ArgumentParser()
    cli_simulate.add_arguments(p)
    sim = vars(p.parse_args([]))
    sim.update({k: v for k, v in vars(args).items() if k in sim and k != "command"})
    return experiment_from_args(argparse.Namespace(**sim))


def demo_enrollment(fed: Federation, pop: Population, client: int = 0, impostors=None, far: float = 1e-3,
                    q: float = 0.9) -> dict:
    """Enroll ``client`` with its own verifier (the one its do-no-harm check chose) on its local
    images and verify one held-out image of its own and one of another client.

    With ``impostors`` (the run's public impostor set) τ is set for ``far`` on it
    (:mod:`fedfs_sdk.runtime.operating_point`) when the warm-up still accepts ``q`` of the owner's
    photos, else FedUV's warm-up τ for ``q`` is kept and its FAR measured; either way the
    operating point is returned with the accept rate of the other clients' held-out photos."""
    spec = fed.method.verifier(fed.client_state(client), fed.global_weights, fed.private_weights(client))
    spec.net.load_state_dict(spec.weights, strict=True)
    backend = TorchBackend(spec.net, model_id=f"demo/{fed.method.name}/client{client}")
    warm = pop.train_images(client).numpy()
    refused = None
    try:
        enrollment = enroll(backend, warm, q=q, codeword=spec.codeword, impostors=impostors,
                            far=far if impostors is not None else None)
    except OperatingPointError as e:
        refused = str(e)
        enrollment = enroll(backend, warm, q=q, codeword=spec.codeword, impostors=impostors)
    own = pop.test_images(client)[:1].numpy()
    others = torch.cat([pop.test_images(c) for c in range(pop.num_clients) if c != client]).numpy()
    accepted = score(backend, enrollment, others) >= enrollment.threshold
    return {"client": client, "method": fed.method.label, "mode": enrollment.mode,
            "threshold": enrollment.threshold, "n_warmup": enrollment.n_warmup, "enrollment": enrollment,
            "refused": refused, "others_accepted": float(accepted.mean()), "others": int(accepted.size),
            "own": verify(backend, enrollment, own), "stranger": verify(backend, enrollment, others[:1])}


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = simulate_config(args)
    feds: dict[str, Federation] = {}
    results = cli_simulate.run_simulation(cfg, title="fedfs demo", keep=feds)
    table = markdown_table(results["methods"], f"fedfs demo — {cfg.data.scenario} scenario, "
                                               f"{results['population']['clients']} SynthFaces clients, "
                                               f"{cfg.train.rounds} rounds, participation {cfg.train.participation}")
    print(table)
    print(headroom_line(results["methods"]))
    xi_stats = results["xi"]["stats"]
    print(f"ξ: pre-trained on {results['population']['public']} public identities "
          f"(train acc {xi_stats.get('final_train_acc', float('nan')):.2f}{', cached' if results['xi']['cached'] else ''})")
    combined = next((s for s in cfg.train.method if s.split(":")[0] == "fedfs+feduv"), None) or \
        next((s for s in cfg.train.method if s.split(":")[0] != "pretrained"), None)
    if combined is not None:
        fed = feds[combined]
        pop = getattr(fed.data, "pop", fed.data)          # all of the client's photos (the hold-out too)
        info = demo_enrollment(fed, pop, client=0, impostors=cli_simulate.public_impostors(cfg, pop))
        own, stranger = info["own"], info["stranger"]
        print(f"\nenrollment ({info['method']}, client {info['client']}, {info['mode']} mode, "
              f"{info['n_warmup']} warm-up images): threshold τ = {info['threshold']:.4f}")
        if info["refused"]:
            print(f"  FAR {1e-3:g} target refused ({info['refused']}); FedUV's warm-up τ (q = 0.9) kept")
        print(f"  {describe(info['enrollment'].meta)}")
        print(f"  other clients' held-out photos accepted at τ: {info['others_accepted']:.4f} of {info['others']}")
        print(f"  verify own held-out image:   {'ACCEPT' if own.accepted else 'reject'} (score {own.score:.4f})")
        print(f"  verify a stranger's image:   {'ACCEPT' if stranger.accepted else 'reject'} (score {stranger.score:.4f})")
    print(f"\nwrote {', '.join(results['files'].values())}; total {time.perf_counter() - t0:.0f} s")
    return 0


__all__ = ["add_arguments", "run", "demo_enrollment", "DEMO_DEFAULTS"]
