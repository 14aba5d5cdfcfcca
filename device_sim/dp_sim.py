"""User-level DP-FedAvg in the simulator (``fedfs simulate --dp-epsilon / --dp-noise``).

The same mechanism the HTTP server runs (:mod:`server_agg.dp`, McMahan et al. 2018): each
round samples every client independently with probability ``q = p`` (Poisson, from the
federation's checkpointed sampler — the accountant's amplification assumes it), clips each
participant's update of the ``global`` parameters to ``C`` in float64, sums them with
weights ``min(n/ŵ, 1)``, adds ``N(0, σ²C²)`` per coordinate and divides by ``q·N``
(the fixed-denominator estimator, :mod:`fedfs_sdk.federation.dp`). Private groups (FedFS's ``θ_c``,
FedUV's codeword) never leave a device and are not privatized.

Only the global FedAvg is covered: methods whose server reads per-client uploads
(FedAwS/FedGC class embeddings, PrivacyFace cluster centres — they override
``FederatedMethod.receive``) are refused, as is a distributed run (the noise would have to
be drawn once across ranks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from fedfs_sdk.federation.dp import DpParams
from fedfs_sdk.errors import InputError
from server_agg.dp import DpFedAvg, calibrate_noise, default_delta, epsilon

from .experiment import ExperimentConfig
from .methods.base import FederatedMethod

__all__ = ["SimDp", "from_experiment", "check_dp_method"]


@dataclass
class SimDp:
    """The DP settings of one simulated federation.

    Attributes:
        clip: ``C``.
        noise_multiplier: ``σ`` (0: clipping only, ε = ∞).
        delta: the δ ε is reported at.
        q: per-round sampling rate (``--participation``).
        num_clients: ``N`` (the fixed denominator is ``q·N``).
        seed: seeds the noise (with the round number): reproducible runs.
        weight_cap: ``ŵ`` (1: every client weighs the same).
        target_epsilon: the ε σ was calibrated for (None: σ given).
    """

    clip: float
    noise_multiplier: float
    delta: float
    q: float
    num_clients: int
    seed: int = 0
    weight_cap: int = 1
    target_epsilon: float | None = None

    def __post_init__(self) -> None:
        self.norms: list[float] = []     # every participant's ‖Δ‖ before clipping (all rounds)
        if not 0 < self.q <= 1:
            raise InputError(f"DP needs a sampling rate in (0, 1], got --participation {self.q}")
        self.params = DpParams(self.clip, self.noise_multiplier, self.q * self.num_clients, self.weight_cap)

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        """Poisson sampling: each client independently with probability ``q`` (sorted ids;
        possibly empty — the round then publishes noise only, as DP-FedAvg does)."""
        return np.flatnonzero(rng.random(self.num_clients) < self.q)

    def accumulator(self, global_weights: Mapping[str, torch.Tensor], round_idx: int) -> DpFedAvg:
        rng = np.random.default_rng([self.seed, round_idx, 0xD9])
        return DpFedAvg(global_weights, self.params, rng=rng)

    def add_chunk(self, acc: DpFedAvg, stacked: Mapping[str, torch.Tensor], num_samples: torch.Tensor) -> None:
        """Add a trained chunk's ``global`` parameters (``[K, ...]`` per key) in one step."""
        before = len(acc.norms)
        acc.add_stacked(stacked, num_samples.tolist())
        self.norms.extend(acc.norms[before:])

    def epsilon(self, rounds: int) -> float:
        return epsilon([(self.q, self.noise_multiplier, rounds)], self.delta)

    def record(self, rounds: int) -> dict[str, Any]:
        """The results.json ``dp`` field of a method's row."""
        eps = self.epsilon(rounds)
        return {"epsilon": eps if math.isfinite(eps) else "inf", "delta": self.delta,
                "target_epsilon": self.target_epsilon, "noise_multiplier": self.noise_multiplier,
                "clip": self.clip, "sampling_rate": self.q, "rounds": rounds, "denominator": self.params.denominator,
                "noise_std": self.params.std, "weight_cap": self.weight_cap, "accountant": "rdp", "unit": "user",
                "update_norm_median": float(np.median(self.norms)) if self.norms else None,
                "clipped_fraction": float(np.mean(np.asarray(self.norms) > self.clip)) if self.norms else None}


def check_dp_method(method: FederatedMethod) -> None:
    """Refuse a method DP-FedAvg does not cover (its server reads per-client uploads)."""
    if type(method).receive is not FederatedMethod.receive or method.local_only or not method.trains:
        raise InputError(f"--dp-* covers the FedAvg of global weights only; method {method.label!r} "
                         "reads per-client uploads on the server or does not federate — run it without --dp-*")


def from_experiment(cfg: ExperimentConfig, num_clients: int) -> SimDp | None:
    """The run's DP settings from ``--dp-epsilon / --dp-noise / --dp-clip / --dp-delta`` (None: off)."""
    dp, t = cfg.dp, cfg.train
    eps, sigma = dp.dp_epsilon, dp.dp_noise
    if eps is None and sigma is None:
        if dp.dp_clip is not None:
            raise InputError("--dp-clip needs --dp-epsilon or --dp-noise")
        return None
    if eps is not None and sigma is not None:
        raise InputError("give --dp-epsilon (σ is calibrated) or --dp-noise (σ), not both")
    clip = dp.dp_clip
    if clip is None:
        raise InputError("--dp-epsilon / --dp-noise need --dp-clip C (the L2 bound of a client's update)")
    if cfg.runtime.distributed or cfg.runtime.workers > 1:
        raise InputError("--dp-* runs in one process; drop --distributed / --workers")
    delta = dp.dp_delta if dp.dp_delta is not None else default_delta(num_clients)
    q = float(t.participation)
    if eps is not None:
        if not eps > 0:
            raise InputError(f"--dp-epsilon must be > 0 (inf: no noise), got {eps}")
        sigma = calibrate_noise(eps, delta, q, max(int(t.rounds), 1))
    elif sigma < 0:
        raise InputError(f"--dp-noise must be ≥ 0, got {sigma}")
    return SimDp(clip=float(clip), noise_multiplier=float(sigma), delta=float(delta), q=q,
                 num_clients=num_clients, seed=int(t.seed), target_epsilon=eps)
