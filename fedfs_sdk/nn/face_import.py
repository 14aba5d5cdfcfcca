"""Bring your own face model: import pre-trained weights as ξ or as ϕ's starting point.

Two sources, one result — a fedfs checkpoint (:func:`fedfs_sdk.nn.checkpoint.save_checkpoint`)
that ``--xi`` / ``--pretrained`` and ``fedfs enroll --model`` accept:

* :func:`import_onnx`: an insightface-style ONNX recognizer. Its parameters are read in the
  order the graph uses them (:mod:`fedfs_sdk.nn.onnx_weights`; torch.onnx folds
  ``weight.reshape(1, C, 1, 1)`` into anonymous ``onnx::Mul_…`` constants, so names cannot be
  relied on) and mapped by shape onto the first topology they fill (:data:`TOPOLOGIES`). The
  import is then **checked**: the ONNX graph (ONNX Runtime) and the imported model embed the
  same random images; a difference above ``atol`` (relative to the embeddings' magnitude)
  means the graph is not that architecture and the import is refused with the figure —
  never a silently different model.
* :func:`import_state_dict`: a PyTorch state dict (``.pt``/``.pth`` read with
  ``weights_only=True``, or ``.safetensors``) mapped by name, then by shape in order. The
  :class:`MappingReport` lists every key that found no place.

Topologies: the project's MobileFaceNet (``mobilefacenet``: GroupNorm; ``mobilefacenet-affine``:
the same with BatchNorm folded) and insightface's arcface_torch "mbf" (``insightface-mbf``,
:mod:`fedfs_sdk.nn.backbones.insightface_mbf`: buffalo_s/buffalo_sc's ``w600k_mbf.onnx``). A graph
that fills none is refused naming, for each, the first layer that does not map, and — for
OpenCV's SFace and insightface's ResNets (ArcFace R50/R100) — what the network is instead.

**BatchNorm**: at inference a BatchNorm is the per-channel affine ``a·x + b`` with
``a = γ/sqrt(σ² + ε)``, ``b = β − a·μ`` (:mod:`fedfs_sdk.nn.batchnorm_fold`); kept
``BatchNormalization`` nodes, running statistics and exporter-folded conv biases all become
:class:`~fedfs_sdk.nn.backbones.layers.ChannelAffine` parameters.

**Input convention**: every fedfs model takes RGB, ``(x − 127.5)/127.5``
(:mod:`fedfs_sdk.runtime.preprocess`). A source that wants something else — BGR, another mean/std
outside the graph, or a ``Sub``/``Mul`` normalization inside it (MXNet-converted models, SFace)
— has the difference moved into its first convolution (channels reordered, input scaled; exact
because 127.5 maps to 0 either way, so zero padding keeps its meaning). The source's convention
and what was absorbed are recorded in :attr:`MappingReport.input_convention` and the
checkpoint's meta; the imported model is then used with the project's own preprocessing.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from .batchnorm_fold import AFFINE, GROUP, fold_batchnorm, state_dict_backbone
from ..errors import CheckpointError, InputError
from .model import FaceNet, ModelConfig
from .onnx_weights import FEDFS_INPUT, absorb_input_convention, onnx_initializers_in_use_order
from .state_dict_map import (WRAPPER_KEYS, MappingReport, _strip_prefix, map_onto, read_state_dict,  # noqa: F401
                             unwrap_state_dict)  # (re-exported: reading and mapping a state dict moved down)

MBF = "insightface-mbf"
AFFINE_96 = "mobilefacenet-affine-112x96"
RELU6 = "mobilefacenet-relu6"

TOPOLOGIES: dict[str, str] = {
    GROUP: "the project's MobileFaceNet (GroupNorm)",
    AFFINE: "the project's MobileFaceNet (BatchNorm, folded)",
    AFFINE_96: "a MobileFaceNet for 112×96 crops (GDC 7×6, BatchNorm folded)",
    RELU6: "a ReLU6 MobileFaceNet with a pointwise stem conv (BatchNorm folded)",
    MBF: "insightface's mbf MobileFaceNet (arcface_torch get_mbf; buffalo_s/buffalo_sc w600k_mbf)",
}
"""Backbones a source can import onto, tried in this order; a BatchNorm source (kept or folded)
goes to the ``ChannelAffine`` ones, a source without BatchNorm to the GroupNorm one."""

def _candidates(batchnorm: bool) -> tuple[str, ...]:
    return (AFFINE, AFFINE_96, RELU6, MBF) if batchnorm else (GROUP,)


def _fit(source: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]], backbones: tuple[str, ...],
         emb: int | None, size: int) -> tuple[FaceNet, MappingReport, list[tuple[str, FaceNet, MappingReport]]]:
    """Map ``source`` onto each backbone in turn; the first one it fills completely wins, else
    the one it fills most. Returns the winner and every attempt (for an error message)."""
    tried: list[tuple[str, FaceNet, MappingReport]] = []
    for name in backbones:
        model = FaceNet(ModelConfig(name, embedding_dim=emb, input_size=size))
        rep = map_onto(model.backbone, source)
        tried.append((name, model, rep))
        if rep.complete:
            return model, rep, tried
    _, model, rep = max(tried, key=lambda t: len(t[2].mapped))
    return model, rep, tried


def _refusal(what: str, tried: list[tuple[str, FaceNet, MappingReport]],
             tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Why no topology fits: for each, the first layer that does not map; a hint when the
    source is a known foreign network."""
    names = " nor ".join(TOPOLOGIES[n] for n, _, _ in tried)
    lines = [f"{what} is neither {names}: its weights do not fill it"]
    lines += [f"  {n}: {_first_mismatch(rep, tensors, model.backbone)}" for n, model, rep in tried]
    hint = _foreign_hint(tensors)
    if hint:
        lines.append(hint)
    lines.append("Supported: see docs/real-faces.md, 'Bring your own face model'.")
    return "\n".join(lines)


