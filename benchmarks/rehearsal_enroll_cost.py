"""Per-device CPU of an enrollment's public-impostor scoring, with and without the shared outputs of
``fedfs_sdk/runtime/impostor_outputs.PUBLIC_OUTPUTS``, on one device folder a rehearsal left:

    PYTHONPATH=. python benchmarks/rehearsal_enroll_cost.py OUT/fleet/client_00000

Prints the thread CPU (and wall) of enrolling with ξ while scoring the set itself, of filling the
shared entry and of enrolling from it, and whether the operating point and τ are the same. One torch
thread and one BLAS thread, as the rehearsal's devices run.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(f: Callable[[], Any]) -> tuple[Any, float, float]:
    c0, t0 = time.thread_time(), time.perf_counter()
    out = f()
    return out, time.thread_time() - c0, time.perf_counter() - t0


def main(device_dir: str) -> None:
    from device_sim.cli_common import single_thread_blas
    from fedfs_sdk.nn.checkpoint import load_verifier
    from fedfs_sdk.runtime.enrollment import enroll
    from fedfs_sdk.runtime.impostor_outputs import PublicOutputs
    from fedfs_sdk.runtime.impostors import load_impostors
    from fedfs_sdk.runtime.inference import TorchBackend
    from fedfs_sdk.runtime.preprocess import preprocess

    torch.set_num_threads(1)
    single_thread_blas()
    d = Path(device_dir)
    backend = TorchBackend(*load_verifier(d / "state" / "xi.safetensors"))
    impostors = load_impostors(d / "state" / "impostors.npz")
    photos = sorted(str(p) for p in (d / "photos").glob("*.png"))
    x = preprocess(photos, backend.input_size)
    old, c_old, w_old = timed(lambda: enroll(backend, x, q=0.9, outliers="none", impostors=impostors))
    cache = PublicOutputs()
    _, c_fill, w_fill = timed(lambda: cache.get(backend, impostors))
    new, c_new, w_new = timed(lambda: enroll(backend, x, q=0.9, outliers="none", impostors=impostors,
                                             impostor_outputs=cache.get(backend, impostors)))
    print(f"{len(photos)} photos, {len(impostors)} impostors")
    print(f"enroll, scoring the set itself: {c_old:.2f} s CPU ({w_old:.2f} s wall)")
    print(f"filling the shared entry once:  {c_fill:.2f} s CPU ({w_fill:.2f} s wall)")
    print(f"enroll from the shared entry:   {c_new:.2f} s CPU ({w_new:.2f} s wall)")
    print("same operating point:", old.meta["operating_point"] == new.meta["operating_point"],
          "same τ:", old.threshold == new.threshold)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
