"""Batch sizes that fit a memory budget, measured from the model itself.

MobileFaceNet at 112×112 keeps ≈ 60 MB of activations per image for the backward pass
(its norm layers, :class:`~fedfs_sdk.nn.backbones.layers.GroupNormP`, are built from primitive
ops that each save their input); at the historical default batch of 128 that is 7.6 GB of
saved tensors and a 12.4 GB peak. Instead of a per-backbone table, the cost per image is
measured on a 2-image forward pass (the bytes autograd saves; the largest layer output for
inference) and the batch is cut to fit :data:`TRAIN_BUDGET_BYTES` / :data:`INFER_BUDGET_BYTES`.

Splitting a training batch into micro-batches and accumulating gradients gives the same
gradient (up to float summation order) because every fedfs backbone normalizes each sample
by itself — there is no BatchNorm whose statistics would depend on the batch.
"""
from __future__ import annotations

import os

import torch
from torch import nn

_MB = 1 << 20

TRAIN_BUDGET_BYTES = int(float(os.environ.get("FEDFS_TRAIN_MEMORY_MB", 1024)) * _MB)
"""Activation memory one training micro-batch may keep for backward: 1 GiB by default
(``FEDFS_TRAIN_MEMORY_MB``). Backward needs about as much again transiently, and the process
(torch, model, optimizer, data) ≈ 0.6 GB, so MobileFaceNet pre-training peaks below 3 GB."""

INFER_BUDGET_BYTES = int(float(os.environ.get("FEDFS_INFER_MEMORY_MB", 512)) * _MB)
"""Memory one no-grad forward batch may use: 512 MiB by default (``FEDFS_INFER_MEMORY_MB``)."""

CPU_FORWARD_BYTES = int(float(os.environ.get("FEDFS_CPU_FORWARD_MB", 24)) * _MB)
"""On CPU, the largest layer output of one no-grad forward batch: 24 MiB by default
(``FEDFS_CPU_FORWARD_MB``) — a batch whose activations stay near the last-level cache.
Measured (issue 32, MobileFaceNet@112's trunk, 1.6 MB largest output per image, 1 thread,
AMD EPYC 32 MiB L3): 18–22 ms of CPU per image at 10–20 images per batch, 28–30 at 32,
31–43 at 64 — the larger batch is slower per image, not faster, on CPU."""

# A no-grad forward holds a layer's input, its output and a few same-sized temporaries
# (GroupNormP: centred values, their square, the normalized values): 4 × the largest output.
_INFER_LIVE_COPIES = 4
# Backward allocates gradients of the saved activations layer by layer, on top of them.
_BACKWARD_FACTOR = 1.5


_CACHE: dict[tuple, tuple[int, int]] = {}


def per_image_bytes(model: nn.Module, input_size: int) -> tuple[int, int]:
    """``(training, inference)`` bytes per image of ``model`` at ``input_size``: what autograd
    saves for backward, and the largest layer output of a no-grad forward. Measured once per
    architecture (cached by parameter names and shapes)."""
    key = (type(model).__name__, int(input_size),
           tuple((k, tuple(v.shape)) for k, v in model.state_dict().items()))
    if key not in _CACHE:
        _CACHE[key] = _measure(model, int(input_size))
    return _CACHE[key]


def _measure(model: nn.Module, input_size: int) -> tuple[int, int]:
    p = next(model.parameters(), None)
    x = torch.zeros(2, 3, input_size, input_size, device=p.device if p is not None else "cpu")
    saved: dict[int, int] = {}
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:         # weights are not per image
            saved[st.data_ptr()] = st.nbytes()  # a storage saved by several ops counts once
        return t

    largest = [0]

    def hook(_m: nn.Module, _i: object, out: object) -> None:
        if torch.is_tensor(out):
            largest[0] = max(largest[0], out.numel() * out.element_size())

    was_training = model.training
    try:
        model.train()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                model(x[:1])
        finally:
            for h in handles:
                h.remove()
    finally:
        model.train(was_training)
    return sum(saved.values()) // 2, largest[0]


def train_micro_batch(model: nn.Module, input_size: int, budget: int | None = None) -> int:
    """Images per training forward/backward so that saved activations (× the backward
    overhead) fit ``budget`` bytes (default :data:`TRAIN_BUDGET_BYTES`); at least 2."""
    per, _ = per_image_bytes(model, input_size)
    b = TRAIN_BUDGET_BYTES if budget is None else budget
    return max(2, int(b // max(1, int(per * _BACKWARD_FACTOR))))


def inference_batch(model: nn.Module, input_size: int, budget: int | None = None, cap: int = 512) -> int:
    """Images per no-grad forward that fit ``budget`` bytes (default
    :data:`INFER_BUDGET_BYTES`), at most ``cap``; at least 1."""
    _, largest = per_image_bytes(model, input_size)
    b = INFER_BUDGET_BYTES if budget is None else budget
    return max(1, min(cap, int(b // max(1, largest * _INFER_LIVE_COPIES))))


def forward_batch(model: nn.Module, input_size: int, device: str | torch.device, cap: int = 512) -> int:
    """Images per no-grad forward of ``model`` on ``device``: :func:`inference_batch` (memory),
    and on CPU also at most :data:`CPU_FORWARD_BYTES` of largest layer output (speed: the batch of
    64–1024 images that suits a GPU runs MobileFaceNet's trunk ~2× slower per image on CPU than
    batches of 10–20). At least 1, at most ``cap``."""
    b = inference_batch(model, input_size, cap=cap)
    if torch.device(device).type == "cpu":
        _, largest = per_image_bytes(model, input_size)
        b = min(b, max(1, CPU_FORWARD_BYTES // max(1, largest)))
    return b


__all__ = ["TRAIN_BUDGET_BYTES", "INFER_BUDGET_BYTES", "CPU_FORWARD_BYTES", "per_image_bytes", "train_micro_batch",
           "inference_batch", "forward_batch"]
