"""User-level differential privacy for FedAvg: the parts a device and a server share.

DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018, *Learning Differentially Private Recurrent
Language Models*, Alg. 1): each sampled user's model update ``Δ_k = w_k − w`` is clipped to
L2 norm ``C``; the server adds Gaussian noise ``N(0, σ²·S²)`` to the weighted sum of the
clipped updates and divides by a **fixed** denominator, where ``S`` bounds how much one
user can change the sum.

Estimator (why this one). McMahan et al. give two estimators of the weighted average for
user weights ``w_k = min(n_k / ŵ, 1)`` (``n_k`` = the user's sample count, capped at ``ŵ``):

* ``f̃_f = Σ_{k∈round} w_k Δ_k / (q·W)`` — the *fixed-denominator* estimator; adding or
  removing one user changes the numerator by at most ``w_k·C ≤ C`` and the denominator not
  at all, so the sensitivity is ``C / (q·W)``;
* ``f̃_c = Σ w_k Δ_k / max(q·W_min, Σ_{k∈round} w_k)`` — the *clipped* estimator, with
  sensitivity ``2C / (q·W_min)``.

We use ``f̃_f``: it needs half the noise for the same ``C``, and the data-dependent
denominator of ``f̃_c`` is what makes plain weighted FedAvg (``Σ n_k w_k / Σ n_k``)
unboundedly sensitive: one user claiming a huge ``n_k`` takes over the average. Capping
``w_k ≤ 1`` is what keeps the weighted sum's sensitivity at ``C``. The price: ``f̃_f`` is
unbiased only when ``W`` is the population's true total weight; we take ``W = N`` (every
user counted with the maximal weight 1), which shrinks the step by ``Σ w / N`` when users
have fewer than ``ŵ`` samples — choose ``ŵ`` at or below the typical ``n_k`` (``ŵ = 1``:
every user weighs the same).

Everything here is float64 numpy and torch-free, so the ORT (torch-free) device runtime,
the torch runtime, the server and the simulator clip with one definition.

Not covered: floating-point Gaussian samplers leak through their low bits (Mironov 2012,
*On significance of the least significant bits for differential privacy*); the noise here
is numpy's float64 Gaussian, as in most DP libraries' simulation paths.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import InputError

__all__ = ["DpParams", "clip_delta", "clip_flat_update", "user_weight", "gaussian_noise", "noise_std", "NOISE_TAIL"]

NOISE_TAIL = 8.0
"""Distributed DP noise: a secure round's fixed-point range holds the clipped input plus this many
standard deviations of a device's noise (a coordinate beyond it — probability 2Φ(−8) ≈ 1e-15 — is
clipped). Weight rounds (:func:`server_agg.secagg_rounds.dp_range`) and statistics rounds
(:func:`fedfs_sdk.stats.privacy.packed_range`)."""


@dataclass(frozen=True)
class DpParams:
    """The DP-FedAvg mechanism of one round.

    Attributes:
        clip: ``C``, the L2 bound on one user's update ``Δ = w_c − w``.
        noise_multiplier: ``σ``, the noise std in units of the sum's sensitivity ``C``.
        denominator: the fixed denominator ``q·W`` of the estimator ``f̃_f`` (``W = N``).
        weight_cap: ``ŵ``: a user with ``n`` samples weighs ``min(n / ŵ, 1)``.
    """

    clip: float
    noise_multiplier: float
    denominator: float
    weight_cap: int = 1

    def __post_init__(self) -> None:
        for name in ("clip", "denominator"):
            v = getattr(self, name)
            if not _finite(v) or v <= 0:
                raise InputError(f"DP {name} must be a finite number > 0, got {v!r}")
        if not _finite(self.noise_multiplier) or self.noise_multiplier < 0:
            raise InputError(f"DP noise_multiplier must be a finite number ≥ 0, got {self.noise_multiplier!r}")
        if isinstance(self.weight_cap, bool) or not isinstance(self.weight_cap, int) or self.weight_cap < 1:
            raise InputError(f"DP weight_cap must be an integer ≥ 1, got {self.weight_cap!r}")

    @property
    def std(self) -> float:
        """Per-coordinate noise std on the *average*: ``σ·C / (q·W)``."""
        return noise_std(self.noise_multiplier, self.clip, self.denominator)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DpParams":
        if not isinstance(d, Mapping):
            raise InputError(f"DP parameters must be an object, got {type(d).__name__}")
        try:
            return cls(clip=float(d["clip"]), noise_multiplier=float(d["noise_multiplier"]),
                       denominator=float(d["denominator"]), weight_cap=int(d.get("weight_cap", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"invalid DP parameters {dict(d)!r}: {e}") from None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def clip_delta(delta: np.ndarray, clip: float) -> tuple[np.ndarray, float, bool]:
    """``Δ · min(1, C/‖Δ‖₂)`` in float64; returns ``(clipped Δ, ‖Δ‖ before, clipped?)``.

    The scaling is done in float64 so the result's norm is ``C`` up to float64 rounding
    (a relative 1e-15), never the float32 rounding of a weight cast.
    """
    if not _finite(clip) or clip <= 0:
        raise InputError(f"clip norm must be a finite number > 0, got {clip!r}")
    d = np.asarray(delta, dtype=np.float64)
    norm = float(np.linalg.norm(d))
    if not math.isfinite(norm):
        raise InputError("the update has a non-finite entry; it cannot be clipped")
    if norm <= clip:
        return d, norm, False
    return d * (clip / norm), norm, True


def clip_flat_update(new: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                     clip: float) -> tuple[dict[str, np.ndarray], float, bool]:
    """Clip the update of a state dict of arrays: ``w + clip(w_c − w)`` over floating keys.

    Non-floating entries (integer buffers) are passed through. Returns the new arrays in
    each reference array's dtype, the norm before clipping and whether it was clipped. The
    device runs this before encoding its upload (so what leaves the device is already
    bounded); the server clips again (it cannot trust the device).
    """
    keys = [k for k, r in ref.items() if np.issubdtype(np.asarray(r).dtype, np.floating)]
    missing = [k for k in keys if k not in new]
    if missing:
        raise InputError(f"the update lacks {missing[:5]} of the model")
    flat = np.concatenate([(np.asarray(new[k], np.float64) - np.asarray(ref[k], np.float64)).ravel()
                           for k in keys]) if keys else np.zeros(0)
    clipped, norm, was = clip_delta(flat, clip)
    out = dict(new)
    if was:
        off = 0
        for k in keys:
            r = np.asarray(ref[k])
            n = r.size
            out[k] = (r.astype(np.float64) + clipped[off:off + n].reshape(r.shape)).astype(r.dtype)
            off += n
    return out, norm, was


def user_weight(num_samples: int, weight_cap: int) -> float:
    """``w_k = min(n_k / ŵ, 1)`` (McMahan et al. 2018, §2): bounds one user's weight by 1."""
    if num_samples <= 0 or weight_cap < 1:
        raise InputError(f"need num_samples > 0 and weight_cap ≥ 1, got {num_samples}, {weight_cap}")
    return min(num_samples / weight_cap, 1.0)


def noise_std(noise_multiplier: float, clip: float, denominator: float) -> float:
    """``σ·C / (q·W)``: the per-coordinate std of the noise on the estimated average update."""
    return float(noise_multiplier) * float(clip) / float(denominator)


def gaussian_noise(rng: np.random.Generator, size: int, noise_multiplier: float, clip: float) -> np.ndarray:
    """``N(0, (σ·C)²)`` per coordinate: the noise added once per round to the weighted *sum*
    of clipped updates (its sensitivity is ``C`` under ``w_k ≤ 1``)."""
    return rng.normal(0.0, float(noise_multiplier) * float(clip), size=int(size))
