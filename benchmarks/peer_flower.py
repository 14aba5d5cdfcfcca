"""fedfs's simulator vs Flower's simulation engine (the Flower column of issue 14 item 4).

Same clients (SynthFaces, the ``fedfs simulate`` split: N clients, 20 training images each),
same model (``--backbone``: tiny at 32 px or MobileFaceNet at 112 px, with the method's
projection / FedUV head; Flower's ξ is a random one of the same architecture, since only the
speed is compared), same local
objective and settings (``fedfs_sdk.training.trainer.LocalTrainer``, 1 epoch, batch 10, the method's
default lr), same participation and rounds. Each run is a fresh process, the two engines
interleaved (A B A B …) so a shared machine's drift hits both.

* fedfs: ``fedfs simulate --threads T`` (one process); client-updates/s = participants /
  training seconds of its rounds (results.json), as ``benchmarks/sim_workers.py``.
* Flower: ``flwr.simulation.run_simulation`` (Ray backend, one actor per CPU core, 1 torch
  thread each) with fedfs_flower's ClientApp and FedFSStrategy; the ClientApp takes the
  same in-memory client images (``images_fn``). Client-updates/s = participants / seconds
  from the first round's start to the last round's aggregation; ``warm`` leaves round 1 out
  (Ray actors start and import torch during it).

Wall time is the whole process (start-up, data, ξ from the cache, fedfs's evaluation of 20
clients). Peak RSS is the largest sum of resident memory over the process tree (Ray's raylet,
GCS and workers included), sampled every 0.2 s.

    PYTHONPATH=. /path/to/venv-with-flwr/bin/python benchmarks/peer_flower.py
    PYTHONPATH=. python benchmarks/peer_flower.py --method feduv --clients 1000 --participation 0.1 --rounds 3
    PYTHONPATH=. python benchmarks/peer_flower.py --backbone mobilefacenet --clients 50 --participation 0.2 --random-xi
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
PAGE = resource.getpagesize()


# ---- process-tree peak RSS ---------------------------------------------------------------

def _tree(root: int) -> tuple[int, set[int], set[int]]:
    """Resident bytes summed over ``root`` and its descendants, their session ids and their
    process ids (from /proc).

    Sessions matter on a shared Linux machine: with ``kernel.sched_autogroup_enabled=1`` the
    scheduler shares the CPU fairly between *sessions* (autogroups), not processes, so a
    launcher that starts each worker in a new session (torchrun does, ``start_new_session``)
    takes a larger share from other users' jobs than workers that stay in one session."""
    parent: dict[int, int] = {}
    sid: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(d)], sid[int(d)] = int(fields[1]), int(fields[3])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            pass
    return total, {sid[p] for p in tree if p in sid}, tree


