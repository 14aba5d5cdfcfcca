"""FedUV Alg. 2's warm-up rule on scores alone (no model, no images): the threshold
``τ`` = the ``i``-th smallest warm-up score, ``i = ⌊n(1−q)⌋`` (:func:`warmup_threshold`), the
fewest warm-up images that rule needs, ``⌈1/(1−q)⌉`` (:func:`min_warmup_images`), and the
outlier rejection applied to the warm-up scores before ``τ`` is set (:func:`mad_outliers`,
robust z-score with median ``m`` and ``σ̂ = 1.4826·MAD``; :func:`outlier_rule` says it in words).
Used by :func:`fedfs_sdk.runtime.enrollment.enroll`, which re-exports every name here.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from ..errors import InputError, InsufficientWarmupError
from ..exact import as_written

# ---- outlier rejection (applied to the warm-up scores before τ is set) ------------------
OUTLIER_RULES = ("mad", "none")
OUTLIER_K = 3.5            # Iglewicz & Hoaglin (1993): |modified z| > 3.5 flags an outlier
MAD_SCALE = 1.4826         # MAD · 1.4826 estimates σ for normal data (1 / Φ⁻¹(3/4))
# An outlier must also lie this far below the median: 5 % of the score's range, i.e. 0.1 for
# a cosine (range [−1, 1]) and 0.05 for the FedUV score (range width Σ|v_k|/c = 1). It keeps
# genuine images when the warm-up scores are so tight that the MAD is tiny (or 0).
OUTLIER_MARGIN = {"template": 0.1, "codeword": 0.05}


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


__all__ = ["OUTLIER_RULES", "OUTLIER_K", "MAD_SCALE", "OUTLIER_MARGIN", "min_warmup_images", "warmup_threshold",
           "mad_outliers", "outlier_rule"]
