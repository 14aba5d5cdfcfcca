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

This module is the enrollment itself (:func:`enroll`); its parts live one job per module and
are re-exported here: the warm-up rule and outlier rejection on scores
(:mod:`~fedfs_sdk.runtime.warmup_rule`), the record (:mod:`~fedfs_sdk.runtime.enrollment_record`)
and scoring / verification (:mod:`~fedfs_sdk.runtime.scoring`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, InsufficientWarmupError
from .enrollment_record import Enrollment
from .enrollment_store import (_MAGIC, _NONCE, _VERSION, _aesgcm, generate_key, load_enrollment,  # noqa: F401
                               save_enrollment)  # (re-exported: encrypted enrollment files)
from .inference import InferenceBackend
from .operating_point import operating_point
from .scoring import (VerifyResult, _as_batch, _is_batch, _run_alone, _unit, _verify_scores,  # noqa: F401
                      check_codeword, preprocessing_record, recorded_detect_face, score, uv_scores,
                      verify)  # (re-exported: scores against an enrollment, the accept rule)
# enroll reads warmup_threshold from this module's namespace, so a test's
# monkeypatch.setattr(enrollment, "warmup_threshold", …) still reaches it
from .warmup_rule import (MAD_SCALE, OUTLIER_K, OUTLIER_MARGIN, OUTLIER_RULES, _fraction,  # noqa: F401
                          mad_outliers, min_warmup_images, outlier_rule,
                          warmup_threshold)  # (re-exported: the warm-up rule on scores)

# ---- enroll's own settings (the outlier rule's constants are in warmup_rule) --------------
_MAX_PASSES = 5            # template mode: re-estimate the template at most this often
# τ is stored this much below the warm-up score that set it. Warm-up scores are computed as
# verify computes them (one image per forward), which is exact only while the backend returns
# the same bits for the same image every time; a float32 forward of one image vs a batch (or
# another thread split / kernel choice) differs by ~1e-7, and scores are O(1) (cosine and FedUV
# score both lie in [−1, 1]), so 1e-6 covers that noise 10× and moves no real decision.
WARMUP_TOLERANCE = 1e-6


def _name(src: Any) -> str | None:
    return Path(src).name if isinstance(src, (str, os.PathLike)) else None


def _loo_scores(emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out cosines of unit embeddings ``emb`` and the (float32) template of all of them."""
    total = emb.sum(0)
    loo = _unit(total[None, :] - emb)                 # template without image j
    return (emb * loo).sum(1), _unit(total).astype(np.float32)


def enroll(backend: InferenceBackend, images: Any, q: float = 0.9, codeword: np.ndarray | None = None,
           detect_face: bool = False, meta: dict[str, Any] | None = None, outliers: str = "mad",
           outlier_k: float = OUTLIER_K, template_output: str = "embedding", far: float | None = None,
           impostors: Any = None, in_domain: Any = None, far_evidence: str = "auto",
           impostor_outputs: Any = None) -> Enrollment:
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
        imp = None if impostors is None else _impostor_scores(backend, impostors, mode, v, template,
                                                              template_output, impostor_outputs)
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
                     template: np.ndarray | None, output: str, outputs: Any = None) -> np.ndarray:
    """Verification scores of the public impostor photos against a new enrollment, chunk by chunk
    (``outputs``: the backend's per-chunk outputs on them, computed elsewhere; None: computed now)."""
    from .impostor_outputs import impostor_outputs

    outs = impostor_outputs(backend, impostors) if outputs is None else outputs
    return np.concatenate([_verify_scores(o, mode, codeword, template, output) for o in outs])


__all__ = ["enroll", "WARMUP_TOLERANCE",
           # re-exported from enrollment_record, scoring, warmup_rule and enrollment_store
           "Enrollment", "VerifyResult", "score", "verify", "uv_scores", "check_codeword", "preprocessing_record",
           "recorded_detect_face", "OUTLIER_RULES", "OUTLIER_K", "MAD_SCALE", "OUTLIER_MARGIN", "min_warmup_images",
           "warmup_threshold", "mad_outliers", "outlier_rule", "generate_key", "save_enrollment", "load_enrollment"]
