"""Optional differential privacy on a statistics round's sums (issue 29: "DP optional on the same sums").

The Gaussian mechanism (Dwork & Roth 2014, Thm A.1; the weight rounds' DP-FedAvg noise,
:func:`fedfs_sdk.federation.dp.gaussian_noise`, is the same mechanism): the unit is one **device**
(add or remove one device's whole contribution). A statistic's contribution has segments of very
different scale (``Σ e``, ``Σ e²``, ``n``), each with its own L2 bound ``Δ_j``
(:func:`~.contributions.sensitivity`). Divided segment-wise by ``Δ_j``, one device moves the
statistic by at most ``√k`` in L2 (``k`` segments); Gaussian noise of std ``z·√k`` per coordinate
there is the Gaussian mechanism with **noise multiplier z**. Back in the sum's units:

    σ_j = z · √k · Δ_j          (per element of segment j)            — :func:`noise_std`

so each segment is drowned in proportion to its own bound (a count is not buried under noise sized
for second moments). A round with ``S`` statistics composes ``S`` such mechanisms: its ε at δ is that
of ``S`` Gaussian mechanisms at ``z`` (:func:`round_epsilon`, ``dp-accounting``; equivalently one at
``z/√S``). No sampling amplification is claimed: every eligible device is invited (``q = 1``).

Where the noise is added (the weight rounds' two semantics, ``dp_noise``):

* ``central``: the server adds ``N(0, σ_j²)`` to the unmasked sum once (:func:`add_noise`);
* ``distributed``: each device adds ``N(0, σ_j²/m)`` to its own clipped contribution before masking
  (:func:`device_noise`, packed units), ``m`` the fewest inputs the server may unmask (the round's
  threshold), so any sum it may learn holds at least ``σ_j²`` (``count/m ·σ_j²`` in all).

The bounds make the noise: ``σ`` grows with ``max_photos·bound²``. The default bounds of the
automatic rounds (:data:`~.contributions.EMBEDDING_BOUND` = 1e3) only stop a malicious device; under DP
pick them near the real norms (a photo above the bound is clipped), docs/personalization.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import InputError
from ..federation.dp import NOISE_TAIL, gaussian_noise
from .contributions import sensitivity

NOISE_MODES = ("central", "distributed")


@dataclass(frozen=True)
class StatsDp:
    """A statistics round's DP parameters (the task's ``dp`` field, chosen by the operator).

    Attributes:
        noise_multiplier: ``z`` (noise std in units of each segment's sensitivity, ×√k).
        noise: ``central`` (the server adds it) or ``distributed`` (each device adds 1/m of the variance).
        delta: the δ at which the round's ε is reported (None: the server's choice, ``N^-1.1``).
    """

    noise_multiplier: float
    noise: str = "central"
    delta: float | None = None

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0 or z > 1e6:
            raise InputError(f"statistics DP noise_multiplier must be a finite number in [0, 1e6], got {z!r}")
        if self.noise not in NOISE_MODES:
            raise InputError(f"statistics DP noise must be one of {NOISE_MODES}, got {str(self.noise)[:40]!r}")
        d = self.delta
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1):
            raise InputError(f"statistics DP delta must be in (0, 1), got {d!r}")

    def to_json(self) -> dict[str, Any]:
        return {"noise_multiplier": float(self.noise_multiplier), "noise": self.noise, "delta": self.delta}

    @classmethod
    def from_json(cls, d: Any) -> "StatsDp | None":
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise InputError(f"statistics DP parameters must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - {"noise_multiplier", "noise", "delta"})
        if unknown:
            raise InputError(f"statistics DP parameters: unknown field(s) {unknown} (noise_multiplier, noise, delta)")
        if "noise_multiplier" not in d:
            raise InputError("statistics DP parameters need noise_multiplier (z)")
        delta = d.get("delta")
        return cls(d["noise_multiplier"], str(d.get("noise", "central")), None if delta is None else delta)


def noise_std(kind: str, length: int, bound: float, max_photos: int, z: float) -> np.ndarray:
    """``σ`` per element of one statistic's sum: ``z·√k·Δ_j`` (module docstring)."""
    segs = sensitivity(kind, length, bound, max_photos)
    out = np.zeros(int(length))
    root_k = math.sqrt(len(segs))
    for idx, delta in segs:
        out[idx] = float(z) * root_k * delta
    return out