def _sched(pids: set[int], seen: dict[tuple[int, int], tuple[int, int]]) -> None:
    """Record each thread's ``/proc/PID/task/TID/schedstat`` of ``pids`` in ``seen``:
    ``(pid, tid) → (ns on a CPU, ns runnable but waiting for one)``. Sampled, so a thread that
    ends between two samples loses at most one interval's growth."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    run, wait, _ = f.read().split()
            except (OSError, ValueError):
                continue
            seen[(pid, int(t))] = (int(run), int(wait))


def run_measured(cmd: list[str], env: dict[str, str], stats: dict | None = None) -> tuple[float, int]:
    """Run ``cmd``; returns (wall seconds, peak process-tree RSS bytes). ``stats`` receives
    ``sessions``: how many session ids the tree used (see :func:`_tree`), and ``cpu_s``: the CPU
    seconds (user + system) of the whole tree — every descendant that its parent waited for,
    as ``getrusage(RUSAGE_CHILDREN)`` counts them; on a shared machine this, not wall time, is
    the cost of the work (run one command at a time: the count is this process's children's);
    and ``ready_wait_s``: the seconds the tree's threads were runnable but waiting for a CPU
    (``schedstat``, summed over threads) — the wall time other people's load took from it."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]
    sessions: set[int] = set()
    sched: dict[tuple[int, int], tuple[int, int]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss, sids, pids = _tree(proc.pid)
            peak[0] = max(peak[0], rss)
            sessions.update(sids)
            _sched(pids, sched)
            done.wait(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} … exited with {proc.returncode}:\n{err[-3000:]}")
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if stats is not None:
        stats["sessions"] = len(sessions)
        stats["cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        stats["ready_wait_s"] = sum(w for _, w in sched.values()) / 1e9
    return wall, peak[0]


# ---- fedfs's simulator -------------------------------------------------------------------

def run_fedfs(a: argparse.Namespace, env: dict[str, str], tmp: Path, rounds: int | None = None) -> dict[str, float]:
    out = tmp / f"fedfs_{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "simulate", "--method", a.method, "--clients", str(a.clients),
           "--participation", str(a.participation), "--rounds", str(rounds or a.rounds), "--train-per-client",
           str(a.images), "--local-epochs", "1", "--batch-size", str(a.batch_size), "--eval-clients", "20",
           "--quiet", "--threads", str(a.threads), "--backbone", a.backbone, "--image-size", str(a.image_size),
           "--out", str(out)]
    if a.pretrain_epochs is not None:
        cmd += ["--pretrain-epochs", str(a.pretrain_epochs)]
    if a.xi_file:
        cmd += ["--pretrained", a.xi_file]
    wall, rss = run_measured(cmd, env)
    hist = json.loads((out / "results.json").read_text())["methods"][0]["history"]
    updates, seconds = sum(h["participants"] for h in hist), sum(h["seconds"] for h in hist)
    warm = hist[1:] or hist
    return {"updates_per_s": updates / seconds, "warm_updates_per_s": sum(h["participants"] for h in warm)
            / sum(h["seconds"] for h in warm), "wall_s": wall, "peak_rss_mb": rss / 2 ** 20}


# ---- Flower's simulation engine (child process) ------------------------------------------

_POP = {}


def _population(clients: int, images: int, size: int):
    """The ``fedfs simulate`` clients (synth data, default split seeds), built once per process."""
    if "pop" not in _POP:
        from device_sim.cli_common import add_data_arguments
        from device_sim.experiment_data import build_data
        from device_sim.experiment_resolve import experiment_from_args
        from device_sim.population import Population

        p = argparse.ArgumentParser()
        add_data_arguments(p)
        ds, splits = build_data(experiment_from_args(p.parse_args(
            ["--clients", str(clients), "--train-per-client", str(images), "--image-size", str(size)])))
        _POP["pop"] = Population(ds, splits)
    return _POP["pop"]


def flower_child(a: argparse.Namespace, tmp: Path, result_file: Path) -> None:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedfs_flower.client_app import create_app
    from fedfs_flower.settings import ServerSettings
    from fedfs_flower.strategy import FedFSStrategy
    from fedfs_sdk.nn.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
    from fedfs_sdk.training.methods import uses_fedfs, uses_feduv
    from fedfs_sdk.nn.model import FaceNet, ModelConfig
    from fedfs_sdk.training.trainer import initial_global_weights

    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    xi = load_checkpoint(a.xi_file)[0].eval() if a.xi_file else FaceNet(ModelConfig(a.backbone, input_size=a.image_size)).eval()
    emb = int(xi.config.resolved().embedding_dim)
    # the simulator's model: ξ's backbone, the FedFS projection it sizes from ξ, FedUV's c = 127
    mc = ModelConfig(a.backbone, input_size=a.image_size,
                     proj_dim=FedFSLossConfig().projection_dim(emb) if uses_fedfs(a.method) else None,
                     code_length=127 if uses_feduv(a.method) else None)
    model = FaceNet(mc)
    model.load_state_dict(initial_global_weights(mc, xi, seed=0))
    save_checkpoint(tmp / "xi.safetensors", xi, xi.config)
    save_checkpoint(tmp / "global0.safetensors", model, mc)
    cfg = {"method": a.method, "initial-model": str(tmp / "global0.safetensors"), "num-rounds": a.rounds,
           "fraction-train": a.participation, "min-nodes": 2, "xi": str(tmp / "xi.safetensors"),
           "train": json.dumps({"local_epochs": 1, "batch_size": a.batch_size}), "state-root": str(tmp / "state"),
           "torch-threads": 1}
    marks: list[tuple[int, float, int]] = []
    final: dict[str, torch.Tensor] = {}          # the last round's global model (peer_frameworks.py compares it)

    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        s = ServerSettings.from_run_config(cfg)
        weights, config, _ = read_checkpoint(s.initial_model)
        strategy = FedFSStrategy(method=s.method, model_config_json=config.to_json(), train=s.train,
                                 fraction_train=s.fraction_train, min_nodes=s.min_nodes,
                                 on_aggregate=lambda r, w, acc: (marks.append((r, time.perf_counter(), len(acc))),
                                                                 final.update(w)))
        marks.append((0, time.perf_counter(), 0))
        strategy.start(grid=grid, initial_arrays=ArrayRecord.from_torch_state_dict(weights), num_rounds=s.num_rounds,
                       train_config=ConfigRecord({}))

    clients, images, size = a.clients, a.images, a.image_size
    client = create_app(cfg, images_fn=lambda ctx: _population(clients, images, size).train_images(
        int(ctx.node_config["partition-id"])).numpy())
    run_simulation(server_app=server, client_app=client, num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": a.cores, "include_dashboard": False}})
    if len(marks) != a.rounds + 1:
        raise RuntimeError(f"Flower ran {len(marks) - 1} of {a.rounds} rounds")
    updates = sum(m[2] for m in marks[1:])
    warm = sum(m[2] for m in marks[2:]) if a.rounds > 1 else updates
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in final.items()}, str(tmp / "global.safetensors"))
    result_file.write_text(json.dumps({
        "updates_per_s": updates / (marks[-1][1] - marks[0][1]),
        "warm_updates_per_s": warm / (marks[-1][1] - marks[1 if a.rounds > 1 else 0][1])}))


