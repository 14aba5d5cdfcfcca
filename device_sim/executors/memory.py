"""How many clients fit in a chunk: a probe of real training steps, and the plan it gives.

The batched executor's memory grows linearly with the chunk: each client brings its stacked
weights, gradients, images, ξ features and — by far the largest part — the activations its
images leave for the backward pass. :meth:`BatchedExecutor.calibrate` measures one training step
of 1 and of 2 real clients; the difference is the per-client part, the rest is fixed (cuDNN
workspaces, the folded skeletons). The chunk is what fits in ``fraction`` of the memory free
for the allocator (the device's free memory plus what PyTorch's cache holds unused).
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from fedfs_sdk.errors import InputError

MAX_CHUNK = 4096


@dataclass(frozen=True)
class MemoryPlan:
    """A chunk size and the figures behind it (bytes)."""

    chunk_size: int
    per_client: int
    fixed: int
    free: int
    fraction: float

    @staticmethod
    def from_probes(probes: Sequence[tuple[int, int, int]], fraction: float) -> "MemoryPlan":
        """``probes``: ``(clients, peak bytes above the baseline, free bytes)`` of one step each,
        for 1 client and (where the round has two) 2 clients."""
        (k1, p1, free), *rest = probes
        if rest and rest[-1][0] > k1:
            k2, p2, _ = rest[-1]
            per_client = max((p2 - p1) // (k2 - k1), 1)
            fixed = max(p1 - per_client * k1, 0)
        else:                      # one client only: all of it counts as per-client (conservative)
            per_client, fixed = max(p1 // k1, 1), 0
        budget = int(fraction * free) - fixed
        chunk = max(1, min(MAX_CHUNK, budget // per_client))
        return MemoryPlan(int(chunk), int(per_client), int(fixed), int(free), float(fraction))

    def describe(self) -> str:
        mib = 2 ** 20
        return (f"chunk {self.chunk_size} clients: {self.per_client / mib:.0f} MiB per client + "
                f"{self.fixed / mib:.0f} MiB fixed, within {self.fraction:.0%} of {self.free / mib:.0f} MiB free")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def free_cuda_bytes(device: torch.device) -> int:
    """Bytes the caching allocator can still hand out: the device's free memory plus what it
    reserved and holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def cuda_memory_probe(device: torch.device) -> Callable[[Callable[[], object]], tuple[int, int]]:
    """``probe(fn) -> (free bytes, peak bytes fn allocated above what was allocated before)``."""

    def probe(fn: Callable[[], object]) -> tuple[int, int]:
        if device.type != "cuda":
            raise InputError(f"chunk calibration measures CUDA memory; on {device} give --chunk-size")
        gc.collect()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        free = free_cuda_bytes(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return free, int(peak)

    return probe


def release_cuda(device: torch.device) -> None:
    """After an out-of-memory error: drop the failed chunk's tensors and the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
