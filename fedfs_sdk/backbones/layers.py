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
"""
from __future__ import annotations

import torch
from torch import nn


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


class PReLUP(nn.Module):
    """Per-channel PReLU as ``relu(x) − a · relu(−x)`` (ORT has no ``PRelu`` gradient)."""

    def __init__(self, num_channels: int, init: float = 0.25) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((num_channels,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        a = self.weight.reshape(shape)
        return torch.relu(x) - a * torch.relu(-x)


def l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """``x / ||x||`` with ReduceSum/Sqrt only (ORT has no LpNormalization gradient)."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def norm_groups(channels: int, preferred: int) -> int:
    """Largest group count ≤ ``preferred`` that divides ``channels``."""
    g = min(preferred, channels)
    while channels % g:
        g -= 1
    return g
