"""Read a face recognizer's weights and input convention out of an ONNX graph.

Used by :mod:`fedfs_sdk.nn.face_import`. Two jobs:

* :func:`onnx_initializers_in_use_order`: the parameters in the order the graph uses them,
  BatchNorm (kept as ``BatchNormalization`` nodes or already folded into biased convolutions
  by the exporter / an optimizer) turned into per-channel affines ``a·x + b``;
* :func:`input_normalization` / :func:`absorb_input_convention`: the elementwise ``Sub``/``Add``/``Mul``/``Div`` by constants
  that some graphs apply to the raw pixels before their first convolution (MXNet-converted
  insightface models, OpenCV's SFace: ``(x − 127.5)·0.0078125`` inside the graph, fed 0–255
  pixels), as ``y = k·x + d`` per channel, moved with the channel order and any mean/std
  applied before the graph into the first convolution, so that the imported model takes the
  project's input convention (:data:`FEDFS_INPUT`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .batchnorm_fold import affine_of_bn
from ..errors import InputError

_ELEMENTWISE = ("Sub", "Add", "Mul", "Div")

FEDFS_INPUT = "RGB, (x − 127.5) / 127.5 (fedfs_sdk.runtime.preprocess)"
"""What every fedfs model takes (:mod:`fedfs_sdk.runtime.preprocess`); imports are converted to it."""


@dataclass(frozen=True)
class InGraphNormalization:
    """``y = k·x + d`` per input channel (in the graph's channel order), applied by the graph
    itself to its raw input before the first convolution; ``nodes``: the node names."""

    k: tuple[float, float, float]
    d: tuple[float, float, float]
    nodes: tuple[str, ...]

    def describe(self) -> str:
        if len(set(self.k)) == 1 and len(set(self.d)) == 1 and self.k[0] != 0:
            mean, std = -self.d[0] / self.k[0], 1.0 / self.k[0]
            return f"(x − {mean:g}) / {std:g} inside the graph ({', '.join(self.nodes)})"
        return f"x·{list(self.k)} + {list(self.d)} inside the graph ({', '.join(self.nodes)})"


def _load(path: str | os.PathLike[str]) -> Any:
    import onnx

    p = Path(path)
    if not p.is_file():
        raise InputError(f"ONNX model not found: {p}")
    try:
        return onnx.load(str(p))
    except Exception as e:  # noqa: BLE001
        raise InputError(f"{p} is not a readable ONNX model ({e})") from None


def _constants(g: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """``(initializers, Constant-node values, Identity aliases)`` of graph ``g``."""
    inits = {i.name: i for i in g.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in g.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    # torch.onnx stores equal constants once and gives the other uses an Identity alias
    alias: dict[str, str] = {}
    for n in g.node:
        if n.op_type == "Identity" and n.input and (n.input[0] in inits or n.input[0] in consts or n.input[0] in alias):
            alias[n.output[0]] = alias.get(n.input[0], n.input[0])
    return inits, consts, alias


def _image_input(g: Any, inits: dict[str, Any], p: Path) -> tuple[str, list[int | None]]:
    real_inputs = [i for i in g.input if i.name not in inits]
    if len(real_inputs) != 1:
        raise InputError(f"{p}: expected one image input, found {[i.name for i in real_inputs]}")
    dims = [d.dim_value or None for d in real_inputs[0].type.tensor_type.shape.dim]
    return real_inputs[0].name, dims


def input_normalization(model: Any) -> tuple[InGraphNormalization | None, set[str]]:
    """The chain of ``Sub``/``Add``/``Mul``/``Div`` nodes by scalar or per-channel (3-element)
    constants that starts at the graph's image input, composed to ``y = k·x + d``; None when
    the first consumer of the input is not such a node. Also returns the names of the
    constant tensors the chain used (they are not weights)."""
    from onnx import numpy_helper

    g = model.graph
    inits, consts, alias = _constants(g)
    name, _ = _image_input(g, inits, Path("graph"))
    k, d = np.ones(3), np.zeros(3)
    used_nodes: list[str] = []
    used_consts: set[str] = set()
    cur = name
    for n in g.node:
        if cur not in n.input:
            continue
        if n.op_type not in _ELEMENTWISE or len(n.input) != 2:
            break
        other = n.input[1] if n.input[0] == cur else n.input[0]
        proto = inits.get(alias.get(other, other)) or consts.get(alias.get(other, other))
        if proto is None:
            break
        c = np.asarray(numpy_helper.to_array(proto), dtype=np.float64).reshape(-1)
        if c.size not in (1, 3):
            break
        c = np.broadcast_to(c, (3,))
        first = n.input[0] == cur
        if n.op_type == "Add":
            d = d + c
        elif n.op_type == "Sub":
            k, d = (k, d - c) if first else (-k, c - d)
        elif n.op_type == "Mul":
            k, d = k * c, d * c
        elif first:                                       # Div(x, c); Div(c, x) is not affine
            k, d = k / c, d / c
        else:
            break
        used_nodes.append(n.name or n.op_type)
        used_consts.add(alias.get(other, other))
        cur = n.output[0]
    if not used_nodes:
        return None, set()
    return InGraphNormalization(tuple(float(v) for v in k), tuple(float(v) for v in d), tuple(used_nodes)), used_consts


def onnx_initializers_in_use_order(path: str | os.PathLike[str]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """``([(name, tensor)], info)``: the float initializers with more than one element, once
    per use, in the order the graph's nodes use them, and ``info``: ``input`` / ``shape`` (the
    image input), ``folded`` (the BatchNorm nodes / conv biases turned into affines) and
    ``normalization`` (:func:`input_normalization`, whose constants are not listed as weights).
    Once per use, not once per name: torch.onnx stores equal constants once (two layers whose
    norm weights are all ones share one initializer).

    BatchNorm is read as its eval-mode affine: a ``BatchNormalization`` node's (scale, B,
    mean, var, ε) give one ``(a, b)`` pair; a ``Conv``/``Gemm`` bias (an exporter's BatchNorm
    folded into the conv) is carried to the next affine (``b += a·bias``) or emitted as an
    identity affine ``(1, bias)`` before the next layer; ``Gemm``/``MatMul`` weights are
    given as ``[out, in]`` like a conv's."""
    from onnx import helper, numpy_helper

    p = Path(path)
    model = _load(p)
    g = model.graph
    inits, consts, alias = _constants(g)
    input_name, dims = _image_input(g, inits, p)
    norm, norm_consts = input_normalization(model)

    def tensor(name: str) -> torch.Tensor | None:
        proto = inits.get(alias.get(name, name)) or consts.get(alias.get(name, name))
        if proto is None:
            return None
        a = numpy_helper.to_array(proto)
        return torch.from_numpy(np.array(a, dtype=np.float32)) if a.dtype.kind == "f" else None

    out: list[tuple[str, torch.Tensor]] = []
    folded: list[str] = []
    pending: tuple[str, torch.Tensor] | None = None      # a conv bias waiting for its affine

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.extend([(f"{pending[0]}:affine.weight", torch.ones_like(pending[1])), (f"{pending[0]}:affine.bias", pending[1])])
            folded.append(pending[0])
            pending = None

    for n in g.node:
        if n.op_type == "Identity" and n.output[0] in alias:
            continue
        attrs = {at.name: helper.get_attribute_value(at) for at in n.attribute}
        if n.op_type == "BatchNormalization":
            scale, beta, mean, var = (tensor(i) for i in n.input[1:5])
            if mean is None or var is None:
                raise InputError(f"{p}: BatchNormalization node {n.name!r} has non-constant statistics")
            a, b = affine_of_bn(scale, beta, mean, var, float(attrs.get("epsilon", 1e-5)))
            if pending is not None:
                b = b + a * pending[1].reshape(-1)
                folded.append(pending[0])
                pending = None
            out.extend([(f"{n.name}:a", a), (f"{n.name}:b", b)])
            folded.append(n.name or n.output[0])
            continue
        w = tensor(n.input[1]) if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1 else None
        if w is not None and w.dim() >= 2:
            flush()
            if (n.op_type == "Gemm" and not attrs.get("transB", 0)) or n.op_type == "MatMul":
                w = w.t()                                          # [in, out] → [out, in]
            out.append((n.input[1], w.contiguous()))
            bias = tensor(n.input[2]) if len(n.input) > 2 and n.input[2] else None
            if bias is not None:
                pending = (n.input[2], bias.reshape(-1))
            continue
        for name in n.input:
            if alias.get(name, name) in norm_consts:
                continue
            t = tensor(name)
            if t is not None and t.numel() > 1:
                flush()
                out.append((alias.get(name, name), t))
    flush()
    return out, {"input": input_name, "shape": dims, "folded": folded, "normalization": norm}


