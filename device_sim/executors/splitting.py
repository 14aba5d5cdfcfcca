"""A chunk that runs out of memory is split in half and retried.

Clients are independent (each trains only its own weights on its own images), so training a
chunk in two halves gives each client the same updates — up to float rounding where kernels
pick other algorithms for another chunk size — and the concatenated result is the chunk's.
The executor's chunk size drops to the half that fitted, so later chunks do not fail again.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..methods.base import FederatedMethod, RoundPlan
from .common import ChunkResult, ClientTask, Executor, LocalConfig
from .memory import release_cuda


def train_splitting(executor: Executor, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
                    cfg: LocalConfig) -> ChunkResult:
    """``executor.train`` on ``tasks``; on ``torch.OutOfMemoryError`` the chunk is freed, split in
    half and each half retried the same way. A single client that does not fit re-raises with
    what to change."""
    try:
        return executor.train(method, plan, tasks, cfg)
    except torch.OutOfMemoryError as e:
        reason = (str(e).splitlines() or ["out of memory"])[0]
    # Outside the handler: the traceback, and with it the failed chunk's tensors, is gone.
    release_cuda(executor.device)
    if len(tasks) <= 1:
        raise torch.OutOfMemoryError(
            f"one client (client {tasks[0].client}, {tasks[0].num_samples} images) does not fit in "
            f"{executor.device} memory: lower --batch-size, use --amp bf16, or free the GPU ({reason})")
    half = (len(tasks) + 1) // 2
    executor.chunk_size = max(1, min(executor.chunk_size, half))
    executor.oom_splits = getattr(executor, "oom_splits", 0) + 1   # type: ignore[attr-defined]
    left = train_splitting(executor, method, plan, tasks[:half], cfg)
    right = train_splitting(executor, method, plan, tasks[half:], cfg)
    return ChunkResult.concat([left, right])
