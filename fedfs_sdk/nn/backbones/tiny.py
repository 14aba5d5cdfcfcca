"""A tiny MobileFaceNet-shaped backbone for tests, demos and CPU simulation.

Same building blocks as :mod:`mobilefacenet` (strided convs, a depthwise-separable block,
GDC head, GroupNormP/PReLUP), a few hundred thousand multiply-adds at 32×32.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import GroupNormP, PReLUP, norm_groups


def _cna(cin: int, cout: int, k: int, s: int, groups: int = 1, act: bool = True) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False),
                               GroupNormP(norm_groups(cout, 4), cout)]
    if act:
        layers.append(PReLUP(cout))
    return layers


class TinyFaceNet(nn.Module):
    name = "tiny"

    def __init__(self, embedding_dim: int = 64, input_size: int = 32, width: int = 16) -> None:
        super().__init__()
        if input_size % 8 != 0:
            raise ValueError(f"tiny input_size must be a multiple of 8, got {input_size}")
        w = width
        self.features = nn.Sequential(
            *_cna(3, w, 3, 2),                 # /2
            *_cna(w, w, 3, 1, groups=w),       # depthwise
            *_cna(w, 2 * w, 1, 1),             # pointwise
            *_cna(2 * w, 2 * w, 3, 2),         # /4
            *_cna(2 * w, 4 * w, 3, 2),         # /8
        )
        k = input_size // 8
        self.gdc = nn.Conv2d(4 * w, 4 * w, k, 1, 0, groups=4 * w, bias=False)
        self.embed = nn.Linear(4 * w, embedding_dim, bias=False)
        self.embed_norm = GroupNormP(1, embedding_dim)
        self.input_size = input_size
        self.embedding_dim = embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gdc(self.features(x)).flatten(1)
        return self.embed_norm(self.embed(x))
