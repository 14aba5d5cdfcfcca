"""A device's side of the statistics round over HTTP (``server_agg.stats_routes``).

:class:`StatsParticipant` answers whatever phase the server's round is in — the secure-sum messages of
:class:`~fedfs_sdk.federation.secagg.device.SecAggDevice` on its packed contribution
(:func:`~fedfs_sdk.stats.transport.pack`), or, in a plain round its policy allows, the packed vector
itself — and :meth:`StatsParticipant.fetch_published` keeps the published sum in the device's state
folder for its next enrollment. The contribution is computed once, when the task arrives, by the
caller's function of the task (the device functions of :mod:`fedfs_sdk.stats.contributions` on its own
photos under the task's model).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..federation.secagg import messages as M
from ..federation.secagg.device import SecAggDevice
from .transport import PLAIN, StatsDevicePolicy, StatsTask, pack, secagg_params


class StatsParticipant:
    """One device in statistics rounds. ``contribution(task)`` → ``{name: vector}`` of its own photos."""

    def __init__(self, client: Any, contribution: Callable[[StatsTask], Mapping[str, np.ndarray]],
                 policy: StatsDevicePolicy = StatsDevicePolicy()) -> None:
        self.client, self.contribution, self.policy = client, contribution, policy
        self._round: int | None = None
        self._dev: SecAggDevice | None = None
        self._packed: np.ndarray | None = None
        self._done: set[str] = set()
        self.bytes_sent = 0

    def _json(self, method: str, path: str, body: Any = None) -> dict:
        r = self.client.request(method, path, json_body=body)
        return r.json()

    def step(self) -> str:
        """Do what the round's current phase asks of this device (once per phase); returns the phase."""
        v = self._json("GET", "/v1/stats-round")
        phase = v.get("phase", "none")
        if phase == "none":
            return phase
        task = StatsTask.from_json(v["task"])
        self.policy.check(task)                     # a plain round is refused by a device that requires secagg
        if task.round_id != self._round:
            self._round, self._done = task.round_id, set()
            self._packed = pack(self.contribution(task), task)
            self._dev = None
            if phase != "plain":
                self._dev = SecAggDevice(secagg_params(task, int(v["participants"])), int(v["index"]),
                                         policy=self.policy.secagg)
        if phase in self._done:
            return phase
        base = f"/v1/stats-round/{task.round_id}"
        if phase == "plain":
            assert task.transport == PLAIN
            self._send_plain(base)
        else:
            assert self._dev is not None
            msg = {"advertise": lambda: self._dev.advertise(),
                   "share_keys": lambda: self._dev.share_keys(M.from_json(v["roster"])),
                   "masked": lambda: self._dev.masked_input(M.from_json(v["inbox"]), self._packed, 1),
                   "unmask": lambda: self._dev.unmask(M.from_json(v["unmask_request"]))}[phase]()
            text = M.to_json(msg)
            self.bytes_sent += len(text)
            self._json("POST", f"{base}/message", {"message": text})
        self._done.add(phase)
        return phase

    def _send_plain(self, base: str) -> None:
        body = {"vector": self._packed.tolist()}
        self.bytes_sent += len(json.dumps(body))
        self._json("PUT", f"{base}/plain", body)

    def fetch_published(self, path: str | Path) -> dict:
        """Download the published sum and keep it (``path``, in the device's state folder)."""
        from ..fileio import atomic_write_bytes

        d = self._json("GET", "/v1/stats")
        atomic_write_bytes(Path(path), json.dumps(d, sort_keys=True).encode())
        return d


__all__ = ["StatsParticipant"]