def _foreign_hint(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Name the network when its first convolution and its fully connected layer give it away."""
    first = next((t for _, t in tensors if t.dim() == 4), None)
    fcs = [t for _, t in tensors if t.dim() == 2]
    fc_in = int(fcs[-1].shape[1]) if fcs else None
    if first is not None and tuple(first.shape) == (32, 3, 3, 3) and fc_in == 1024 * 7 * 7:
        return ("This looks like OpenCV's SFace (face_recognition_sface_2021dec.onnx): a MobileNet-v1-style "
                "network (a stride-1 32-filter stem, then 3×3 depthwise + 1×1 pointwise pairs without inverted "
                "residuals up to 1024 channels) whose embedding is a fully connected layer on the flattened "
                "1024×7×7 map instead of MobileFaceNet's GDC head. No fedfs backbone has that topology, so it "
                "cannot be imported; use insightface's w600k_mbf.onnx.")
    if fc_in == 512 * 7 * 7:
        return ("This looks like insightface's IResNet (ArcFace R18/R34/R50/R100, e.g. buffalo_l's w600k_r50.onnx "
                "or glintr100.onnx): a ResNet whose embedding is a fully connected layer on the flattened 512×7×7 "
                "map. It is not supported (24–65 M parameters: not a model a phone trains); use buffalo_s's or "
                "buffalo_sc's w600k_mbf.onnx.")
    return ""


def import_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig | None = None,
                      require_complete: bool = True, bn_eps: float = 1e-5,
                      rgb: bool = True, input_std: float = 127.5) -> tuple[FaceNet, MappingReport]:
    """Map a state dict onto the backbone of a :class:`FaceNet` of ``config`` (default: the
    first of :data:`TOPOLOGIES` it fills — the project's MobileFaceNet, or with BatchNorm
    (found by :func:`state_dict_backbone`, folded with :func:`fold_batchnorm` and ``bn_eps``)
    ``mobilefacenet-affine`` then ``insightface-mbf``, e.g. arcface_torch's ``model.pt`` of
    ``get_mbf``; 112 px, embedding size taken from the last layer). With an explicit
    GroupNorm ``mobilefacenet`` config, BatchNorm statistics are not folded but reported as
    unmapped (a starting point for ϕ, not the same function). ``rgb=False``: the weights were
    trained on BGR input (the first convolution's input channels are swapped); ``input_std``: the
    source's ``(x − 127.5)/input_std`` (e.g. 128 for SphereFace-era models), absorbed into the first
    convolution (exact: the mean is fedfs', so zero padding keeps its meaning). With
    ``require_complete`` a model key left at its initial value is an :class:`InputError`
    listing them (pass False to keep a partial import as ϕ's starting point)."""
    state = _strip_prefix(state)
    w = state.get("embed.weight")
    emb = int(w.shape[0]) if w is not None else _last_dim(list(state.items()), default=None)
    backbones = (config.backbone,) if config is not None else _candidates(state_dict_backbone(state) == AFFINE)
    folded: list[str] = []
    if any(b != GROUP for b in backbones):
        state, folded = fold_batchnorm(state, bn_eps)
    if not rgb:
        state = _bgr_to_rgb_state(state)
    if input_std != 127.5:
        state = _scaled_input_state(state, 127.5 / float(input_std))
    if config is not None:
        cfg = replace(config, proj_dim=None, code_length=None).resolved()
        model = FaceNet(cfg)
        rep = map_onto(model.backbone, state)
        tried = [(cfg.backbone, model, rep)]
    else:
        model, rep, tried = _fit(state, backbones, emb, 112)
    rep.folded = folded
    absorbed = ([] if rgb else ["BGR → RGB (input channels swapped)"]) + (
        [f"input scaled by {127.5 / float(input_std):.6g}"] if input_std != 127.5 else [])
    rep.input_convention = {"source": f"{'RGB' if rgb else 'BGR'}, (x − 127.5) / {float(input_std):g}",
                            "fedfs": FEDFS_INPUT, "absorbed": "; ".join(absorbed)}
    if require_complete and not rep.complete:
        if config is None and len(tried) > 1:
            raise InputError(_refusal("the state dict", tried, list(state.items())))
        raise InputError("the state dict does not fill the model (not the same architecture?)\n" + rep.summary()
                         + "\n(pass require_complete=False, or --partial to fedfs import-model, to keep what maps as a starting point for ϕ)")
    return model.eval(), rep


def _scaled_input_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    out = dict(state)
    for k, v in out.items():
        if torch.is_floating_point(v) and v.dim() == 4 and v.shape[1] == 3:
            out[k] = v * scale
            return out
    raise InputError("the state dict has no convolution over 3 input channels to absorb the input scale into")


def _bgr_to_rgb_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(state)
    for k, v in out.items():
        if torch.is_floating_point(v) and v.dim() == 4 and v.shape[1] == 3:
            out[k] = v.flip(1)
            break
    return out


def import_onnx(path: str | os.PathLike[str], rgb: bool = True, embedding_dim: int | None = None,
                atol: float = 1e-4, seed: int = 0, input_mean: float | None = None,
                input_std: float | None = None) -> tuple[FaceNet, MappingReport]:
    """Import an ONNX face recognizer onto the first of :data:`TOPOLOGIES` its weights fill (see
    the module docstring) and check it against ONNX Runtime on 4 random images.

    The source's input convention: ``rgb`` (False: the graph wants BGR), and the normalization
    applied *before* the graph, ``(x − input_mean)/input_std`` — by default insightface's rule:
    127.5/127.5 (insightface, arcface_torch exports), or 0/1 (raw pixels) when the graph starts
    with its own ``Sub``/``Mul`` normalization. It is absorbed into the first convolution
    (:func:`~fedfs_sdk.nn.onnx_weights.absorb_input_convention`), so the imported model takes
    fedfs' input. :class:`InputError` if no topology is filled (naming the first layer that
    does not map for each) or the embeddings differ by more than
    ``atol · max(1, largest embedding component)``."""
    tensors, info = onnx_initializers_in_use_order(path)
    shape = info["shape"]
    size = shape[-1] if len(shape) == 4 and shape[-1] else 112
    if len(shape) != 4 or (shape[1] not in (None, 3)) or shape[-1] != shape[-2]:
        raise InputError(f"{path}: input {info['input']} has shape {shape}; expected [N, 3, S, S] (NCHW, square)")
    norm = info["normalization"]
    mean = float(input_mean if input_mean is not None else (0.0 if norm else 127.5))
    std = float(input_std if input_std is not None else (1.0 if norm else 127.5))
    emb = embedding_dim or _last_dim(tensors)
    tensors, convention = absorb_input_convention(tensors, norm, rgb, mean, std, str(path))
    model, rep, tried = _fit(tensors, _candidates(bool(info["folded"])), emb, int(size))
    rep.folded = list(info["folded"])
    rep.input_convention = convention
    if not rep.complete:
        raise InputError(_refusal(str(path), tried, tensors))
    model.eval()
    rep.max_abs_diff, scale = _parity(path, info["input"], model, int(size), rgb, mean, std, seed)
    rep.max_rel_diff = rep.max_abs_diff / scale if scale > 0 else float("inf")
    if not rep.max_abs_diff <= atol * max(1.0, scale):
        raise InputError(f"{path}: the imported model's embeddings differ from the ONNX graph's by up to "
                         f"{rep.max_abs_diff:.3g} (> {atol:g} × max(1, {scale:.3g})): the graph is not "
                         f"{TOPOLOGIES[model.config.backbone]} (another topology with the same shapes in the same "
                         "order?), or its input convention is not the one given — see docs/real-faces.md")
    return model, rep


def _first_mismatch(rep: MappingReport, tensors: list[tuple[str, torch.Tensor]], target: torch.nn.Module) -> str:
    """``first layer that does not map: source X [shape] → model Y [shape]`` for an error message."""
    shapes = dict(tensors)
    tstate = target.state_dict()
    src = rep.unmapped_source[0] if rep.unmapped_source else None
    if not rep.missing_target:
        return "fills the model"
    tgt = rep.missing_target[0]
    where = f"source {src} {list(shapes[src].shape)}" if src in shapes else "the source has no tensor left"
    return f"first layer that does not map: {where} → model {tgt} {list(tstate[tgt].shape)}"


def _last_dim(tensors: list[tuple[str, torch.Tensor]], default: int | None = 128) -> int | None:
    # the embedding layer: a 1×1 conv [E, 512, 1, 1] (fedfs) or a linear layer [E, 512·k] (insightface)
    for _, t in reversed(tensors):
        if (t.dim() == 4 and t.shape[2:] == (1, 1) and t.shape[1] == 512) or (t.dim() == 2 and t.shape[1] % 512 == 0):
            return int(t.shape[0])
    return default


@torch.no_grad()
def _parity(path: str | os.PathLike[str], input_name: str, model: FaceNet, size: int, rgb: bool,
            mean: float, std: float, seed: int) -> tuple[float, float]:
    """``(max |Δ|, max |graph embedding|)`` over 4 random images: fedfs' input ``u`` to the
    model, the same pixels ``p = 127.5 u + 127.5`` in the graph's convention to ONNX Runtime."""
    import onnxruntime as ort

    x = np.random.default_rng(seed).uniform(-1, 1, (4, 3, size, size)).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 4          # a batch-1 graph's failure on the batch of 4 is handled below
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    pixels = x.astype(np.float64) * 127.5 + 127.5
    feed = ((pixels if rgb else pixels[:, ::-1]) - mean) / std
    feed = np.ascontiguousarray(feed, dtype=np.float32)
    try:
        ref = sess.run(None, {input_name: feed})[0]
    except Exception:  # noqa: BLE001 - a graph exported for batch 1
        ref = np.concatenate([sess.run(None, {input_name: feed[i:i + 1]})[0] for i in range(len(x))])
    ours = model(torch.from_numpy(x)).embedding.numpy()
    if ref.shape != ours.shape:
        return float("inf"), float(np.abs(ref).max())
    return float(np.abs(ref - ours).max()), float(np.abs(ref).max())


def save_imported(path: str | os.PathLike[str], model: FaceNet, report: MappingReport, source: str) -> Path:
    """Write ``model`` as a fedfs checkpoint (``kind: "xi"``, the source, the mapping report
    and the input convention in its meta), usable as ``--xi`` / ``--pretrained`` or
    ``fedfs enroll --model``."""
    from .checkpoint import save_checkpoint

    meta = {"kind": "xi", "imported_from": source, "input_convention": dict(report.input_convention), "mapping": {
        "mapped": len(report.mapped), "by_shape": len(report.by_shape),
        "unmapped_source": report.unmapped_source, "missing_target": report.missing_target,
        "folded_batchnorm": report.folded, "max_abs_diff": report.max_abs_diff, "max_rel_diff": report.max_rel_diff}}
    try:
        save_checkpoint(path, model, model.config, meta)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e
    return Path(path)


__all__ = ["MappingReport", "TOPOLOGIES", "WRAPPER_KEYS", "map_onto", "read_state_dict", "unwrap_state_dict", "import_state_dict", "import_onnx",
           "fold_batchnorm", "state_dict_backbone", "onnx_initializers_in_use_order", "save_imported"]