def run_flower(a: argparse.Namespace, env: dict[str, str], tmp: Path) -> dict[str, float]:
    d = tmp / f"flower_{time.monotonic_ns()}"
    d.mkdir()
    res = d / "result.json"
    cmd = [sys.executable, __file__, *sys.argv[1:], "--flower-child", str(d)]
    if a.xi_file:
        cmd += ["--xi-file", a.xi_file]
    wall, rss = run_measured(cmd, env)
    return {**json.loads(res.read_text()), "wall_s": wall, "peak_rss_mb": rss / 2 ** 20}


# ---- main ------------------------------------------------------------------------------

def spread(values: list[float], fmt: str) -> str:
    """``median [min–max]`` of the repeats, as the peer tables print a cell."""
    return f"{median(values):{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload every engine runs alike (this script and benchmarks/peer_frameworks.py)."""
    p.add_argument("--method", default="fedfs", choices=["fedfs", "feduv", "fedfs+feduv"])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--participation", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--backbone", default="tiny", choices=["tiny", "mobilefacenet", "feduv_cnn"])
    p.add_argument("--image-size", type=int, default=None, help="input side (default: 32 tiny, 112 otherwise)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads of fedfs's simulator")
    p.add_argument("--pretrain-epochs", type=int, default=None,
                   help="ξ pre-training epochs of fedfs simulate (untimed; default: its own)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="Ray CPUs = Flower actors (1 thread each)")
    p.add_argument("--random-xi", action="store_true",
                   help="both engines use one randomly initialized ξ (no pre-training: only speed is compared)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--xi-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--flower-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.image_size is None:
        a.image_size = 32 if a.backbone == "tiny" else 112
    if a.flower_child:
        d = Path(a.flower_child)
        flower_child(a, d, d / "result.json")
        return
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
               "FEDFS_CACHE_DIR": os.environ.get("FEDFS_CACHE_DIR", str(tmp / "cache"))}
        if a.random_xi:
            import torch

            from fedfs_sdk.nn.checkpoint import save_checkpoint
            from fedfs_sdk.nn.model import FaceNet, ModelConfig

            torch.manual_seed(0)
            xi = FaceNet(ModelConfig(a.backbone, input_size=a.image_size))
            a.xi_file = str(tmp / "xi_random.safetensors")
            save_checkpoint(a.xi_file, xi, xi.config, {"role": "xi", "random": True})
        else:
            run_fedfs(a, env, tmp, rounds=1)                   # ξ pre-trained into the cache (untimed)
        res: dict[str, list[dict[str, float]]] = {"fedfs simulate": [], "Flower simulation": []}
        for rep in range(a.repeats):
            for name, fn in (("fedfs simulate", run_fedfs), ("Flower simulation", run_flower)):
                r = fn(a, env, tmp)
                res[name].append(r)
                print(f"# repeat {rep + 1} {name}: {r['updates_per_s']:.1f} updates/s "
                      f"(warm {r['warm_updates_per_s']:.1f}), wall {r['wall_s']:.1f} s, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    print(f"{a.method}, {a.backbone} backbone @{a.image_size} px, {a.clients} SynthFaces clients, "
          f"{round(a.participation * a.clients)} per round, {a.rounds} rounds, {a.images} images, 1 epoch, "
          f"batch {a.batch_size}; fedfs: 1 process × {a.threads} thread(s); Flower: Ray, {a.cores} actors × 1 thread; "
          f"{a.repeats} interleaved repeats (median [min–max])")
    print("| engine | client-updates/s | warm (rounds 2+) | wall s | peak RSS MB (process tree) |")
    print("|---|---|---|---|---|")
    for name, rs in res.items():
        def col(k: str, fmt: str = ".1f") -> str:
            return spread([r[k] for r in rs], fmt)
        print(f"| {name} | {col('updates_per_s')} | {col('warm_updates_per_s')} | {col('wall_s')} | "
              f"{col('peak_rss_mb', '.0f')} |")


if __name__ == "__main__":
    main()
