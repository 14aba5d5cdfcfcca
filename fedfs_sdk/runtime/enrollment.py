"""Enroll and verify the device owner (FedUV Alg. 2 warm-up and verification).

numpy + cryptography only: works with any :class:`~fedfs_sdk.runtime.inference.InferenceBackend`,
so a phone verifying through ONNX Runtime never imports torch.

Two scoring modes, chosen by what the enrollment holds:

* **codeword** (FedUV, FedFS+FedUV): ``e = (1/c) v_uᵀ σ(W g(x))`` (FedUV Eq. 5) with the
  device's secret codeword ``v_u``; needs a backend with a ``uv`` output.
* **template** (FedFS alone): cosine between the embedding and the enrolled template (the
  normalized mean of the warm-up embeddings). Warm-up scores are leave-one-out so an image
  is never scored against a template that contains it.

Either way the threshold is FedUV's warm-up rule (:func:`warmup_threshold`), applied after
**outlier rejection** (:func:`mad_outliers`, ``outliers="mad"``): a warm-up image whose score
is far below the others (a stranger's photo in the owner's folder) is dropped before ``τ`` is
set, because with ``i = ⌊n(1−q)⌋ = 1`` the single lowest score *is* ``τ``.

The warm-up scores are computed one image at a time, through the same code as :func:`verify`
(:func:`_scores_alone`): a float32 forward of a batch and of a single image differ by ~1e-7,
so a threshold taken from batched scores could reject, verified alone, the very image that
set it.

The enrollment is stored encrypted and authenticated (AES-256-GCM) with a key the app
supplies (e.g. from the platform keystore), written atomically, never overwritten unless
asked (:mod:`fedfs_sdk.runtime.enrollment_store`, re-exported here).
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

from ..errors import EnrollmentError, InputError, InsufficientWarmupError
from ..exact import as_written
from .inference import InferenceBackend
from .operating_point import operating_point

# ---- outlier rejection (applied to the warm-up scores before τ is set) ------------------
OUTLIER_RULES = ("mad", "none")
OUTLIER_K = 3.5            # Iglewicz & Hoaglin (1993): |modified z| > 3.5 flags an outlier
MAD_SCALE = 1.4826         # MAD · 1.4826 estimates σ for normal data (1 / Φ⁻¹(3/4))
# An outlier must also lie this far below the median: 5 % of the score's range, i.e. 0.1 for
# a cosine (range [−1, 1]) and 0.05 for the FedUV score (range width Σ|v_k|/c = 1). It keeps
# genuine images when the warm-up scores are so tight that the MAD is tiny (or 0).
OUTLIER_MARGIN = {"template": 0.1, "codeword": 0.05}
_MAX_PASSES = 5            # template mode: re-estimate the template at most this often
# τ is stored this much below the warm-up score that set it. Warm-up scores are computed as
# verify computes them (one image per forward), which is exact only while the backend returns
# the same bits for the same image every time; a float32 forward of one image vs a batch (or
# another thread split / kernel choice) differs by ~1e-7, and scores are O(1) (cosine and FedUV
# score both lie in [−1, 1]), so 1e-6 covers that noise 10× and moves no real decision.
WARMUP_TOLERANCE = 1e-6



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

    @property
    def template_output(self) -> str:
        """Template mode: which backend output the template is built on — ``embedding`` (the
        backbone's) or ``uv`` (the FedUV head ``σ(W g)``: its cosine is that of ``W·g``, the
        ``head-template`` verifier of docs/personalization.md). Kept in ``meta`` so the file's
        keys stay those older readers know; files without it are ``embedding``."""
        out = self.meta.get("template_output", "embedding")
        if out not in ("embedding", "uv"):
            raise EnrollmentError(f"enrollment names an unknown template output {out!r}; re-enroll")
        return str(out)

    @property
    def dropped(self) -> list[int]:
        """Indices (in the images given to :func:`enroll`) of the warm-up images dropped as
        outliers; details in ``meta["dropped"]`` (index, file name for paths, score) and
        ``meta["outlier_rule"]``. Empty for enrollments made before outlier rejection (their
        files load unchanged: the record lives in ``meta``, so the format is the same)."""
        return [int(d["index"]) for d in self.meta.get("dropped", [])]

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


def mad_outliers(scores: Sequence[float] | np.ndarray, k: float = OUTLIER_K,
                 margin: float = OUTLIER_MARGIN["template"]) -> np.ndarray:
    """Low outliers among warm-up scores (robust z-score, Iglewicz–Hoaglin).

    With ``m = median(s)`` and ``σ̂ = 1.4826 · median(|s − m|)`` (the MAD scaled to estimate
    a normal σ; median and MAD ignore up to half the sample, so a stranger cannot hide
    itself by shifting them), score ``s_j`` is an outlier iff

        ``s_j < m − k·σ̂``  and  ``s_j < m − margin``.

    Only low scores count (a high score is never a reason to distrust an owner image). The
    margin stops the rule from dropping genuine images when the scores are so tight that
    ``σ̂`` is tiny (``σ̂ = 0`` when over half the scores tie). Returns a boolean mask.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    if not np.isfinite(k) or k <= 0:
        raise InputError(f"outlier_k must be a positive number, got {k!r}")
    if s.size < 3:
        return np.zeros(s.size, dtype=bool)
    med = float(np.median(s))
    sigma = MAD_SCALE * float(np.median(np.abs(s - med)))
    return (s < med - k * sigma) & (s < med - margin)


