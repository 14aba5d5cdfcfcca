"""client-updates/s of ``fedfs simulate`` with 1 process vs ``--workers N`` processes.

Each variant is a fresh ``fedfs simulate`` process (``--method fedfs``, tiny backbone, by
default 1,000 SynthFaces clients, 100 per round, 3 rounds, 20 images, 1 local epoch — the
workload of issue 14), run in turn, ``--repeats`` times interleaved (A B C A B C …) so a
noisy shared machine drifts over every variant alike. Reported per variant: the median
and range of the training throughput (participants / seconds over all rounds, rank 0's
round times, which include waiting for the all-reduce) and of the process wall time (start-up,
data, ξ from the cache and the evaluation included). ξ is pre-trained by a first, untimed run.

    PYTHONPATH=. python benchmarks/sim_workers.py
    PYTHONPATH=. python benchmarks/sim_workers.py --variants 1x1 1x2 2x1 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]


def _cmd(out: Path, workers: int, threads: int, a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "fedfs_sdk.cli.main", "simulate", "--method", a.method, "--clients", str(a.clients),
            "--participation", str(a.participation), "--rounds", str(a.rounds), "--train-per-client",
            str(a.images), "--local-epochs", "1", "--eval-clients", str(a.eval_clients), "--quiet",
            "--threads", str(threads), "--workers", str(workers), "--out", str(out)]


def run_once(workers: int, threads: int, a: argparse.Namespace, env: dict[str, str], tmp: Path) -> dict[str, float]:
    out = tmp / f"w{workers}t{threads}_{time.monotonic_ns()}"
    t0 = time.perf_counter()
    subprocess.run(_cmd(out, workers, threads, a), env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    hist = json.loads((out / "results.json").read_text())["methods"][0]["history"]
    updates = sum(h["participants"] for h in hist)
    seconds = sum(h["seconds"] for h in hist)
    return {"updates_per_s": updates / seconds, "train_s": seconds, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["1x1", "1x2", "2x1"],
                   help="WORKERSxTHREADS (threads per process)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--method", default="fedfs")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--participation", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=20)
    p.add_argument("--eval-clients", type=int, default=20)
    a = p.parse_args()
    variants = [tuple(int(x) for x in v.split("x")) for v in a.variants]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = {**os.environ, "FEDFS_CACHE_DIR": os.environ.get("FEDFS_CACHE_DIR", str(tmp / "cache")),
               "PYTHONPATH": str(ROOT)}
        run_once(1, 1, argparse.Namespace(**{**vars(a), "rounds": 1}), env, tmp)   # ξ into the cache (untimed)
        res: dict[tuple[int, int], list[dict[str, float]]] = {v: [] for v in variants}
        for rep in range(a.repeats):
            for v in variants:
                r = run_once(*v, a, env, tmp)
                res[v].append(r)
                print(f"# repeat {rep + 1}: {v[0]} process(es) × {v[1]} thread(s): "
                      f"{r['updates_per_s']:.1f} updates/s, wall {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(f"{a.method}, tiny backbone, {a.clients} clients, {round(a.participation * a.clients)} per round, "
          f"{a.rounds} rounds, {a.images} images, 1 epoch; {a.repeats} interleaved repeats (median [min–max])")
    print("| processes × threads | client-updates/s | training s | wall s |")
    print("|---|---|---|---|")
    for v, rs in res.items():
        u = [r["updates_per_s"] for r in rs]
        t = [r["train_s"] for r in rs]
        w = [r["wall_s"] for r in rs]
        print(f"| {v[0]} × {v[1]} | {median(u):.1f} [{min(u):.1f}–{max(u):.1f}] | {median(t):.1f} | "
              f"{median(w):.1f} [{min(w):.1f}–{max(w):.1f}] |")


if __name__ == "__main__":
    main()
