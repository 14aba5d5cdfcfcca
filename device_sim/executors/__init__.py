"""Local training of many simulated clients: one loop per client, or a whole chunk at once.

* :class:`SequentialExecutor` (:mod:`.sequential`) loops over clients — fastest on CPU.
* :class:`BatchedExecutor` (:mod:`.batched`) trains a chunk of K clients per step over stacked
  ``[K, …]`` weights, with ``vmap`` or a client-folded backbone (:mod:`.folding`); chunks are
  sized from free CUDA memory before the first one is built (:mod:`.memory`) and a chunk that
  still runs out of memory is split and retried (:mod:`.splitting`).

``make_executor("auto", device)`` picks the batched executor on CUDA and the sequential one on
CPU.
"""
from __future__ import annotations

import torch

from fedfs_sdk.errors import InputError

from .batched import FOLD_MODES, BatchedExecutor, xi_features
from .common import (AMP_MODES, ChunkResult, ClientTask, Executor, LocalConfig, client_batches, normalized,
                     sgd_update, unstack)
from .compiled import COMPILE_MODES
from .memory import MemoryPlan
from .sequential import SequentialExecutor
from .splitting import train_splitting


def make_executor(kind: str, device: str, chunk_size: int = 0, **options) -> SequentialExecutor | BatchedExecutor:
    """``sequential`` | ``batched`` | ``auto`` (batched on CUDA, sequential on CPU — see
    ``benchmarks/sim_throughput.py`` for the measurement behind the choice). ``options`` go to
    :class:`BatchedExecutor` (``fold``, ``pointwise``, ``memory_fraction``, ``compile``); the
    sequential executor has no compiled path and accepts ``compile`` only as ``auto``/``off``."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was requested but torch.cuda.is_available() is False")
    if kind == "auto":
        kind = "batched" if dev.type == "cuda" else "sequential"
    if kind == "sequential":
        if options.get("compile", "auto") not in ("auto", "off"):
            raise InputError(f"compile={options['compile']} needs the batched executor (--executor batched): "
                             "the sequential executor has no compiled path")
        return SequentialExecutor(dev, chunk_size or 64)
    if kind == "batched":
        return BatchedExecutor(dev, chunk_size, **options)
    raise InputError(f"unknown executor {kind!r}; choose auto, sequential or batched")


__all__ = ["LocalConfig", "ClientTask", "ChunkResult", "Executor", "SequentialExecutor", "BatchedExecutor",
           "MemoryPlan", "make_executor", "train_splitting", "client_batches", "sgd_update", "unstack", "normalized",
           "xi_features", "AMP_MODES", "FOLD_MODES", "COMPILE_MODES"]
