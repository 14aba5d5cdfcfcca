"""pfl-research's simulator running fedfs's local step (the pfl column of ``peer_frameworks.py``).

Run by ``benchmarks/peer_frameworks.py`` with the interpreter of a venv that has ``pfl``
(``pip install 'pfl[pytorch]==0.6.0'``), either as one process or under
``python -m torch.distributed.run --nproc_per_node W`` — pfl's own multi-process mode:
:class:`pfl.internal.ops.pytorch_ops.PyTorchDistributedContext` joins the torchrun group
(gloo on CPU), each worker trains every W-th user of a cohort and pfl all-reduces the summed
model differences once per round.

What pfl runs, with the same pieces as fedfs's simulator and Flower's ClientApp:

* model: :class:`pfl.model.pytorch.PyTorchModel` around fedfs's ``FaceNet`` (the method's
  projection / FedUV head), round-0 weights ``initial_global_weights(config, ξ, seed=0)``,
  central optimizer SGD(lr=1) — ``w ← w + mean_c(w_c − w)``, FedAvg (all clients hold
  the same number of images, so pfl's unweighted mean equals the weighted one);
* algorithm: :class:`pfl.algorithm.FederatedAveraging` whose ``train_one_user`` runs
  ``fedfs_sdk.training.trainer.LocalTrainer`` (the device's local step: FedFS loss with ξ and θ_c,
  FedUV's codeword) instead of pfl's own SGD loop, and returns ``w_c − w`` as pfl's statistics;
* backend: :class:`pfl.aggregate.simulate.SimulatedBackend` over a
  :class:`pfl.data.federated_dataset.FederatedDataset` whose user sampler replays
  fedfs's participants (``Federation.sample_participants``: seeded, sorted), so all
  engines train the same clients each round.

Differences that stay (named so nobody reads more into the model difference): pfl's model
difference covers parameters only, so BatchNorm running statistics keep their round-0 values
(fedfs and Flower average them); ``θ_c`` lives in the worker process that trained the client, so
with 2 workers a client drawn again by the other worker restarts ``θ_c`` from the global model;
the local shuffles come from ``client_seed(0, round, client)``. pfl evaluates users before and
after training in round 1 (``do_evaluation`` at iteration 0); the model's ``metrics`` returns a
constant without a forward pass, so that costs pfl no model evaluation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch


def participants_schedule(clients: int, participation: float, rounds: int, seed: int = 0) -> list[np.ndarray]:
    """fedfs's participants per round (``Federation.sample_participants``: the same generator
    seed and draw), so every engine trains the same clients."""
    k = max(1, min(clients, round(participation * clients)))
    rng = np.random.default_rng([seed, 0x5A4D])
    return [np.sort(rng.choice(clients, k, replace=False)) for _ in range(rounds)]


def run(a: argparse.Namespace) -> None:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops import pytorch_ops
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from safetensors.torch import save_file

    from device_sim.federation import client_seed
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig
    from fedfs_sdk.training.methods import uses_fedfs, uses_feduv
    from fedfs_sdk.nn.model import FaceNet, ModelConfig
    from fedfs_sdk.training.trainer import LocalTrainer, initial_global_weights
    from fedfs_sdk.federation.wire import train_config_from_json
    from peer_flower import _population

    torch.set_num_threads(a.threads)
    dist = pytorch_ops.distributed
    rank, world = dist.global_rank, dist.world_size
    xi = load_checkpoint(a.xi_file)[0].eval()
    emb = int(xi.config.resolved().embedding_dim)
    mc = ModelConfig(a.backbone, input_size=a.image_size,
                     proj_dim=FedFSLossConfig().projection_dim(emb) if uses_fedfs(a.method) else None,
                     code_length=127 if uses_feduv(a.method) else None)
    pop = _population(a.clients, a.images, a.image_size)
    codeword = None
    if uses_feduv(a.method):     # the simulator's codewords v_u = C(b_u ‖ r_u), deterministic in (seed, client)
        from device_sim.methods import parse_method
        from device_sim.methods.base import SimContext

        sim_method = parse_method(a.method)
        sim_method.setup(SimContext(xi.config, xi, a.clients, 0, "cpu"))
        codeword = sim_method.codeword

    class Net(FaceNet):
        """FaceNet with the ``loss`` / ``metrics`` methods pfl's PyTorchModel asks for; training
        goes through fedfs's LocalTrainer, so ``loss`` is never called."""

        def loss(self, x):  # pragma: no cover - not used: train_one_user runs LocalTrainer
            raise RuntimeError("pfl's own SGD loop is not used")

        def metrics(self, x):
            return {"users": Weighted(0.0, 1)}

    net = Net(mc)
    net.load_state_dict(initial_global_weights(mc, xi, seed=0))
    trainer = LocalTrainer(mc, train_config_from_json(a.method, {"local_epochs": 1, "batch_size": a.batch_size}),
                           xi if uses_fedfs(a.method) else None)
    personal: dict[int, dict[str, torch.Tensor]] = {}     # θ_c of the clients this process trained

    class FedFSLocalStep(FederatedAveraging):
        """FedAvg whose client step is fedfs's LocalTrainer (FedFS Alg. 1 / FedUV Alg. 2)."""

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            c = int(user_dataset.user_id)
            r = int(central_context.current_central_iteration) + 1
            torch_model = model.pytorch_model
            start = {k: v.detach().clone() for k, v in torch_model.state_dict().items()}
            res = trainer.train(start, user_dataset.raw_data[0], personal_weights=personal.get(c),
                                codeword=codeword(c) if codeword is not None else None, seed=client_seed(0, r, c))
            if res.personal_weights is not None:
                personal[c] = res.personal_weights
            torch_model.load_state_dict(res.weights)
            stats = model.get_model_difference(initial_model_state, clone=True)
            torch_model.load_state_dict(start)      # buffers too (pfl restores the parameters only)
            return stats, Metrics()

    schedule = participants_schedule(a.clients, a.participation, a.rounds)
    order = iter(np.concatenate(schedule).tolist())

    def make_dataset(user_id):
        return Dataset((pop.train_images(int(user_id)).numpy(),), user_id=str(user_id))

    train_data = FederatedDataset(make_dataset, lambda: next(order))
    marks: list[float] = []

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            marks.append(time.perf_counter())
            return False, Metrics()

    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    k = len(schedule[0])
    FedFSLocalStep().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=a.rounds, evaluation_frequency=a.rounds + 1,
                                           train_cohort_size=k, val_cohort_size=None),
        backend=SimulatedBackend(training_data=train_data, val_data=train_data),
        model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=0.0,
                                              local_batch_size=a.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=a.batch_size),
        callbacks=[Clock()], send_metrics_to_platform=False)
    if rank != 0:
        return
    if len(marks) != a.rounds + 1:
        raise RuntimeError(f"pfl ran {len(marks) - 1} of {a.rounds} rounds")
    out = Path(a.out)
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(out / "global.safetensors"))
    updates = k * a.rounds
    warm = (k * (a.rounds - 1), marks[-1] - marks[1]) if a.rounds > 1 else (updates, marks[-1] - marks[0])
    (out / "result.json").write_text(json.dumps({
        "updates_per_s": updates / (marks[-1] - marks[0]), "warm_updates_per_s": warm[0] / warm[1],
        "world_size": world}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="fedfs", choices=["fedfs", "feduv", "fedfs+feduv"])
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--participation", type=float, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--images", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--backbone", default="tiny")
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads per pfl process")
    p.add_argument("--xi-file", required=True)
    p.add_argument("--out", required=True, help="folder for result.json and global.safetensors")
    p.add_argument("--launch", type=int, default=0,
                   help="start this many pfl worker processes in this process's session (pfl's "
                        "PFL_WORKER_ADDRESSES / PFL_WORKER_RANK) and wait for them; 0: be one process")
    a = p.parse_args()
    if os.environ.get("OMP_NUM_THREADS") is None:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    if a.launch > 0:
        launch(a.launch)
    else:
        run(a)


def launch(workers: int) -> None:
    """pfl's multi-process mode without torchrun: ``workers`` copies of this script, rank i
    told by ``PFL_WORKER_RANK``, the group's master by ``PFL_WORKER_ADDRESSES``'s first entry
    (pfl's GenericPlatform). Unlike torchrun they stay in this session, as ``fedfs simulate
    --workers`` does (see ``peer_flower._tree`` on why that matters on a shared machine)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--launch")
    del argv[i:i + 2]
    addresses = ",".join(f"127.0.0.1:{port + r}" for r in range(workers))
    procs = [subprocess.Popen([sys.executable, __file__, *argv],
                              env={**os.environ, "PFL_WORKER_ADDRESSES": addresses, "PFL_WORKER_RANK": str(r)})
             for r in range(workers)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"pfl workers exited with {codes}")


if __name__ == "__main__":
    main()
