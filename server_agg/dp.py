"""User-level DP-FedAvg on the server: the privacy accountant, the budget, and the noisy
round aggregate (McMahan et al. 2018, *Learning Differentially Private Recurrent Language
Models*; the estimator and its sensitivity are explained in :mod:`fedfs_sdk.federation.dp`).

* :func:`epsilon` — ε at a given δ after a sequence of rounds, each a Poisson-subsampled
  Gaussian mechanism ``(q, σ)``, from Google's ``dp-accounting`` library (RDP — Mironov
  2017, with the subsampled-Gaussian bound of Mironov, Talwar & Zhang 2019 — or PLD).
  The accounting is per **user** (add/remove one user's whole data), because a round's
  mechanism bounds one user's whole update.
* :class:`Ledger` — the rounds charged so far, persisted by the coordinator; a round is
  charged when it is *opened* (its participants learn the model and a failed round still
  reveals who uploaded), so a crash never under-counts.
* :class:`DpFedAvg` — drop-in for :class:`~server_agg.aggregate.StreamingFedAvg` in a DP
  round: accumulates ``Σ w_k · clip_C(w_c − w)`` in float64 and returns
  ``w + (Σ + N(0, σ²C²)) / (q·N)``. Under secure aggregation the devices clip and weigh
  their own updates and the sum arrives unmasked (:meth:`DpFedAvg.add_secure_sum`); the
  noise is added here, centrally, once.

Sampling must be Poisson with rate ``q`` and secret for the amplification the accountant
assumes: the coordinator samples DP rounds with :class:`random.SystemRandom`, each eligible
device independently (not the seeded fixed-size sample of non-DP rounds).
"""
from __future__ import annotations

import functools
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedfs_sdk.federation.dp import DpParams, clip_delta, gaussian_noise, user_weight
from fedfs_sdk.federation.dp_account import ACCOUNTANTS, calibrate_noise, default_delta, epsilon, require_accountant
from fedfs_sdk.errors import InputError

from .aggregate import check_num_samples

__all__ = ["ACCOUNTANTS", "epsilon", "calibrate_noise", "Ledger", "DpFedAvg", "DpParams", "default_delta",
           "dp_epsilon_cached", "publish_record", "require_accountant"]


@dataclass
class Ledger:
    """Rounds charged to the privacy budget: counts per ``(q, σ)``, plus rounds that ran
    without DP (any of those makes ε infinite for the models that follow)."""

    counts: dict[tuple[float, float], int] = field(default_factory=dict)
    non_private: int = 0

    def charge(self, q: float, sigma: float) -> "Ledger":
        c = dict(self.counts)
        key = (float(q), float(sigma))
        c[key] = c.get(key, 0) + 1
        return Ledger(c, self.non_private)

    def charge_non_private(self) -> "Ledger":
        return Ledger(dict(self.counts), self.non_private + 1)

    @property
    def rounds(self) -> int:
        return sum(self.counts.values())

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        if self.non_private:
            return math.inf
        return epsilon(((q, s, n) for (q, s), n in sorted(self.counts.items())), delta, accountant)

    def to_json(self) -> str:
        return json.dumps({"counts": [[q, s, n] for (q, s), n in sorted(self.counts.items())],
                           "non_private": self.non_private})

    @classmethod
    def from_json(cls, text: str | None) -> "Ledger":
        if not text:
            return cls()
        d = json.loads(text)
        return cls({(float(q), float(s)): int(n) for q, s, n in d.get("counts", [])}, int(d.get("non_private", 0)))


