"""HTTP routes of the statistics round (``/v1/stats…``, :mod:`server_agg.stats_round`).

The operator opens a round (``POST /v1/admin/stats-round``: the statistics with their bounds, the
transport — ``fedfs-secagg/2`` unless the body names ``plain-sum-reveals-each-device`` —, the fewest
contributors) on every registered device, and advances its phases (``POST
/v1/admin/stats-round/{id}/advance``: advertise → share_keys → masked → unmask → published). A device
reads its view (``GET /v1/stats-round``: the task, its index in the round, the phase and the message
it waits for), sends its secure-sum messages (``POST /v1/stats-round/{id}/message``, JSON of
:mod:`fedfs_sdk.federation.secagg.messages`) or, in a plain round, its packed vector (``PUT
/v1/stats-round/{id}/plain``), and downloads the published sum (``GET /v1/stats``) to keep for its
next enrollment. Phase deadlines, persistence of an open statistics round across a restart and the
authenticated roster of ``fedfs-secagg/2`` weight rounds are not wired here yet; the published sum is
persisted (``stats.json`` in the state directory).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
from fastapi import Body, FastAPI, Path, Security

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.errors import SecAggError
from fedfs_sdk.stats.transport import SECURE, StatSpec, StatsTask

from .errors import Conflict, NotFound, Unprocessable
from .stats_round import StatsRound, load_published, save_published

PHASES = ("advertise", "share_keys", "masked", "unmask", "published")


class StatsDesk:
    """The server's statistics round: at most one open, its devices' indices, the published sum."""

    def __init__(self, coord: Any) -> None:
        self.coord, self._lock = coord, threading.Lock()
        self.round: StatsRound | None = None
        self.phase = "published"
        self.index: dict[str, int] = {}
        self.waiting: dict[str, Any] = {}          # what each phase hands the devices (roster, inboxes, request)
        self.path = coord.layout.root / "stats.json"

    def open(self, body: dict) -> dict:
        with self._lock:
            if self.round is not None and self.phase != "published":
                raise Conflict(f"statistics round {self.round.task.round_id} is open", code="stats_round_open")
            devices = self.coord.eligible_devices()
            rid = (self.round.task.round_id if self.round else 0) + 1
            try:
                task = StatsTask(rid, int(self.coord.model.version) if self.coord.model else 0,
                                 tuple(StatSpec(**s) for s in body["stats"]),
                                 transport=str(body.get("transport", SECURE)),
                                 min_contributors=int(body.get("min_contributors", 10)),
                                 max_photos=int(body.get("max_photos", 64)))
                # the operator opts into a plain sum by naming it in the request: allow_plain = transport
                self.round = StatsRound(task, list(range(1, len(devices) + 1)), allow_plain=task.transport)
            except (KeyError, TypeError, ValueError, InputError) as e:
                raise Unprocessable(f"statistics round refused: {e}", code="invalid_stats_round") from None
            self.index = {d: i for i, d in enumerate(devices, 1)}
            self.phase, self.waiting = ("advertise" if self.round.secagg is not None else "plain"), {}
            return {"round_id": rid, "phase": self.phase, "devices": len(devices), "task": task.to_json()}

    def view(self, device_id: str) -> dict:
        with self._lock:
            if self.round is None or self.phase == "published" or device_id not in self.index:
                return {"phase": "none", "retry_after": 1.0}
            i = self.index[device_id]
            out = {"phase": self.phase, "index": i, "participants": len(self.index),
                   "task": self.round.task.to_json(), "retry_after": 0.2}
            if self.phase == "share_keys":
                out["roster"] = M.to_json(self.waiting["roster"])
            elif self.phase == "masked" and i in self.waiting.get("inboxes", {}):
                out["inbox"] = M.to_json(self.waiting["inboxes"][i])
            elif self.phase == "unmask":
                out["unmask_request"] = M.to_json(self.waiting["request"])
            return out

    def _target(self, device_id: str, round_id: int) -> StatsRound:
        if self.round is None or self.round.task.round_id != round_id or self.phase == "published":
            raise Conflict(f"statistics round {round_id} is not open", code="stats_round_closed")
        if device_id not in self.index:
            raise Conflict(f"device {device_id} is not in statistics round {round_id}", code="not_selected")
        return self.round

    def message(self, device_id: str, round_id: int, text: str) -> dict:
        with self._lock:
            rnd = self._target(device_id, round_id)
            if rnd.secagg is None:
                raise Conflict("a plain statistics round takes PUT …/plain", code="not_secure_round")
            try:
                msg = M.from_json(text)
                if msg.get("device") != self.index[device_id]:
                    raise InputError(f"message names device {msg.get('device')}, this device is {self.index[device_id]}")
                rnd.secagg.receive(msg)
            except (InputError, SecAggError) as e:
                raise Unprocessable(f"statistics message refused: {e}", code="invalid_stats_message") from None
            return {"round_id": round_id, "phase": self.phase, "accepted": True}

    def plain(self, device_id: str, round_id: int, vector: list) -> dict:
        with self._lock:
            rnd = self._target(device_id, round_id)
            try:
                rnd.contribute_plain(self.index[device_id], np.asarray(vector, dtype=np.float64))
            except (InputError, TypeError, ValueError) as e:
                raise Unprocessable(f"statistics vector refused: {e}", code="invalid_stats_vector") from None
            return {"round_id": round_id, "accepted": True}

    def advance(self, round_id: int) -> dict:
        with self._lock:
            rnd = self.round
            if rnd is None or rnd.task.round_id != round_id or self.phase == "published":
                raise Conflict(f"statistics round {round_id} is not open", code="stats_round_closed")
            try:
                if self.phase == "advertise":
                    self.waiting["roster"], self.phase = rnd.secagg.close_advertise(), "share_keys"
                elif self.phase == "share_keys":
                    self.waiting["inboxes"], self.phase = rnd.secagg.close_share_keys(), "masked"
                elif self.phase == "masked":
                    self.waiting["request"], self.phase = rnd.secagg.close_masked(), "unmask"
                else:                                   # unmask (secure) or plain: publish
                    pub = rnd.close()
                    save_published(self.path, pub)
                    self.phase = "published"
                    return {"round_id": round_id, "phase": "published", "count": pub["count"]}
            except (InputError, SecAggError) as e:
                self.phase = "published"                # the round failed: nothing is published
                raise Conflict(f"statistics round {round_id} failed: {e}", code="stats_round_failed") from None
            return {"round_id": round_id, "phase": self.phase}

    def published(self) -> dict:
        if not self.path.is_file():
            raise NotFound("no statistics sum published yet", code="no_stats")
        return load_published_json(self.path)


def load_published_json(path) -> dict:
    import json

    load_published(path)                                # validates
    return json.loads(path.read_text())


def install_stats_routes(app: FastAPI, coord: Any, device: Callable[..., str], admin: Callable[..., str],
                         errors: Callable[..., dict]) -> StatsDesk:
    """The statistics round's endpoints; ``errors(*statuses)`` documents their refusals (the app's
    ``{error, reason}`` body) so the OpenAPI schema lists every status they answer."""
    desk = StatsDesk(coord)
    refusals = errors(400, 401, 403, 404, 409, 413, 422)

    @app.post("/v1/admin/stats-round", tags=["statistics"], responses=refusals)
    def open_stats(body: dict = Body(...), _: str = Security(admin)) -> dict:
        return desk.open(body)

    @app.post("/v1/admin/stats-round/{round_id}/advance", tags=["statistics"], responses=refusals)
    def advance_stats(round_id: int = Path(ge=1), _: str = Security(admin)) -> dict:
        return desk.advance(round_id)

    @app.get("/v1/stats-round", tags=["statistics"], responses=refusals)
    def stats_view(device_id: str = Security(device)) -> dict:
        return desk.view(device_id)

    @app.post("/v1/stats-round/{round_id}/message", tags=["statistics"], responses=refusals)
    def stats_message(round_id: int = Path(ge=1), body: dict = Body(...), device_id: str = Security(device)) -> dict:
        return desk.message(device_id, round_id, str(body.get("message", "")))

    @app.put("/v1/stats-round/{round_id}/plain", tags=["statistics"], responses=refusals)
    def stats_plain(round_id: int = Path(ge=1), body: dict = Body(...), device_id: str = Security(device)) -> dict:
        return desk.plain(device_id, round_id, body.get("vector"))

    @app.get("/v1/stats", tags=["statistics"], responses=refusals)
    def stats_published(_: str = Security(device)) -> dict:
        return desk.published()

    return desk


__all__ = ["StatsDesk", "install_stats_routes", "PHASES"]
