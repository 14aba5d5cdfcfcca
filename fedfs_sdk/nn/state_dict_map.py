"""A state dict's tensors onto a module: read the file (``.safetensors``, or torch ``.pt``/``.pth``
with ``weights_only=True``), unwrap a training script's checkpoint (:data:`WRAPPER_KEYS`), then
copy the tensors by name and, for the rest, by shape in order (:func:`map_onto`), recording
where each went in a :class:`MappingReport`. The shared piece of :mod:`fedfs_sdk.nn.face_import`
(which picks the topology, folds BatchNorm, absorbs the input convention and checks parity).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import InputError

# Buffers of BatchNorm layers: meaningless for GroupNormP (normalizes each sample by itself).
_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class MappingReport:
    """Which source tensor went where. ``mapped``: ``(source, target)`` pairs; ``by_shape``:
    the targets filled by shape order rather than by name; ``unmapped_source`` /
    ``missing_target``: keys left over on either side (``missing_target`` keep their
    initial values); ``max_abs_diff`` / ``max_rel_diff``: the parity check of an ONNX import
    (None otherwise; relative to the graph's largest embedding component); ``folded``: the
    BatchNorm layers / conv biases folded into per-channel affines; ``input_convention``: what
    the source wants as input and what was absorbed into the first convolution."""

    mapped: list[tuple[str, str]] = field(default_factory=list)
    by_shape: list[str] = field(default_factory=list)
    unmapped_source: list[str] = field(default_factory=list)
    missing_target: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    folded: list[str] = field(default_factory=list)
    max_rel_diff: float | None = None
    input_convention: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing_target

    def summary(self) -> str:
        """A few lines for a CLI or a log: counts, then every unmapped key."""
        lines = [f"mapped {len(self.mapped)} tensors ({len(self.by_shape)} by shape order), "
                 f"{len(self.unmapped_source)} source keys unmapped, {len(self.missing_target)} model keys missing"]
        if self.folded:
            lines.append(f"folded {len(self.folded)} BatchNorm layers / conv biases into per-channel affines (a·x + b)")
        if self.max_abs_diff is not None:
            rel = f" ({self.max_rel_diff:.2e} of the largest component)" if self.max_rel_diff is not None else ""
            lines.append(f"parity with the source graph: max |Δembedding| = {self.max_abs_diff:.2e}{rel}")
        if self.input_convention.get("absorbed"):
            lines.append(f"source input: {self.input_convention['source']}; absorbed into the first convolution: "
                         f"{self.input_convention['absorbed']}")
        if self.unmapped_source:
            lines.append("unmapped source keys: " + _listing(self.unmapped_source))
        if self.missing_target:
            lines.append("model keys left at their initial values: " + _listing(self.missing_target))
        return "\n".join(lines)


def _listing(keys: list[str], limit: int = 40) -> str:
    uniq = list(dict.fromkeys(keys))
    more = f" … and {len(uniq) - limit} more" if len(uniq) > limit else ""
    return ", ".join(uniq[:limit]) + more


def _strip_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}
    for prefix in ("backbone.", "model."):
        if out and all(k.startswith(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out


def _fits(src: torch.Tensor, shape: torch.Size) -> bool:
    # [1, C, 1, 1] constants (folded reshapes) fit a [C] parameter; squeeze only size-1 dims
    return tuple(src.shape) == tuple(shape) or (src.numel() == int(np.prod(shape)) and
                                                [d for d in src.shape if d != 1] == [d for d in shape if d != 1])


def map_onto(target: torch.nn.Module, source: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
             by_shape: bool = True) -> MappingReport:
    """Copy ``source`` tensors into ``target``'s state dict: first every key whose name
    (after stripping ``module.``/``backbone.``/``model.``) and shape match, then — if
    ``by_shape`` — the remaining ones pairwise in order while their shapes fit, stopping at
    the first mismatch. BatchNorm statistics are never mapped. Returns the report."""
    items = list(source.items()) if isinstance(source, Mapping) else list(source)
    src_named = _strip_prefix(dict(items)) if isinstance(source, Mapping) else None
    order = list(src_named.items()) if src_named is not None else items
    tstate = target.state_dict()
    rep = MappingReport()
    new: dict[str, torch.Tensor] = {}
    used_src: set[int] = set()
    for i, (k, v) in enumerate(order):
        if k.rsplit(".", 1)[-1] in _STATS:
            used_src.add(i)
            rep.unmapped_source.append(k)
        elif src_named is not None and k in tstate and tuple(v.shape) == tuple(tstate[k].shape):
            new[k] = v
            used_src.add(i)
            rep.mapped.append((k, k))
    if by_shape:
        rest_src = [(i, k, v) for i, (k, v) in enumerate(order) if i not in used_src]
        rest_tgt = [k for k in tstate if k not in new]
        for (i, k, v), t in zip(rest_src, rest_tgt):
            if not _fits(v, tstate[t].shape) or not torch.is_floating_point(v):
                break
            new[t] = v.reshape(tstate[t].shape)
            used_src.add(i)
            rep.mapped.append((k, t))
            rep.by_shape.append(t)
    rep.unmapped_source += [k for i, (k, _) in enumerate(order) if i not in used_src]
    rep.missing_target = [k for k in tstate if k not in new]
    merged = {k: new.get(k, tstate[k]).to(tstate[k].dtype).clone() for k in tstate}
    target.load_state_dict(merged, strict=True)
    return rep


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or a torch ``.pt``/``.pth`` file (loaded with
    ``weights_only=True``: no pickled code runs); a ``{"state_dict": …}`` wrapper is opened."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"weights file not found: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file
            obj: Any = load_file(str(p))
        else:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is "not a weights file"
        raise InputError(f"{p} is not a readable state dict ({e})") from None
    obj, path = unwrap_state_dict(obj)
    if obj is None:
        raise InputError(f"{p} does not hold a state dict (a mapping of names to tensors): {path}; pass the "
                         "state dict itself (e.g. torch.save(ckpt['<key>'], 'weights.pt'))")
    return obj


WRAPPER_KEYS = ("state_dict", "net_state_dict", "model_state_dict", "state_dict_backbone", "model", "net",
                "network", "backbone", "module", "params", "weights", "ema", "model_ema")
"""Keys under which training scripts keep the weights (tried in this order, level by level):
torch-lightning / timm ``state_dict``, Xiaoccer's MobileFaceNet ``net_state_dict``, the PyTorch
tutorial's ``model_state_dict``, arcface_torch's resume ``state_dict_backbone``, …"""


def unwrap_state_dict(obj: Any) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The tensors of a loaded checkpoint: ``obj`` itself when it maps names to tensors (non-tensor
    entries such as an epoch counter alongside are dropped only inside a wrapper), else the mapping
    under one of :data:`WRAPPER_KEYS`, level by level (``{"model": {"state_dict": …}}``); a
    ``module.`` prefix (DataParallel) is removed later by the mapping. Returns ``(state, how)`` —
    ``how`` names the keys followed — or ``(None, what was seen)`` for the error message."""
    path: list[str] = []
    for _ in range(4):
        if isinstance(obj, dict) and obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
            return dict(obj), " → ".join(path) or "top level"
        if not isinstance(obj, dict):
            break
        key = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), dict) and obj[k]), None)
        if key is None:
            break
        path.append(repr(key))
        obj = obj[key]
    if isinstance(obj, dict):
        seen = ", ".join(f"{k!r} ({type(v).__name__}{f' of {len(v)}' if isinstance(v, dict) else ''})"
                         for k, v in list(obj.items())[:12])
        more = f" … and {len(obj) - 12} more" if len(obj) > 12 else ""
        where = f" under {' → '.join(path)}" if path else ""
        return None, f"the keys it holds{where} are {seen or 'none'}{more}, and none is a mapping of names to tensors"
    return None, f"it holds a {type(obj).__name__}"


__all__ = ["MappingReport", "WRAPPER_KEYS", "map_onto", "read_state_dict", "unwrap_state_dict"]