def outlier_rule(mode: str, outliers: str = "mad", k: float = OUTLIER_K) -> str:
    """The rule :func:`enroll` applies, in words (stored in ``meta["outlier_rule"]``)."""
    if outliers == "none":
        return "none (outlier rejection off)"
    what = "leave-one-out cosine" if mode == "template" else "FedUV score"
    return (f"mad: dropped iff {what} < median − {k:g}·1.4826·MAD and < median − {OUTLIER_MARGIN[mode]:g}"
            + (" (template re-estimated without the dropped)" if mode == "template" else ""))


def _name(src: Any) -> str | None:
    return Path(src).name if isinstance(src, (str, os.PathLike)) else None


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


def _loo_scores(emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out cosines of unit embeddings ``emb`` and the (float32) template of all of them."""
    total = emb.sum(0)
    loo = _unit(total[None, :] - emb)                 # template without image j
    return (emb * loo).sum(1), _unit(total).astype(np.float32)


def enroll(backend: InferenceBackend, images: Any, q: float = 0.9, codeword: np.ndarray | None = None,
           detect_face: bool = False, meta: dict[str, Any] | None = None, outliers: str = "mad",
           outlier_k: float = OUTLIER_K, template_output: str = "embedding", far: float | None = None,
           impostors: Any = None, in_domain: Any = None, far_evidence: str = "auto") -> Enrollment:
    """Enroll the owner from ``n`` warm-up images with target TPR ``q`` (FedUV Alg. 2).

    ``images``: paths / bytes / uint8 arrays, or an already preprocessed float32 batch.
    With ``codeword`` the FedUV score is used, else a cosine template of the backend output
    ``template_output``: ``embedding`` or ``uv`` (the FedUV head; its cosine equals that of
    ``W·g``, the ``head-template`` scoring that the fedfs+feduv default uses).

    ``outliers="mad"`` (default) first drops warm-up images whose score is an outlier by
    :func:`mad_outliers` (``k = outlier_k``); in template mode the template and the
    leave-one-out scores are then recomputed on the rest, until nothing more is dropped (at
    most 5 passes). The rule never drops a photo that would leave fewer than the warm-up
    minimum ``⌈1/(1−q)⌉``: it drops the most outlying (lowest-scoring) flagged photos down to that
    floor and keeps the rest, recorded in ``meta["kept_at_floor"]`` (index, file, score), with
    ``meta["outliers_flagged"]`` (how many the rule would have dropped) and
    ``meta["outliers_kept_at_floor"]`` — a kept photo may set ``τ``, so the caller should tell the
    user to add photos of the owner. ``τ`` is set from the photos kept; the result's ``dropped``,
    ``meta["dropped"]`` and ``meta["outlier_rule"]`` say what was dropped and why, and
    ``n_warmup`` counts the photos kept. :class:`InsufficientWarmupError` only when fewer than
    ``⌈1/(1−q)⌉`` photos are given. ``outliers="none"`` keeps every image (FedUV as written).

    Every warm-up image whose warm-up score is ``≥ τ`` is accepted by :func:`verify` on its
    own: the scores are computed per image as verify computes them, and in template mode
    ``τ`` is lowered to the smallest verify score of those images if rounding (the stored
    float32 template) put one below it — in exact arithmetic the full-template cosine is
    never below the leave-one-out one, so this moves ``τ`` by float noise at most. The stored
    ``τ`` is then lowered by :data:`WARMUP_TOLERANCE` (1e-6) in case the backend's bits for
    one image are not reproducible between runs (float32 noise is ~1e-7).

    ``impostors`` (a public :class:`~fedfs_sdk.runtime.impostors.ImpostorSet`, or a preprocessed
    float32 batch) are scored against the enrollment: the stored operating point
    (``meta["operating_point"]``) then says how many of them the threshold accepts. With ``far``
    the threshold is set for that false-accept rate instead of ``q``
    (:mod:`fedfs_sdk.runtime.operating_point`: at most ``⌊far·(n+1)⌋ − 1`` public impostors pass,
    so an exchangeable impostor passes with probability ≤ ``far``), provided the warm-up still
    accepts at least ``q`` of the owner's photos; :class:`~fedfs_sdk.errors.OperatingPointError`
    otherwise, naming both rates.

    ``in_domain`` (an :class:`~fedfs_sdk.stats.evidence.InDomainEvidence`, built from the federation's
    published statistics for this backend's model) lets ``far`` be met in the federation's own capture
    conditions: ``τ = m_u + s_u·z*(far)`` — the Gaussian location/scale of the owner's template's
    impostor scores and the federation's tail quantile (:mod:`fedfs_sdk.stats.tail`), a prediction, not
    a bound. ``far_evidence`` (:data:`~fedfs_sdk.runtime.operating_point.FAR_EVIDENCE`): ``auto`` uses
    the public set when it holds ≥ ``⌈1/far⌉ − 1`` photos, else the statistics; the record's
    ``far_evidence`` says which set ``τ``. With neither evidence a ``far`` is refused, naming both.
    """
    if outliers not in OUTLIER_RULES:
        raise InputError(f"outliers must be one of {', '.join(OUTLIER_RULES)}, got {outliers!r}")
    k = float(outlier_k)
    if not math.isfinite(k) or k <= 0:
        raise InputError(f"outlier_k must be a positive number, got {outlier_k!r}")
    n = len(images)
    q_stored = float(_fraction(q))     # validated; a plain float (np.float32 is not JSON)
    min_n = min_warmup_images(q)
    if n < min_n:
        raise InsufficientWarmupError(f"{n} warm-up image(s) are too few for target TPR q={q}; "
                                      f"at least {min_n} are needed")
    v = None if codeword is None else check_codeword(codeword, backend)
    if template_output not in ("embedding", "uv"):
        raise InputError(f"template_output must be 'embedding' or 'uv', got {template_output!r}")
    if v is not None and template_output != "embedding":
        raise InputError("template_output applies to template enrollments; a codeword enrollment scores the uv output")
    if template_output == "uv" and "uv" not in backend.outputs:
        raise InputError("template_output='uv' needs a model with a FedUV head (backend has no 'uv' output)")
    batch = _as_batch(backend, images, detect_face)
    outs = _run_alone(backend, batch)
    mode = "template" if v is None else "codeword"
    keep = np.ones(n, dtype=bool)
    names = [_name(x) for x in images] if isinstance(images, (list, tuple)) else [None] * n
    dropped: list[dict[str, Any]] = []
    floor: list[dict[str, Any]] = []     # flagged by the rule, kept: dropping them would leave < min_n

    def drop(mask: np.ndarray, scores: np.ndarray) -> bool:
        """Drop the flagged photos, the most outlying (lowest score: all flagged lie below the
        median) first, but never below ``min_n`` kept — with exactly ``⌈1/(1−q)⌉`` photos an
        enrollment would otherwise fail whenever the rule fires (deployment bug 3). Returns
        whether the floor kept any (then no later pass can drop more)."""
        idx, sc = np.flatnonzero(keep)[mask], scores[mask]
        room = int(keep.sum()) - min_n
        for rank, o in enumerate(np.argsort(sc, kind="stable")):
            j = int(idx[o])
            rec = {"index": j, "score": float(sc[o]), **({"file": names[j]} if names[j] else {})}
            (dropped if rank < room else floor).append(rec)
        keep[[d["index"] for d in dropped]] = False
        return len(sc) > room

    if v is not None:
        if outs[0]["uv"].shape[1] != v.size:
            raise InputError(f"codeword has {v.size} bits but the model's head outputs {outs[0]['uv'].shape[1]}")
        scores = np.array([_verify_scores(o, "codeword", v, None)[0] for o in outs])   # = verify's, bit for bit
        if outliers == "mad":
            out_mask = mad_outliers(scores, k, OUTLIER_MARGIN["codeword"])
            if out_mask.any():
                drop(out_mask, scores)
                scores = scores[keep]           # one pass: scores cover every photo
        tau = warmup_threshold(scores, q)
        template = None
    else:
        emb = _unit(np.concatenate([o[template_output] for o in outs]).astype(np.float64))
        at_floor = False
        for _ in range(_MAX_PASSES):
            scores, template = _loo_scores(emb[keep])
            if at_floor:             # the floor kept flagged photos: nothing more can be dropped
                break
            out_mask = mad_outliers(scores, k, OUTLIER_MARGIN["template"]) if outliers == "mad" else None
            if out_mask is None or not out_mask.any():
                break
            at_floor = drop(out_mask, scores)
        else:
            scores, template = _loo_scores(emb[keep])
        tau = warmup_threshold(scores, q)
        alone = np.array([_verify_scores(outs[j], "template", None, template, template_output)[0]
                          for j in np.flatnonzero(keep)])
        tau = min(tau, float(alone[scores >= tau].min()))
    tau -= WARMUP_TOLERANCE
    op = None
    if far is not None or impostors is not None:
        imp = None if impostors is None else _impostor_scores(backend, impostors, mode, v, template, template_output)
        ids = getattr(impostors, "identity", None)
        fed = None if in_domain is None or far is None else \
            (_verify_scores(in_domain.draws, mode, v, template, template_output), in_domain)
        tau, op = operating_point(scores, q, far, imp, tau, identities=ids, in_domain=fed, far_evidence=far_evidence)
        op["n_warmup"] = int(keep.sum())
        if impostors is not None and hasattr(impostors, "digest"):
            op["impostor_set"] = {"sha256": impostors.digest(), "photos": len(impostors),
                                  "identities": impostors.num_identities}
    info = {**dict(meta or {}), "dropped": sorted(dropped, key=lambda d: d["index"]),
            "outlier_rule": outlier_rule(mode, outliers, k), "n_given": n,
            "outliers_flagged": len(dropped) + len(floor), "outliers_kept_at_floor": len(floor),
            "kept_at_floor": sorted(floor, key=lambda d: d["index"]), "min_warmup": min_n,
            **({"operating_point": op} if op is not None else {})}
    if template_output != "embedding":
        info["template_output"] = template_output
    if not _is_batch(images):            # how the photos became model inputs: verify applies the same
        info["preprocessing"] = preprocessing_record(backend, detect_face)
    return Enrollment(backend.model_id, mode, tau, q_stored, int(keep.sum()), codeword=v, template=template,
                      meta=info)


def _impostor_scores(backend: InferenceBackend, impostors: Any, mode: str, codeword: np.ndarray | None,
                     template: np.ndarray | None, output: str, chunk: int = 64) -> np.ndarray:
    """Verification scores of the public impostor photos against a new enrollment (in chunks)."""
    batch = impostors.batch(backend.input_size) if hasattr(impostors, "batch") else np.asarray(impostors, np.float32)
    if batch.ndim != 4 or batch.shape[0] == 0:
        raise InputError(f"impostors must be an ImpostorSet or a float32 [N, 3, S, S] batch, got shape {list(batch.shape)}")
    return np.concatenate([_verify_scores(backend.run(batch[a:a + chunk]), mode, codeword, template, output)
                           for a in range(0, batch.shape[0], chunk)])


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


# ---- storage: encrypted enrollment files (enrollment_store.py, re-exported here) ---------
from .enrollment_store import (_MAGIC, _NONCE, _VERSION, _aesgcm, generate_key, load_enrollment,  # noqa: E402,F401
                               save_enrollment)
