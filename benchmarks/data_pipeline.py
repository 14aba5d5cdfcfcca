"""The simulator's data path: render speed, the renderer's working memory, and per --data-cache
option the store's build time, per-chunk gather time, memory, and what prefetching hides.

Usage (seconds on a CPU; the GPU command the issue asks for is the second)::

    PYTHONPATH=. python benchmarks/data_pipeline.py
    PYTHONPATH=. python benchmarks/data_pipeline.py --device cuda --image-size 112 --clients 2000 --images 67

Sections:

1. **render**: SynthFaces images/s on the CPU (``--cpu-render-images``, process threads) and on
   ``--device`` when it is CUDA (``--render-images``), after a warm-up; and the painter's peak
   working memory per pixel (CPU: live tensor bytes traced through a dispatch mode; CUDA:
   ``max_memory_allocated`` of one default-size chunk) next to the constant the CUDA chunk
   size is derived from.
2. **per option** (``device`` on CUDA only, ``host``, ``none``), ``--clients`` clients of
   ``--images`` images (the last ``--test-images`` held out): *build* = every client's train
   and test images produced into the store once (what round 1 and the first evaluation pay;
   ``none`` keeps nothing), *gather* = mean time to hand one chunk of ``--chunk`` clients'
   training images to the training device as uint8 once the store is built (``none``: produce
   them again), the store's bytes, the device's peak memory during the gathers, and the
   full-size store that ``--data-cache auto`` plans for (and what it would choose here).
3. **prefetch**: a round of ``--rounds-chunks`` chunks through :class:`ChunkFeed` with a
   stand-in training step of ``--train-ms`` (a GPU spin on CUDA, a sleep on the CPU): the
   time the loop waited for data — for the first chunk (nothing to overlap with) and on
   average for the later ones — prefetch off vs on, on a ``none`` store (the worst case:
   every chunk rendered again). Prefetching can hide a chunk's data time up to the step time.
"""
from __future__ import annotations

import argparse
import functools
import time
import weakref

import numpy as np
import torch

from device_sim.datasets import SynthDataset
from device_sim.image_store import CachePlan, plan_data_cache
from device_sim.population import Population
from device_sim.prefetch import ChunkFeed
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces
from device_sim.synthfaces.generator import CUDA_RENDER_BUDGET_BYTES, RENDER_BYTES_PER_PIXEL
from device_sim.synthfaces.painter import paint

print = functools.partial(print, flush=True)     # noqa: A001 — rows appear as they are measured (bounded GPU runs)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def render_rate(faces: SynthFaces, n: int, dev: torch.device) -> float:
    ids, idx = np.arange(n) // 8 + 1000, np.arange(n) % 8
    faces.render_u8(ids[:8], idx[:8], dev)           # warm-up (noise bank, kernels)
    _sync(dev)
    t = time.perf_counter()
    faces.render_u8(ids, idx, dev)
    _sync(dev)
    return n / (time.perf_counter() - t)


