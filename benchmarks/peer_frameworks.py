"""fedfs's simulator vs Flower's simulation engine vs pfl-research, same work (issue 14 item 4).

Same clients (SynthFaces, the ``fedfs simulate`` split: N clients, ``--images`` training images
each), same model (``--backbone``: tiny at 32 px or MobileFaceNet at 112 px, with the method's
FedFS projection / FedUV head, started from one random ξ saved here — only speed is compared,
so nothing is pre-trained), same local objective and settings (fedfs's local step, 1 epoch,
batch 10), same participation and rounds, FedAvg on the server. Every run is a fresh process
tree started with its framework's interpreter; the variants are interleaved (A B C … A B C …)
``--repeats`` times so a shared machine's drift hits all of them.

* ``fedfs P×T``: ``fedfs simulate --workers P --threads T`` (P processes of T torch threads,
  one gloo all-reduce per round); ``fedfs P×T torchrun``: the same P ranks started by
  ``torchrun … simulate --distributed``. client-updates/s = participants / seconds of its
  rounds (rank 0's ``results.json``).
* ``Flower``: ``flwr.simulation.run_simulation`` (Ray, one actor per core, 1 thread each)
  with ``fedfs_flower``'s ClientApp / FedFSStrategy (``benchmarks/peer_flower.py``; Flower
  samples its own participants). Seconds from round 1's start to the last aggregation.
* ``pfl P×1``: ``pfl`` 0.6.0's ``SimulatedBackend`` + ``FederatedAveraging`` running fedfs's
  ``LocalTrainer`` per user (``benchmarks/peer_pfl.py``), in one process or P worker processes
  (pfl's multi-worker mode) that it starts in one session (pfl's ``PFL_WORKER_ADDRESSES``);
  ``pfl P×1 torchrun``: the P workers under ``torch.distributed.run``. It replays fedfs's
  participants. Seconds from ``on_train_begin`` to the last ``after_central_iteration``.

``sessions``: how many session ids the variant's process tree used. On Linux with
``kernel.sched_autogroup_enabled=1`` (this machine) the scheduler shares the CPU fairly between
sessions, not processes; torchrun starts every worker in a new session, so under other users'
load a torchrun launch gets up to P× the CPU share of P workers that stay in one session (as
``fedfs simulate --workers`` and ``pfl P×1`` do). Compare launches with the same session count.

``warm`` leaves round 1 out (Ray actors start, processes import and allocate during it).
Wall time is the whole process tree's life (start-up, data; fedfs also evaluates 2 clients against 20 impostor
images and no new users, kept small because the others do not evaluate).
``waiting for a CPU s``: seconds the tree's threads were runnable but not running
(``/proc/…/schedstat``, summed over threads) — the share of the wall time that other people's
load took; a thread's wall time is its CPU + this + time it slept (blocked).
``CPU s / update``: user + system CPU seconds of the whole process tree (start-up, data, rounds;
fedfs's small evaluation too) per client update — what the run cost a shared machine, less sensitive
to other users' load than the rates. fedfs runs its method with ``select=off``: the default's
do-no-harm check trains on fewer photos and runs ξ's trunk on every client before round 1 (a
statistics round outside the timed rounds), which is not the work the other engines do.
Peak RSS is the largest sum of resident memory over the process tree (sampled every 0.2 s).
The last column is the global model's distance from fedfs's after the same rounds:
``‖w − w_fedfs‖ / ‖w_fedfs − w_0‖`` over the parameters (BatchNorm statistics left out: pfl does
not average them), median over repeats, against the first ``fedfs`` variant's first run.

Interpreters: ``--flower-python`` (default ``/work/flower-venv/bin/python``) needs ``flwr``;
``--pfl-python`` (default ``/work/pfl-venv/bin/python``) needs ``pfl[pytorch]==0.6.0``; both with
fedfs installed (``pip install -e . --no-deps`` plus its runtime deps). A framework whose
interpreter is missing or lacks the package is skipped with the reason printed.

    PYTHONPATH=. .venv/bin/python benchmarks/peer_frameworks.py
    PYTHONPATH=. .venv/bin/python benchmarks/peer_frameworks.py --backbone mobilefacenet --clients 50 \\
        --participation 0.2 --rounds 2
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_flower import add_workload_arguments, run_measured, spread  # noqa: E402  (wall time, peak RSS)

ROOT = Path(__file__).resolve().parents[1]


def _common(a: argparse.Namespace) -> list[str]:
    return ["--method", a.method, "--clients", str(a.clients), "--participation", str(a.participation),
            "--rounds", str(a.rounds), "--images", str(a.images), "--batch-size", str(a.batch_size),
            "--backbone", a.backbone, "--image-size", str(a.image_size)]


def _torchrun(python: str, n: int) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


def fedfs_command(a: argparse.Namespace, out: Path, workers: int, threads: int, torchrun: bool = False) -> list[str]:
    """The ``fedfs simulate`` command of a fedfs variant: the other engines' work (their
    clients, images, local step and rounds) plus the smallest evaluation the CLI runs."""
    launch = _torchrun(a.fedfs_python, workers) + ["-m"] if torchrun else [a.fedfs_python, "-m"]
    # select=off: the do-no-harm check (the default's select=auto) holds back part of each client's
    # photos and runs a statistics round (ξ's trunk on every client) before round 1 — work the
    # LocalTrainer of the other engines does not do; off, all engines train the same images.
    # --new-users 0: the synth default (20 new users) makes the final evaluation embed their
    # warm-up and test images and score them against every other new user's — two thirds of
    # a 1-round MobileFaceNet run's CPU (45 s of it; 16 s without; issue 32). pfl and Flower
    # evaluate nothing.
    return [*launch, "fedfs_sdk.cli.main", "simulate", "--method", f"{a.method}:select=off",
            "--clients", str(a.clients), "--participation", str(a.participation), "--rounds", str(a.rounds),
            "--train-per-client", str(a.images), "--local-epochs", "1", "--batch-size", str(a.batch_size),
            "--eval-clients", "2", "--impostor-pool", "20", "--new-users", "0", "--quiet",
            "--threads", str(threads), *(["--distributed"] if torchrun else ["--workers", str(workers)]),
            "--backbone", a.backbone, "--image-size", str(a.image_size), "--pretrained", a.xi_file,
            "--checkpoint-every", str(a.rounds), "--out", str(out)]


def run_fedfs(a: argparse.Namespace, env: dict[str, str], out: Path, workers: int, threads: int,
              torchrun: bool = False) -> dict:
    cmd = fedfs_command(a, out, workers, threads, torchrun)
    stats: dict = {}
    wall, rss = run_measured(cmd, env, stats)
    hist = json.loads((out / "results.json").read_text())["methods"][0]["history"]
    warm = hist[1:] or hist
    ck = sorted(glob.glob(str(out / "checkpoints" / "*" / "round_*.safetensors")))[-1]
    return {"updates_per_s": sum(h["participants"] for h in hist) / sum(h["seconds"] for h in hist),
            "warm_updates_per_s": sum(h["participants"] for h in warm) / sum(h["seconds"] for h in warm),
            "wall_s": wall, "peak_rss_mb": rss / 2 ** 20, "global": (ck, "global/"), **stats}


def run_flower(a: argparse.Namespace, env: dict[str, str], out: Path) -> dict:
    out.mkdir()
    cmd = [a.flower_python, str(ROOT / "benchmarks" / "peer_flower.py"), *_common(a), "--cores", str(a.cores),
           "--xi-file", a.xi_file, "--flower-child", str(out)]
    stats: dict = {}
    wall, rss = run_measured(cmd, env, stats)
    return {**json.loads((out / "result.json").read_text()), "wall_s": wall, "peak_rss_mb": rss / 2 ** 20,
            "global": (str(out / "global.safetensors"), ""), **stats}


def run_pfl(a: argparse.Namespace, env: dict[str, str], out: Path, workers: int, torchrun: bool = False) -> dict:
    out.mkdir()
    script = [str(ROOT / "benchmarks" / "peer_pfl.py"), *_common(a), "--xi-file", a.xi_file, "--out", str(out)]
    if torchrun:
        cmd = _torchrun(a.pfl_python, workers) + script
    else:
        cmd = [a.pfl_python, *script, *(["--launch", str(workers)] if workers > 1 else [])]
    stats: dict = {}
    wall, rss = run_measured(cmd, env, stats)
    return {**json.loads((out / "result.json").read_text()), "wall_s": wall, "peak_rss_mb": rss / 2 ** 20,
            "global": (str(out / "global.safetensors"), ""), **stats}


def _has(python: str, module: str) -> str | None:
    """None when ``python`` exists and imports ``module``; else why not."""
    if not Path(python).exists():
        return f"{python} not found"
    r = subprocess.run([python, "-c", f"import {module}, fedfs_sdk"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"{python} cannot import {module} / fedfs_sdk: {r.stderr.strip()[-200:]}"


def model_distance(ref: tuple[str, str], other: tuple[str, str], w0: dict, params: set[str]) -> float:
    """``‖w − w_ref‖ / ‖w_ref − w_0‖`` over the parameter tensors."""
    from safetensors.torch import load_file

    def load(spec: tuple[str, str]) -> dict:
        path, prefix = spec
        return {k[len(prefix):]: v for k, v in load_file(path).items() if k.startswith(prefix)}

    r, o = load(ref), load(other)
    num = sum(float((o[k].double() - r[k].double()).pow(2).sum()) for k in params)
    den = sum(float((r[k].double() - w0[k].double()).pow(2).sum()) for k in params)
    return (num / den) ** 0.5 if den > 0 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--fedfs", nargs="*", default=["1x1", "2x1", "2x1t"],
                   help="fedfs simulate variants PROCESSESxTHREADS: --workers P --threads T; a trailing 't' "
                        "launches the P processes with torchrun (--distributed) instead (empty: none)")
    p.add_argument("--pfl", nargs="*", default=["1", "2", "2t"],
                   help="pfl worker-process counts; 't': launched by torchrun instead of in one session "
                        "(empty: none)")
    p.add_argument("--no-flower", action="store_true")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="Ray CPUs = Flower actors (1 thread each)")
    p.add_argument("--fedfs-python", default=sys.executable)
    p.add_argument("--flower-python", default="/work/flower-venv/bin/python")
    p.add_argument("--pfl-python", default="/work/pfl-venv/bin/python")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    if a.image_size is None:
        a.image_size = 32 if a.backbone == "tiny" else 112

    import torch

    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig
    from fedfs_sdk.training.methods import uses_fedfs, uses_feduv
    from fedfs_sdk.nn.model import FaceNet, ModelConfig
    from fedfs_sdk.training.trainer import initial_global_weights

    variants: list[tuple[str, object]] = []
    for v in a.fedfs:
        tr = v.endswith("t")
        w, t = (int(x) for x in v.rstrip("t").split("x"))
        variants.append((f"fedfs {w}×{t}{' torchrun' if tr else ''}",
                         lambda env, out, w=w, t=t, tr=tr: run_fedfs(a, env, out, w, t, tr)))
    skipped: list[str] = []
    if not a.no_flower:
        why = _has(a.flower_python, "flwr")
        if why is None:
            variants.append((f"Flower ({a.cores} actors)", lambda env, out: run_flower(a, env, out)))
        else:
            skipped.append(f"Flower skipped: {why}")
    if a.pfl:
        why = _has(a.pfl_python, "pfl")
        for v in a.pfl if why is None else []:
            n, tr = int(v.rstrip("t")), v.endswith("t")
            variants.append((f"pfl {n}×1{' torchrun' if tr else ''}",
                             lambda env, out, n=n, tr=tr: run_pfl(a, env, out, n, tr)))
        if why is not None:
            skipped.append(f"pfl skipped: {why}")
    for s in skipped:
        print(f"# {s}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
               "FEDFS_CACHE_DIR": os.environ.get("FEDFS_CACHE_DIR", str(tmp / "cache"))}
        torch.manual_seed(0)
        xi = FaceNet(ModelConfig(a.backbone, input_size=a.image_size))
        a.xi_file = str(tmp / "xi_random.safetensors")
        save_checkpoint(a.xi_file, xi, xi.config, {"role": "xi", "random": True})
        emb = int(xi.config.resolved().embedding_dim)
        mc = ModelConfig(a.backbone, input_size=a.image_size,
                         proj_dim=FedFSLossConfig().projection_dim(emb) if uses_fedfs(a.method) else None,
                         code_length=127 if uses_feduv(a.method) else None)
        w0 = initial_global_weights(mc, xi, seed=0)
        params = {k for k, _ in FaceNet(mc).named_parameters()}
        res: dict[str, list[dict]] = {name: [] for name, _ in variants}
        updates = max(1, round(a.participation * a.clients)) * a.rounds
        for rep in range(a.repeats):
            for name, fn in variants:
                r = fn(env, tmp / f"{len(res[name])}_{name.replace(' ', '_')}_{time.monotonic_ns()}")
                r["cpu_per_update"] = r["cpu_s"] / updates
                res[name].append(r)
                print(f"# repeat {rep + 1} {name}: {r['updates_per_s']:.2f} updates/s "
                      f"(warm {r['warm_updates_per_s']:.2f}), wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s, "
                      f"waiting for a CPU {r['ready_wait_s']:.1f} s, load {os.getloadavg()[0]:.1f}, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
        ref = next((rs[0]["global"] for n, rs in res.items() if n.startswith("fedfs") and rs), None)
        for rs in res.values():
            for r in rs:
                r["diff"] = model_distance(ref, r["global"], w0, params) if ref else float("nan")
    load = os.getloadavg()
    print(f"{a.method}, {a.backbone} @{a.image_size} px, {a.clients} SynthFaces clients, "
          f"{max(1, round(a.participation * a.clients))} per round, {a.rounds} rounds, {a.images} images, 1 epoch, "
          f"batch {a.batch_size}; {os.cpu_count()} CPUs, load average at the end {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {a.repeats} interleaved repeats (median [min–max])")
    for s in skipped:
        print(f"({s})")
    print("| engine (processes × threads) | client-updates/s | warm (rounds 2+) | wall s | CPU s / update | "
          "waiting for a CPU s | peak RSS MB | sessions | ‖w − w_fedfs‖ / ‖w_fedfs − w_0‖ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in res.items():
        def col(k: str, fmt: str = ".2f") -> str:
            return spread([r[k] for r in rs], fmt)
        print(f"| {name} | {col('updates_per_s')} | {col('warm_updates_per_s')} | {col('wall_s', '.1f')} | "
              f"{col('cpu_per_update', '.2f')} | {col('ready_wait_s', '.1f')} | {col('peak_rss_mb', '.0f')} | {max(r.get('sessions', 0) for r in rs)} | "
              f"{median(r['diff'] for r in rs):.2g} |")


if __name__ == "__main__":
    main()
