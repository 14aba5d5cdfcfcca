"""int8 quantization of the ONNX verifier (``onnxruntime.quantization``) and its check.

Static QDQ quantization, per-channel int8 weights, uint8 activations calibrated (MinMax)
on face images — the format NNAPI / XNNPACK / Core ML execution providers run as int8.
Three choices, all measured (``docs/export.md``):

* **Only the dense inner convolutions are int8** (:func:`fp32_convs` lists the others and
  why): the first (its output groups have very different ranges, and the per-sample group
  norm after it blows the small groups' quantization noise up to full scale — alone it
  dropped the min cosine to fp32 to 0.62 on the tiny model; excluded: 0.994), the depthwise
  ones (ORT's int8 depthwise kernel is slower than its fp32 one) and the last.
* **Static, not dynamic.** Dynamic quantization computes activation scales per *batch*
  at run time, so an image's embedding would depend on the other images batched with it,
  and ORT's CPU ``ConvInteger`` has no int8-weight kernel.
* **Decisions are checked before the file is written** (:func:`quantize_int8`): on held-out
  calibration images the int8 model may decide at most :data:`INT8_MAX_FLIP_RATE` of
  accept/reject decisions unlike fp32, else :class:`Int8NumericsError`.

The int8 model gets its own ``model_id``, ``<fp32 id>-int8-<16 hex>``: the suffix is the
sha256 of what the int8 graph computes with (every initializer — int8 weights, scales, zero
points — and every node), the way the fp32 id hashes the fp32 weights. Two quantizations
of one model with different calibration images get different ids; thresholds never carry over.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from fedfs_sdk.errors import InputError
from fedfs_sdk.runtime.onnx_backend import int8_model_id

from .common import ExportError, synthetic_faces
from .onnx_inference import OUTPUT_EMBEDDING, read_metadata, set_metadata
from .score_bounds import GUARANTEE, decision_flip_rate, score_change_bounds

INT8_MAX_FLIP_RATE = 0.05
"""Largest fraction of accept/reject decisions the int8 model may decide unlike the fp32 one
on its held-out calibration images (:func:`export.score_bounds.decision_flip_rate`: random
codewords / all image pairs, thresholds at the 10–90 % quantiles of each model's own scores,
averaged),
else :class:`Int8NumericsError`. Measured (docs/export.md): tiny 0.03; a random-init
MobileFaceNet@112 0.09 — refused: its random features put every score near every threshold."""

MIN_CHECK_IMAGES = 8
"""Below this many check images the flip rate is too coarse to enforce (one pair of 3 images
is a third of the decisions): it is still measured and recorded, with ``enforced: false``."""

HOLD_OUT_EVERY = 4
"""Every 4th calibration image (when there are ≥ 8) checks the quantized model instead of
calibrating it, so the check runs on images the activation ranges were not fitted to."""


class Int8NumericsError(ExportError):
    """The int8 model moves verification scores beyond the tolerance (the file is not written)."""


def synthetic_calibration(input_size: int, identities: int = 16, per_identity: int = 4,
                          seed: int = 20_240_601) -> np.ndarray:
    """Calibration faces from SynthFaces (float32 ``[N,3,S,S]``, the input contract).

    For a deployed model prefer real aligned faces (``--calibration DIR``)."""
    return synthetic_faces(input_size, identities, per_identity, seed)[0]


def folder_calibration(folder: str | os.PathLike[str], input_size: int, limit: int = 256) -> np.ndarray:
    """Up to ``limit`` images of ``folder``, preprocessed like every fedfs input."""
    from fedfs_sdk.runtime.preprocess import list_images, preprocess

    files = list_images(folder)[:limit]
    return preprocess([str(f) for f in files], input_size)


def fp32_convs(model: onnx.ModelProto) -> dict[str, str]:
    """The convolutions kept in float, ``{node name: why}`` (see the module docstring):

    * the first one (fed by the graph input): its output groups have very different ranges
      and the group norm after it amplifies the quantization noise of the small ones;
    * every depthwise one (``group > 1``): ORT's int8 depthwise kernel was 2.4× *slower* than
      its fp32 NCHWc one (``benchmarks/export_profile.py``), and their neighbours (group norm,
      PReLU) run in fp32 anyway, so keeping them float also saves a Quantize/Dequantize pair;
    * the last one (the embedding projection, 0.03 % of the MACs): its rounding goes straight
      into the scores, unaveraged by later layers.
    """
    graph_input = model.graph.input[0].name
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    keep: dict[str, str] = {}
    for n in convs:
        group = next((a.i for a in n.attribute if a.name == "group"), 1)
        if graph_input in n.input:
            keep[n.name] = "first convolution"
        elif group > 1:
            keep[n.name] = "depthwise"
    if len(convs) > 1:
        keep.setdefault(convs[-1].name, "last (feeds the embedding)")
    return keep


def split_calibration(calib: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(calibrate, check, held_out)``: every :data:`HOLD_OUT_EVERY`-th image checks, the rest
    calibrate; with fewer than 8 images all do both (``held_out`` False, said in the manifest)."""
    if len(calib) < 8:
        return calib, calib, False
    held = np.arange(len(calib)) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
    return calib[~held], calib[held], True


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str], calibration: np.ndarray,
                  calibration_source: str = "synthfaces", *,
                  max_flip_rate: float = INT8_MAX_FLIP_RATE) -> dict[str, Any]:
    """Quantize the fp32 verifier ``src`` into ``dst``; returns what was done (for the manifest).

    The quantized model is checked before ``dst`` is written: on the held-out calibration
    images (:func:`split_calibration`) its decisions are compared with ``src``'s
    (:func:`export.score_bounds.decision_flip_rate`); more than ``max_flip_rate`` of them
    different → :class:`Int8NumericsError` and no file. The manifest entry also records the
    bound on how far any score moved (:func:`export.score_bounds.score_change_bounds`)."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    images = np.asarray(calibration, dtype=np.float32)
    if images.ndim != 4 or images.shape[0] < 1:
        raise InputError(f"calibration must be a float32 [N,3,S,S] batch, got shape {list(images.shape)}")
    calib, check, held_out = split_calibration(images)
    meta = read_metadata(src)
    input_name = meta.get("fedfs.input_name", "input")

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{input_name: calib[i:i + 16]} for i in range(0, len(calib), 16)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre))          # shape inference + graph cleanup
        keep = fp32_convs(onnx.load(str(pre)))
        out = Path(tmp) / "int8.onnx"
        quantize_static(str(pre), str(out), _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["Conv"], nodes_to_exclude=sorted(keep))
        model = onnx.load(str(out))
        kinds = sorted(set(keep.values()))
        description = ("static QDQ: per-channel int8 Conv weights, uint8 activations (MinMax calibration on "
                       f"{len(calib)} {calibration_source} images); in fp32: {', '.join(kinds)} convolutions "
                       "and all non-Conv ops")
        model_id = int8_model_id(model, meta["fedfs.model_id"])
        set_metadata(model, {**meta, "fedfs.precision": "int8", "fedfs.model_id": model_id,
                             "fedfs.quantization": description})
        onnx.save(model, str(out))
        want = OnnxBackend(src).run(check)
        got = {k: v for k, v in OnnxBackend(out).run(check).items() if k in want}
    bounds = score_change_bounds(got, want)
    flips = {k: decision_flip_rate(k, got[k], want[k]) for k in want}
    worst = max(flips, key=flips.get)
    enforced = len(check) >= MIN_CHECK_IMAGES
    if enforced and not flips[worst] <= max_flip_rate:
        raise Int8NumericsError(
            f"int8 quantization of {Path(src).name} decides {100 * flips[worst]:.1f} % of accept/reject decisions "
            f"unlike fp32 (output {worst!r}, limit {100 * max_flip_rate:g} %) on {len(check)} "
            f"{'held-out ' if held_out else ''}calibration images (scores moved by up to {bounds[worst]:.3g}). "
            "Ship the fp32 ONNX model, or calibrate on more real aligned faces (--calibration DIR)")
    onnx.save(model, str(dst))
    return {"model_id": model_id, "method": "static-qdq", "calibration_images": int(len(calib)),
            "calibration_source": calibration_source, "excluded_nodes": sorted(keep),
            "description": description,
            "check": {"images": int(len(check)), "held_out": held_out, "reference": "the fp32 ONNX model",
                      "decision_flip_rate": flips, "max_flip_rate": max_flip_rate, "enforced": enforced,
                      "max_score_change": bounds, "guarantee": GUARANTEE}}


def compare_int8(fp32_path: str | os.PathLike[str], int8_path: str | os.PathLike[str],
                 images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Verification AUROC (all pairs, cosine of embeddings) of both models on labelled
    ``images``, and the cosine between each image's fp32 and int8 embedding."""
    from sklearn.metrics import roc_auc_score

    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    labels = np.asarray(labels)
    same = labels[:, None] == labels[None, :]
    iu = np.triu_indices(len(labels), 1)
    if same[iu].all() or not same[iu].any():
        raise InputError("AUROC needs both genuine and impostor pairs (≥ 2 identities, one with ≥ 2 images)")
    out: dict[str, float] = {}
    embs = {}
    for tag, path in (("fp32", fp32_path), ("int8", int8_path)):
        e = OnnxBackend(path).run(images)[OUTPUT_EMBEDDING].astype(np.float64)
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        embs[tag] = e
        out[f"auroc_{tag}"] = float(roc_auc_score(same[iu], (e @ e.T)[iu]))
    cos = (embs["fp32"] * embs["int8"]).sum(1)
    out["auroc_change"] = out["auroc_int8"] - out["auroc_fp32"]
    out["min_cosine_fp32_int8"] = float(cos.min())
    out["mean_cosine_fp32_int8"] = float(cos.mean())
    return out


def synthetic_eval_set(input_size: int, identities: int = 40, per_identity: int = 6,
                       seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """A SynthFaces verification set (identities disjoint from the calibration set's)."""
    return synthetic_faces(input_size, identities, per_identity, seed, first_identity=10_000)
