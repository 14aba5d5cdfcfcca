"""Native vs primitive GroupNormP / PReLUP in one torch training step (interleaved).

The layers emit elementary ops only while a graph is traced for export
(``fedfs_sdk.nn.backbones.layers.tracing``); eager torch runs ``F.group_norm`` / ``F.prelu``.
This prints what that choice is worth for a backbone's forward + backward at one thread::

    PYTHONPATH=. python benchmarks/norm_kernels.py --backbone mobilefacenet --batch 10 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fedfs_sdk.nn.backbones import layers
from fedfs_sdk.nn.model import FaceNet, ModelConfig


def step_seconds(model: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    def step() -> None:
        model.zero_grad()
        model(x).square().sum().backward()

    step()                                   # warm-up (allocator, oneDNN primitives)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", default="mobilefacenet")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = FaceNet(ModelConfig(a.backbone, input_size=a.image_size)).backbone.train()
    x = torch.randn(a.batch, 3, a.image_size, a.image_size)
    native_tracing = layers.tracing
    times: dict[str, list[float]] = {"primitives": [], "native": []}
    for _ in range(a.repeats):               # interleaved: the machine is shared
        for name in times:
            layers.tracing = (lambda: True) if name == "primitives" else native_tracing
            try:
                times[name].append(step_seconds(model, x, a.steps))
            finally:
                layers.tracing = native_tracing
    print(f"{a.backbone}@{a.image_size}, batch {a.batch}, {a.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    for name, ts in times.items():
        print(f"  {name:10s} step s: {' / '.join(f'{t:.3f}' for t in ts)}  (median {statistics.median(ts):.3f})")
    print(f"  speed-up: {statistics.median(times['primitives']) / statistics.median(times['native']):.2f}×")


if __name__ == "__main__":
    main()
