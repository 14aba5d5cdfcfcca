"""insightface's "mbf" MobileFaceNet (arcface_torch), the recognizer of buffalo_s/buffalo_sc.

insightface's ``w600k_mbf.onnx`` (model packs ``buffalo_s`` and ``buffalo_sc``) is arcface_torch's
``get_mbf`` — a MobileFaceNet (Chen et al., 2018) widened by ``scale = 2`` with its own block
layout ``blocks = (1, 4, 6, 2)`` — trained with ArcFace (Deng et al., 2019) on WebFace600K. Its
layers, in forward order (``c = 64·scale = 128``):

* stem: 3×3/2 conv 3→c, then a 3×3/1 *grouped* conv c→c with 64 groups (2 input channels per
  group, not depthwise), each conv → BatchNorm → PReLU;
* three stages, each one stride-2 "depthwise" unit (1×1 expand → 3×3/2 depthwise → 1×1 linear
  projection, no shortcut) then ``blocks[1..3]`` residual units at stride 1: c→c (hidden 128)
  then ×4 (hidden 128); c→2c (hidden 256) then ×6 (256); 2c→2c (hidden 512) then ×2 (256) —
  the hidden widths are arcface_torch's fixed ``groups`` arguments, not an expansion factor;
* ``conv_sep``: 1×1 conv 2c→512 → BatchNorm → PReLU;
* GDC head: 7×7 depthwise conv (no padding) → BatchNorm, flatten, ``Linear(512, E, bias=False)``
  → BatchNorm1d. E = 512 for w600k_mbf.

:class:`InsightFaceMBF` (backbone ``insightface-mbf``) is that topology with the project's
ORT-trainable layers: every (eval-mode) BatchNorm is a :class:`ChannelAffine` ``a·x + b`` and
every PReLU a :class:`PReLUP`, so the imported weights (:mod:`fedfs_sdk.nn.face_import`) give the
same function, train on-device and export like the other backbones. Modules are registered in
arcface_torch's forward order, so its state dict maps onto this one tensor by tensor.
Input: ``[B, 3, 112, 112]`` RGB, ``(x − 127.5)/127.5`` (the project's and insightface's convention).
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import ChannelAffine
from .mobilefacenet import Bottleneck, ConvNormAct


class InsightFaceMBF(nn.Module):
    """``x [B,3,S,S]`` (S = 112 for the released weights) → embedding ``[B, embedding_dim]``."""

    name = "insightface-mbf"
    norm = "affine"

    def __init__(self, embedding_dim: int = 512, input_size: int = 112,
                 blocks: tuple[int, int, int, int] = (1, 4, 6, 2), scale: int = 2) -> None:
        super().__init__()
        if input_size % 16 != 0:
            raise ValueError(f"insightface-mbf input_size must be a multiple of 16, got {input_size}")
        if blocks[0] != 1:
            # arcface_torch builds a residual stem for blocks[0] > 1 (mbf_large); not needed for w600k_mbf
            raise ValueError(f"insightface-mbf supports blocks[0] = 1 (get_mbf), got {blocks}")
        self.input_size = input_size
        self.embedding_dim = embedding_dim
        c = 64 * scale
        layers: list[nn.Module] = [
            ConvNormAct(3, c, 3, 2, norm="affine"),
            ConvNormAct(c, c, 3, 1, groups=64, norm="affine"),       # grouped (64 groups), as in arcface_torch
        ]
        # (cin, cout, hidden of the stride-2 unit, hidden of the residual units, repeats); the hidden
        # widths are arcface_torch's fixed ``groups`` arguments (they do not follow ``scale``)
        for cin, cout, h_down, h_res, n in ((c, c, 128, 128, blocks[1]),
                                            (c, 2 * c, 256, 256, blocks[2]),
                                            (2 * c, 2 * c, 512, 256, blocks[3])):
            # arcface_torch's DepthWise (stride 2, no shortcut) then its Residual units (stride 1)
            layers.append(Bottleneck(cin, cout, 2, 1, 1, norm="affine", hidden=h_down))
            layers += [Bottleneck(cout, cout, 1, 1, 1, norm="affine", hidden=h_res) for _ in range(n)]
        layers.append(ConvNormAct(2 * c, 512, 1, 1, norm="affine"))            # conv_sep
        self.features = nn.Sequential(*layers)
        k = input_size // 16
        # GDC: a k×k depthwise conv + affine (no activation) in place of global average pooling
        self.gdc = ConvNormAct(512, 512, k, 1, groups=512, act=False, norm="affine")
        self.gdc[0].padding = (0, 0)
        self.embed = nn.Linear(512, embedding_dim, bias=False)
        self.embed_norm = ChannelAffine(embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gdc(self.features(x)).flatten(1)
        return self.embed_norm(self.embed(x))
