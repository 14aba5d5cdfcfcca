"""A device's side of the statistics round over HTTP (``server_agg.stats_routes``).

:meth:`StatsParticipant.take_part` runs one round the server has open for this device: in a secure
round the weight rounds' own :class:`~fedfs_sdk.federation.secagg.http_device.SecAggSession` — the
same floors (:class:`~fedfs_sdk.federation.secagg.policy.DevicePolicy`: pinned CA, roster size,
threshold), identity, signatures and revocation checks — on its packed contribution
(:func:`~fedfs_sdk.stats.transport.pack`, weight 1); in a plain round its policy allows, the packed
vector itself. Its signatures bind :func:`~fedfs_sdk.stats.transport.stats_context` (the task and the
word *statistics*), and its round ids are logged apart from the weight rounds'
(``secagg_stats_rounds.json``), since the server numbers the two kinds of round separately.

A device contributes each statistic at most once per basis (:meth:`StatsTask.keys`: ξ, or the model
version; ``stats_contributed.json`` in its state, written before any key leaves): a second sum over a
cohort that differs by one device would reveal that device's vector. :meth:`fetch_published` keeps
the published sums in the state folder for the next enrollment, with the device's own contribution
(which only it holds: the others' sum is the published one minus it).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import InputError
from .transport import PLAIN, StatsDevicePolicy, StatsTask, pack, stats_context

LEDGER_FILE = "stats_contributed.json"
ROUND_LOG_FILE = "secagg_stats_rounds.json"


class StatsParticipant:
    """One device in statistics rounds. ``contribution(task)`` → ``{name: vector}`` of its own photos;
    ``state_dir``: where the ledger, the round log and the published sums live (None: in memory);
    ``identity``: its certified key (authenticated rounds)."""

    def __init__(self, client: Any, contribution: Callable[[StatsTask], Mapping[str, np.ndarray]],
                 policy: StatsDevicePolicy = StatsDevicePolicy(), state_dir: str | Path | None = None,
                 identity: Any = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, wait_timeout_s: float = 600.0) -> None:
        self.client, self.contribution, self.policy = client, contribution, policy
        self.dir = None if state_dir is None else Path(state_dir)
        self.identity, self._sleep, self._clock, self.wait_timeout_s = identity, sleep, clock, wait_timeout_s
        self._ledger: dict[str, int] = {}
        if self.dir is not None and (self.dir / LEDGER_FILE).is_file():
            self._ledger = {str(k): int(v) for k, v in json.loads((self.dir / LEDGER_FILE).read_text()).items()}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.done: set[int] = set()

    # ---- the ledger -------------------------------------------------------------------------
    def contributed(self, task: StatsTask) -> list[str]:
        return [k for k in task.keys() if k in self._ledger]

    def _record(self, task: StatsTask) -> None:
        again = self.contributed(task)
        if again:
            raise InputError(f"statistics round {task.round_id}: this device already contributed {again} (round "
                             f"{self._ledger[again[0]]}); a second sum over another cohort could reveal its vector")
        self._ledger.update({k: task.round_id for k in task.keys()})
        if self.dir is not None:
            from ..fileio import atomic_write_bytes

            atomic_write_bytes(self.dir / LEDGER_FILE, json.dumps(self._ledger, sort_keys=True).encode(), mode=0o600)

    # ---- one round --------------------------------------------------------------------------
    def view(self) -> dict:
        r = self.client.request("GET", "/v1/stats-round")
        self.bytes_received += len(r.content)
        return r.json()

    def take_part(self, view: Mapping[str, Any] | None = None) -> dict | None:
        """Take part in the round open for this device (``view``: the server's ``GET /v1/stats-round``
        answer, fetched when None); None when there is none, or it already took part. Raises
        :class:`InputError` for a round it refuses (plain while secure is required, a statistic it
        already contributed) and :class:`~fedfs_sdk.federation.secagg.http_device.SecAggRoundLost` when
        it refuses a secure step or drops out."""
        v = dict(view) if view is not None else self.view()
        if v.get("phase") not in ("secure", "plain"):
            return None
        task = StatsTask.from_json(v["task"])
        if task.round_id in self.done:
            return None
        self.done.add(task.round_id)                # one answer per round: taken part, or refused once
        self.policy.check(task)                     # a plain round is refused by a device that requires secagg
        if v["phase"] == "plain":
            if task.transport != PLAIN:
                raise InputError(f"statistics round {task.round_id}: a plain phase in a {task.transport} round")
            packed = pack(self.contribution(task), task)        # DP in a plain round: central (the server's)
            self._record(task)
            body = {"vector": packed.tolist()}
            self.bytes_sent += len(json.dumps(body))
            self.client.request("PUT", f"/v1/stats-round/{task.round_id}/plain", json_body=body)
            return {"round_id": task.round_id, "transport": PLAIN, "bytes_sent": self.bytes_sent}
        return self._secure(task, v["secagg"])

    def _secure(self, task: StatsTask, fields: Mapping[str, Any]) -> dict:
        from ..federation.secagg.http_device import SecAggSession
        from ..federation.secagg.round_log import RoundLog

        log = RoundLog(None if self.dir is None else self.dir / ROUND_LOG_FILE)
        dp = task.privacy
        distributed = isinstance(fields.get("dp_noise"), Mapping)
        if distributed != (dp is not None and dp.noise == "distributed"):
            raise InputError(f"statistics round {task.round_id}: the task's DP ({task.dp}) and the secure fields' "
                             f"noise request ({fields.get('dp_noise')}) disagree: this device takes no part")
        session = SecAggSession(self.client, {"round_id": task.round_id, "secagg": dict(fields)}, sleep=self._sleep,
                                clock=self._clock, wait_timeout_s=self.wait_timeout_s, identity=self.identity,
                                policy=self.policy.secagg, round_log=log, context=stats_context(task, fields),
                                path=f"/v1/stats-round/{task.round_id}/secagg", dp=dp)   # refuses below its floors
        t0 = time.perf_counter()
        own = self.contribution(task)               # before any key leaves: a device that cannot, sends nothing
        packed = pack(own, task)
        if distributed:          # its share of the noise, on its clipped contribution, before masking
            import secrets

            from .privacy import device_noise

            packed = packed + device_noise(task, float(dp.noise_multiplier), int(session.noise_min_inputs),
                                           np.random.default_rng(secrets.randbits(128)))
        self._record(task)                          # before any key leaves
        self.keep_own(task, own)
        session.advertise()
        session.share_keys()
        session.masked_vector(packed, 1)
        session.unmask()                            # authenticated rounds: after the consistency check
        session.result()
        self.bytes_sent += session.bytes_sent
        self.bytes_received += session.bytes_received
        return {"round_id": task.round_id, "transport": task.transport, "protocol": session.params.protocol,
                "bytes_sent": session.bytes_sent, "bytes_received": session.bytes_received,
                "seconds": time.perf_counter() - t0}

    # ---- what is kept -------------------------------------------------------------------------
    def keep_own(self, task: StatsTask, own: Mapping[str, np.ndarray]) -> None:
        """This device's contribution (never sent in the clear), kept to subtract from the sum."""
        if self.dir is None:
            self._own = {task.round_id: dict(own)}
            return
        import io

        from ..fileio import atomic_write_bytes

        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v, dtype=np.float64) for k, v in own.items()})
        atomic_write_bytes(self.dir / f"stats-own-r{task.round_id:06d}.npz", buf.getvalue(), mode=0o600)

    def fetch_published(self, path: str | Path | None = None, round_id: int | None = None) -> dict:
        """Download a published sum (the newest, or ``round_id``'s) and keep it (``path``, default the
        state folder's ``stats-r{id}.json``)."""
        from ..fileio import atomic_write_bytes

        r = self.client.request("GET", "/v1/stats" if round_id is None else f"/v1/stats/{round_id}")
        self.bytes_received += len(r.content)
        d = r.json()
        if path is None and self.dir is not None:
            path = self.dir / f"stats-r{int(d['round_id']):06d}.json"
        if path is not None:
            atomic_write_bytes(Path(path), json.dumps(d, sort_keys=True).encode(), mode=0o600)
        return d


__all__ = ["StatsParticipant", "LEDGER_FILE", "ROUND_LOG_FILE"]
