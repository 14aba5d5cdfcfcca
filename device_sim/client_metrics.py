"""Per-client metrics of a simulation: each client's verification / identification figures
aggregated over clients (mean, median, sd; degenerate clients counted), the paired Δ between
two methods, FedUV's warm-up outcome per user (Alg. 2) and the mean ROC.

The score-level metrics they apply per client (ROC, AUROC, EER, TAR@FAR, TPIR@FPIR) are in
:mod:`device_sim.score_metrics`; the conventions are stated in :mod:`device_sim.metrics`."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

from fedfs_sdk.errors import InputError, InsufficientWarmupError

from .score_metrics import DEFAULT_FARS, _scores, roc, tpir_at_fpir, verification_metrics

__all__ = ["aggregate", "per_client_verification", "per_client_identification", "paired_delta", "WarmupOutcome",
           "warmup_outcome", "per_user_warmup", "mean_roc"]


# ---------------------------------------------------------------------------------------------
# Aggregation over clients
# ---------------------------------------------------------------------------------------------
def aggregate(values: Sequence[float] | np.ndarray) -> dict:
    """``mean``, ``median``, ``std``, ``min``, ``max`` over the finite values, with counts.

    NaN marks a degenerate client (no genuine or no impostor scores, non-finite scores); it
    is excluded and counted in ``n_degenerate``. All-NaN input gives NaN statistics.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    ok = v[np.isfinite(v)]
    nan = float("nan")
    return {"mean": float(ok.mean()) if ok.size else nan,
            "median": float(np.median(ok)) if ok.size else nan,
            "std": float(ok.std()) if ok.size else nan,
            "min": float(ok.min()) if ok.size else nan,
            "max": float(ok.max()) if ok.size else nan,
            "n": int(ok.size), "n_degenerate": int(v.size - ok.size)}


def per_client_verification(scores: Sequence[tuple[np.ndarray, np.ndarray]],
                            fars: Iterable[float] = DEFAULT_FARS) -> dict:
    """Verification metrics per client and aggregated.

    Args:
        scores: per client ``(genuine, impostor)`` scores under that client's own model.

    Returns ``{"per_client": [metrics | {"error": …}], "auroc": aggregate, "eer": aggregate,
    "tar_at_far": {far: aggregate}, "pooled": verification_metrics of all scores}``. The
    per-client mean is the personalized figure (each client thresholds its own model);
    ``pooled`` is what one global threshold across all clients would see.
    """
    fars = tuple(float(f) for f in fars)
    per, au, ee = [], [], []
    tars: dict[float, list[float]] = {f: [] for f in fars}
    all_g, all_i = [], []
    for g, i in scores:
        try:
            m = verification_metrics(g, i, fars)
        except InputError as e:
            per.append({"error": str(e)})
            au.append(math.nan)
            ee.append(math.nan)
            for f in fars:
                tars[f].append(math.nan)
            continue
        per.append(m)
        au.append(m["auroc"])
        ee.append(m["eer"])
        for f in fars:
            tars[f].append(m["tar_at_far"][f])
        all_g.append(np.asarray(g, dtype=np.float64).reshape(-1))
        all_i.append(np.asarray(i, dtype=np.float64).reshape(-1))
    pooled = verification_metrics(np.concatenate(all_g), np.concatenate(all_i), fars) if all_g else None
    return {"per_client": per, "auroc": aggregate(au), "eer": aggregate(ee),
            "tar_at_far": {f: aggregate(v) for f, v in tars.items()}, "pooled": pooled}


def per_client_identification(scores: Sequence[tuple[np.ndarray, np.ndarray]],
                              fpirs: Iterable[float] = DEFAULT_FARS) -> dict:
    """Mean (and spread of) TPIR@FPIR over clients (FedFS Table 2).

    Args:
        scores: per client ``(mated, nonmated)`` from :func:`identification_scores` (or, for
            a one-identity gallery, genuine test scores and other users' scores).

    Returns ``{"tpir_at_fpir": {fpir: aggregate}, "per_client": {fpir: [float]}}``; a client
    whose scores are unusable is NaN in ``per_client`` and counted in ``n_degenerate``.
    """
    fpirs = tuple(float(f) for f in fpirs)
    vals: dict[float, list[float]] = {f: [] for f in fpirs}
    for m, n in scores:
        try:
            r = tpir_at_fpir(m, n, fpirs)
        except InputError:
            r = {f: math.nan for f in fpirs}
        for f in fpirs:
            vals[f].append(r[f])
    return {"tpir_at_fpir": {f: aggregate(v) for f, v in vals.items()}, "per_client": vals}


