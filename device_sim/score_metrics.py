"""Score-level verification and identification metrics: ROC, AUROC, EER, TAR@FAR, TPIR@FPIR,
pairwise 1:1 scores. The conventions (accept iff score ≥ τ, TAR@FAR's envelope, FedFR's 1:N
protocol) are stated in :mod:`device_sim.metrics`."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from fedfs_sdk.errors import InputError

__all__ = ["DEFAULT_FARS", "roc", "auroc", "eer", "threshold_at_far", "tar_at_far", "verification_metrics",
           "identification_scores", "template_scores", "tpir_at_fpir", "tpir_other_clients", "pairwise_scores",
           "pairwise_auroc"]

DEFAULT_FARS: tuple[float, ...] = (1e-1, 1e-2, 1e-3)
_trapezoid = getattr(np, "trapezoid", None) or np.trapz      # NumPy < 2 names it trapz


def _scores(x: Sequence[float] | np.ndarray, what: str, allow_empty: bool = False) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.size == 0 and not allow_empty:
        raise InputError(f"{what} scores are empty")
    if a.size and not np.isfinite(a).all():
        raise InputError(f"{what} scores contain {int((~np.isfinite(a)).sum())} NaN/Inf value(s)")
    return a


def _curve(g: np.ndarray, i: np.ndarray, drop_intermediate: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fps, tps, thresholds)`` at every distinct score, highest first, with the ``(0, 0, +inf)``
    point in front — scikit-learn's ``roc_curve`` step for step (the same sort, cumulative sums and
    collinear-point drop), so the curves and areas are bit for bit its own. Done here because its
    per-call input validation cost more than the curve: 20 of a reduced LFW run's 128 CPU-seconds
    went to ``roc_auc_score`` / ``roc_curve`` and scikit-learn's import (issue 31)."""
    s = np.concatenate([g, i])
    y = np.concatenate([np.ones(g.size), np.zeros(i.size)])
    order = np.argsort(s, kind="mergesort")[::-1]
    s, y = s[order], y[order]
    idx = np.r_[np.where(np.diff(s))[0], y.size - 1]
    tps = np.cumsum(y, dtype=np.float64)[idx]
    fps = 1 + idx - tps
    thr = s[idx]
    if drop_intermediate and len(fps) > 2:      # keep the corners of the staircase only
        keep = np.where(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])[0]
        fps, tps, thr = fps[keep], tps[keep], thr[keep]
    return np.r_[0, fps], np.r_[0, tps], np.r_[np.inf, thr]


