"""Enroll and verify the device owner (FedUV Alg. 2 warm-up and verification).

numpy + cryptography only: works with any :class:`~fedfs_sdk.inference.InferenceBackend`,
so a phone verifying through ONNX Runtime never imports torch.

Two scoring modes, chosen by what the enrollment holds:

* **codeword** (FedUV, FedFS+FedUV): ``e = (1/c) v_uᵀ σ(W g(x))`` (FedUV Eq. 5) with the
  device's secret codeword ``v_u``; needs a backend with a ``uv`` output.
* **template** (FedFS alone): cosine between the embedding and the enrolled template (the
  normalized mean of the warm-up embeddings). Warm-up scores are leave-one-out so an image
  is never scored against a template that contains it.

Either way the threshold is FedUV's warm-up rule (:func:`warmup_threshold`).

The enrollment is stored encrypted and authenticated (AES-256-GCM) with a key the app
supplies (e.g. from the platform keystore), written atomically, never overwritten unless
asked.
"""
from __future__ import annotations

import base64
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import (EnrollmentError, EnrollmentExistsError, InputError, InsufficientWarmupError)
from .exact import as_written
from .inference import InferenceBackend

_MAGIC = b"FEDFSENR"
_VERSION = 1
_NONCE = 12


def _fraction(q: Any) -> Fraction:
    """``q`` as the exact decimal the user wrote, ``Fraction(str(q))`` (0.9 → 9/10,
    ``np.float32(0.8)`` → 4/5 because it prints as ``0.8``; see :mod:`fedfs_sdk.exact`); no
    rounding, so ``q = 0.9999999999`` stays below 1. Checks ``0 < q < 1`` exactly."""
    try:
        f = as_written(q, "target TPR q")
    except InputError:
        raise InputError(f"target TPR q must be a number in (0, 1), got {q!r}") from None
    if not 0 < f < 1:
        raise InputError(f"target TPR q must be in (0, 1), got {q}")
    return f


def min_warmup_images(q: float) -> int:
    """Smallest ``n`` with ``⌊n(1−q)⌋ ≥ 1`` (e.g. 10 for ``q = 0.9``)."""
    return math.ceil(1 / (1 - _fraction(q)))


def warmup_threshold(scores: Sequence[float] | np.ndarray, q: float) -> float:
    """FedUV Alg. 2 warm-up: ``τ`` = the ``i``-th smallest score, ``i = ⌊n(1−q)⌋`` (1-based).

    Accepting ``score ≥ τ`` then accepts at least ``n − i + 1 ≥ q·n`` of the warm-up inputs.
    Raises :class:`InsufficientWarmupError` when ``n(1−q) < 1`` (``i`` would be 0) and says
    how many inputs are needed.
    """
    e = np.asarray(scores, dtype=np.float64).ravel()
    if e.size and not np.isfinite(e).all():
        raise InputError("warm-up scores contain NaN or Inf")
    fq = _fraction(q)
    i = math.floor(e.size * (1 - fq))
    if i < 1:
        raise InsufficientWarmupError(
            f"{e.size} warm-up image(s) are too few for target TPR q={q}: ⌊n(1−q)⌋ must be ≥ 1, "
            f"so at least {min_warmup_images(q)} images are needed")
    return float(np.sort(e)[i - 1])


@dataclass
class Enrollment:
    """The device owner's enrollment. Secret: never leaves the device."""

    model_id: str
    mode: str                      # "codeword" | "template"
    threshold: float
    q: float
    n_warmup: int
    codeword: np.ndarray | None = None   # int8 ±1 [c]
    template: np.ndarray | None = None   # float32 unit vector [D]
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["codeword"] = None if self.codeword is None else np.packbits(self.codeword < 0).tobytes().hex()
        d["code_length"] = None if self.codeword is None else int(self.codeword.size)
        d["template"] = None if self.template is None else base64.b64encode(
            np.asarray(self.template, dtype="<f4").tobytes()).decode()
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Enrollment":
        try:
            d = json.loads(data)
            c = d.pop("code_length")
            if d["codeword"] is not None:
                bits = np.unpackbits(np.frombuffer(bytes.fromhex(d["codeword"]), dtype=np.uint8))[:c]
                d["codeword"] = (1 - 2 * bits.astype(np.int8)).astype(np.int8)
            if d["template"] is not None:
                d["template"] = np.frombuffer(base64.b64decode(d["template"]), dtype="<f4").astype(np.float32)
            return cls(**d)
        except (ValueError, KeyError, TypeError) as e:
            raise EnrollmentError(f"enrollment content is malformed: {e}") from e


@dataclass(frozen=True)
class VerifyResult:
    accepted: bool
    score: float
    threshold: float


def _as_batch(backend: InferenceBackend, images: Any, detect_face: bool) -> np.ndarray:
    if isinstance(images, np.ndarray) and images.dtype == np.float32 and images.ndim == 4:
        return images
    from .preprocess import preprocess
    return preprocess(images, backend.input_size, detect_face=detect_face)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def uv_scores(uv: np.ndarray, codeword: np.ndarray) -> np.ndarray:
    """``e = (1/c) v_uᵀ σ(W g(x))`` for each row of ``uv`` (FedUV Eq. 5)."""
    return (uv.astype(np.float64) @ codeword.astype(np.float64)) / codeword.size


def check_codeword(codeword: np.ndarray, backend: InferenceBackend | None = None) -> np.ndarray:
    v = np.asarray(codeword)
    if v.ndim != 1 or not np.isin(v, (-1, 1)).all():
        raise InputError(f"codeword must be a 1-D ±1 vector, got shape {list(v.shape)}")
    if backend is not None and "uv" not in backend.outputs:
        raise InputError("codeword enrollment needs a model with a FedUV head (backend has no 'uv' output)")
    return v.astype(np.int8)


