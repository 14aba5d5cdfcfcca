"""A statistics round on the server (issue 29): the federation learns the sum of the devices'
clipped statistics vectors (:mod:`fedfs_sdk.stats`) and the number of contributors, nothing else.

The round's :class:`~fedfs_sdk.stats.transport.StatsTask` names the statistics, their clip bounds, the
model version (and ξ) they are computed under and the fewest contributors whose sum may be published
(:data:`~fedfs_sdk.stats.MIN_CONTRIBUTORS`: with 2 devices a sum of ``f fᵀ`` minus one's own is the
other's). Transport:

* ``secure-sum`` (the default): the devices' packed vectors go through the weight rounds' secure
  aggregation — the same :class:`~server_agg.secagg_rounds.SecAggRound` (phases, deadlines, signed
  roster, consistency check, revocation list) with the fields :func:`stats_fields` derives from the
  server's policy: ``fedfs-secagg/2`` when the server pins an operator CA (``--secagg-ca``), else
  ``fedfs-secagg/1``. Every device weighs 1, so the unmasked weight word is the count;
* ``plain-sum-reveals-each-device``: only when the operator names it (``allow_plain=PLAIN``): each
  vector arrives in the clear and is added; a device that requires secure aggregation refuses it
  (:class:`~fedfs_sdk.stats.transport.StatsDevicePolicy`).

What is published (:meth:`StatsRound.finish`): ``{"task", "count", "sums"}`` — the unpacked sum of the
survivors' statistics, only when at least ``min_contributors`` devices are in it — and, when the task
carries DP (``task.dp``, :mod:`fedfs_sdk.stats.privacy`), ``"dp"``: the mechanism (z, where the noise
was added, σ per statistic's segment, contributors, the round's ε at δ). Central noise is added here
to the unmasked sum; distributed noise arrives inside it (each device added its share).
"""
from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedfs_sdk.errors import InputError
from fedfs_sdk.stats import StatSum
from fedfs_sdk.stats.transport import PLAIN, SECURE, STATS_FIXED_POINT, StatsTask, unpack

from .secagg_rounds import SecAggRound, task_fields
from .store import atomic_write


def stats_fields(policy: Any, task: StatsTask, n_devices: int) -> dict[str, Any]:
    """``secagg`` fields of a statistics round: the weight rounds' (:func:`~.secagg_rounds.task_fields`:
    protocol, CA, SecAgg+ degree, phase timeout) with the statistics' fixed point — packed values in
    ``[-1, 1]``, weight 1 per device, ``2^-46`` steps — at least ``min_contributors`` devices, no DP
    input and the default threshold (``⌊2n/3⌋ + 1``: the operator's weight-round threshold is for
    another ``n``)."""
    fp = STATS_FIXED_POINT
    if n_devices > fp.max_devices:
        raise InputError(f"a statistics round holds at most {fp.max_devices} devices, {n_devices} are eligible")
    fields = task_fields(policy, {"statistics": (task.dim,)}, n_devices)
    for k in ("input", "dp_noise"):
        fields.pop(k, None)
    fields.update(clip=fp.clip, scale_bits=fp.scale_bits, max_devices=fp.max_devices, max_samples=1,
                  threshold=None, min_devices=max(int(policy.secagg_min_devices), int(task.min_contributors)))
    dp = task.privacy
    if dp is not None and dp.noise == "distributed":
        # each device adds N(0, σ²/m) (fedfs_sdk.stats.privacy.device_noise), m = the threshold t of the
        # invited n (a device refuses m > t); the range holds the noise tails, the resolution gives way
        from fedfs_sdk.federation.secagg.params import default_threshold
        from fedfs_sdk.stats.privacy import packed_range

        m = min(default_threshold(max(1, n_devices)), max(1, n_devices))
        clip = packed_range(task, float(dp.noise_multiplier), m)
        fields.update(clip=clip, scale_bits=fp.scale_bits - max(0, math.ceil(math.log2(clip))),
                      dp_noise={"min_inputs": m})
    return fields


