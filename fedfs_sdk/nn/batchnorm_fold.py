"""BatchNorm at inference as a per-channel affine ``a·x + b`` (for ``mobilefacenet-affine``).

An eval-mode BatchNorm computes ``γ (x − μ)/sqrt(σ² + ε) + β`` with frozen running statistics:
``a = γ/sqrt(σ² + ε)``, ``b = β − a·μ``. Used by :mod:`fedfs_sdk.nn.face_import` to import
BatchNorm-trained recognizers (insightface, OpenCV SFace) exactly onto
:class:`~fedfs_sdk.nn.backbones.layers.ChannelAffine` norms.
"""
from __future__ import annotations

from typing import Mapping

import torch

GROUP, AFFINE = "mobilefacenet", "mobilefacenet-affine"


def affine_of_bn(gamma: torch.Tensor | None, beta: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm ``γ (x − μ)/sqrt(σ² + ε) + β`` as ``(a, b)`` of ``a·x + b`` (float64 on the way)."""
    mean, var = mean.double(), var.double()
    g = torch.ones_like(mean) if gamma is None else gamma.double()
    a = g / torch.sqrt(var + eps)
    b = (torch.zeros_like(mean) if beta is None else beta.double()) - a * mean
    return a.float(), b.float()


def fold_batchnorm(state: Mapping[str, torch.Tensor], eps: float = 1e-5) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A state dict with every BatchNorm (a module with ``running_mean``/``running_var``)
    replaced by its eval-mode affine — ``weight`` = a, ``bias`` = b, statistics dropped — and
    every conv/linear bias moved into the affine that follows it (the project's convs have no
    bias): into the next BatchNorm's ``b`` (``b += a·bias``) or, when none follows, as an
    identity affine ``(1, bias)`` of its own. ``eps``: the BatchNorm's ε, which a state dict
    does not record (torch's default 1e-5; insightface's MobileFaceNet uses the default).
    Returns the new dict (in the source's order) and the folded module names."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        prefix, _, leaf = k.rpartition(".")
        groups.setdefault(prefix, {})[leaf] = v
    out: dict[str, torch.Tensor] = {}
    folded: list[str] = []
    pending: tuple[str, torch.Tensor] | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            name, bias = pending
            out[f"{name}.bias:affine.weight"] = torch.ones_like(bias)
            out[f"{name}.bias:affine.bias"] = bias
            folded.append(f"{name}.bias")
            pending = None

    for prefix, g in groups.items():
        pre = f"{prefix}." if prefix else ""
        if "running_mean" in g and "running_var" in g:
            a, b = affine_of_bn(g.get("weight"), g.get("bias"), g["running_mean"], g["running_var"], eps)
            if pending is not None:
                b = b + a * pending[1].float()
                folded.append(f"{pending[0]}.bias")
                pending = None
            out[pre + "weight"], out[pre + "bias"] = a, b
            folded.append(prefix)
            continue
        w, bias = g.get("weight"), g.get("bias")
        flush()
        if w is not None and w.dim() >= 2 and bias is not None and bias.dim() == 1 and bias.shape[0] == w.shape[0]:
            out[pre + "weight"] = w
            pending = (prefix, bias)
            out.update({pre + k: v for k, v in g.items() if k not in ("weight", "bias")})
            continue
        out.update({pre + k: v for k, v in g.items()})
    flush()
    return out, folded


def state_dict_backbone(state: Mapping[str, torch.Tensor]) -> str:
    """``mobilefacenet-affine`` when the state dict has BatchNorm statistics or biased
    convolutions (a BatchNorm network, folded or not), else ``mobilefacenet``."""
    groups: dict[str, set[str]] = {}
    for k, v in state.items():
        prefix, _, leaf = k.rpartition(".")
        groups.setdefault(prefix, set()).add(leaf if not (leaf == "weight" and v.dim() >= 2) else "weight2d")
    return AFFINE if any({"running_mean", "running_var"} <= g or {"weight2d", "bias"} <= g
                         for g in groups.values()) else GROUP


__all__ = ["GROUP", "AFFINE", "affine_of_bn", "fold_batchnorm", "state_dict_backbone"]