def enroll(backend: InferenceBackend, images: Any, q: float = 0.9, codeword: np.ndarray | None = None,
           detect_face: bool = False, meta: dict[str, Any] | None = None) -> Enrollment:
    """Enroll the owner from ``n`` warm-up images with target TPR ``q`` (FedUV Alg. 2).

    ``images``: paths / bytes / uint8 arrays, or an already preprocessed float32 batch.
    With ``codeword`` the FedUV score is used, else a cosine template.
    """
    n = len(images)
    q_stored = float(_fraction(q))     # validated; a plain float (np.float32 is not JSON)
    min_n = min_warmup_images(q)
    if n < min_n:
        raise InsufficientWarmupError(f"{n} warm-up image(s) are too few for target TPR q={q}; "
                                      f"at least {min_n} are needed")
    batch = _as_batch(backend, images, detect_face)
    out = backend.run(batch)
    if codeword is not None:
        v = check_codeword(codeword, backend)
        if out["uv"].shape[1] != v.size:
            raise InputError(f"codeword has {v.size} bits but the model's head outputs {out['uv'].shape[1]}")
        scores = uv_scores(out["uv"], v)
        return Enrollment(backend.model_id, "codeword", warmup_threshold(scores, q), q_stored, n,
                          codeword=v, meta=dict(meta or {}))
    emb = _unit(out["embedding"].astype(np.float64))
    total = emb.sum(0)
    loo = _unit(total[None, :] - emb)                 # template without image j
    scores = (emb * loo).sum(1)
    template = _unit(total).astype(np.float32)
    return Enrollment(backend.model_id, "template", warmup_threshold(scores, q), q_stored, n,
                      template=template, meta=dict(meta or {}))


def score(backend: InferenceBackend, enrollment: Enrollment, images: Any, detect_face: bool = False) -> np.ndarray:
    """Verification scores of one or more images against ``enrollment``."""
    if backend.model_id != enrollment.model_id:
        raise EnrollmentError(f"enrollment was made with model {enrollment.model_id!r} but the backend runs "
                              f"{backend.model_id!r}; thresholds do not carry over between models — re-enroll")
    if not (isinstance(images, np.ndarray) and images.ndim == 4) and not isinstance(images, (list, tuple)):
        images = [images]
    out = backend.run(_as_batch(backend, images, detect_face))
    if enrollment.mode == "codeword":
        assert enrollment.codeword is not None
        if "uv" not in out:
            raise InputError("this enrollment needs a model with a FedUV head (backend has no 'uv' output)")
        return uv_scores(out["uv"], enrollment.codeword)
    assert enrollment.template is not None
    return (_unit(out["embedding"].astype(np.float64)) @ enrollment.template.astype(np.float64))


def verify(backend: InferenceBackend, enrollment: Enrollment, image: Any, detect_face: bool = False) -> VerifyResult:
    """Accept iff ``score ≥ τ`` (FedUV Alg. 2 verification)."""
    s = float(score(backend, enrollment, image, detect_face)[0])
    return VerifyResult(accepted=s >= enrollment.threshold, score=s, threshold=enrollment.threshold)


# ---- storage -------------------------------------------------------------------------

def generate_key() -> bytes:
    """A fresh 256-bit AES-GCM key (store it in the platform keystore)."""
    return os.urandom(32)


def _aesgcm(key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    if not isinstance(key, (bytes, bytearray)) or len(key) not in (16, 24, 32):
        raise InputError("enrollment key must be 16, 24 or 32 bytes")
    return AESGCM(bytes(key))


def save_enrollment(path: str | os.PathLike[str], enrollment: Enrollment, key: bytes,
                    overwrite: bool = False) -> None:
    """Encrypt (AES-GCM) and write atomically. An existing file is kept unless ``overwrite``."""
    from .fileio import atomic_write_bytes

    p = Path(path)
    if p.exists() and not overwrite:
        raise EnrollmentExistsError(f"{p} already holds an enrollment; pass overwrite=True (`fedfs enroll --overwrite`) to replace it")
    header = _MAGIC + bytes([_VERSION])
    nonce = os.urandom(_NONCE)
    blob = header + nonce + _aesgcm(key).encrypt(nonce, enrollment.to_json(), header)
    atomic_write_bytes(p, blob, mode=0o600)


def load_enrollment(path: str | os.PathLike[str], key: bytes) -> Enrollment:
    """Read and authenticate an enrollment; :class:`EnrollmentError` if tampered or wrong key."""
    from cryptography.exceptions import InvalidTag

    p = Path(path)
    if not p.is_file():
        raise EnrollmentError(f"enrollment file not found: {p}")
    blob = p.read_bytes()
    header = _MAGIC + bytes([_VERSION])
    if not blob.startswith(_MAGIC):
        raise EnrollmentError(f"{p} is not a fedfs enrollment file")
    if blob[:len(header)] != header:
        raise EnrollmentError(f"{p} has unsupported enrollment version {blob[len(_MAGIC)]}")
    body = blob[len(header):]
    if len(body) < _NONCE + 16:
        raise EnrollmentError(f"{p} is truncated")
    try:
        plain = _aesgcm(key).decrypt(body[:_NONCE], body[_NONCE:], header)
    except InvalidTag:
        raise EnrollmentError(f"{p} failed authentication: the file was tampered with or the key is wrong") from None
    return Enrollment.from_json(plain)
