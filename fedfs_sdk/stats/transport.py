"""How a statistics round's contributions travel: a secure sum (the weight rounds' secure-aggregation
protocol, :mod:`fedfs_sdk.federation.secagg`, run by the same code on both sides — ``fedfs-secagg/2``
with certified identities where the server pins an operator CA, else ``fedfs-secagg/1``) or — only
when the operator opts in by name — a plain sum that reveals each device's vector to the server.

A round's :class:`StatsTask` names the statistics, their lengths and clip bounds, the model version
(and ξ) they are computed under and the fewest contributors whose sum may be published. A device packs its
contribution (:func:`pack`: each segment divided by its largest possible magnitude, so every number
lies in ``[-1, 1]`` before the fixed-point encoding of :class:`~fedfs_sdk.federation.secagg.encoding.FixedPoint`)
and the server unpacks the sum (:func:`unpack`). :class:`StatsDevicePolicy` refuses a plain round when the
device requires secure aggregation, and carries the device's secure-aggregation floor.

Precision: packed numbers are encoded with ``2^-46`` steps (each device's weight is 1, so up to
16,384 devices fit the 64-bit ring) and the server decodes the statistics round's sum in float64:
each element comes back to ``2^-47`` of its *scale* (``max_photos·bound²`` for second moments)
times the count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..errors import InputError
from .contributions import MAX_PHOTOS, MIN_CONTRIBUTORS, feature_dim

from ..federation.secagg.encoding import FixedPoint
from ..federation.secagg.params import SecAggParams
from ..federation.secagg.policy import DevicePolicy

if TYPE_CHECKING:
    from .privacy import StatsDp

SECURE = "secure-sum"
"""The secure sum of weight rounds (pairwise masks, Shamir-shared seeds; the round's ``secagg`` fields
say ``fedfs-secagg/2`` — certified keys, signed roster, consistency check — when the server pins an
operator CA, else ``fedfs-secagg/1``, which a device with the default floors refuses)."""
PLAIN = "plain-sum-reveals-each-device"
TRANSPORTS = (SECURE, PLAIN)


@dataclass(frozen=True)
class StatSpec:
    """One statistic of a round: ``kind`` ``embedding`` (2·D + 1), ``features`` (F + F(F+1)/2 + 1),
    ``checks`` (4 per candidate) or ``tail`` (``P·``:data:`~.tail.TAIL_BINS` counts, :mod:`.tail`), its
    length and the per-photo L2 ``bound``."""

    name: str
    kind: str
    length: int
    bound: float = 1.0

    def scales(self, max_photos: int) -> np.ndarray:
        """The largest magnitude each element of a contribution can reach (its packing divisor)."""
        p, b = float(max_photos), float(self.bound)
        if self.kind == "embedding":
            d = (self.length - 1) // 2
            return np.concatenate([np.full(d, p * b), np.full(d, p * b * b), [p]])
        if self.kind == "features":
            f = feature_dim(self.length)
            return np.concatenate([np.full(f, p * b), np.full(self.length - f - 1, p * b * b), [p]])
        if self.kind == "checks":       # Δmargin ∈ ±8 (margins clipped to ±4), its square ≤ 64, ΔAUROC ∈ ±1, 1
            return np.tile([8.0, 64.0, 1.0, 1.0], self.length // 4)
        if self.kind == "tail":         # counts of ≤ max_photos photos per bin (.tail.tail_histogram)
            return np.full(self.length, p)
        raise InputError(f"unknown statistic kind {self.kind!r} (embedding, features, checks, tail)")


@dataclass(frozen=True)
class StatsTask:
    """What a statistics round asks every sampled device for."""

    round_id: int
    model_version: int
    stats: tuple[StatSpec, ...]
    transport: str = SECURE
    min_contributors: int = MIN_CONTRIBUTORS
    max_photos: int = MAX_PHOTOS
    extra: dict = field(default_factory=dict)
    dp: dict | None = None
    """The round's DP (:class:`~.privacy.StatsDp` as JSON: ``noise_multiplier`` z, ``noise``
    central | distributed, ``delta``), None: no noise. Part of the task, so devices see it and
    authenticated rounds sign it (:func:`stats_context`)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise InputError(f"statistics transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.min_contributors < 2:
            raise InputError("a statistics round needs min_contributors ≥ 2 (one device's 'sum' is its own vector)")
        dp = self.privacy
        if dp is not None:
            object.__setattr__(self, "dp", dp.to_json())        # one canonical form (signed, compared)
            if dp.noise == "distributed" and self.transport != SECURE:
                raise InputError(f"distributed DP noise needs the {SECURE} transport (a plain round shows each "
                                 "device's noisy vector); use noise=central")

    @property
    def privacy(self) -> "StatsDp | None":
        """:attr:`dp` parsed (None: no DP)."""
        from .privacy import StatsDp

        return StatsDp.from_json(self.dp)

    @property
    def dim(self) -> int:
        return sum(s.length for s in self.stats)

    def basis(self, spec: "StatSpec") -> str:
        """What ``spec`` is computed under: ξ (its sha256, from ``extra["xi_sha256"]``) for ξ's
        moments and tail histograms, the global model version for check results. A device contributes one statistic
        at most once per basis, and the server runs it at most once per basis: two sums over
        cohorts that differ by one device would reveal that device's vector."""
        if spec.kind in ("embedding", "features", "tail") and self.extra.get("xi_sha256"):
            return f"xi:{self.extra['xi_sha256']}"
        return f"model:{self.model_version}"

    def keys(self) -> list[str]:
        """``name@basis`` of every statistic (the ledgers' keys, :meth:`basis`)."""
        return [f"{s.name}@{self.basis(s)}" for s in self.stats]

    def to_json(self) -> dict:
        return {**asdict(self), "stats": [asdict(s) for s in self.stats]}

    @classmethod
    def from_json(cls, d: Mapping) -> "StatsTask":
        try:
            return cls(int(d["round_id"]), int(d["model_version"]), tuple(StatSpec(**s) for s in d["stats"]),
                       str(d.get("transport", SECURE)), int(d.get("min_contributors", MIN_CONTRIBUTORS)),
                       int(d.get("max_photos", MAX_PHOTOS)), dict(d.get("extra") or {}), d.get("dp"))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"not a statistics task ({e})") from None


