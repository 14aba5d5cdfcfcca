"""Client-folded backbones: K clients' networks as ONE network over ``[B, K·C, H, W]``.

``vmap`` over clients turns each per-client convolution into a grouped convolution, but its
batching rules keep the client dimension in front (``[K, B, C, H, W]``) and move it next to the
channels and back around every convolution, norm and activation, forward and backward: on an
H200, MobileFaceNet@112 trained 11 client-updates/s at K = 48 with most of the device time in
those layout copies (benchmarks/gpu_step_profile.py; docs/simulation.md).

Here the clients live in the channel dimension for the whole trunk — client ``k``'s channel
``c`` is channel ``k·C + c`` — and every layer has a native kernel in that layout:

================================  =============================================================
layer (per client)                folded (K clients)
================================  =============================================================
``Conv2d(C→O, groups=g)``         ``conv2d`` with ``groups = K·g`` on the ``[K·O, C/g, kh, kw]``
                                  view of the stacked weights (depthwise stays depthwise);
                                  a 1×1 convolution optionally as a batched matrix product
``GroupNormP(G, C)``              ``group_norm`` with ``K·G`` groups (each client's groups are
                                  consecutive channel blocks, so statistics stay per client
                                  and per sample)
``ChannelAffine`` / ``PReLUP``    per-channel ``K·C`` weights
``Linear(Din→Dout)``              ``[B, K, Din] × [K, Dout, Din]``
ReLU, pooling, flatten, ``+``     unchanged (channel-wise or client-major already)
================================  =============================================================

No layer mixes samples (no batch statistics), so the folded network computes, for every
client, exactly what its own network computes on its own images (up to float rounding: the
kernels differ). :func:`check_folding` verifies that numerically for any backbone before it is
used; a backbone with a layer this module does not know, or whose own ``forward`` mixes
channels across clients (a channel concatenation, a reduction over channels), fails the check
and the executor keeps ``vmap``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedfs_sdk.nn.backbones.layers import ChannelAffine, GroupNormP, PReLUP

POINTWISE_MODES = ("conv", "matmul")


class FoldedConv2d(nn.Conv2d):
    """``weight`` ``[K, O, C/g, kh, kw]`` (and ``bias`` ``[K, O]``), input ``[B, K·C, H, W]``."""

    pointwise = "conv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        k, o = int(w.shape[0]), int(w.shape[1])
        if self.padding_mode != "zeros":
            raise NotImplementedError("folded convolution supports zero padding only")
        if (self.pointwise == "matmul" and self.kernel_size == (1, 1) and self.stride == (1, 1)
                and self.groups == 1 and self.padding in ((0, 0), "valid") and x.is_contiguous()):
            n, _, h, wd = x.shape
            # [K, O, C] @ [B, K, C, H·W] → [B, K, O, H·W]: a bmm over (sample, client), no layout copy
            y = torch.matmul(w.reshape(k, o, -1), x.reshape(n, k, -1, h * wd)).reshape(n, k * o, h, wd)
            return y if b is None else y + b.reshape(1, k * o, 1, 1)
        return F.conv2d(x, w.reshape((k * o,) + tuple(w.shape[2:])), None if b is None else b.reshape(k * o),
                        self.stride, self.padding, self.dilation, self.groups * k)


class FoldedGroupNorm(GroupNormP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = int(self.weight.shape[0])
        return F.group_norm(x, self.num_groups * k, self.weight.reshape(-1), self.bias.reshape(-1), self.eps)


class FoldedChannelAffine(ChannelAffine):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.reshape(shape) + self.bias.reshape(shape)


class FoldedPReLU(PReLUP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight.reshape(-1))


class FoldedLinear(nn.Linear):
    """``weight`` ``[K, Dout, Din]``, input ``[B, K·Din]`` → ``[B, K·Dout]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = int(self.weight.shape[0])
        n = x.shape[0]
        y = torch.einsum("bki,koi->bko", x.reshape(n, k, -1), self.weight)
        if self.bias is not None:
            y = y + self.bias.unsqueeze(0)
        return y.reshape(n, -1)


FOLDED: dict[type, type] = {nn.Conv2d: FoldedConv2d, GroupNormP: FoldedGroupNorm, ChannelAffine: FoldedChannelAffine,
                            PReLUP: FoldedPReLU, nn.Linear: FoldedLinear}