class DpFedAvg:
    """The DP-FedAvg round aggregate (fixed-denominator estimator ``f̃_f``).

    Same interface as :class:`~server_agg.aggregate.StreamingFedAvg` (``add``, ``count``,
    ``total_samples``, ``result``), so the coordinator swaps it in for a DP round. Each added
    update is re-clipped here in float64 (the coordinator's ``max_update_norm`` clip casts
    back to float32, which may leave the norm an ulp above ``C``).

    Args:
        reference: the round's global model ``w``.
        params: the round's mechanism.
        rng: the noise generator (default: seeded from the OS's CSPRNG).
    """

    def __init__(self, reference: Mapping[str, torch.Tensor], params: DpParams,
                 rng: np.random.Generator | None = None) -> None:
        self.reference = {k: v.detach().cpu() for k, v in reference.items()}
        self.keys = [k for k, v in self.reference.items() if v.is_floating_point()]
        self._ref_flat = np.concatenate([self.reference[k].double().numpy().ravel() for k in self.keys]) \
            if self.keys else np.zeros(0)
        self.params = params
        self.rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        self._sum = np.zeros_like(self._ref_flat)
        self.count = 0
        self.total_samples = 0
        self.weight_sum = 0.0
        self.clipped = 0
        self.norms: list[float] = []   # ‖Δ‖ before clipping, per added update (for choosing C)

    def add(self, weights: Mapping[str, torch.Tensor], num_samples: int) -> None:
        """Add ``w_k · clip_C(w_c − w)`` with ``w_k = min(n/ŵ, 1)``."""
        n = check_num_samples(num_samples)
        missing = [k for k in self.keys if k not in weights]
        if missing:
            raise InputError(f"update lacks {missing[:5]}")
        flat = np.concatenate([weights[k].detach().cpu().double().numpy().ravel() for k in self.keys]) \
            if self.keys else np.zeros(0)
        if flat.shape != self._ref_flat.shape:
            raise InputError(f"update has {flat.size} floating values, the model {self._ref_flat.size}")
        delta, norm, was = clip_delta(flat - self._ref_flat, self.params.clip)
        self.norms.append(norm)
        wk = user_weight(n, self.params.weight_cap)
        self._sum += wk * delta
        self.count += 1
        self.total_samples += n
        self.weight_sum += wk
        self.clipped += int(was)

    def add_stacked(self, stacked: Mapping[str, torch.Tensor], num_samples: Sequence[int]) -> None:
        """:meth:`add` for ``K`` updates at once (``[K, ...]`` per key, the simulator's trained
        chunk): the same float64 clipping and weights, as one matrix product instead of a
        Python loop over clients."""
        ns = [check_num_samples(int(n)) for n in num_samples]
        missing = [k for k in self.keys if k not in stacked]
        if missing:
            raise InputError(f"update lacks {missing[:5]}")
        if not ns:
            return
        k_ = len(ns)
        flat = np.concatenate([stacked[k].detach().cpu().double().reshape(k_, -1).numpy() for k in self.keys],
                              axis=1) if self.keys else np.zeros((k_, 0))
        if flat.shape[1] != self._ref_flat.size:
            raise InputError(f"update has {flat.shape[1]} floating values, the model {self._ref_flat.size}")
        delta = flat - self._ref_flat
        norms = np.linalg.norm(delta, axis=1)
        if not np.isfinite(norms).all():
            raise InputError("an update has a non-finite entry; it cannot be clipped")
        clip = self.params.clip
        scale = np.where(norms > clip, clip / np.maximum(norms, np.finfo(np.float64).tiny), 1.0)
        wk = np.array([user_weight(n, self.params.weight_cap) for n in ns])
        self._sum += (wk * scale) @ delta
        self.norms.extend(norms.tolist())
        self.count += k_
        self.total_samples += sum(ns)
        self.weight_sum += float(wk.sum())
        self.clipped += int((norms > clip).sum())

    def add_secure_sum(self, weighted_sum: np.ndarray, count: int) -> None:
        """Take a secure-aggregation round's unmasked sum instead of individual updates.

        ``weighted_sum`` is ``Σ_k w_k Δ_k`` over **all** tensors sorted by name (the secure
        layout of :func:`fedfs_sdk.federation.secagg.http_device.flatten_update`): the devices
        clipped and weighed their own updates (:func:`fedfs_sdk.federation.secagg.dp_input.dp_input`).
        The server cannot re-clip here — it never sees one update — and coordinates of integer
        buffers are ignored (not privatized, as in :meth:`add`). ``total_samples`` is not
        known (nobody learns ``Σ min(n_k, ŵ)``)."""
        if count < 1:
            raise InputError(f"a secure DP sum needs ≥ 1 input; got {count}")
        names = sorted(self.reference)
        offsets, at = {}, 0
        for k in names:
            offsets[k] = at
            at += self.reference[k].numel()
        vec = np.asarray(weighted_sum, dtype=np.float64)
        if vec.shape != (at,):
            raise InputError(f"the unmasked sum has shape {vec.shape}, the model {at} values")
        flat = np.concatenate([vec[offsets[k]:offsets[k] + self.reference[k].numel()] for k in self.keys]) \
            if self.keys else np.zeros(0)
        self._sum += flat
        self.count += int(count)

    def noisy_average_update(self, add_noise: bool = True) -> np.ndarray:
        """``(Σ w_k Δ_k + N(0, σ²C²)) / (q·N)``: fresh noise on every call. ``add_noise=False``:
        the sum already carries it (distributed noise under secure aggregation)."""
        p = self.params
        if not add_noise:
            return self._sum / p.denominator
        noise = gaussian_noise(self.rng, self._sum.size, p.noise_multiplier, p.clip)
        return (self._sum + noise) / p.denominator

    def result(self, add_noise: bool = True) -> dict[str, torch.Tensor]:
        """``w + f̃_f + noise`` as a state dict in the reference dtypes (non-floating
        buffers keep the global model's values: they are not privatized)."""
        upd = self.noisy_average_update(add_noise)
        out: dict[str, torch.Tensor] = {}
        off = 0
        for k, ref in self.reference.items():
            if k in self.keys:
                n = ref.numel()
                new = ref.double() + torch.from_numpy(upd[off:off + n].reshape(tuple(ref.shape)))
                out[k] = new.to(ref.dtype)
                off += n
            else:
                out[k] = ref.clone()
        return out


def publish_record(ledger: Ledger, delta: float, budget: float | None, accountant: str,
                   params: DpParams | None, q: float | None) -> dict[str, Any]:
    """The (ε, δ) statement published with a model version / in the status."""
    eps = ledger.epsilon(delta, accountant)
    return {"epsilon": eps if math.isfinite(eps) else "inf", "delta": delta, "accountant": accountant,
            "rounds_charged": ledger.rounds, "non_private_rounds": ledger.non_private,
            "epsilon_budget": budget, "noise_multiplier": params.noise_multiplier if params else None,
            "clip": params.clip if params else None, "sampling_rate": q,
            "denominator": params.denominator if params else None,
            "weight_cap": params.weight_cap if params else None, "unit": "user"}


def ledger_groups(ledger: Ledger) -> Sequence[tuple[float, float, int]]:
    return [(q, s, n) for (q, s), n in sorted(ledger.counts.items())]


@functools.lru_cache(maxsize=256)
def dp_epsilon_cached(ledger_json: str, delta: float, accountant: str) -> float:
    """:meth:`Ledger.epsilon` memoized on the ledger's JSON (the server's tick asks often)."""
    return Ledger.from_json(ledger_json).epsilon(delta, accountant)
