"""int8 quantization of the ONNX verifier (``onnxruntime.quantization``) and its check.

Static QDQ quantization, per-channel int8 weights, uint8 activations calibrated (MinMax)
on face images — the format NNAPI / XNNPACK / Core ML execution providers run as int8.
Two choices, both measured (``docs/export.md``):

* **The first convolution stays float.** Every conv here is followed by a per-sample group
  norm (``GroupNormP``), which rescales each channel group to unit variance. The first
  conv's output has channel groups of very different ranges; one per-tensor activation
  scale leaves the small groups a few levels, and the norm then blows their quantization
  noise up to full scale (alone it dropped the min cosine to fp32 to 0.62 on the tiny
  model; excluding it: 0.994). Deeper convs quantize well.
* **Static, not dynamic.** Dynamic quantization computes activation scales per *batch*
  at run time, so an image's embedding would depend on the other images batched with it,
  and ORT's CPU ``ConvInteger`` has no int8-weight kernel.

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
from fedfs_sdk.onnx_backend import int8_model_id

from .onnx_inference import OUTPUT_EMBEDDING, read_metadata, set_metadata


def synthetic_calibration(input_size: int, identities: int = 16, per_identity: int = 4,
                          seed: int = 20_240_601) -> np.ndarray:
    """Calibration faces from SynthFaces (float32 ``[N,3,S,S]``, the input contract).

    For a deployed model prefer real aligned faces (``--calibration DIR``)."""
    try:
        from device_sim.synthfaces import SynthFaces
    except ImportError as e:  # pragma: no cover - device_sim ships with the repo
        raise InputError("no calibration images given and device_sim.synthfaces is unavailable; "
                         "pass --calibration DIR") from e
    faces = SynthFaces(seed=seed, image_size=input_size)
    ids = np.repeat(np.arange(identities), per_identity)
    return faces.render(ids, np.tile(np.arange(per_identity), identities)).numpy().astype(np.float32)


def folder_calibration(folder: str | os.PathLike[str], input_size: int, limit: int = 256) -> np.ndarray:
    """Up to ``limit`` images of ``folder``, preprocessed like every fedfs input."""
    from fedfs_sdk.preprocess import list_images, preprocess

    files = list_images(folder)[:limit]
    return preprocess([str(f) for f in files], input_size)


def _first_conv(model: onnx.ModelProto) -> str | None:
    graph_input = model.graph.input[0].name
    for node in model.graph.node:
        if node.op_type == "Conv" and graph_input in node.input:
            return node.name
    return None


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str], calibration: np.ndarray,
                  calibration_source: str = "synthfaces") -> dict[str, Any]:
    """Quantize the fp32 verifier ``src`` into ``dst``; returns what was done (for the manifest)."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    calib = np.asarray(calibration, dtype=np.float32)
    if calib.ndim != 4 or calib.shape[0] < 1:
        raise InputError(f"calibration must be a float32 [N,3,S,S] batch, got shape {list(calib.shape)}")
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
        first = _first_conv(onnx.load(str(pre)))
        out = Path(tmp) / "int8.onnx"
        quantize_static(str(pre), str(out), _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["Conv"], nodes_to_exclude=[first] if first else [])
        model = onnx.load(str(out))
    description = ("static QDQ: per-channel int8 Conv weights, uint8 activations (MinMax calibration on "
                   f"{len(calib)} {calibration_source} images); first Conv and all non-Conv ops in fp32")
    model_id = int8_model_id(model, meta["fedfs.model_id"])
    set_metadata(model, {**meta, "fedfs.precision": "int8", "fedfs.model_id": model_id,
                         "fedfs.quantization": description})
    onnx.save(model, str(dst))
    return {"model_id": model_id, "method": "static-qdq", "calibration_images": int(len(calib)),
            "calibration_source": calibration_source, "excluded_nodes": [first] if first else [],
            "description": description}


def compare_int8(fp32_path: str | os.PathLike[str], int8_path: str | os.PathLike[str],
                 images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Verification AUROC (all pairs, cosine of embeddings) of both models on labelled
    ``images``, and the cosine between each image's fp32 and int8 embedding."""
    from sklearn.metrics import roc_auc_score

    from fedfs_sdk.onnx_backend import OnnxBackend

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
    from device_sim.synthfaces import SynthFaces

    faces = SynthFaces(seed=seed, image_size=input_size)
    ids = np.repeat(np.arange(10_000, 10_000 + identities), per_identity)
    imgs = faces.render(ids, np.tile(np.arange(per_identity), identities)).numpy().astype(np.float32)
    return imgs, ids
