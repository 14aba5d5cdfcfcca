"""MobileFaceNet (Chen et al., 2018) at 112×112 with ORT-trainable norm/activation.

Depthwise-separable inverted bottlenecks, a global depthwise convolution (GDC) head and a
linear embedding of 128 or 512 dimensions. BatchNorm is replaced by :class:`GroupNormP`
and PReLU by :class:`PReLUP` (see ``layers.py`` and ``docs/methods.md`` for why).

:class:`MobileFaceNetAffine` (backbone ``mobilefacenet-affine``) is the same topology with
:class:`ChannelAffine` in place of every norm: an eval-mode BatchNorm folded to ``a·x + b``,
so BatchNorm-trained recognizers (insightface, OpenCV SFace) import exactly. Two more variants of
published MobileFaceNets import onto it (``fedfs import-model``):

* :class:`MobileFaceNetAffine112x96` (``mobilefacenet-affine-112x96``): the same network trained on
  112×96 crops (CASIA-WebFace models of the SphereFace/CosFace era, e.g. Xiaoccer's PyTorch port),
  whose GDC kernel is 7×6. It takes the project's square 112×112 input and crops its centre 96
  columns itself: insightface's 112×112 template is the 96×112 SphereFace template moved 8 px to
  the right, so the centre 96 columns of an aligned 112×112 face are exactly the 112×96 crop.
* :class:`MobileFaceNetReLU6` (``mobilefacenet-relu6``): ReLU6 in place of PReLU and a pointwise
  1×1 conv after the stem's depthwise conv (both with ReLU), BatchNorm folded — the graph of
  Facegate's ``MobileFaceNet.onnx``.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import ChannelAffine, GroupNormP, PReLUP, norm_groups

# (expansion t, output channels c, repeats n, first stride s), the paper's Table 1.
_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)


def _norm(channels: int, gn_groups: int, norm: str) -> nn.Module:
    """``"group"``: per-sample :class:`GroupNormP`; ``"affine"``: per-channel :class:`ChannelAffine`."""
    if norm == "affine":
        return ChannelAffine(channels)
    if norm == "group":
        return GroupNormP(norm_groups(channels, gn_groups), channels)
    raise ValueError(f"norm must be 'group' or 'affine', got {norm!r}")


def _act(kind: str, channels: int) -> nn.Module:
    """``"prelu"``: the project's :class:`PReLUP` (trainable slopes); ``"relu6"`` / ``"relu"``."""
    if kind == "prelu":
        return PReLUP(channels)
    if kind == "relu6":
        return nn.ReLU6()           # exports as Clip(0, 6): ORT differentiates it
    if kind == "relu":
        return nn.ReLU()
    raise ValueError(f"activation must be 'prelu', 'relu6' or 'relu', got {kind!r}")


class ConvNormAct(nn.Sequential):
    # Convolutions have no bias: a norm follows each one, and its β (or the affine's b) is the
    # bias — a BatchNorm-folded conv bias is imported into that b (fedfs_sdk.nn.face_import).
    # ``act``: True (= "prelu"), False (none) or an activation name (_act).
    def __init__(self, cin: int, cout: int, k: int | tuple[int, int], s: int, groups: int = 1,
                 act: bool | str = True, gn_groups: int = 8, norm: str = "group") -> None:
        pad = 0 if not isinstance(k, int) else (k // 2 if k > 1 else 0)
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, k, s, pad, groups=groups, bias=False),
            _norm(cout, gn_groups, norm),
        ]
        if act:
            layers.append(_act("prelu" if act is True else act, cout))
        super().__init__(*layers)


