"""SynthFaces rendering throughput (images/s) per image size, device and torch thread count.

Usage: PYTHONPATH=. python benchmarks/synthfaces_speed.py [--sizes 32 112] [--threads 1 2]
       [--device cpu cuda] [--images 2048]

Each row renders ``--images`` distinct (identity, index) pairs once after a warm-up call
and reports the best of ``--repeats`` runs. Timing covers parameter hashing, rendering and
uint8 quantization (``render``), i.e. what ``SynthDataset`` pays on a cache miss.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from device_sim.synthfaces import SynthFaces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 112])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--device", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--difficulty", type=float, default=1.0)
    a = ap.parse_args()

    print("| device | threads | size | images | images/s |")
    print("|---|---|---|---|---|")
    for dev in a.device:
        for th in (a.threads if dev == "cpu" else [torch.get_num_threads()]):
            torch.set_num_threads(th)
            for S in a.sizes:
                f = SynthFaces(seed=0, image_size=S, difficulty=a.difficulty)
                n = a.images if S <= 32 else max(64, a.images * 32 * 32 // (S * S) * 4)
                ids = np.arange(n) // 8
                idx = np.arange(n) % 8
                f.render(ids[:64], idx[:64] + 100, device=dev)      # warm-up (noise bank, kernels)
                best = float("inf")
                for _ in range(a.repeats):
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    f.render(ids, idx, device=dev)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t)
                print(f"| {dev} | {th if dev == 'cpu' else '-'} | {S} | {n} | {n / best:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
