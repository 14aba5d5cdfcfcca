"""The FedUV paper's CNN for CelebA (FedUV Table 2, CelebA column), 64×64 input.

Five blocks ``conv3×3 → relu → maxpool → GN(2)`` with 64…1024 channels, then flatten to a
1024-d ``g_θ(x)``. The paper's final ``FC(1024, c)`` + Scaling is the FedUV head ``W``/σ,
which lives in :class:`fedfs_sdk.nn.model.FedUVHead`, not here.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import GroupNormP


class FedUVCNN(nn.Module):
    name = "feduv_cnn"

    def __init__(self, embedding_dim: int = 1024, input_size: int = 64, width: int = 64) -> None:
        super().__init__()
        if input_size != 64:
            raise ValueError(f"feduv_cnn is defined for 64×64 inputs (FedUV Table 2), got {input_size}")
        chans = [3, width, width * 2, width * 4, width * 8, width * 16]
        pools = [2, 2, 2, 2, 4]
        blocks: list[nn.Module] = []
        for cin, cout, p in zip(chans[:-1], chans[1:], pools):
            blocks += [nn.Conv2d(cin, cout, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(p), GroupNormP(2, cout)]
        self.features = nn.Sequential(*blocks)
        self.input_size = input_size
        if embedding_dim != chans[-1]:
            raise ValueError(f"feduv_cnn embedding_dim is 16×width = {chans[-1]}, got {embedding_dim}")
        self.embedding_dim = embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).flatten(1)