class StatsRound:
    """One statistics round: its task, its invited devices (ids), and either the secure round
    (``secagg``) or the plain vectors collected."""

    def __init__(self, task: StatsTask, participants: Sequence[str], allow_plain: str | None = None,
                 secagg: SecAggRound | None = None, opened: float = 0.0, deadline: float = float("inf")) -> None:
        if task.transport == PLAIN and allow_plain != PLAIN:
            raise InputError(f"a plain statistics sum shows the server each device's vector: open it only with "
                             f"allow_plain={PLAIN!r} (the operator's explicit opt-in)")
        if (task.transport == SECURE) != (secagg is not None):
            raise InputError(f"statistics round {task.round_id}: transport {task.transport!r} "
                             + ("needs its secure round" if secagg is None else "runs no secure round"))
        if len(participants) < task.min_contributors:
            raise InputError(f"statistics round {task.round_id}: {len(participants)} device(s) eligible, the task "
                             f"publishes a sum of ≥ {task.min_contributors}")
        self.task, self.participants = task, sorted(str(p) for p in participants)
        self.secagg, self.opened, self.deadline = secagg, opened, deadline
        if secagg is not None:
            secagg.srv.decode_dtype = np.float64       # the sums need the fixed point's full resolution
        self._plain: dict[str, np.ndarray] = {}
        self.published: dict[str, Any] | None = None

    def contribute_plain(self, device: str, packed: np.ndarray) -> None:
        """A device's packed vector in the clear (plain rounds only; once per device)."""
        if self.secagg is not None:
            raise InputError(f"statistics round {self.task.round_id} runs {SECURE}: a plain vector is refused")
        if device not in self.participants:
            raise InputError(f"device {device} was not invited to statistics round {self.task.round_id}")
        if device in self._plain:
            raise InputError(f"device {device} already contributed to statistics round {self.task.round_id}")
        v = np.asarray(packed, dtype=np.float64)
        if v.shape != (self.task.dim,) or not np.isfinite(v).all() or np.abs(v).max(initial=0.0) > 1.0 + 1e-9:
            raise InputError(f"a packed statistics vector has {self.task.dim} finite numbers in [-1, 1]")
        self._plain[device] = v

    @property
    def plain_complete(self) -> bool:
        return len(self._plain) == len(self.participants)

    def close_plain(self) -> dict[str, Any]:
        total = np.sum(list(self._plain.values()), axis=0) if self._plain else np.zeros(self.task.dim)
        return self.finish(total, len(self._plain))

    def finish(self, total: np.ndarray, count: int) -> dict[str, Any]:
        """Publish ``{"task", "count", "sums"}`` of a summed packed vector over ``count`` devices;
        :class:`InputError` (nothing published) when fewer than ``min_contributors``."""
        if count < self.task.min_contributors:
            raise InputError(f"statistics round {self.task.round_id}: {count} contributor(s), fewer than the "
                             f"{self.task.min_contributors} whose sum may be published; nothing published")
        summed = StatSum(unpack(np.asarray(total, dtype=np.float64), self.task), int(count))
        record = {}
        dp = self.task.privacy
        if dp is not None:
            from fedfs_sdk.federation.dp_account import default_delta
            from fedfs_sdk.stats.privacy import add_noise, mechanism

            m = self.secagg.min_inputs if self.secagg is not None and self.secagg.min_inputs else None
            if dp.noise == "central":           # the devices' sum arrived noise-free: add σ once, here
                rng = np.random.default_rng(secrets.randbits(128))
                summed = StatSum(add_noise(summed.sums, self.task.stats, self.task.max_photos,
                                           float(dp.noise_multiplier), rng), summed.count)
            delta = dp.delta if dp.delta is not None else default_delta(len(self.participants))
            record = {"dp": mechanism(self.task.stats, self.task.max_photos, dp, int(count), delta, m)}
        self.published = {"task": self.task.to_json(), **summed.to_dict(), **record}
        return self.published


def save_published(path: Path, published: Mapping[str, Any]) -> None:
    """Persist a published sum (server: what devices download; device: what its next enrollment uses)."""
    atomic_write(Path(path), json.dumps(published, sort_keys=True).encode())


def load_published(path: Path) -> tuple[StatsTask, StatSum]:
    d = json.loads(Path(path).read_text())
    return StatsTask.from_json(d["task"]), StatSum.from_dict(d)


__all__ = ["StatsRound", "stats_fields", "save_published", "load_published"]
