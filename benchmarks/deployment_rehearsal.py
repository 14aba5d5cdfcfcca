"""Deployment rehearsal: the clients of a ``fedfs simulate`` split as real devices of a real server,
scored next to the simulator on the same clients (issue 29, item 5).

    PYTHONPATH=. .venv/bin/python benchmarks/deployment_rehearsal.py --out runs/rehearsal \\
        --data synth --clients 12 --new-users 0 --rounds 2 --seed 0 --split-seed 0
    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/deployment_rehearsal.py --out runs/reh-night \\
        --sim-results /tmp/stats/runs/px-real-night/seed_0/results.json \\
        --data /tmp/stats/lfw-112 --pretrained /tmp/stats-xi.safetensors --image-size 112 \\
        --backbone mobilefacenet-affine --scenario real-night --method pretrained fedfs+feduv \\
        --rounds 20 --seed 0 --split-seed 0 --threads 1

Every argument the rehearsal does not know is a ``fedfs simulate`` argument: the split (data,
scenario, sizes, ``--split-seed``), ξ, the methods, T, p, ``--seed``. What it does:

1. **The simulator's split and data** (:func:`device_sim.experiment_data.build_data`, the same
   resolved config): client ``c`` of the deployment is client ``c`` of the simulation. Its
   training photos (as the simulator's devices see them: capture shift applied) are written as
   PNG files into the device's own folder — a device holds only its owner's training photos.
2. **An operator, a server, devices** (:mod:`benchmarks.rehearsal_fleet`): a CA in its own folder
   (never the server's state), the server's TLS certificate, a signed revocation list; a real
   ``fedfs serve`` process with HTTPS and ``fedfs-secagg/2`` serving ξ and the public impostor
   set the simulator's devices ship with (its public identities as ξ saw them), running the
   deployed method (default: the first trained method of ``--method``, i.e. the simulator's
   default ``fedfs+feduv``) for T rounds at participation p, seed and local batch size as
   simulated. Each client is a :class:`~fedfs_sdk.federation.agent.DeviceAgent` (its own state
   folder, identity key, certificate and key file) run as ``fedfs device --enroll`` runs it, one
   thread each (secure rounds need their sampled devices at once); every device enrolls.
3. **Evaluation with the simulator's own code**: each device's enrollment — the verifier it chose
   and the template it enrolled — is read from its state folder (**a test-bench privilege**: a
   real device shows neither to anyone) and scored by :func:`device_sim.evaluate.evaluate` with
   the simulator's evaluation settings: the same clients, test photos and impostor pool. ξ as the
   server served it is scored too: it must reproduce the simulator's ``pretrained`` row per client
   (the check that both sides score the same clients on the same photos).
4. **The simulator** on the same arguments (in this process, ``OUT/simulate``), or its
   ``results.json`` (``--sim-results``, refused unless it was run on the same split and clients).
5. **Prints** per row the means and the paired per-client Δ vs ξ (mean ± SE) of template AUROC,
   pairwise AUROC and TAR@FAR 1e-3 (template and pairwise), what each device chose, then the
   paired per-client difference deployment − simulator for every simulator row; time (wall, CPU
   of this process and of the server) and bytes per device. ``OUT/rehearsal.json`` holds it all,
   with the per-client values.

What the design guarantees, and what it does not: ξ served by the server equals the simulator's ξ
and is scored on the same photos, so the "deployed ξ" row equals the ``pretrained`` row client by
client (floating-point noise only). Trained models are not expected to agree client by client:
the server samples devices with its own generator, a device holds out photos by a hash of their
file names (the simulator by a seeded draw), trains with its own seeds, and — until the
statistics round reaches devices — runs ``norm_init=none`` and checks candidates against the
public impostor set (``check=public``), where the simulator's default uses the federation's
statistics (``norm_init=standardize``, ``check=in-domain``). The comparison rows measure that gap.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rehearsal_deploy import deploy, free_port, log, read_deployment  # noqa: E402
from rehearsal_eval import (choice_counts, compare, device_spec, evaluate_specs, markdown, per_client,  # noqa: E402
                            xi_spec)
from rehearsal_fleet import PHASES, Device, ServerPlan, process_cpu_seconds, set_enroll_concurrency  # noqa: E402
from rehearsal_sim import check_same_split, sim_rows, to_u8, train_settings, write_impostors  # noqa: E402

DEPLOYABLE = ("fedfs", "feduv", "fedfs+feduv")


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="every other argument is passed to `fedfs simulate`")
    p.add_argument("--out", type=Path, default=Path("runs/rehearsal"), help="output folder (fleet, server, results)")
    p.add_argument("--sim-results", type=Path, help="the simulator's results.json on the same arguments "
                   "(default: run the simulator here, into OUT/simulate)")
    p.add_argument("--deploy", default=None, choices=DEPLOYABLE,
                   help="the method the server runs (default: the first trained method of --method)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more `fedfs serve` argument (repeat; e.g. --server-arg=--secagg-neighbours "
                        "--server-arg=8)")
    p.add_argument("--no-impostors", action="store_true",
                   help="the server ships no public impostor set (devices then keep ξ, and say so)")
    p.add_argument("--eval-device-template", action=argparse.BooleanOptionalAction, default=True,
                   help="score each device's enrolled template (default); off: the simulator enrolls the "
                        "device's verifier on all of the client's training photos itself")
    p.add_argument("--outliers", choices=("none", "mad"), default="none",
                   help="the devices' enrollment outlier rule: 'none' (default: the simulator's evaluation "
                        "enrolls every training photo) or 'mad' (fedfs device's default; a device whose "
                        "inliers fall below q's warm-up minimum then fails to enroll)")
    p.add_argument("--deploy-only", action="store_true",
                   help="skip the simulator (e.g. to time a deployment of fewer rounds); Δ vs ξ as served")
    p.add_argument("--rescore", action="store_true",
                   help="do not deploy: score the fleet an earlier run left in OUT (OUT/deployment.json) again, "
                        "e.g. against another --sim-results")
    p.add_argument("--resume", action="store_true",
                   help="an earlier run in OUT stopped (its devices' states and the server's remain): start the "
                        "server again on its state and port and run every device again — they finish their "
                        "rounds and enroll, as `fedfs device` re-run does")
    p.add_argument("--enroll-concurrency", type=int, default=16,
                   help="devices enrolling at once (each check holds ~150 MB with a MobileFaceNet; default 16). "
                        "Enrolling devices take part in the check-results statistics round, which publishes over "
                        "≥ 10 devices: a gate below that (8 was the default) stalls the round to its deadline")
    p.add_argument("--partial", action="store_true",
                   help="with --rescore: compare on the clients whose device enrolled (a run stopped before all did)")
    p.add_argument("--phones", type=float, default=0.0, metavar="SHARE",
                   help="this share of the devices (spread evenly; 0.5: every odd client) run as phones: ONNX "
                        "Runtime from `fedfs export`'s default artifacts of the server's model (no torch in their "
                        "training, statistics, check or enrollment); default 0")
    p.add_argument("--quiet", action="store_true")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, sim_argv = parse(argv)
    from device_sim.cli_common import single_thread_blas
    from device_sim.cli_simulate import experiment_from_argv, run_simulation
    from device_sim.experiment_data import build_data
    from device_sim.evaluate import EvalConfig
    from device_sim.folder_split import auto_warmup_q
    from device_sim.methods import parse_method
    from device_sim.population import Population
    from device_sim.xi_source import resolve_xi
    import torch

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = experiment_from_argv(sim_argv + ["--out", str(out / "simulate")] + (["--quiet"] if args.quiet else []),
                               command="simulate")
    torch.set_num_threads(cfg.runtime.threads or 1)
    # NumPy's BLAS on one thread, as the simulator runs (device_sim.cli_common.single_thread_blas): every
    # device's check takes an eigh of its 512×512 feature covariance, and OpenBLAS's two threads busy-wait —
    # 16 devices checking at once spent 86% of their check in eigh (3 s CPU each, against 0.07 s on one thread)
    single_thread_blas()
    set_enroll_concurrency(args.enroll_concurrency)
    t_start, cpu_start = time.perf_counter(), process_cpu_seconds()
    timing: dict[str, float] = {}

    # 1. the simulator's split, data and ξ
    ds, splits = build_data(cfg)
    pop = Population(ds, splits)
    xi, xi_info = resolve_xi(cfg, ds, splits, quiet=True)
    q = cfg.evaluation.q or (auto_warmup_q(splits)[0] if cfg.data.data != "synth" else 0.9)
    eval_cfg = EvalConfig(q=q, max_clients=cfg.evaluation.eval_clients, impostor_pool=cfg.evaluation.impostor_pool,
                          seed=cfg.train.seed)
    trained = [s for s in cfg.train.method if parse_method(s).trains]
    deploy_spec = next((s for s in trained if parse_method(s).name == args.deploy), None) if args.deploy else \
        (trained[0] if trained else None)
    method = args.deploy or (parse_method(deploy_spec).name if deploy_spec else None)
    if method not in DEPLOYABLE:
        raise SystemExit(f"nothing to deploy: --method {list(cfg.train.method)} has none of {DEPLOYABLE}")
    xi_name = xi_info["builtin"] if "builtin" in xi_info else str(xi_info["path"])
    impostors = None if args.no_impostors else write_impostors(cfg, ds, splits, out / "impostors.npz")
    plan = ServerPlan(xi=xi_name, impostors=impostors, method=method, rounds=cfg.train.rounds,
                      participation=cfg.train.participation, seed=cfg.train.seed,
                      train=train_settings(cfg, deploy_spec or method), extra=tuple(args.server_arg),
                      # each waiting device polls at this hint: quick for a handful, 2 s (the default) for many
                      poll_interval=0.5 if pop.num_clients <= 20 else 2.0)
    timing["data_s"] = time.perf_counter() - t_start
    log(f"{pop.num_clients} clients, q={q:g}, ξ {xi_name}; deploying {method} for {plan.rounds} rounds "
        f"at p={plan.participation:g}, train {plan.train}", args.quiet)

    # 2. operator, server, devices (or, with --rescore, the fleet an earlier run left)
    record = read_deployment(out) if args.rescore else deploy(args, out, pop, plan, q)
    devices = [Device(c, out / "fleet" / f"client_{c:05d}", [], Path()) for c in range(pop.num_clients)]
    timing.update(record["timing"])
    per_dev = record["per_device"]

    # 3. the deployed enrollments, scored by the simulator's evaluation
    t0 = time.perf_counter()
    xi_backbone = getattr(xi, "backbone", xi)
    specs, metas, on_xi_trunk = {}, {}, {}
    served = xi_spec(devices[0].state_dir / "xi.safetensors", xi_backbone)
    enrolled = {d.client: (d.state_dir / "enrollment.fedfs").is_file() for d in devices}
    if not all(enrolled.values()) and not args.partial:
        raise SystemExit(f"{sum(not e for e in enrolled.values())} device(s) have no enrollment: --resume the run, "
                         "or --rescore --partial to compare on the enrolled clients only")
    phone_config = None                 # the server's model configuration: a phone's verifier.onnx read in torch
    if (out / "server-v1.safetensors").is_file():
        from fedfs_sdk.nn.checkpoint import read_checkpoint

        phone_config = read_checkpoint(out / "server-v1.safetensors")[1]
    for d in devices:
        if not enrolled[d.client]:      # --partial: a placeholder, left out of every row below
            specs[d.client], metas[d.client], on_xi_trunk[d.client] = served, {"model_choice": None}, 0.0
            continue
        specs[d.client], metas[d.client], on_xi_trunk[d.client] = device_spec(
            d.state_dir, (d.dir / "device.key").read_bytes(), xi_backbone, args.eval_device_template, phone_config)
    deployed = evaluate_specs(specs, pop, eval_cfg, cfg.runtime.device)
    xi_eval = evaluate_specs({d.client: served for d in devices}, pop, eval_cfg, cfg.runtime.device)
    timing["eval_s"] = time.perf_counter() - t0

    # 4. the simulator on the same arguments
    t0 = time.perf_counter()
    if args.deploy_only:
        results = {"methods": []}
    elif args.sim_results is not None:
        results = json.loads(args.sim_results.read_text())
        check_same_split(results, cfg, pop, ds, splits, deployed["clients"])
    else:
        log("running the simulator on the same arguments", args.quiet)
        results = run_simulation(cfg)
    timing["simulate_s"] = time.perf_counter() - t0
    sims = sim_rows(results)
    ref = next((r for r in sims.values() if r["method"] == "pretrained"), None)
    if args.deploy_only:        # no simulator: Δ vs ξ as served
        ref = {"label": "ξ as served", "eval": xi_eval}
    elif ref is None:
        raise SystemExit("the simulator's rows have no 'pretrained' (ξ) row: add pretrained to --method")

    # 5. the tables
    clients = deployed["clients"]
    keep = [enrolled[c] for c in clients]       # every client, unless --partial
    dep_choices = [metas[c].get("model_choice") for c, k in zip(clients, keep) if k]
    def sim_choices(r: dict[str, Any]) -> list | None:
        per = (r.get("selection") or {}).get("per_client")
        return None if per is None else [x for x, k in zip(per, keep) if k]

    rows = [{"name": f"simulator: {label}", "values": per_client(r["eval"], keep),
             "vs_xi": None if r is ref else compare(r["eval"], ref["eval"], keep),
             "choices": choice_counts(sim_choices(r)) if r.get("selection") else None,
             "per_client_choice": sim_choices(r)} for label, r in sims.items()]
    rows += [{"name": "deployment: ξ as served", "values": per_client(xi_eval, keep),
              "vs_xi": compare(xi_eval, ref["eval"], keep), "choices": None},
             {"name": f"deployment: {method}", "values": per_client(deployed, keep),
              "vs_xi": compare(deployed, ref["eval"], keep),
              "choices": choice_counts(dep_choices), "per_client_choice": dep_choices}]
    comparisons = [] if args.deploy_only else [{"a": "deployed ξ", "b": ref["label"],
                                                 "delta": compare(xi_eval, ref["eval"], keep)}]
    comparisons += [{"a": f"deployed {method}", "b": label, "delta": compare(deployed, r["eval"], keep)}
                    for label, r in sims.items() if r is not ref]
    runtimes = per_dev.get("runtime") or ["torch"] * len(devices)
    if "ort" in runtimes and "torch" in runtimes:     # a mixed fleet: each kind of device on its own clients too
        for kind in ("ort", "torch"):
            mine = [bool(k and r == kind) for k, r in zip(keep, runtimes)]
            comparisons += [{"a": f"deployed {method} ({'phones, ONNX Runtime' if kind == 'ort' else 'torch devices'})",
                             "b": label, "delta": compare(deployed, r["eval"], mine)}
                            for label, r in sims.items() if r is not ref]
    phases = {name: {k: float(sum(p[name][k] for p in per_dev["phases"])) for k in ("wall_s", "cpu_s")}
              for name, _, _ in PHASES}
    timing["total_wall_s"] = time.perf_counter() - t_start
    timing["total_cpu_s"] = process_cpu_seconds() - cpu_start + timing.get("server_cpu_s", 0.0)
    sim_time = {label: {"train_s": r.get("seconds"), "eval_s": r.get("eval_seconds")} for label, r in sims.items()}
    table = markdown(rows, comparisons)
    cost = (f"deployment: {len(devices)} devices, {plan.rounds} rounds"
            + (f" (rounds took {' / '.join(f'{r:.0f}' for r in timing['rounds_s'])} s)" if timing.get("rounds_s") else "")
            + (" — resumed after a stop: fleet figures are the resumed run's" if timing.get("resumed") else "")
            + (f"; compared on the {sum(keep)} of {len(keep)} clients whose device enrolled" if not all(keep) else "")
            + f"; fleet wall {timing['fleet_wall_s']:.0f} s, "
            f"CPU {timing['fleet_cpu_s']:.0f} s (devices, this process) + {timing['server_cpu_s']:.0f} s (server); "
            f"per device sent {np.mean(per_dev['sent_bytes']) / 1e6:.2f} MB, received "
            f"{np.mean(per_dev['received_bytes']) / 1e6:.2f} MB (mean), {np.mean(per_dev['rounds']):.1f} rounds; "
            f"registration {timing['register_s']:.0f} s, evaluation {timing['eval_s']:.0f} s; device CPU by phase "
            + ", ".join(f"{k} {v['cpu_s']:.0f} s" for k, v in phases.items())
            + "".join(f"; {kind} devices ({runtimes.count(kind)}): CPU {np.mean([c for c, r in zip(per_dev['cpu_s'], runtimes) if r == kind]):.1f} s, "
                      f"received {np.mean([b for b, r in zip(per_dev['received_bytes'], runtimes) if r == kind]) / 1e6:.2f} MB each"
                      for kind in ("ort", "torch") if "ort" in runtimes and kind in runtimes)
            + "; simulator "
            + ", ".join(f"{k}: train {v['train_s'] or 0:.0f} s" for k, v in sim_time.items()))
    report = {"settings": {"simulate_argv": sim_argv, "server": record["plan"], "server_flags": record["server_flags"],
                           "q": q,
                           "eval_device_template": args.eval_device_template, "outliers": args.outliers,
                           "sim_results": str(args.sim_results) if args.sim_results else None},
              "clients": clients, "compared": keep, "test_photos": [int(splits.clients[c].test.size) for c in clients],
              "train_photos": [int(splits.clients[c].train.size) for c in clients],
              "rows": rows, "comparisons": comparisons, "timing": timing, "per_device": per_dev,
              "phases_total": phases,
              "simulator_timing": sim_time, "table": table, "cost": cost,
              "device_selection": [metas[c].get("selection") for c in clients],
              # scope=top: max |Δ| of each deployed verifier's trunk from ξ's (≤ TRUNK_ATOL: scored on ξ's trunk)
              "verifier_trunk_deviation": [on_xi_trunk[c] for c in clients]}
    (out / "rehearsal.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "rehearsal.md").write_text(table + "\n\n" + cost + "\n")
    if not args.quiet:
        print(table)
        print()
        print(cost)
    return report


# step 2 (deploy) and the simulator's side moved to rehearsal_deploy.py / rehearsal_sim.py: re-exported here
__all__ = ["main", "parse", "DEPLOYABLE", "deploy", "read_deployment", "free_port", "log", "to_u8", "write_impostors",
           "train_settings", "sim_rows", "check_same_split"]

if __name__ == "__main__":
    main()
