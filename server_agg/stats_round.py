"""A statistics round on the server (issue 29): the federation learns the sum of the devices'
clipped statistics vectors (:mod:`fedfs_sdk.stats`) and the number of contributors, nothing else.

The round's :class:`~fedfs_sdk.stats.transport.StatsTask` names the statistics, their clip bounds, the
model version they are computed under and the fewest contributors whose sum may be published
(:data:`~fedfs_sdk.stats.MIN_CONTRIBUTORS`: with 2 devices a sum of ``f fᵀ`` minus one's own is the
other's). Transport:

* ``fedfs-secagg/2`` (the default): the devices' packed vectors go through the secure-sum protocol of
  weight rounds (:class:`~fedfs_sdk.federation.secagg.server.SecAggServer`: masked inputs, Shamir
  shares of the masks, unmasking of the survivors' sum) with a weight of 1 per device; the server
  sees masked vectors only, and the protocol's mean times the count is the sum;
* ``plain-sum-reveals-each-device``: only when the operator names it (``allow_plain=PLAIN``): each
  vector arrives in the clear and is added; a device that requires secure aggregation refuses it
  (:class:`~fedfs_sdk.stats.transport.StatsDevicePolicy`).

What is published (:meth:`StatsRound.close`): ``{"task", "count", "sums"}`` — the unpacked sum of the
survivors' statistics. DP is optional on the same sums (not applied here). The HTTP routes and the
device agent's side of the exchange are not wired yet: this module is the round's state machine.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg.server import SecAggServer
from fedfs_sdk.stats import StatSum
from fedfs_sdk.stats.transport import PLAIN, SECURE, StatsTask, secagg_params, unpack

from .store import atomic_write

class StatsRound:
    """One statistics round: open on a task and its participants, collect, publish the sum."""

    def __init__(self, task: StatsTask, participants: list[int], allow_plain: str | None = None) -> None:
        if task.transport == PLAIN and allow_plain != PLAIN:
            raise InputError(f"a plain statistics sum shows the server each device's vector: open it only with "
                             f"allow_plain={PLAIN!r} (the operator's explicit opt-in)")
        if len(participants) < task.min_contributors:
            raise InputError(f"statistics round {task.round_id}: {len(participants)} device(s) sampled, the task "
                             f"publishes a sum of ≥ {task.min_contributors}")
        self.task, self.participants = task, sorted(int(p) for p in participants)
        self.secagg = SecAggServer(secagg_params(task, len(self.participants))) if task.transport == SECURE else None
        self._plain: dict[int, np.ndarray] = {}
        self.published: dict[str, Any] | None = None

    def contribute_plain(self, device: int, packed: np.ndarray) -> None:
        """A device's packed vector in the clear (plain rounds only; once per device)."""
        if self.secagg is not None:
            raise InputError(f"statistics round {self.task.round_id} runs {SECURE}: a plain vector is refused")
        if device not in self.participants:
            raise InputError(f"device {device} was not sampled for statistics round {self.task.round_id}")
        if device in self._plain:
            raise InputError(f"device {device} already contributed to statistics round {self.task.round_id}")
        v = np.asarray(packed, dtype=np.float64)
        if v.shape != (self.task.dim,) or not np.isfinite(v).all() or np.abs(v).max(initial=0.0) > 1.0 + 1e-9:
            raise InputError(f"a packed statistics vector has {self.task.dim} finite numbers in [-1, 1]")
        self._plain[device] = v

    def close(self) -> dict[str, Any]:
        """Publish ``{"task", "count", "sums"}`` (the secure round's unmasked sum, or the plain sum);
        :class:`InputError` when fewer than ``min_contributors`` devices made it."""
        if self.secagg is not None:
            res = self.secagg.finalize()
            count, total = int(res.total_samples), res.mean.astype(np.float64) * int(res.total_samples)
        else:
            count = len(self._plain)
            total = np.sum(list(self._plain.values()), axis=0) if self._plain else np.zeros(self.task.dim)
        if count < self.task.min_contributors:
            raise InputError(f"statistics round {self.task.round_id}: {count} contributor(s), fewer than the "
                             f"{self.task.min_contributors} whose sum may be published; nothing published")
        summed = StatSum(unpack(total, self.task), count)
        self.published = {"task": self.task.to_json(), **summed.to_dict()}
        return self.published


def save_published(path: Path, published: Mapping[str, Any]) -> None:
    """Persist a published sum (server: what devices download; device: what its next enrollment uses)."""
    atomic_write(Path(path), json.dumps(published, sort_keys=True).encode())


def load_published(path: Path) -> tuple[StatsTask, StatSum]:
    d = json.loads(Path(path).read_text())
    return StatsTask.from_json(d["task"]), StatSum.from_dict(d)


__all__ = ["StatsRound", "save_published", "load_published"]
