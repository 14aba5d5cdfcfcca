"""Bring your own face model: import pre-trained weights as ξ or as ϕ's starting point.

Two sources, one result — a fedfs checkpoint (:func:`fedfs_sdk.checkpoint.save_checkpoint`)
that ``--xi`` / ``--pretrained`` and ``fedfs enroll --model`` accept:

* :func:`import_state_dict`: a PyTorch state dict (a ``.pt``/``.pth`` file read with
  ``weights_only=True``, or a ``.safetensors`` file) mapped onto the project's backbone by
  name, then by shape in order. The :class:`MappingReport` lists every key that found no place.
* :func:`import_onnx`: an insightface-style ONNX recognizer — input ``[N, 3, 112, 112]``
  RGB, ``(x − 127.5) / 127.5``, output the embedding (``rgb=False`` when the graph wants
  BGR: the first convolution's input channels are then swapped). Its parameters are read
  in the order the graph uses them (torch.onnx folds ``weight.reshape(1, C, 1, 1)`` of the
  norm/PReLU layers into anonymous ``onnx::Mul_…`` constants, so names cannot be relied on)
  and mapped by shape onto the project's MobileFaceNet. The import is then **checked**: the
  ONNX graph (ONNX Runtime) and the imported model embed the same random images; a maximum
  difference above ``atol`` means the graph is not this architecture (e.g. a ResNet) and the
  import is refused with the figure — never a silently different model.

**BatchNorm** (insightface's MobileFaceNet, OpenCV's SFace): at inference a BatchNorm is the
per-channel affine ``a·x + b`` with ``a = γ/sqrt(σ² + ε)``, ``b = β − a·μ``. Both paths fold
it so (``BatchNormalization`` nodes; ``running_mean``/``running_var`` keys) and import onto
``mobilefacenet-affine`` (:class:`~fedfs_sdk.backbones.mobilefacenet.MobileFaceNetAffine`),
the same topology with :class:`~fedfs_sdk.backbones.layers.ChannelAffine` norms. A graph whose
exporter already folded BatchNorm into the convolutions has biased convs instead; the
project's convs have no bias, so that bias goes into the following affine's ``b`` (``a = 1``,
or ``b += a·bias`` when a BatchNorm still follows). A source with neither imports onto the
GroupNorm ``mobilefacenet`` as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .batchnorm_fold import AFFINE, GROUP, affine_of_bn, fold_batchnorm, state_dict_backbone
from .errors import CheckpointError, InputError
from .model import FaceNet, ModelConfig

# Buffers of BatchNorm layers: meaningless for GroupNormP (normalizes each sample by itself).
_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class MappingReport:
    """Which source tensor went where. ``mapped``: ``(source, target)`` pairs; ``by_shape``:
    the targets filled by shape order rather than by name; ``unmapped_source`` /
    ``missing_target``: keys left over on either side (``missing_target`` keep their
    initial values); ``max_abs_diff``: the parity check of an ONNX import (None otherwise);
    ``folded``: the BatchNorm layers / conv biases folded into per-channel affines."""

    mapped: list[tuple[str, str]] = field(default_factory=list)
    by_shape: list[str] = field(default_factory=list)
    unmapped_source: list[str] = field(default_factory=list)
    missing_target: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    folded: list[str] = field(default_factory=list)

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
            lines.append(f"parity with the source graph: max |Δembedding| = {self.max_abs_diff:.2e}")
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
    for key in ("state_dict", "model", "backbone"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
        raise InputError(f"{p} does not hold a state dict (a mapping of names to tensors)")
    return dict(obj)


def import_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig | None = None,
                      require_complete: bool = True, bn_eps: float = 1e-5) -> tuple[FaceNet, MappingReport]:
    """Map a state dict onto the backbone of a :class:`FaceNet` of ``config`` (default:
    MobileFaceNet, 112 px, embedding size taken from the source's last layer; the
    ``mobilefacenet-affine`` variant when :func:`state_dict_backbone` finds BatchNorm, which
    is then folded with :func:`fold_batchnorm` and ``bn_eps``). With an explicit GroupNorm
    ``mobilefacenet`` config, BatchNorm statistics are not folded but reported as unmapped (a
    starting point for ϕ, not the same function). With ``require_complete`` a model key left
    at its initial value is an :class:`InputError` listing them (pass False to keep a partial
    import as ϕ's starting point)."""
    state = _strip_prefix(state)
    w = state.get("embed.weight")
    emb = int(w.shape[0]) if w is not None else None
    cfg = (config or ModelConfig(state_dict_backbone(state), embedding_dim=emb, input_size=112)).resolved()
    folded: list[str] = []
    if cfg.backbone == AFFINE:
        state, folded = fold_batchnorm(state, bn_eps)
    model = FaceNet(replace(cfg, proj_dim=None, code_length=None))
    rep = map_onto(model.backbone, state)
    rep.folded = folded
    if require_complete and not rep.complete:
        raise InputError("the state dict does not fill the model (not the same architecture?)\n" + rep.summary()
                         + "\n(pass require_complete=False, or --partial to fedfs import-model, to keep what maps as a starting point for ϕ)")
    return model.eval(), rep


def onnx_initializers_in_use_order(path: str | os.PathLike[str]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """``([(name, tensor)], info)``: the float initializers with more than one element, once
    per use, in the order the graph's nodes use them, and ``info`` (input name/shape, and
    ``folded``: the BatchNorm nodes / conv biases turned into affines). Once per use, not once
    per name: torch.onnx stores equal constants once (two layers whose norm weights are all
    ones share one initializer).

    BatchNorm is read as its eval-mode affine: a ``BatchNormalization`` node's (scale, B,
    mean, var, ε) give one ``(a, b)`` pair; a ``Conv``/``Gemm`` bias (an exporter's BatchNorm
    folded into the conv) is carried to the next affine (``b += a·bias``) or emitted as an
    identity affine ``(1, bias)`` before the next layer; ``Gemm``/``MatMul`` weights are
    given as ``[out, in]`` like a conv's."""
    import onnx
    from onnx import helper, numpy_helper

    p = Path(path)
    if not p.is_file():
        raise InputError(f"ONNX model not found: {p}")
    try:
        model = onnx.load(str(p))
    except Exception as e:  # noqa: BLE001
        raise InputError(f"{p} is not a readable ONNX model ({e})") from None
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in g.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    # torch.onnx stores equal constants once and gives the other uses an Identity alias
    alias: dict[str, str] = {}
    for n in g.node:
        if n.op_type == "Identity" and n.input and (n.input[0] in inits or n.input[0] in consts or n.input[0] in alias):
            alias[n.output[0]] = alias.get(n.input[0], n.input[0])

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
            t = tensor(name)
            if t is not None and t.numel() > 1:
                flush()
                out.append((alias.get(name, name), t))
    flush()
    real_inputs = [i for i in g.input if i.name not in inits]
    if len(real_inputs) != 1:
        raise InputError(f"{p}: expected one image input, found {[i.name for i in real_inputs]}")
    dims = [d.dim_value or None for d in real_inputs[0].type.tensor_type.shape.dim]
    return out, {"input": real_inputs[0].name, "shape": dims, "folded": folded}


def import_onnx(path: str | os.PathLike[str], rgb: bool = True, embedding_dim: int | None = None,
                atol: float = 1e-4, seed: int = 0) -> tuple[FaceNet, MappingReport]:
    """Import an insightface-style ONNX face recognizer onto the project's MobileFaceNet
    (see the module docstring) and check it against ONNX Runtime on 4 random images.

    ``rgb``: the graph's input channel order (insightface: RGB, after its ``swapRB``);
    ``(x − 127.5)/127.5`` normalization is assumed (fedfs' own). :class:`InputError` if the
    weights do not fill the model or the embeddings differ by more than ``atol``."""
    tensors, info = onnx_initializers_in_use_order(path)
    shape = info["shape"]
    size = shape[-1] if len(shape) == 4 and shape[-1] else 112
    if len(shape) != 4 or (shape[1] not in (None, 3)) or shape[-1] != shape[-2]:
        raise InputError(f"{path}: input {info['input']} has shape {shape}; expected [N, 3, S, S] (NCHW, square)")
    emb = embedding_dim or _last_dim(tensors)
    backbone = AFFINE if info["folded"] else GROUP           # BatchNorm (kept or folded) → per-channel affines
    model = FaceNet(ModelConfig(backbone, embedding_dim=emb, input_size=int(size)).resolved())
    if not rgb and tensors:
        name, w = tensors[0]
        tensors[0] = (name, w.flip(1) if w.dim() == 4 and w.shape[1] == 3 else w)   # BGR → RGB filters
    rep = map_onto(model.backbone, tensors, by_shape=True)
    rep.folded = list(info["folded"])
    if not rep.complete:
        raise InputError(f"{path} is not the project's MobileFaceNet ({backbone}, {emb}-d, {size} px): its weights "
                         f"do not fill it; {_first_mismatch(rep, tensors, model.backbone)}\n{rep.summary()}")
    model.eval()
    rep.max_abs_diff = _parity(path, info["input"], model, int(size), rgb, seed)
    if not rep.max_abs_diff <= atol:
        raise InputError(f"{path}: the imported model's embeddings differ from the ONNX graph's by up to "
                         f"{rep.max_abs_diff:.3g} (> {atol:g}): the graph is not the project's MobileFaceNet "
                         f"({backbone}; another topology with the same shapes in the same order?) — see "
                         "docs/real-faces-alignment.md")
    return model, rep


def _first_mismatch(rep: MappingReport, tensors: list[tuple[str, torch.Tensor]], target: torch.nn.Module) -> str:
    """``first layer that does not map: source X [shape] → model Y [shape]`` for an error message."""
    shapes = dict(tensors)
    tstate = target.state_dict()
    src = rep.unmapped_source[0] if rep.unmapped_source else None
    tgt = rep.missing_target[0]
    where = f"source {src} {list(shapes[src].shape)}" if src in shapes else "the source has no tensor left"
    return f"first layer that does not map: {where} → model {tgt} {list(tstate[tgt].shape)}"


def _last_dim(tensors: list[tuple[str, torch.Tensor]]) -> int:
    # the embedding layer: a 1×1 conv [E, 512, 1, 1] (fedfs) or a linear layer [E, 512·k] (insightface)
    for _, t in reversed(tensors):
        if (t.dim() == 4 and t.shape[2:] == (1, 1) and t.shape[1] == 512) or (t.dim() == 2 and t.shape[1] % 512 == 0):
            return int(t.shape[0])
    return 128


@torch.no_grad()
def _parity(path: str | os.PathLike[str], input_name: str, model: FaceNet, size: int, rgb: bool, seed: int) -> float:
    import onnxruntime as ort

    x = np.random.default_rng(seed).uniform(-1, 1, (4, 3, size, size)).astype(np.float32)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = x if rgb else x[:, ::-1].copy()
    try:
        ref = sess.run(None, {input_name: feed})[0]
    except Exception:  # noqa: BLE001 - a graph exported for batch 1
        ref = np.concatenate([sess.run(None, {input_name: feed[i:i + 1]})[0] for i in range(len(x))])
    ours = model(torch.from_numpy(x)).embedding.numpy()
    if ref.shape != ours.shape:
        return float("inf")
    return float(np.abs(ref - ours).max())


def save_imported(path: str | os.PathLike[str], model: FaceNet, report: MappingReport, source: str) -> Path:
    """Write ``model`` as a fedfs checkpoint (``kind: "xi"``, the source and the mapping
    report in its meta), usable as ``--xi`` / ``--pretrained`` or ``fedfs enroll --model``."""
    from .checkpoint import save_checkpoint

    meta = {"kind": "xi", "imported_from": source, "mapping": {
        "mapped": len(report.mapped), "by_shape": len(report.by_shape),
        "unmapped_source": report.unmapped_source, "missing_target": report.missing_target,
        "folded_batchnorm": report.folded, "max_abs_diff": report.max_abs_diff}}
    try:
        save_checkpoint(path, model, model.config, meta)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e
    return Path(path)


__all__ = ["MappingReport", "map_onto", "read_state_dict", "import_state_dict", "import_onnx", "fold_batchnorm",
           "state_dict_backbone", "onnx_initializers_in_use_order", "save_imported"]
