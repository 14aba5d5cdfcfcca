"""Pieces every exporter shares: the ONNX version targets, the input contract, checkpoint
loading with export-specific errors, hashing, and a quiet ONNX Runtime.

The input contract is fixed once for every format so a phone app preprocesses the same
way whatever runtime it uses (insightface convention, :mod:`fedfs_sdk.runtime.preprocess`):
RGB, ``float32`` NCHW ``[N, 3, S, S]``, ``(x − 127.5) / 127.5``. Core ML takes the
uint8 image itself and applies the same affine map inside the model (``ImageType``
scale ``1/127.5``, bias ``−1``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fedfs_sdk.errors import InputError

OPSET = 17
"""ONNX opset of every exported graph. ORT 1.19 (training build included) reads opset ≤ 21
and IR ≤ 10; 17 is what ``torch.onnx.export(dynamo=False)`` exercises best and is
supported by ONNX Runtime Mobile and the onnxruntime-training-android/objc packages."""

MAX_IR_VERSION = 10
"""Largest ONNX IR version ONNX Runtime 1.19 loads (``onnx`` 1.17 writes ≤ 10)."""

class ExportError(InputError):
    """The requested artifact cannot be built from these inputs (says which and why)."""


FORMAT_ONNX = "fedfs-onnx/1"
FORMAT_ORT_TRAINING = "fedfs-ort-training/1"
FORMAT_COREML = "fedfs-coreml/1"
FORMAT_MANIFEST = "fedfs-export/1"


@dataclass(frozen=True)
class InputContract:
    """What the exported models expect as input (same for ONNX, int8 and ORT training)."""

    input_size: int
    layout: str = "NCHW"
    dtype: str = "float32"
    color: str = "RGB"
    mean: float = 127.5
    std: float = 127.5
    face_alignment: str | None = None
    """The face crop the model was trained on, when it needs one whatever the app's detection
    choice (``"dlib-chip"`` for ``dlib-resnet``: ``fedfs_sdk.runtime.align.dlib_chip``)."""

    @property
    def normalization(self) -> str:
        return f"(x - {self.mean:g}) / {self.std:g}"

    def to_dict(self) -> dict[str, Any]:
        out = {"layout": self.layout, "dtype": self.dtype, "color": self.color,
               "shape": ["N", 3, self.input_size, self.input_size],
               "normalization": self.normalization, "mean": self.mean, "std": self.std,
               "pixel_range": "uint8 RGB 0..255 before normalization; model input in [-1, 1]"}
        if self.face_alignment:
            out["face_alignment"] = self.face_alignment
        return out


def quiet_onnxruntime() -> None:
    """ORT's default logger prints every graph transformer at INFO during artifact
    generation; keep warnings and errors only (library code never prints)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{relative file path: sha256}`` for a file or every file below a folder."""
    p = Path(path)
    if p.is_file():
        return {p.name: sha256_file(p)}
    return {str(f.relative_to(p)): sha256_file(f) for f in sorted(p.rglob("*")) if f.is_file()}


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read once: the model built from exactly the bytes ``sha256`` hashes."""

    model: Any           # FaceNet, eval mode
    meta: dict[str, Any]
    sha256: str
    name: str


def load_for_export(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """A fedfs checkpoint for export, with errors that say what to fix.

    The file is read once; the model is built from those bytes and ``sha256`` is their hash,
    so what the manifest records is what was built even if the file changes meanwhile.
    :class:`~fedfs_sdk.errors.CheckpointError` when the file is missing, is not a fedfs checkpoint, or its
    tensors do not fit the architecture its header declares.
    """
    from fedfs_sdk.nn.checkpoint import checkpoint_from_bytes, read_checkpoint_bytes

    p = Path(path)
    data = read_checkpoint_bytes(p)
    model, meta = checkpoint_from_bytes(data, p)
    return LoadedCheckpoint(model.eval(), meta, hashlib.sha256(data).hexdigest(), p.name)


def model_version(meta: dict[str, Any]) -> str:
    """The version string written into every artifact: the checkpoint's ``model_version``,
    the global ``version`` a ``fedfs serve`` checkpoint records (``models/vNNNNNN``), or the
    FL ``round`` if it records one, else ``unversioned``."""
    for key in ("model_version", "version", "round"):
        if key in meta and meta[key] is not None:
            return str(meta[key])
    return "unversioned"


@contextlib.contextmanager
def captured_native_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2 (ORT's gradient builder logs
    every graph transformer there regardless of the Python logger severity). The captured
    text is appended to the yielded list, so a caller can attach it to an error."""
    sink: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield sink
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode("utf-8", "replace"))


def synthetic_faces(input_size: int, identities: int, per_identity: int, seed: int,
                    first_identity: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``per_identity`` SynthFaces images of each of ``identities`` identities from
    ``first_identity`` on: float32 ``[N,3,S,S]`` in the input contract (``(x − 127.5)/127.5``)
    and their identity labels — the stand-in faces of the export checks (int8 calibration and
    evaluation, Core ML numerics) when the user gives no folder."""
    try:
        from device_sim.synthfaces import SynthFaces
    except ImportError as e:  # pragma: no cover - device_sim ships with the repo
        raise InputError("no images given and device_sim.synthfaces is unavailable; pass a folder of faces") from e
    ids = np.repeat(np.arange(first_identity, first_identity + identities), per_identity)
    imgs = SynthFaces(seed=seed, image_size=input_size).render(ids, np.tile(np.arange(per_identity), identities))
    return imgs.numpy().astype(np.float32), ids
