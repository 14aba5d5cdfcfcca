"""Verification scores against an enrollment, and the accept rule (FedUV Alg. 2 verification:
accept iff ``score ≥ τ``). One formula for :func:`score` / :func:`verify` and for the warm-up
scores of :func:`fedfs_sdk.runtime.enrollment.enroll` (:func:`_verify_scores`): codeword mode
``e = (1/c) v_uᵀ σ(W g(x))`` (FedUV Eq. 5, :func:`uv_scores`), template mode the cosine between
the backend output and the enrolled template. Also how photos become model inputs as the
enrollment records them (:func:`preprocessing_record`, :func:`recorded_detect_face`).
numpy only (any :class:`~fedfs_sdk.runtime.inference.InferenceBackend`); re-exported by
:mod:`fedfs_sdk.runtime.enrollment`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EnrollmentError, InputError
from .enrollment_record import Enrollment
from .inference import InferenceBackend


@dataclass(frozen=True)
class VerifyResult:
    accepted: bool
    score: float
    threshold: float


def _is_batch(images: Any) -> bool:
    return isinstance(images, np.ndarray) and images.dtype == np.float32 and images.ndim == 4


def preprocessing_record(backend: InferenceBackend, detect_face: bool | str | None) -> dict[str, Any]:
    """What an enrollment records of its preprocessing (``meta["preprocessing"]``): the
    ``detect_face`` it was made with, the face crop the model was fed (``face_mode``: ``none``,
    ``align``, ``haar``, ``dlib-chip``) and the input size. :func:`score` / :func:`verify` apply the
    recorded ``detect_face`` unless told otherwise — an owner enrolled on aligned faces is
    rejected on centre crops (issue 29)."""
    from .preprocess import face_mode, model_face_mode

    return {"detect_face": face_mode(detect_face) or "none",
            "face_mode": model_face_mode(detect_face, getattr(backend, "alignment", None)) or "none",
            "input_size": int(backend.input_size)}


def recorded_detect_face(enrollment: "Enrollment", detect_face: bool | str | None = None) -> bool | str:
    """The ``detect_face`` to verify ``enrollment`` with: the recorded one (``detect_face=None``),
    else the caller's — which must not contradict the record (:class:`InputError`, naming both)."""
    from .preprocess import face_mode

    rec = (enrollment.meta.get("preprocessing") or {}).get("detect_face")
    if detect_face is None:
        return False if rec in (None, "none") else rec
    if rec is not None and (face_mode(detect_face) or "none") != rec:
        raise InputError(f"the enrollment was made with detect_face={rec!r} but verification asks for "
                         f"{face_mode(detect_face) or 'none'!r}: verify as enrolled (drop the flag) or re-enroll")
    return detect_face


def _as_batch(backend: InferenceBackend, images: Any, detect_face: bool | str) -> np.ndarray:
    if _is_batch(images):
        return images
    from .preprocess import model_face_mode, preprocess
    # a model trained on one face crop (a backend's optional ``alignment``, e.g. dlib-resnet's
    # "dlib-chip") is fed that crop whatever detect_face says
    mode = model_face_mode(detect_face, getattr(backend, "alignment", None))
    return preprocess(images, backend.input_size, detect_face=mode or False)


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


def _run_alone(backend: InferenceBackend, batch: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The backend's outputs for each image run alone (a batch of one), as :func:`verify` runs it."""
    return [backend.run(batch[j:j + 1]) for j in range(batch.shape[0])]


def _verify_scores(out: dict[str, np.ndarray], mode: str, codeword: np.ndarray | None,
                   template: np.ndarray | None, output: str = "embedding") -> np.ndarray:
    """Verification scores of a backend output: the one formula :func:`score` and :func:`enroll` share."""
    if mode == "codeword" or output == "uv":
        if "uv" not in out:
            raise InputError("this enrollment needs a model with a FedUV head (backend has no 'uv' output)")
    if mode == "codeword":
        assert codeword is not None
        return uv_scores(out["uv"], codeword)
    assert template is not None
    return _unit(out[output].astype(np.float64)) @ template.astype(np.float64)


def score(backend: InferenceBackend, enrollment: Enrollment, images: Any,
          detect_face: bool | str | None = None) -> np.ndarray:
    """Verification scores of one or more images against ``enrollment``, preprocessed as the
    enrollment records (``detect_face=None``; :func:`recorded_detect_face`)."""
    detect_face = recorded_detect_face(enrollment, detect_face)
    if backend.model_id != enrollment.model_id:
        raise EnrollmentError(f"enrollment was made with model {enrollment.model_id!r} but the backend runs "
                              f"{backend.model_id!r}; thresholds do not carry over between models — re-enroll")
    if not (isinstance(images, np.ndarray) and images.ndim == 4) and not isinstance(images, (list, tuple)):
        images = [images]
    out = backend.run(_as_batch(backend, images, detect_face))
    return _verify_scores(out, enrollment.mode, enrollment.codeword, enrollment.template,
                          enrollment.template_output)


def verify(backend: InferenceBackend, enrollment: Enrollment, image: Any,
           detect_face: bool | str | None = None) -> VerifyResult:
    """Accept iff ``score ≥ τ`` (FedUV Alg. 2 verification); preprocessed as enrolled by default."""
    s = float(score(backend, enrollment, image, detect_face)[0])
    return VerifyResult(accepted=s >= enrollment.threshold, score=s, threshold=enrollment.threshold)


__all__ = ["VerifyResult", "preprocessing_record", "recorded_detect_face", "uv_scores", "check_codeword", "score",
           "verify"]