def roc(genuine: Sequence[float] | np.ndarray, impostor: Sequence[float] | np.ndarray
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, tpr, thresholds)`` over all distinct thresholds (accept iff score ≥ thr).

    ``thresholds`` decrease; the first is ``+inf`` (accept nothing).
    """
    g, i = _scores(genuine, "genuine"), _scores(impostor, "impostor")
    fps, tps, thr = _curve(g, i, drop_intermediate=False)
    return fps / fps[-1], tps / tps[-1], thr


def auroc(genuine: Sequence[float] | np.ndarray, impostor: Sequence[float] | np.ndarray) -> float:
    """Area under the ROC (probability a genuine score beats an impostor one, ties ½)."""
    g, i = _scores(genuine, "genuine"), _scores(impostor, "impostor")
    fps, tps, _ = _curve(g, i, drop_intermediate=True)
    return float(_trapezoid(tps / tps[-1], fps / fps[-1]))


def eer(genuine: Sequence[float] | np.ndarray, impostor: Sequence[float] | np.ndarray) -> float:
    """Equal error rate: where FAR = FRR on the ROC, linearly interpolated between points."""
    fpr, tpr, _ = roc(genuine, impostor)
    fnr = 1.0 - tpr
    diff = fnr - fpr                     # +1 at thr = +inf, −1 at thr = −inf: crosses 0 once
    k = int(np.argmax(diff <= 0))
    if k == 0:
        return float(fpr[0])
    d0, d1 = diff[k - 1], diff[k]
    w = d0 / (d0 - d1) if d0 != d1 else 0.0
    return float(fpr[k - 1] + w * (fpr[k] - fpr[k - 1]))


def threshold_at_far(impostor: Sequence[float] | np.ndarray, far: float) -> float:
    """Smallest threshold ``t`` (accept iff score ≥ t) with ``FAR(t) ≤ far`` on ``impostor``.

    ``t`` lies just above the ``(m+1)``-th largest impostor score, ``m = ⌊far · n⌋``, so ties
    at that score are rejected together; ``-inf`` when ``far ≥ 1``.
    """
    i = _scores(impostor, "impostor")
    if not 0.0 <= far <= 1.0:
        raise InputError(f"far must be in [0, 1], got {far}")
    m = int(math.floor(far * i.size + 1e-9))
    if m >= i.size:
        return -math.inf
    s = np.sort(i)[::-1][m]                       # the (m+1)-th largest
    return float(np.nextafter(s, math.inf))


def tar_at_far(genuine: Sequence[float] | np.ndarray, impostor: Sequence[float] | np.ndarray,
               far: float) -> float:
    """Genuine accept rate at :func:`threshold_at_far`."""
    g = _scores(genuine, "genuine")
    t = threshold_at_far(impostor, far)
    return float(np.mean(g >= t))


def verification_metrics(genuine: Sequence[float] | np.ndarray, impostor: Sequence[float] | np.ndarray,
                         fars: Iterable[float] = DEFAULT_FARS) -> dict:
    """AUROC, EER and TAR@FAR for one set of genuine and impostor scores.

    Returns ``{"auroc", "eer", "tar_at_far": {far: tar}, "threshold_at_far": {far: t},
    "n_genuine", "n_impostor", "far_resolution"}``; ``far_resolution = 1 / n_impostor`` is
    the smallest FAR the impostor set can resolve.
    """
    g, i = _scores(genuine, "genuine"), _scores(impostor, "impostor")
    thr = {float(f): threshold_at_far(i, f) for f in fars}
    return {
        "auroc": auroc(g, i),
        "eer": eer(g, i),
        "tar_at_far": {f: float(np.mean(g >= t)) for f, t in thr.items()},
        "threshold_at_far": thr,
        "n_genuine": int(g.size),
        "n_impostor": int(i.size),
        "far_resolution": 1.0 / i.size,
    }


# ---------------------------------------------------------------------------------------------
# 1:N identification (FedFR protocol)
# ---------------------------------------------------------------------------------------------
def identification_scores(similarity: np.ndarray, probe_labels: Sequence[int] | np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Split a probe × gallery similarity matrix into mated and non-mated decision scores.

    Args:
        similarity: ``[P, G]`` scores of every probe against every gallery identity.
        probe_labels: ``[P]`` gallery column of each probe's identity, or ``-1`` for a
            probe whose identity is not enrolled (non-mated).

    Returns ``(mated, nonmated)``: a mated probe's score against its own entry, or ``-inf``
    if another entry outranks it (it is then never correctly identified); a non-mated
    probe's best score over the gallery.
    """
    s = np.asarray(similarity, dtype=np.float64)
    lab = np.asarray(probe_labels, dtype=np.int64).reshape(-1)
    if s.ndim != 2 or s.shape[0] != lab.size:
        raise InputError(f"similarity must be [P, G] with P = len(probe_labels) = {lab.size}, got {list(s.shape)}")
    if s.size and not np.isfinite(s).all():
        raise InputError("similarity contains NaN/Inf")
    if lab.size and (lab.max() >= s.shape[1] or lab.min() < -1):
        raise InputError(f"probe_labels must be -1 or in [0, {s.shape[1]})")
    mated_rows = np.flatnonzero(lab >= 0)
    own = s[mated_rows, lab[mated_rows]]
    others = s[mated_rows].copy()
    others[np.arange(mated_rows.size), lab[mated_rows]] = -np.inf
    best_other = others.max(axis=1) if s.shape[1] > 1 else np.full(mated_rows.size, -np.inf)
    mated = np.where(own > best_other, own, -np.inf)   # a tie with an impostor entry is not rank-1
    nonmated = s[lab < 0].max(axis=1) if s.shape[1] else np.zeros(0)
    return mated, nonmated


