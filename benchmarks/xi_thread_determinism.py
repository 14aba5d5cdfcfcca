"""How much the torch thread count changes a pre-trained ξ (float reduction order).

Usage: PYTHONPATH=. python benchmarks/xi_thread_determinism.py [--threads 1 2] [--epochs 2]

Runs ``fedfs pretrain --force`` once per thread count (each in its own process and cache
folder, same seeds and data) and prints, for every pair, the largest absolute weight
difference of the two ξ checkpoints; a repeat with the first thread count shows that one
count alone is bit-for-bit reproducible (0.0).
"""
from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.numpy import load_file


def pretrain(threads: int, epochs: int, folder: Path, tag: str) -> Path:
    out = folder / f"xi-{tag}.safetensors"
    subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", "pretrain", "--quiet", "--force",
                    "--threads", str(threads), "--pretrain-epochs", str(epochs),
                    "--cache-dir", str(folder / f"cache-{tag}"), "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    return max(float(abs(x[k].astype("float64") - y[k].astype("float64")).max()) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = {f"{t} threads": pretrain(t, a.epochs, folder, f"t{t}") for t in a.threads}
        runs[f"{a.threads[0]} threads (repeat)"] = pretrain(a.threads[0], a.epochs, folder, "repeat")
        print(f"ξ pre-trained for {a.epochs} epochs; max |Δweight| between runs")
        for (na, pa), (nb, pb) in itertools.combinations(runs.items(), 2):
            print(f"  {na:>22} vs {nb:<22} {max_diff(pa, pb):.3e}")


if __name__ == "__main__":
    main()
