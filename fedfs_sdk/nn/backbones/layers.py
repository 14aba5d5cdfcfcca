"""Layers built only from primitives that every target differentiates.

Why not ``nn.GroupNorm`` / ``nn.PReLU`` / ``nn.BatchNorm2d``:

* ONNX Runtime training (1.19) has no gradient for ``InstanceNormalization`` (what
  ``nn.GroupNorm`` exports to) nor for ``PRelu``;
* BatchNorm uses batch statistics in ORT training and running statistics in torch eval,
  and ``torch.func.vmap`` over clients has no per-client running statistics; worse, a
  phone's batch holds one identity, so batch statistics are degenerate there.

:class:`GroupNormP` normalizes each sample by itself (mean/variance over channel groups),
so it behaves identically in torch training and eval, under vmap and in ORT on-device
training, and exports to ReduceMean/Sub/Mul/Sqrt/Div which ORT can differentiate.

The primitives are for traced graphs only (:func:`tracing`). Eager torch — the device's
trainer, the simulator's executors — calls the native ``F.group_norm`` / ``F.prelu``: the same
functions up to float rounding, and a MobileFaceNet training step 1.7× faster at one thread
(``benchmarks/norm_kernels.py``; figures in docs/simulation.md).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def tracing() -> bool:
    """True while a graph is being traced for a runtime (ONNX / ORT training export, Core ML's
    ``torch.jit.trace``): the layers below then emit the primitives every target differentiates
    and runs in any precision; eager torch uses the native kernels."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


class GroupNormP(nn.Module):
    """Group normalization from primitives: ``(x − μ_g) / sqrt(σ²_g + ε) · γ + β``.

    Numerically equal to :func:`torch.nn.functional.group_norm` (tested), but exported
    to ONNX as elementary ops instead of ``InstanceNormalization``.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError(f"num_channels={num_channels} is not divisible by num_groups={num_groups}")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not tracing():
            # eager torch (device training, the simulator, vmap): the native kernel — 1.7× faster
            # for a MobileFaceNet training step at 1 thread, equal up to float rounding (tested)
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        n = x.shape[0]
        g = x.reshape(n, self.num_groups, -1)
        mean = g.mean(dim=-1, keepdim=True)
        centered = g - mean
        var = (centered * centered).mean(dim=-1, keepdim=True)
        g = centered / torch.sqrt(var + self.eps)
        x = g.reshape(x.shape)
        # (1, -1, 1, …) is a constant in the exported graph, so the affine parameters have a
        # static [1, C, …] shape; with the traced C (dynamic) ONNX Runtime training cannot see
        # the broadcast and builds a bias gradient of the activation's shape (MobileFaceNet).
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.reshape(shape) + self.bias.reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}"


class ChannelAffine(nn.Module):
    """Per-channel affine ``y = a · x + b`` — what a BatchNorm is at inference.

    An eval-mode BatchNorm computes ``γ (x − μ) / sqrt(σ² + ε) + β`` with *frozen* running
    statistics, i.e. ``a = γ / sqrt(σ² + ε)`` and ``b = β − a μ`` per channel. This layer
    holds that folded form (``weight`` = a, ``bias`` = b), so a BatchNorm-trained recognizer
    (insightface, OpenCV SFace) is imported exactly (``fedfs_sdk.nn.face_import``). It has no
    batch statistics, so — like :class:`GroupNormP` — it behaves identically in torch
    training and eval, under vmap, in a one-identity phone batch and in ORT training (Mul/Add
    only). Parameter names match :class:`GroupNormP`'s.
    """

    def __init__(self, num_channels: int) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # static [1, C, 1, …] shape for ONNX Runtime training (see GroupNormP.forward)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.reshape(shape) + self.bias.reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.num_channels}"


class PReLUP(nn.Module):
    """Per-channel PReLU as ``relu(x) − a · relu(−x)`` (ORT has no ``PRelu`` gradient)."""

    def __init__(self, num_channels: int, init: float = 0.25) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((num_channels,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not tracing():
            return F.prelu(x, self.weight)        # eager: the native kernel, same function
        shape = (1, -1) + (1,) * (x.dim() - 2)
        a = self.weight.reshape(shape)
        return torch.relu(x) - a * torch.relu(-x)


def l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """``x / ‖x‖`` along ``dim`` from ReduceSum/Sqrt/Div (ORT has no LpNormalization gradient),
    overflow-proof wherever the graph can run in a narrow precision.

    * float32/float64 eager torch (training, the simulator): ``x / sqrt(Σ x² + ε)``. It
      cannot overflow below ‖x‖ ≈ 1.8e19, and its rounding is the one the executors'
      batched-vs-sequential equality is measured with (the scaled form below moved that
      difference from 2e-6 to 3e-4 for ``fedfs+feduv:paper`` — not yet understood, see
      issue 13's report — so fp32 training keeps the plain formula).
    * fp16/bf16 tensors and every traced graph (ONNX, ORT training artifacts, Core ML,
      whatever precision a runtime later picks): :func:`l2_normalize_scaled`, equal in exact
      arithmetic and overflow-proof in any precision.
    """
    if x.dtype in (torch.float32, torch.float64) and not tracing():
        return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return l2_normalize_scaled(x, dim, eps)


def l2_normalize_scaled(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """``x / ‖x‖`` from Abs/ReduceSum/Sqrt/Div, overflow-proof in any precision.

    The plain ``x / sqrt(Σ x²)`` overflows wherever ``Σ x²`` exceeds the format's range:
    fp16 (Core ML fp16, GPU autocast) tops out at 65504, so a FedUV head with ‖W g‖ ≥ 256
    gave ``uv = 0`` for every image and accepted everyone (issue 13). Here ``x`` is first
    divided by its mean magnitude ``m = Σ_i (|x_i| / n)`` (each term pre-divided, so no
    partial sum exceeds ``max|x|``) and by ``√n``: then ``u = x / (m √n)`` has
    ``‖u‖₁ = √n``, hence ``1 ≤ ‖u‖² ≤ n`` and ``|u_i| ≤ √n`` — every intermediate stays in
    ``[0, n]`` whatever the scale of ``x`` (n ≤ 511 here: far inside fp16's range).

    In exact arithmetic the result is ``x / ‖x‖`` for any positive scale, so ``m`` is
    detached (its gradient is exactly zero; autograd through it would only add rounding).
    ``eps`` only keeps ``x = 0`` at 0: it is added to ``‖u‖² ≥ 1``, where 1e-12 is below
    float32 resolution. ONNX has no stop-gradient, so ORT training differentiates the ``m``
    branch too (Abs, ReduceSum: both have ORT gradients) and gets the same gradient up to
    rounding. (A max-magnitude scale would be exact but ORT has no ReduceMax gradient.)
    """
    n = int(x.shape[dim])      # a constant in traced graphs (the normalized dim is never dynamic)
    m = (x.detach().abs() * (1.0 / n)).sum(dim=dim, keepdim=True)
    u = x / (m + torch.finfo(x.dtype).tiny) * (1.0 / math.sqrt(n))    # + tiny: x = 0 stays 0, not 0/0
    return u / torch.sqrt((u * u).sum(dim=dim, keepdim=True) + eps)


def norm_groups(channels: int, preferred: int) -> int:
    """Largest group count ≤ ``preferred`` that divides ``channels``."""
    g = min(preferred, channels)
    while channels % g:
        g -= 1
    return g