def pack(contribution: Mapping[str, np.ndarray], task: StatsTask) -> np.ndarray:
    """The device's contribution as one vector in ``[-1, 1]`` (each element divided by its largest
    possible magnitude), in the task's order."""
    parts = []
    for s in task.stats:
        v = np.asarray(contribution.get(s.name), dtype=np.float64)
        if v.shape != (s.length,):
            raise InputError(f"statistic {s.name!r}: length {v.size}, the task asks for {s.length}")
        parts.append(v / s.scales(task.max_photos))
    return np.concatenate(parts)


def unpack(vector: np.ndarray, task: StatsTask) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack` on a (summed) vector."""
    v = np.asarray(vector, dtype=np.float64)
    if v.size != task.dim:
        raise InputError(f"a statistics vector of this task has {task.dim} numbers, got {v.size}")
    out, at = {}, 0
    for s in task.stats:
        out[s.name] = v[at:at + s.length] * s.scales(task.max_photos)
        at += s.length
    return out


@dataclass(frozen=True)
class StatsDevicePolicy:
    """A device's floor for statistics rounds: with ``require_secure`` (the default) it refuses a round
    whose transport reveals its vector; ``secagg`` is its secure-aggregation floor (issue 30's
    :class:`DevicePolicy`, secure by default — the device agent passes the one its weight rounds use,
    with its pinned CA). Against a server that pins the operator CA the statistics round runs
    ``fedfs-secagg/2`` and a device with its default floor takes part; a server without a CA runs
    ``fedfs-secagg/1`` (unauthenticated keys), which the default floor refuses — an owner who trusts the
    server to follow the protocol opts in with :meth:`honest_but_curious`."""

    require_secure: bool = True
    secagg: DevicePolicy = field(default_factory=DevicePolicy)

    @classmethod
    def honest_but_curious(cls) -> "StatsDevicePolicy":
        """Secure sums required, ``fedfs-secagg/1`` keys accepted: for a server trusted to follow the
        protocol (what ``--allow-unauthenticated-secagg`` says for weight rounds)."""
        return cls(secagg=DevicePolicy.honest_but_curious())

    def check(self, task: StatsTask) -> None:
        """Refuse a plain round when secure is required, and — the weight rounds' DP floor
        (:meth:`DevicePolicy.check_dp_floor`, ``min_noise_multiplier``) — a round without DP or
        with ``z`` below the floor."""
        if task.transport != SECURE and self.require_secure:
            raise InputError(f"statistics round {task.round_id}: transport {task.transport!r} would show this "
                             f"device's vector to the server; this device requires {SECURE}")
        from ..federation.secagg.errors import RefusedError

        try:
            self.secagg.check_dp_floor(task.privacy, f"statistics round {task.round_id}")
        except RefusedError as e:
            raise InputError(str(e)) from None


STATS_FIXED_POINT = FixedPoint(clip=1.0, scale_bits=46, max_devices=1 << 14, max_samples=1)
"""Packed statistics lie in [-1, 1] and every device weighs 1: 2^-46 steps for up to 16,384 devices."""


def secagg_params(task: "StatsTask", participants: int) -> SecAggParams:
    """Secure-sum parameters of ``task`` without the server's policy (``fedfs-secagg/1``; unit tests
    of the core). Rounds over HTTP take theirs from the ``secagg`` fields the server sends
    (:func:`server_agg.stats_round.stats_fields`, the weight rounds' :func:`params_from_task`)."""
    return SecAggParams(round_id=task.round_id, dim=task.dim, fixed_point=STATS_FIXED_POINT,
                        min_devices=max(3, task.min_contributors), participants=participants)


def stats_context(task: "StatsTask", fields: Mapping) -> bytes:
    """What an authenticated statistics round's signatures bind besides its parameters: the whole
    task (statistics, bounds, model version, ξ) and the secure fields without the device's index —
    and the word ``statistics``, so no advertisement or consistency signature of a statistics round
    verifies in a weight round (whose context is :func:`~fedfs_sdk.federation.secagg.http_device.task_context`)."""
    import json

    doc = {"kind": "fedfs-statistics/1", "task": task.to_json(),
           "secagg": {k: v for k, v in dict(fields).items() if k != "device"}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


__all__ = ["STATS_FIXED_POINT", "secagg_params", "stats_context", "StatSpec", "StatsTask", "StatsDevicePolicy", "pack", "unpack", "SECURE", "PLAIN", "TRANSPORTS"]