def absorb_input_convention(tensors: list[tuple[str, torch.Tensor]], norm: InGraphNormalization | None, rgb: bool,
                     mean: float, std: float, path: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Move the source's input convention into its first convolution so that the imported model
    takes fedfs' RGB ``u = (p − 127.5)/127.5``. The graph sees, per channel ``j`` of its own
    order, ``y_j = k_j (p_j − mean)/std + d_j`` (``k, d`` of an in-graph normalization, else 1, 0)
    ``= s_j u_j + o_j`` with ``s_j = 127.5 k_j / std`` and ``o_j = k_j (127.5 − mean)/std + d_j``.
    ``o = 0`` (mid-grey is 0 for both) makes the move exact — the first convolution's weights
    times ``s``, channels reordered for BGR — including its zero padding; ``o ≠ 0`` is refused."""
    k = np.array(norm.k if norm else (1.0, 1.0, 1.0))
    d = np.array(norm.d if norm else (0.0, 0.0, 0.0))
    s = 127.5 * k / std
    o = k * (127.5 - mean) / std + d
    source = f"{'RGB' if rgb else 'BGR'}, " + (f"(x − {mean:g}) / {std:g} before the graph" if (mean, std) != (0.0, 1.0)
                                                else "0–255 pixels")
    if norm is not None:
        source += ", then " + norm.describe()
    if np.abs(o).max() > 1e-6 * max(1.0, float(np.abs(s).max())):
        raise InputError(f"{path}: the graph's input convention ({source}) maps mid-grey 127.5 to {o.round(6).tolist()}, "
                         "not 0: fedfs feeds (x − 127.5)/127.5 and can absorb only a rescaling and a channel order into "
                         "the first convolution (a shift would change its zero padding). If the graph is fed otherwise, "
                         "give import_onnx the mean/std applied before it (input_mean=, input_std=).")
    absorbed = []
    if not np.allclose(s, 1.0, rtol=0, atol=1e-7):
        absorbed.append(f"input scaled by {[float(f'{v:.6g}') for v in s]}")
    if not rgb:
        absorbed.append("BGR → RGB (input channels swapped)")
    convention = {"source": source, "fedfs": FEDFS_INPUT, "absorbed": "; ".join(absorbed)}
    if not absorbed:
        return tensors, convention
    i = next((i for i, (_, t) in enumerate(tensors) if t.dim() == 4), None)
    if i is None or tensors[i][1].shape[1] != 3:
        raise InputError(f"{path}: the first weight is not a convolution over 3 input channels; cannot absorb "
                         f"the input convention ({source})")
    name, w = tensors[i]
    w = w * torch.tensor(s, dtype=w.dtype).reshape(1, 3, 1, 1)
    out = list(tensors)
    out[i] = (name, w.flip(1) if not rgb else w)
    return out, convention


__all__ = ["FEDFS_INPUT", "InGraphNormalization", "absorb_input_convention", "input_normalization",
           "onnx_initializers_in_use_order"]