class Bottleneck(nn.Module):
    """Inverted residual: 1×1 expand → 3×3 depthwise (stride s) → 1×1 linear projection; ``x +`` it
    when stride 1 keeps the shape. ``hidden`` overrides ``cin · expansion`` (arcface_torch's mbf
    fixes the expanded widths, :mod:`~fedfs_sdk.nn.backbones.insightface_mbf`)."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int, gn_groups: int,
                 norm: str = "group", hidden: int | None = None, act: str = "prelu") -> None:
        super().__init__()
        hidden = cin * expansion if hidden is None else hidden
        self.residual = stride == 1 and cin == cout
        self.block = nn.Sequential(
            ConvNormAct(cin, hidden, 1, 1, act=act, gn_groups=gn_groups, norm=norm),
            ConvNormAct(hidden, hidden, 3, stride, groups=hidden, act=act, gn_groups=gn_groups, norm=norm),
            ConvNormAct(hidden, cout, 1, 1, act=False, gn_groups=gn_groups, norm=norm),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MobileFaceNet(nn.Module):
    """MobileFaceNet backbone: ``x [B,3,112,112]`` → embedding ``[B, embedding_dim]``."""

    name = "mobilefacenet"
    norm = "group"
    act = "prelu"
    stem_acts: tuple[str, ...] = ("prelu", "prelu")
    """Activations of the stem's conv and depthwise conv (and of its pointwise conv, if a third)."""
    crop_width: int | None = None
    """Columns of the (square) input the network sees, centred; None: all of them."""

    def __init__(self, embedding_dim: int = 128, input_size: int = 112, gn_groups: int = 8) -> None:
        super().__init__()
        width = self.crop_width or input_size
        if input_size % 16 != 0 or width % 16 != 0 or width > input_size:
            raise ValueError(f"{self.name}: input_size (and crop width) must be multiples of 16, got "
                             f"{input_size} ({width})")
        self.input_size = input_size
        self.embedding_dim = embedding_dim
        self.crop = (input_size - width) // 2
        self.width = width
        stem = self.stem_acts
        layers: list[nn.Module] = [
            ConvNormAct(3, 64, 3, 2, act=stem[0], gn_groups=gn_groups, norm=self.norm),
            ConvNormAct(64, 64, 3, 1, groups=64, act=stem[1], gn_groups=gn_groups, norm=self.norm),
        ]
        if len(stem) > 2:          # a pointwise conv after the depthwise one (MobileFaceNetReLU6)
            layers.append(ConvNormAct(64, 64, 1, 1, act=stem[2], gn_groups=gn_groups, norm=self.norm))
        cin = 64
        for t, c, n, s in _SETTINGS:
            for i in range(n):
                layers.append(Bottleneck(cin, c, s if i == 0 else 1, t, gn_groups, self.norm, act=self.act))
                cin = c
        layers.append(ConvNormAct(cin, 512, 1, 1, act=self.act, gn_groups=gn_groups, norm=self.norm))
        self.features = nn.Sequential(*layers)
        k = (input_size // 16, width // 16)
        # GDC: a k×k depthwise conv with no activation replaces global average pooling.
        self.gdc = ConvNormAct(512, 512, k, 1, groups=512, act=False, gn_groups=gn_groups, norm=self.norm)
        self.gdc[0].padding = (0, 0)
        self.embed = nn.Conv2d(512, embedding_dim, 1, bias=False)
        self.embed_norm = _norm(embedding_dim, 1, self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.crop:
            x = x[:, :, :, self.crop:self.crop + self.width]        # static bounds: a constant Slice
        x = self.gdc(self.features(x))
        x = self.embed(x).flatten(1)
        return self.embed_norm(x)


class MobileFaceNetAffine(MobileFaceNet):
    """MobileFaceNet with :class:`ChannelAffine` norms (backbone ``mobilefacenet-affine``).

    The same topology and parameter names as :class:`MobileFaceNet`; each norm is a per-channel
    ``a·x + b`` (an eval-mode BatchNorm, folded). What a BatchNorm-trained recognizer imports
    onto; trainable like any other backbone (no batch statistics, so FL-safe too)."""

    name = "mobilefacenet-affine"
    norm = "affine"


class MobileFaceNetAffine112x96(MobileFaceNetAffine):
    """``mobilefacenet-affine-112x96``: a MobileFaceNet trained on 112×96 crops (GDC 7×6) behind the
    project's 112×112 input, whose centre 96 columns it takes (see the module docstring)."""

    name = "mobilefacenet-affine-112x96"
    crop_width = 96


class MobileFaceNetReLU6(MobileFaceNetAffine):
    """``mobilefacenet-relu6``: ReLU6 activations, a ReLU stem with an extra pointwise conv, BatchNorm
    folded (Facegate's ``MobileFaceNet.onnx``)."""

    name = "mobilefacenet-relu6"
    act = "relu6"
    stem_acts = ("relu6", "relu", "relu")
