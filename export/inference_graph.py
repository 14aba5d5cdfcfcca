"""The inference twin of a verifier: the same parameters, exported with ops ONNX Runtime runs fast.

The backbones build their normalization and activation from primitives
(:class:`~fedfs_sdk.nn.backbones.layers.GroupNormP`: ReduceMean/Sub/Mul/Sqrt/Div;
:class:`~fedfs_sdk.nn.backbones.layers.PReLUP`: Relu/Neg/Mul/Sub) because ONNX Runtime
*training* 1.19 cannot differentiate ``InstanceNormalization`` or ``PRelu``. The training
graphs (``export.training_graphs``) need exactly that; an inference graph does not. Profiled
on MobileFaceNet@112 at one thread (``benchmarks/export_profile.py``), the primitives spent
more time than the 50 convolutions: each norm ran as ~10 separate kernels plus a dynamic
``Shape → Gather → Concat → Reshape`` chain, each PReLU as 5.

:func:`inference_twin` returns a copy of the verifier whose layers compute the same function
with fused ops, and keeps every parameter under its state-dict name (so the ONNX model id,
which hashes the parameters by name, and ``OnnxBackend(weights=…)`` work unchanged):

* ``GroupNormP`` → ``Reshape`` (static ``[-1, G, L]``) → ``InstanceNormalization`` (one kernel
  computes the group statistics and normalizes) → ``Reshape`` back → ``BatchNormalization``
  with mean 0, variance 1, ε 0, i.e. exactly the per-channel affine ``γ·x + β`` in one pass
  (two passes as ``Mul`` + ``Add``; measured 10 % of the graph's time).
* ``ChannelAffine`` → the same ``BatchNormalization``.
* ``PReLUP`` → ``PRelu``.

The static reshape sizes come from the traced input: the input size is fixed by the
:class:`~export.common.InputContract`; only the batch stays dynamic (``-1``).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from fedfs_sdk.nn.backbones.layers import ChannelAffine, GroupNormP, PReLUP


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``weight·x + bias`` per channel (dim 1) as one ``BatchNormalization`` (mean 0, var 1, ε 0)."""
    c = weight.shape[0]
    zeros = torch.zeros(c, dtype=x.dtype)
    ones = torch.ones(c, dtype=x.dtype)
    return F.batch_norm(x, zeros, ones, weight, bias, False, 0.0, 0.0)


class GroupNormInference(nn.Module):
    """:class:`GroupNormP` for inference graphs (``InstanceNormalization`` + ``BatchNormalization``)."""

    def __init__(self, source: GroupNormP) -> None:
        super().__init__()
        self.num_groups = source.num_groups
        self.num_channels = source.num_channels
        self.eps = source.eps
        self.weight = source.weight
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # int(): constants in the traced graph (static spatial size), batch left to -1
        dims = [int(d) for d in x.shape[1:]]
        per_group = math.prod(dims) // self.num_groups
        g = self.num_groups
        y = F.instance_norm(x.reshape(-1, g, per_group), weight=torch.ones(g, dtype=x.dtype),
                            bias=torch.zeros(g, dtype=x.dtype), eps=self.eps)
        return _affine(y.reshape([-1] + dims), self.weight, self.bias)


class ChannelAffineInference(nn.Module):
    """:class:`ChannelAffine` as one ``BatchNormalization`` node."""

    def __init__(self, source: ChannelAffine) -> None:
        super().__init__()
        self.weight = source.weight
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _affine(x, self.weight, self.bias)


class PReLUInference(nn.Module):
    """:class:`PReLUP` as one ``PRelu`` node."""

    def __init__(self, source: PReLUP) -> None:
        super().__init__()
        self.weight = source.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight)


_TWINS: dict[type, type] = {GroupNormP: GroupNormInference, ChannelAffine: ChannelAffineInference,
                            PReLUP: PReLUInference}


def _swap(module: nn.Module) -> int:
    swapped = 0
    for name, child in module.named_children():
        twin = _TWINS.get(type(child))
        if twin is not None:
            setattr(module, name, twin(child))
            swapped += 1
        else:
            swapped += _swap(child)
    return swapped


def inference_twin(verifier: nn.Module) -> nn.Module:
    """A copy of ``verifier`` (eval mode) with the fused-op layers above in place of the
    ORT-trainable ones; same state-dict keys and tensors, same function (to float rounding).

    Layers of other types (a backbone added later) are left as they are: still correct, just
    not faster. The original ``verifier`` is not modified.
    """
    twin = copy.deepcopy(verifier).eval()
    _swap(twin)
    before, after = verifier.state_dict(), twin.state_dict()
    if list(before) != list(after) or any(before[k].shape != after[k].shape for k in before):
        raise RuntimeError("inference twin changed the parameter names or shapes")   # a bug here, not bad input
    return twin