def cpu_bytes_per_pixel(size: int, n: int = 8) -> float:
    """Peak live tensor bytes per pixel while the painter draws ``n`` images on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Track(TorchDispatchMode):
        live = peak = 0
        ptrs: dict[int, int] = {}

        def _free(self, key: int, nbytes: int) -> None:
            if self.ptrs.pop(key, None) is not None:
                self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key, nbytes = st.data_ptr(), st.nbytes()
                    if nbytes and key not in self.ptrs:
                        self.ptrs[key] = nbytes
                        self.live += nbytes
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(t, self._free, key, nbytes)
            return out

    faces = SynthFaces(seed=0, image_size=size)
    faces.noise_bank(torch.device("cpu"))
    with Track() as tr:
        paint(faces, np.arange(n), np.arange(n), torch.device("cpu"))
    return tr.peak / (n * size * size)


def cuda_bytes_per_pixel(faces: SynthFaces, dev: torch.device) -> tuple[float, int]:
    n = faces.chunk_images(dev)
    faces.render_u8(np.arange(2), np.arange(2), dev)
    _sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    faces.render_u8(np.arange(n), np.arange(n), dev)
    _sync(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / (n * faces.image_size ** 2), n


def population(a: argparse.Namespace) -> Population:
    faces = SynthFaces(seed=0, image_size=a.image_size)
    ds = SynthDataset(faces, images_per_identity=a.images, num_identities=a.clients, cache_bytes=0)
    return Population(ds, make_splits(ds, 0, a.clients, 0, a.images - a.test_images, a.test_images, seed=0))


def option_row(a: argparse.Namespace, location: str, dev: torch.device) -> str:
    pop = population(a)
    pop.use_image_store(CachePlan(location, str(dev), location == "host" and dev.type == "cuda",
                                  pop.image_store_bytes(), None, "benchmark"))
    chunks = [np.arange(s, min(s + a.chunk, a.clients)) for s in range(0, a.clients, a.chunk)]
    _sync(dev)
    t = time.perf_counter()
    if location != "none":
        for c in chunks:
            pop.store.images(c, "train", device=dev)
            pop.store.images(c, "test", device=dev)
    _sync(dev)
    build = f"{time.perf_counter() - t:.2f}" if location != "none" else "– (keeps nothing)"
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    reps = chunks[:a.gather_chunks]
    t = time.perf_counter()
    for c in reps:
        x = pop.train_chunk(c, dev)
        del x
    _sync(dev)
    gather = (time.perf_counter() - t) / len(reps)
    peak = f"{torch.cuda.max_memory_allocated(dev) / 1e9:.2f}" if dev.type == "cuda" else "–"
    chunk_bytes = int(min(a.chunk, a.clients)) * (a.images - a.test_images) * 3 * a.image_size ** 2
    return (f"| {location} | {build} | {gather * 1e3:.1f} | {pop.store.allocated_bytes / 1e9:.3f} | "
            f"{chunk_bytes / 1e9:.3f} | {peak} |")


def prefetch_row(a: argparse.Namespace, dev: torch.device, prefetch: bool) -> str:
    pop = population(a)
    pop.use_image_store(CachePlan("none", str(dev), False, pop.image_store_bytes(), None, "benchmark"))
    n = min(a.clients, a.chunk * a.round_chunks)
    waits: list[float] = []
    t_all = time.perf_counter()
    feed = iter(ChunkFeed(pop, np.arange(n), lambda: a.chunk, dev, prefetch))
    while True:
        t = time.perf_counter()
        try:
            chunk, images = next(feed)
            if dev.type == "cuda":       # the data must be there before the step reads it
                torch.cuda.current_stream(dev).synchronize()
        except StopIteration:
            break
        waits.append(time.perf_counter() - t)
        if dev.type == "cuda":
            torch.cuda._sleep(int(a.train_ms * 1.4e6))    # ≈ train_ms of GPU work (cycles at ~1.4 GHz)
            torch.cuda.synchronize(dev)
        else:
            time.sleep(a.train_ms / 1e3)
    total = time.perf_counter() - t_all
    later = f"{np.mean(waits[1:]) * 1e3:.1f}" if len(waits) > 1 else "–"
    return f"| {'on' if prefetch else 'off'} | {len(waits)} | {waits[0] * 1e3:.1f} | {later} | {total:.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--images", type=int, default=20, help="images per client (train + test)")
    ap.add_argument("--test-images", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=16, help="clients per chunk")
    ap.add_argument("--gather-chunks", type=int, default=3, help="chunks timed for the gather")
    ap.add_argument("--render-images", type=int, default=4096, help="images rendered for the --device rate")
    ap.add_argument("--cpu-render-images", type=int, default=256)
    ap.add_argument("--round-chunks", type=int, default=4, help="chunks in the prefetch section")
    ap.add_argument("--train-ms", type=float, default=200.0, help="stand-in training time per chunk")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    S = a.image_size
    print(f"# data pipeline: {a.clients} clients × {a.images} images ({a.test_images} test) at {S} px, "
          f"chunks of {a.chunk}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", {torch.get_num_threads()} CPU threads, torch {torch.__version__}\n")

    print("| renderer | images/s | peak bytes / pixel | chunk (images) |")
    print("|---|---|---|---|")
    faces = SynthFaces(seed=0, image_size=S)
    print(f"| cpu | {render_rate(faces, a.cpu_render_images, torch.device('cpu')):.0f} | "
          f"{cpu_bytes_per_pixel(S):.0f} (constant: {RENDER_BYTES_PER_PIXEL}) | {faces.chunk_images('cpu')} |")
    if dev.type == "cuda":
        rate = render_rate(faces, a.render_images, dev)
        per_px, n = cuda_bytes_per_pixel(faces, dev)
        print(f"| {dev} | {rate:.0f} | {per_px:.0f} (budget {CUDA_RENDER_BUDGET_BYTES >> 20} MiB) | {n} |")

    print("\n| --data-cache | build s | gather ms / chunk | store GB | chunk GB (uint8) | device peak GB |")
    print("|---|---|---|---|---|---|")
    for loc in (["device"] if dev.type == "cuda" else []) + ["host", "none"]:
        print(option_row(a, loc, dev))
    full = population(a).image_store_bytes()
    plan = plan_data_cache("auto", full, dev)
    print(f"\nfull store here: {full / 1e9:.3f} GB; --data-cache auto would choose: {plan.location} ({plan.reason})")
    paper = 10_000 * 67 * 3 * 112 * 112
    print(f"FedFS setting (10,000 clients × 67 images at 112 px): {paper / 1e9:.1f} GB as uint8 "
          f"({paper * 4 / 1e9:.1f} GB as float32); auto here: {plan_data_cache('auto', paper, dev).location}")

    print(f"\n| prefetch (none store, {a.train_ms:.0f} ms stand-in step) | chunks | 1st chunk wait ms | "
          "later chunks: mean wait ms | total s |")
    print("|---|---|---|---|---|")
    for on in (False, True):
        print(prefetch_row(a, dev, on))


if __name__ == "__main__":
    main()