def paired_delta(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> dict:
    """Paired difference of two methods' per-client values (same clients, same order).

    ``Δ = a − b`` over the clients where both values are finite (NaN/None pairs are dropped).
    Returns ``{"mean": mean Δ, "se": sd(Δ, ddof=1)/√n, "n": pairs used, "wins": #Δ > 0,
    "losses": #Δ < 0}``; ``mean`` is NaN when ``n = 0``, ``se`` NaN when ``n < 2``.
    Raises :class:`InputError` when ``a`` and ``b`` differ in length.
    """
    x = np.asarray(a, dtype=np.float64).reshape(-1)
    y = np.asarray(b, dtype=np.float64).reshape(-1)
    if x.size != y.size:
        raise InputError(f"paired values differ in length: {x.size} vs {y.size}")
    ok = np.isfinite(x) & np.isfinite(y)
    d = x[ok] - y[ok]
    n = int(d.size)
    return {"mean": float(d.mean()) if n else math.nan,
            "se": float(d.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan,
            "n": n, "wins": int((d > 0).sum()), "losses": int((d < 0).sum())}


# ---------------------------------------------------------------------------------------------
# FedUV warm-up outcome (Alg. 2)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WarmupOutcome:
    """One user's warm-up threshold and what it achieves on held-out data."""

    threshold: float
    tpr: float           # share of held-out genuine scores ≥ τ
    fpr: float           # share of impostor scores ≥ τ
    n_warmup: int
    n_genuine: int
    n_impostor: int

    def to_dict(self) -> dict:
        return asdict(self)


def warmup_outcome(warmup_scores: Sequence[float] | np.ndarray, genuine_scores: Sequence[float] | np.ndarray,
                   impostor_scores: Sequence[float] | np.ndarray, q: float = 0.9) -> WarmupOutcome:
    """FedUV warm-up: ``τ`` from the user's own warm-up scores at target TPR ``q``
    (:func:`fedfs_sdk.runtime.enrollment.warmup_threshold`), then TPR on the user's held-out genuine
    scores and FPR on impostor scores, accepting ``score ≥ τ``.

    Raises :class:`InsufficientWarmupError` if ``⌊n(1 − q)⌋ < 1``.
    """
    from fedfs_sdk.runtime.enrollment import warmup_threshold

    w = _scores(warmup_scores, "warm-up")
    g = _scores(genuine_scores, "genuine")
    i = _scores(impostor_scores, "impostor")
    tau = warmup_threshold(w, q)
    return WarmupOutcome(threshold=float(tau), tpr=float(np.mean(g >= tau)), fpr=float(np.mean(i >= tau)),
                         n_warmup=int(w.size), n_genuine=int(g.size), n_impostor=int(i.size))


def per_user_warmup(scores: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], q: float = 0.9) -> dict:
    """Warm-up outcomes of many users and their aggregate TPR/FPR.

    Args:
        scores: per user ``(warmup, genuine, impostor)`` scores under that user's model and
            enrollment.

    Users with too few warm-up images are counted in ``n_insufficient`` and excluded.
    Returns ``{"per_user": [WarmupOutcome.to_dict() | None], "tpr": aggregate, "fpr":
    aggregate, "n_insufficient": int, "q": q}``.
    """
    per, tprs, fprs, bad = [], [], [], 0
    for w, g, i in scores:
        try:
            o = warmup_outcome(w, g, i, q)
        except InsufficientWarmupError:
            bad += 1
            per.append(None)
            continue
        per.append(o.to_dict())
        tprs.append(o.tpr)
        fprs.append(o.fpr)
    return {"per_user": per, "tpr": aggregate(tprs), "fpr": aggregate(fprs), "n_insufficient": bad, "q": q}


def mean_roc(scores: Sequence[tuple[np.ndarray, np.ndarray]], fpr_grid: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Vertically averaged ROC over clients: mean TPR (upper envelope) at each FPR of a grid.

    The grid defaults to 200 log-spaced points in ``[1e-4, 1]`` plus 0.
    """
    grid = np.concatenate([[0.0], np.logspace(-4, 0, 200)]) if fpr_grid is None else np.asarray(fpr_grid, np.float64)
    acc = np.zeros_like(grid)
    n = 0
    for g, i in scores:
        fpr, tpr, _ = roc(g, i)
        # upper envelope: best TPR with FPR ≤ grid point (fpr is non-decreasing)
        k = np.searchsorted(fpr, grid, side="right") - 1
        acc += np.maximum.accumulate(tpr)[np.clip(k, 0, None)]
        n += 1
    if n == 0:
        raise InputError("no clients to average")
    return grid, acc / n
