"""Differentially Private Local Clustering (PrivacyFace §3.1, Alg. 1, Theorem 2).

Greedy margin-constrained clustering of unit class centres: each query finds the centre
``w_o`` with the most neighbours within angle ρ, averages those neighbours into ``p``,
releases ``p̂ = (p + v)/‖p + v‖`` with Gaussian noise ``v ~ N(0, σ²I)`` calibrated to the
cluster size (Theorem 2), and removes the centres covered by ``p/‖p‖`` before the next
query. A query whose densest cluster has fewer than ``T`` centres ends the loop (line 6).
Each query is ``(ε, δ)``-DP; ``Q`` queries are ``(Qε, Qδ)``-DP (Property 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedfs_sdk.errors import InputError

from .common import unit


def mean_sensitivity(cluster_size: int, rho: float) -> float:
    """``Δ₂`` of a cluster mean of unit vectors within angle ρ of a centre (Theorem 2):
    ``√(2 − 2cos 2ρ)/|S|``. Two members are at most ``min(2ρ, π)`` apart — past ``ρ = π/2``
    the paper's ``cos 2ρ`` would wrap around and understate the sensitivity."""
    return math.sqrt(2.0 - 2.0 * math.cos(min(2.0 * rho, math.pi))) / cluster_size


def _log_phi(x: float) -> float:
    """``log Φ(x)`` of the standard normal CDF, accurate in the far left tail."""
    if x > -20.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    t = -x   # Φ(−t) ≈ φ(t)/t · (1 − 1/t² + 3/t⁴) for large t
    return -0.5 * t * t - math.log(t * math.sqrt(2.0 * math.pi)) + math.log1p(-1.0 / t**2 + 3.0 / t**4)


def gaussian_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """Exact ``δ`` of the Gaussian mechanism with noise ``σ`` at ``ε`` (Balle & Wang 2018,
    Thm. 8): ``Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ)``."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    return max(0.0, math.exp(_log_phi(a - b)) - math.exp(epsilon + _log_phi(-a - b)))


def analytic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """The smallest ``σ`` (to 1e-9 relative) with :func:`gaussian_delta` ``≤ δ``: valid for
    every ``ε``, unlike the classical ``Δ/ε·√(2 ln(1.25/δ))``, which needs ``ε < 1``."""
    lo, hi = 1e-12 * sensitivity, sensitivity
    while gaussian_delta(hi, sensitivity, epsilon) > delta:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_delta(mid, sensitivity, epsilon) > delta else (lo, mid)
    return hi


def dplc_sigma(cluster_size: int, rho: float, epsilon: float, delta: float) -> float:
    """Noise std of a released cluster centre.

    For ``ε ≤ 1``: Theorem 2 as printed, ``σ = 2/(|S|ε) · √((1 − cos 2ρ) ln(1.25/δ))`` —
    the classical Gaussian mechanism ``Δ₂/ε · √(2 ln(1.25/δ))`` (Definition 3) for the
    sensitivity :func:`mean_sensitivity`. That bound only holds for ``ε < 1`` (Dwork & Roth,
    Thm. A.1; at ε = 1 its exact δ is still below target), so for ``ε > 1`` the σ of the
    analytic Gaussian mechanism is used instead (:func:`analytic_gaussian_sigma`); with the
    classical formula ε = 10 would leak δ ≈ 1.3e-4 > 5e-5 and ε = 100 would not be private
    at all. ``ε = inf`` gives 0 (PrivacyFace's non-private "φ + p" variant).
    """
    if cluster_size < 1:
        raise InputError(f"cluster size must be ≥ 1, got {cluster_size}")
    if not epsilon > 0 or not 0 < delta < 1 or not 0 < rho <= math.pi:
        raise InputError(f"need ε > 0, 0 < δ < 1 and ρ ∈ (0, π]; got ε={epsilon}, δ={delta}, ρ={rho}")
    if math.isinf(epsilon):
        return 0.0
    sens = mean_sensitivity(cluster_size, rho)
    if epsilon <= 1.0:
        return sens / epsilon * math.sqrt(2.0 * math.log(1.25 / delta))
    return analytic_gaussian_sigma(sens, epsilon, delta)


@dataclass(frozen=True)
class DPLCResult:
    """Released cluster centres ``p̂`` ``[q, D]`` (unit rows, what leaves the client), with
    the noise-free ``p/‖p‖`` (for analysis and tests only), cluster sizes and noise stds."""

    centres: torch.Tensor
    clean: torch.Tensor
    sizes: tuple[int, ...]
    sigmas: tuple[float, ...]


def dplc(W: torch.Tensor, rho: float, min_cluster: int, queries: int, epsilon: float, delta: float,
         generator: torch.Generator | None = None) -> DPLCResult:
    """PrivacyFace Alg. 1 on class centres ``W`` ``[n, D]`` (rows normalized first).

    Args:
        rho: cluster margin ρ (angle, radians).
        min_cluster: minimum cluster size ``T`` (line 6).
        queries: maximum number of queries ``Q``.
        epsilon, delta: privacy budget of each query.
        generator: source of the Gaussian noise (line 7).
    """
    if W.dim() != 2 or W.shape[0] == 0:
        raise InputError(f"DPLC needs a non-empty [n, D] matrix of class centres, got {list(W.shape)}")
    if min_cluster < 1 or queries < 1:
        raise InputError(f"need T ≥ 1 and Q ≥ 1, got T={min_cluster}, Q={queries}")
    W = unit(W.detach().double())
    cos_rho = math.cos(rho)
    close = (W @ W.t()) >= cos_rho            # θ_ij ≤ ρ  (line 1, compared as cosines)
    remaining = torch.ones(W.shape[0], dtype=torch.bool)
    centres, clean, sizes, sigmas = [], [], [], []
    for _ in range(queries):                                              # line 2
        if not bool(remaining.any()):
            break
        counts = (close & remaining[None, :] & remaining[:, None]).sum(1)  # |S_i| over i ∈ I (line 3)
        o = int(torch.argmax(counts))                                     # densest (line 4)
        members = close[o] & remaining
        size = int(members.sum())
        if size < min_cluster:                                            # line 6 / break
            break
        p = W[members].mean(0)                                            # line 5
        sigma = dplc_sigma(size, rho, epsilon, delta)
        v = torch.randn(W.shape[1], generator=generator, dtype=torch.float64) * sigma   # line 7
        centres.append(unit(p + v))                                       # line 8
        p_dir = unit(p)
        clean.append(p_dir)
        remaining &= ~((W @ p_dir) >= cos_rho)                            # line 8: I ← I \ cap(p/‖p‖)
        sizes.append(size)
        sigmas.append(sigma)
    D = W.shape[1]
    stack = (lambda xs: torch.stack(xs).float()) if centres else (lambda xs: torch.zeros(0, D))
    return DPLCResult(stack(centres), stack(clean), tuple(sizes), tuple(sigmas))


__all__ = ["dplc", "dplc_sigma", "DPLCResult", "mean_sensitivity", "gaussian_delta", "analytic_gaussian_sigma"]
