"""``manifest.json``: what an export folder holds and how to use it.

One file an app (or its build pipeline) reads to pick a model: every file with its
sha256 and size, the input contract, the outputs, the model id each artifact binds an
enrollment to, and what the verification score and threshold mean.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fedfs_sdk import __version__ as sdk_version

from .common import FORMAT_MANIFEST, InputContract, sha256_file

MANIFEST_NAME = "manifest.json"

THRESHOLD_SEMANTICS = {
    "score": {
        "codeword": "FedUV Eq. 5: e = dot(uv, v) / c, v = the device's secret ±1 BCH codeword (never leaves "
                    "the device); e in [-1, 1], 1 when sigma(W g(x)) equals v",
        "template": "cosine(embedding, enrolled template), template = normalized mean of warm-up embeddings",
    },
    "decision": "accept iff score >= tau",
    "threshold": "tau is set on the device by the FedUV Alg. 2 warm-up: the floor(n(1-q))-th smallest "
                 "score of n owner images, q = target true-positive rate (fedfs_sdk.runtime.enrollment.warmup_threshold)",
    "binding": "an enrollment and its tau are bound to the artifact's model_id: re-enroll after a model "
               "update or when switching precision (fp32 / fp16 / int8); thresholds never carry over",
}


_ALIGNMENTS = {
    "dlib-chip": "required: dlib's face chip, dlib.get_face_chip(rgb, shape_predictor_5(rgb, face box), "
                 "size=input_size, padding=0.25) (fedfs_sdk.runtime.align.dlib_chip; preprocess(..., "
                 "detect_face='dlib-chip')), the crop the model was trained on; for Core ML too",
}
"""What a ``face_alignment`` of the model means, in the manifest's words."""


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` for every file below ``root`` but the manifest;
    a link or other non-regular entry (not a folder) is ``{"type": "link" | "other"}``."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if rel == MANIFEST_NAME or (f.is_dir() and not f.is_symlink()):
            continue
        if f.is_symlink():
            out[rel] = {"type": "link"}
        elif not f.is_file():
            out[rel] = {"type": "other"}
        else:
            out[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


def build_manifest(root: Path, *, source: dict[str, Any], model: dict[str, Any], model_id: str,
                   model_version: str, artifacts: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the export folder ``root`` (files hashed as they are on disk)."""
    return {
        "format": FORMAT_MANIFEST,
        "sdk_version": sdk_version,
        "created_unix": int(time.time()),
        "source_checkpoint": source,
        "model": model,
        "model_id": model_id,
        "model_version": model_version,
        "input_contract": {
            "onnx_and_ort_training": InputContract(int(model["input_size"]),
                                                   face_alignment=model.get("face_alignment")).to_dict(),
            "coreml": {"input": "image", "type": f"RGB image {model['input_size']}x{model['input_size']}",
                       "normalization": "in-model: x * (1/127.5) - 1 (ImageType scale/bias) == (x - 127.5) / 127.5"},
            "preprocessing": "fedfs_sdk.runtime.preprocess.preprocess: RGB, center square crop (or detected face), "
                             "resize to input_size, (x - 127.5) / 127.5, NCHW",
            **({"face_alignment": _ALIGNMENTS.get(model["face_alignment"], model["face_alignment"])}
               if model.get("face_alignment") else {}),
        },
        "outputs": {
            "embedding": f"[N, {model['embedding_dim']}] g(x), not L2-normalized",
            **({"uv": f"[N, {model['code_length']}] sigma(W g(x)), L2 norm sqrt(c)"} if model.get("code_length") else {}),
        },
        "threshold_semantics": THRESHOLD_SEMANTICS,
        "artifacts": artifacts,
        "files": file_entries(root),
    }


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def verify_manifest(root: str | Path) -> list[str]:
    """Paths (relative to ``root``) that do not match the manifest: listed files whose sha256 or
    size changed or that are missing, and anything present that the manifest does not list
    (an extra file, link or other entry could be picked up by an app). Empty when the folder
    is exactly what was exported."""
    root = Path(root)
    listed = json.loads((root / MANIFEST_NAME).read_text())["files"]
    found = file_entries(root)
    return sorted(rel for rel in listed.keys() | found.keys()
                  if rel not in found or "type" in found[rel] or listed.get(rel) != found[rel])