def template_scores(gallery_embeddings: np.ndarray, probe_embeddings: np.ndarray) -> np.ndarray:
    """Cosine similarity ``[P]`` of probes to one enrollment template.

    The template is the L2-normalized mean of the L2-normalized gallery embeddings (FedFR
    builds each gallery identity from the mean of its normalized features).
    """
    g = np.asarray(gallery_embeddings, dtype=np.float64)
    p = np.asarray(probe_embeddings, dtype=np.float64)
    if g.ndim != 2 or p.ndim != 2 or g.shape[1] != p.shape[1] or g.shape[0] == 0:
        raise InputError(f"need gallery [G, D] (G ≥ 1) and probes [P, D], got {list(g.shape)} and {list(p.shape)}")
    g = g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12)
    t = g.mean(0)
    t = t / max(float(np.linalg.norm(t)), 1e-12)
    p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-12)
    return p @ t


def tpir_at_fpir(mated: Sequence[float] | np.ndarray, nonmated: Sequence[float] | np.ndarray,
                 fpirs: Iterable[float] = DEFAULT_FARS) -> dict[float, float]:
    """TPIR at each FPIR for one client, from :func:`identification_scores` outputs.

    ``mated`` may hold ``-inf`` (rank-1 failures); ``nonmated`` must be finite.
    """
    m = np.asarray(mated, dtype=np.float64).reshape(-1)
    if m.size == 0:
        raise InputError("mated scores are empty")
    if np.isnan(m).any() or (m == np.inf).any():
        raise InputError("mated scores contain NaN or +Inf")
    n = _scores(nonmated, "non-mated")
    # a rank-1 failure (−inf) is never identified, even where the threshold is −inf (FPIR ≥ 1)
    return {float(f): float(np.mean(np.isfinite(m) & (m >= threshold_at_far(n, f)))) for f in fpirs}


def tpir_other_clients(mated: Sequence[float] | np.ndarray, pool_scores: Sequence[float] | np.ndarray,
                       pool_owner: Sequence[int] | np.ndarray, client: int,
                       fpirs: Iterable[float] = DEFAULT_FARS) -> dict[float, float]:
    """TPIR at each FPIR of ``client`` with the **other clients' images as non-mated probes**
    (FedFR's 1:N protocol: every identity outside the client's one-entry gallery).

    Args:
        mated: the client's own test images' scores against its gallery entry.
        pool_scores: ``[m]`` scores of a pool of participants' images against the same entry.
        pool_owner: ``[m]`` client of each pool image; the client's own images are dropped.
    """
    s = np.asarray(pool_scores, dtype=np.float64).reshape(-1)
    own = np.asarray(pool_owner).reshape(-1)
    if s.size != own.size:
        raise InputError(f"pool_scores ({s.size}) and pool_owner ({own.size}) differ in length")
    return tpir_at_fpir(mated, s[own != client], fpirs)


# ---------------------------------------------------------------------------------------------
# Pairwise 1:1 verification (FedFR protocol)
# ---------------------------------------------------------------------------------------------
def _unit_rows(x: np.ndarray | Sequence, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise InputError(f"{what} embeddings must be [N, D], got shape {list(a.shape)}")
    if a.size and not np.isfinite(a).all():
        raise InputError(f"{what} embeddings contain NaN/Inf")
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def pairwise_scores(own: np.ndarray, others: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise cosine scores of one client (FedFR's 1:1 protocol).

    Args:
        own: ``[n, D]`` embeddings of the client's own held-out images.
        others: ``[m, D]`` embeddings of other identities' images.

    Returns ``(genuine, impostor)``: ``genuine`` = cosine of every unordered pair ``i < j`` of
    ``own`` (``n(n−1)/2`` scores, row-major over the upper triangle); ``impostor`` = cosine of
    each own image with each other image (``n·m``, row-major ``[own, other]``).
    """
    o, p = _unit_rows(own, "own"), _unit_rows(others, "other")
    if o.shape[1] != p.shape[1]:
        raise InputError(f"own and other embeddings differ in dimension: {o.shape[1]} vs {p.shape[1]}")
    iu = np.triu_indices(o.shape[0], k=1)
    return (o @ o.T)[iu], (o @ p.T).reshape(-1)


def pairwise_auroc(own: np.ndarray, others: np.ndarray) -> float:
    """AUROC of :func:`pairwise_scores`. Raises :class:`InputError` when it is undefined
    (fewer than 2 own images, no other images, non-finite embeddings)."""
    g, i = pairwise_scores(own, others)
    if g.size == 0:
        raise InputError(f"pairwise AUROC needs ≥ 2 own images, got {np.asarray(own).shape[0]}")
    return auroc(g, i)