def spec_std(spec: Any, max_photos: int, z: float) -> np.ndarray:
    """:func:`noise_std` of a :class:`~.transport.StatSpec` (anything with kind, length, bound)."""
    return noise_std(spec.kind, spec.length, spec.bound, max_photos, z)


def add_noise(sums: Mapping[str, np.ndarray], specs: Sequence[Any], max_photos: int, z: float,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Central noise: ``sums[name] + N(0, σ²)`` per statistic (``σ`` = :func:`spec_std`) — the server's
    and the simulator's one function. Statistics not in ``specs`` are refused (no unnoised leftovers)."""
    by = {s.name: s for s in specs}
    missing = sorted(set(sums) - set(by))
    if missing:
        raise InputError(f"DP noise: no bound for statistic(s) {missing}; every published statistic needs one")
    out = {}
    for name, v in sums.items():
        v = np.asarray(v, dtype=np.float64)
        std = spec_std(by[name], max_photos, z)
        if std.shape != v.shape:
            raise InputError(f"statistic {name!r}: {v.size} numbers, its spec {std.size}")
        out[name] = v + gaussian_noise(rng, v.size, 1.0, 1.0) * std
    return out


def packed_std(task: Any, z: float) -> np.ndarray:
    """``σ`` per element of a task's **packed** vector (:func:`~.transport.pack`: each element divided
    by its largest magnitude)."""
    return np.concatenate([spec_std(s, task.max_photos, z) / s.scales(task.max_photos) for s in task.stats])


def device_noise(task: Any, z: float, min_inputs: int, rng: np.random.Generator) -> np.ndarray:
    """Distributed noise of one device, packed units: ``N(0, σ²/m)`` per element — added to its packed
    contribution before masking, so a sum of ``≥ m`` devices holds at least the central ``σ²``."""
    if isinstance(min_inputs, bool) or not isinstance(min_inputs, int) or min_inputs < 1:
        raise InputError(f"distributed noise needs min_inputs ≥ 1, got {min_inputs!r}")
    std = packed_std(task, z) / math.sqrt(min_inputs)
    return gaussian_noise(rng, std.size, 1.0, 1.0) * std


def packed_range(task: Any, z: float, min_inputs: int) -> float:
    """The fixed-point range of a distributed-noise round: ``1 + 8·max σ_packed/√m`` (the weight
    rounds' ``C + 8σC/√m``)."""
    return 1.0 + NOISE_TAIL * float(packed_std(task, z).max(initial=0.0)) / math.sqrt(min_inputs)


def round_epsilon(z: float, statistics: int, delta: float) -> float:
    """ε at ``delta`` of one round with ``statistics`` Gaussian mechanisms at multiplier ``z`` (no
    sampling: ``q = 1``), from the weight rounds' accountant
    (:func:`fedfs_sdk.federation.dp_account.epsilon`, RDP); ``z = 0`` → ∞."""
    from ..federation.dp_account import epsilon

    return epsilon([(1.0, float(z), int(statistics))], float(delta))


def mechanism(specs: Sequence[Any], max_photos: int, dp: StatsDp, count: int, delta: float,
              min_inputs: int | None = None) -> dict[str, Any]:
    """What a published sum says about its noise: ``z``, where it was added, per statistic the
    segments' sensitivities and σ (for ``distributed``, ``σ·√(count/m)``: what the sum holds),
    the contributors and the round's (ε, δ)."""
    z = float(dp.noise_multiplier)
    grow = math.sqrt(count / min_inputs) if dp.noise == "distributed" and min_inputs else 1.0
    stats = {}
    for s in specs:
        segs = sensitivity(s.kind, s.length, s.bound, max_photos)
        root_k = math.sqrt(len(segs))
        stats[s.name] = {"bound": float(s.bound), "sensitivity": [float(d) for _, d in segs],
                         "std": [z * root_k * float(d) * grow for _, d in segs]}
    eps = round_epsilon(z, len(specs), delta)
    return {"mechanism": "gaussian", "unit": "device", "noise_multiplier": z, "noise": dp.noise,
            "min_inputs": min_inputs, "contributors": int(count), "max_photos": int(max_photos),
            "statistics": stats, "delta": float(delta), "epsilon": eps if math.isfinite(eps) else "inf",
            "accountant": "rdp", "effective_noise_multiplier": z / math.sqrt(max(len(specs), 1))}


__all__ = ["StatsDp", "NOISE_MODES", "noise_std", "spec_std", "add_noise", "packed_std", "device_noise",
           "packed_range", "round_epsilon", "mechanism"]