"""Layer → its folded form (a subclass: same parameters and names, another ``forward``)."""

class NotFoldable(Exception):
    """The backbone has a layer without a folded form (the executor keeps vmap)."""


def fold_module(backbone: nn.Module, pointwise: str = "conv") -> nn.Module:
    """A copy of ``backbone`` that runs K clients at once on ``[B, K·C, H, W]`` when called with
    stacked ``[K, …]`` parameters (``torch.func.functional_call``). Raises :class:`NotFoldable`
    for an exact type this module does not know (a subclass of a known layer might compute
    something else, so it is refused too)."""
    if pointwise not in POINTWISE_MODES:
        raise ValueError(f"pointwise must be one of {POINTWISE_MODES}, got {pointwise!r}")
    net = copy.deepcopy(backbone)
    for name, m in net.named_modules():
        kind = type(m)
        if kind in FOLDED:
            m.__class__ = FOLDED[kind]
            if isinstance(m, FoldedConv2d):
                m.pointwise = pointwise
        elif any(True for _ in m.parameters(recurse=False)):
            # a parameter-free module (activation, pooling, a container) runs as it is; whether its
            # forward keeps clients apart is what check_folding verifies
            raise NotFoldable(f"layer {name or '<root>'} ({kind.__name__}) has no client-folded form")
    return net.requires_grad_(False)


def fold_input(x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """``[K, B, C, H, W]`` → ``[B, K·C, H, W]`` (``channels_last``: stored NHWC, the layout
    cuDNN's grouped-convolution kernels work in)."""
    k, n = x.shape[:2]
    y = x.transpose(0, 1).reshape((n, k * x.shape[2]) + tuple(x.shape[3:]))
    return y.contiguous(memory_format=torch.channels_last) if channels_last else y


def unfold_output(y: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, K·D]`` (or ``[B, K·D, 1, 1]``) → ``[K, B, D]``."""
    return y.reshape(y.shape[0], k, -1).transpose(0, 1)


def folded_call(folded: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                channels_last: bool = False) -> torch.Tensor:
    """The backbone outputs ``[K, B, D]`` of K clients: ``params`` stacked ``[K, …]`` (names as
    the backbone's own), ``x`` ``[K, B, C, H, W]``."""
    k = int(x.shape[0])
    return unfold_output(functional_call(folded, params, (fold_input(x, channels_last),)), k)


def check_folding(backbone: nn.Module, folded: nn.Module, input_size: int, device: torch.device,
                  clients: int = 2, batch: int = 2, rtol: float = 1e-3) -> float:
    """Relative max difference between the folded network and ``vmap`` of the backbone on random
    per-client weights and images (float32). Raises :class:`NotFoldable` above ``rtol`` — the
    backbone's ``forward`` does something that is not per channel."""
    gen = torch.Generator().manual_seed(0)
    own = {k: v.detach().to(device, torch.float32) for k, v in backbone.state_dict().items()}
    params = {k: (v.unsqueeze(0) + 0.05 * torch.randn((clients,) + tuple(v.shape), generator=gen).to(device))
              for k, v in own.items()}
    x = torch.randn(clients, batch, 3, input_size, input_size, generator=gen).to(device)
    ref_net = copy.deepcopy(backbone).to(device).requires_grad_(False)
    # Full float32 on both sides: TF32 convolutions/matmuls (cuDNN's default) would round each
    # side differently by ~1e-3 and hide, or fake, a layout error.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = vmap(lambda p, xx: functional_call(ref_net, p, (xx,)))(params, x)
            try:
                got = folded_call(folded.to(device), params, x)
            except (RuntimeError, ValueError) as e:   # e.g. a residual that pads channels (dlib-resnet)
                raise NotFoldable(f"the folded backbone fails ({str(e).splitlines()[0]}): its forward is not "
                                  f"per channel") from None
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    if not err <= rtol:
        raise NotFoldable(f"folded backbone differs from the per-client one by {err:.2e} (relative): its forward "
                          f"mixes channels across clients")
    return err


__all__ = ["fold_module", "folded_call", "fold_input", "unfold_output", "check_folding", "NotFoldable",
           "POINTWISE_MODES"]
