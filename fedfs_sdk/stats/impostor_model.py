"""Impostors in the federation's own capture conditions, from summed feature moments.

A device cannot see another device's photos, but the statistics round gives it the mean ``μ`` and
covariance ``C`` of every other device's trunk features (:func:`~.contributions.feature_moments`
summed, minus its own contribution). Under ``scope="top"`` every candidate verifier — ξ,
``norm-adapt`` ξ, the global model, the device's personalized model — is ξ's frozen trunk followed
by a small top, so one Gaussian model of the trunk features gives the impostor score
distribution of the device's own template under *any* candidate: draw ``f ~ N(μ, C)``
(:func:`impostor_features`), run the candidate's top, score against the template. The top is
nonlinear (a per-sample normalization and the L2 norm), which is why the scores are drawn rather
than written down: the linear part (the embedding layer) sees exactly the federation's first two
moments, and the draws carry them through the rest.

The draws replace the public impostor set in the do-no-harm check
(:func:`fedfs_sdk.training.selection.check_scores`) and set a FAR-targeted threshold
(:func:`threshold_at_far`). How close the predicted FAR is to the measured one on real in-domain
impostors: docs/personalization.md ("A check that sees the phone's conditions").
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .contributions import moments_of

DRAWS = 8192
"""Impostor draws per check: at FAR 1e-3 the threshold is the 9th-highest score (8 above it)."""
SHRINK = 1e-4
"""Ridge added to C (relative to its mean variance): keeps the factor real when the federation has
fewer photos than feature dimensions."""


def others_moments(total: np.ndarray, own: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, float]:
    """``(μ, C, n)`` of every other device's features: the published sum minus the device's own
    contribution (its own photos are genuine, not impostors)."""
    v = np.asarray(total, dtype=np.float64)
    if own is not None:
        v = v - np.asarray(own, dtype=np.float64)
    return moments_of(v)


def gaussian_factor(cov: np.ndarray, shrink: float = SHRINK) -> np.ndarray:
    """``L`` with ``L Lᵀ = C + ε I`` (symmetric square root by ``eigh``: PSD-safe)."""
    c = 0.5 * (cov + cov.T)
    eps = shrink * max(float(np.trace(c)) / c.shape[0], 1e-12)
    w, v = np.linalg.eigh(c + eps * np.eye(c.shape[0]))
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def standard_draws(dim: int, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """The fixed standard-normal draws ``[draws, dim]`` (float32): every candidate of a check uses the
    same ones (common random numbers), so candidates differ by their model, not their luck."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x1B05]).standard_normal((draws, dim)).astype(np.float32)


def impostor_features(mu: np.ndarray, cov: np.ndarray, draws: int = DRAWS, seed: int = 0,
                      z: np.ndarray | None = None) -> np.ndarray:
    """``[draws, F]`` float32 trunk features drawn from ``N(μ, C)``."""
    mu = np.asarray(mu, dtype=np.float64)
    if cov.shape != (mu.size, mu.size):
        raise InputError(f"covariance {list(cov.shape)} does not match a mean of {mu.size}")
    z = standard_draws(mu.size, draws, seed) if z is None else z
    return draws_from_factor(mu, gaussian_factor(cov), z)


def draws_from_factor(mu: np.ndarray, factor: np.ndarray, z: np.ndarray) -> np.ndarray:
    """:func:`impostor_features` from the Gaussian's factor ``L`` (:func:`gaussian_factor` of ``C``)
    instead of ``C``: the factor is what a simulator keeps per client (one ``eigh``), the draws are
    recomputed (``z @ L`` is milliseconds, the draws 8 MB a client)."""
    return (z @ factor.astype(np.float32) + np.asarray(mu, dtype=np.float64).astype(np.float32)).astype(np.float32)


def threshold_at_far(impostor_scores: np.ndarray, far: float) -> float:
    """The score ``τ`` that at most ``⌊far·n⌋`` of the ``n`` predicted impostor scores reach — the
    same rule as :func:`fedfs_sdk.training.selection.check_scores`."""
    from ..training.selection import far_index

    s = np.sort(np.asarray(impostor_scores, dtype=np.float64).ravel())[::-1]
    if s.size < 2:
        raise InputError("a FAR-targeted threshold needs ≥ 2 impostor scores")
    need = int(np.ceil(1.0 / far))
    if s.size < need:
        raise InputError(f"FAR {far:g} needs ≥ {need} impostor draws, got {s.size}")
    return float(s[min(far_index(s.size, far), s.size - 1)])


def predicted_far(impostor_scores: np.ndarray, tau: float) -> float:
    """Share of predicted impostor scores strictly above ``τ`` (what the check calls a false accept)."""
    s = np.asarray(impostor_scores, dtype=np.float64).ravel()
    return float((s > tau).mean()) if s.size else float("nan")


__all__ = ["others_moments", "gaussian_factor", "standard_draws", "impostor_features", "threshold_at_far",
           "predicted_far", "DRAWS", "SHRINK", "draws_from_factor"]
