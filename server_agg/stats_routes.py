"""The statistics desk and its HTTP routes (``/v1/stats…``, :mod:`server_agg.stats_round`).

The operator opens a round (``POST /v1/admin/stats-round``: the statistics with their bounds, the
transport — ``secure-sum`` unless the body names ``plain-sum-reveals-each-device`` —, the fewest
contributors) on every eligible device; with ``fedfs serve``'s automatic statistics
(:mod:`.stats_auto`) the server opens them itself. A device reads its view (``GET /v1/stats-round``:
the task, the ``secagg`` fields with its index, or ``phase: none``), then runs the weight rounds'
secure-aggregation exchange under ``/v1/stats-round/{id}/secagg…`` (the same routes,
:func:`~server_agg.secagg_routes.install_secagg_routes`, the same :class:`~server_agg.secagg_rounds.SecAggRound`:
phases close when every device answered or at their deadline, the survivors' sum is unmasked if
enough are left) or, in a plain round, ``PUT /v1/stats-round/{id}/plain``; it downloads what was
published (``GET /v1/stats``: the newest, with the ids of all; ``GET /v1/stats/{id}``).

The server refuses to run one statistic twice on one basis (ξ, or the model version: a second sum over
a cohort that differs by one device would reveal that device's vector; :meth:`StatsTask.keys`), and a
round that ends with fewer than ``min_contributors`` publishes nothing and says why (``GET
/v1/admin/stats-rounds``). An open statistics round is not kept across a server restart (its devices
drop out of it; a new round takes a new id).
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
from fastapi import Body, FastAPI, Path, Response, Security

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import RoundFailedError
from fedfs_sdk.stats.privacy import spec_std
from fedfs_sdk.stats.transport import SECURE, StatSpec, StatsTask, stats_context

from .errors import Conflict, NotFound, Unprocessable
from .secagg_coord import JSON_BODY_BASE, JSON_BODY_PER_DEVICE
from .secagg_rounds import SecAggRound, ca_of
from .stats_round import StatsRound, load_published, save_published, stats_fields

LEDGER, OUTCOMES, LAST_ID = "stats_ledger", "stats_outcomes", "stats_last_round_id"
PLAIN_TIMEOUT_S = 300.0
"""Deadline of a plain statistics round (a secure one has the policy's phase deadlines)."""


class StatsDesk:
    """The server's statistics rounds: at most one open, the published sums, what each round ended as.
    Runs under the coordinator's lock (the coordinator's tick drives its deadlines)."""

    def __init__(self, coord: Any) -> None:
        self.coord, self._lock = coord, coord._lock
        self.dir = coord.layout.root / "stats"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.round: StatsRound | None = None
        for p in self.dir.glob("s*.json"):       # a round open at a restart is gone (module docstring)
            p.unlink(missing_ok=True)
        for p in self.dir.glob("s*.sum*"):
            p.unlink(missing_ok=True)
        for rid, out in self.outcomes().items():
            if out.get("state") == "open":
                self._outcome(int(rid), "failed", reason="the server restarted while the round was open; nothing "
                              "was published", names=out.get("names"))

    # ---- persisted bookkeeping ------------------------------------------------------------
    def _meta(self, key: str, default: Any) -> Any:
        raw = self.coord.db.get_meta(key)
        return json.loads(raw) if raw else default

    def ledger(self) -> dict[str, int]:
        """``{name@basis: round_id}`` of every statistic whose sum the server learned."""
        return self._meta(LEDGER, {})

    def outcomes(self) -> dict[str, dict]:
        return self._meta(OUTCOMES, {})

    def _outcome(self, rid: int, state: str, **fields: Any) -> None:
        out = self.outcomes()
        out[str(rid)] = {"round_id": rid, "state": state, **fields}
        self.coord.db.set_meta(OUTCOMES, json.dumps(out))

    # ---- opening --------------------------------------------------------------------------
    def open(self, body: dict) -> dict:
        """The admin's round (``POST /v1/admin/stats-round``)."""
        try:
            specs = tuple(StatSpec(**s) for s in body["stats"])
            transport = str(body.get("transport", SECURE))
            min_c, max_p = int(body.get("min_contributors", 10)), int(body.get("max_photos", 64))
            extra = dict(body.get("extra") or {})
            dp = body.get("dp")
        except (KeyError, TypeError, ValueError) as e:
            raise Unprocessable(f"statistics round refused: {e}", code="invalid_stats_round") from None
        return self.open_task(specs, transport, min_c, max_p, extra, dp)

    def open_task(self, specs: tuple[StatSpec, ...], transport: str = SECURE, min_contributors: int = 10,
                  max_photos: int = 64, extra: dict | None = None, dp: dict | None = None) -> dict:
        """Open a round on every eligible device; 409 if one is open, the statistic already ran on
        this basis, or the secure round cannot run (too few devices, parameters devices refuse).
        ``dp``: the round's DP (:class:`~fedfs_sdk.stats.privacy.StatsDp` as JSON; 422 if invalid or
        ``dp-accounting`` is missing)."""
        coord = self.coord
        with self._lock:
            self.tick()
            if self.round is not None:
                raise Conflict(f"statistics round {self.round.task.round_id} is open", code="stats_round_open")
            devices = coord.eligible_devices()
            rid = int(coord.db.get_meta(LAST_ID) or 0) + 1
            policy = coord.policy
            try:
                task = StatsTask(rid, int(coord.model.version) if coord.model else 0, specs, transport=transport,
                                 min_contributors=min_contributors, max_photos=max_photos,
                                 extra={"xi_sha256": coord.db.get_meta("xi_sha256"), **(extra or {})}, dp=dp)
                if task.privacy is not None:     # the published ε needs the accountant: say so now, not at the end
                    from fedfs_sdk.federation.dp_account import require_accountant

                    require_accountant()
                    for s in specs:
                        spec_std(s, task.max_photos, 0.0)     # every statistic has a bounded kind
            except (TypeError, ValueError, InputError) as e:
                raise Unprocessable(f"statistics round refused: {e}", code="invalid_stats_round") from None
            again = sorted(set(task.keys()) & set(self.ledger()))
            if again:
                raise Conflict(f"statistics {again} were already summed on this basis (round "
                               f"{self.ledger()[again[0]]}): a second sum over another cohort would reveal the "
                               "devices by which the cohorts differ", code="stats_repeat")
            if len(devices) < task.min_contributors:
                raise Conflict(f"{len(devices)} eligible device(s), a statistics round publishes a sum of ≥ "
                               f"{task.min_contributors}", code="too_few_devices")
            opened = coord.clock()
            secagg = None
            if task.transport == SECURE:
                try:
                    fields = stats_fields(policy, task, len(devices))
                except InputError as e:
                    raise Conflict(f"statistics round refused: {e}", code="secagg_params") from None
                fields = coord._secagg_checked(policy, fields, rid, len(devices), "statistics round")
                timeout = float(policy.secagg_phase_timeout_s)
                secagg = SecAggRound(rid, devices, fields, self.dir / f"s{rid:06d}.json", opened,
                                     opened + 2 * timeout, stats_context(task, fields), ca_of(policy))
            try:
                # the operator opts into a plain sum by naming it in the request: allow_plain = transport
                rnd = StatsRound(task, devices, allow_plain=task.transport, secagg=secagg, opened=opened,
                                 deadline=opened + PLAIN_TIMEOUT_S)
            except InputError as e:
                raise Unprocessable(f"statistics round refused: {e}", code="invalid_stats_round") from None
            if secagg is not None:
                secagg.save()
            coord.db.set_meta(LAST_ID, str(rid))
            self.round = rnd
            self._outcome(rid, "open", names=[s.name for s in specs], devices=len(devices),
                          **({"dp": task.dp} if task.dp else {}))
            return {"round_id": rid, "phase": "secure" if secagg else "plain", "devices": len(devices),
                    "task": task.to_json(), **({"protocol": secagg.params.protocol} if secagg else {})}

    # ---- deadlines, end of round ----------------------------------------------------------
    def tick(self) -> None:
        """Close phases that are complete or past their deadline; publish or fail the round."""
        with self._lock:
            r = self.round
            if r is None:
                return
            if r.secagg is None:
                if r.plain_complete or self.coord.clock() >= r.deadline:
                    self._end(lambda: r.close_plain(), "plain")
                return
            try:
                res = r.secagg.advance(self.coord.clock())
            except RoundFailedError as e:
                self._fail(str(e))
                return
            if res is not None:
                n = int(res.total_samples)
                self._end(lambda: r.finish(np.asarray(res.mean, dtype=np.float64) * n, n), "secure")

    def _end(self, finish: Callable[[], dict], how: str) -> None:
        r = self.round
        assert r is not None
        rid = r.task.round_id
        led = self.ledger()                    # the server has seen a sum (or vectors) on these bases
        led.update({k: rid for k in r.task.keys()})
        self.coord.db.set_meta(LEDGER, json.dumps(led))
        try:
            pub = finish()
        except InputError as e:
            self._fail(str(e))
            return
        save_published(self.dir / f"published-r{rid:06d}.json", pub)
        save_published(self.coord.layout.root / "stats.json", pub)
        self._outcome(rid, "published", count=pub["count"], names=[s.name for s in r.task.stats], transport=how,
                      **({"dp": pub["dp"]} if "dp" in pub else {}))
        self._close()

    def _fail(self, why: str) -> None:
        r = self.round
        assert r is not None
        self._outcome(r.task.round_id, "failed", reason=why[:500], names=[s.name for s in r.task.stats])
        self._close()

    def _close(self) -> None:
        r = self.round
        if r is not None and r.secagg is not None:
            r.secagg.remove()
        self.round = None

    def advance(self, round_id: int) -> dict:
        """The admin's "now": the current phase closes as if its deadline had passed."""
        with self._lock:
            r = self.round
            if r is None or r.task.round_id != round_id:
                raise Conflict(f"statistics round {round_id} is not open", code="stats_round_closed")
            if r.secagg is not None:
                r.secagg.deadline = self.coord.clock()
            else:
                r.deadline = self.coord.clock()
            self.tick()
            return self.status(round_id)

    def status(self, round_id: int) -> dict:
        with self._lock:
            r = self.round
            if r is not None and r.task.round_id == round_id:
                return {"round_id": round_id, "state": "open",
                        **({"phase": r.secagg.srv.step, **r.secagg.counts()} if r.secagg else {"phase": "plain"})}
            out = self.outcomes().get(str(round_id))
            if out is None:
                raise NotFound(f"statistics round {round_id} does not exist", code="unknown_stats_round")
            return out

    # ---- devices --------------------------------------------------------------------------
    def view(self, device_id: str) -> dict:
        """What a device should do: ``phase: none`` (nothing for it; ``pending`` names the automatic
        rounds still to come), or the open round's task and, secure, its ``secagg`` fields."""
        with self._lock:
            self.tick()
            r = self.round
            pending = self.coord.stats_pending() if hasattr(self.coord, "stats_pending") else []
            if r is None or device_id not in r.participants:
                return {"phase": "none", "retry_after": self.coord.poll_interval_s, "pending": pending}
            out = {"round_id": r.task.round_id, "task": r.task.to_json(), "retry_after": self.coord.poll_interval_s,
                   "participants": len(r.participants)}
            if r.secagg is None:
                return {**out, "phase": "plain"}
            return {**out, "phase": "secure", "secagg": r.secagg.task_for(device_id)}

    def _secure(self, device_id: str, round_id: int) -> SecAggRound:
        r = self.round
        if r is None or r.task.round_id != round_id:     # 409 (not the weight rounds' 410): no round, or over
            raise Conflict(f"statistics round {round_id} is not open", code="stats_round_closed")
        if r.secagg is None:
            raise Conflict(f"statistics round {round_id} is plain: PUT …/plain", code="not_secure_round")
        r.secagg.index_of(device_id)
        return r.secagg

    def secagg_check(self, device_id: str, round_id: int, step: str) -> int:
        with self._lock:
            self.tick()
            sr = self._secure(device_id, round_id)
            return 8 * sr.params.words if step == "masked-input" else \
                JSON_BODY_BASE + JSON_BODY_PER_DEVICE * len(sr.participants)

    def secagg_receive(self, device_id: str, round_id: int, step: str, payload: bytes) -> dict[str, Any]:
        import hashlib

        with self._lock:
            self.tick()
            ack = self._secure(device_id, round_id).receive(device_id, step, payload)
            if step == "masked-input":
                ack["sha256"] = hashlib.sha256(payload).hexdigest()
            self.tick()                                 # everyone answered: close the phase now
            return ack

    def secagg_view(self, device_id: str, round_id: int) -> dict[str, Any]:
        with self._lock:
            self.tick()
            r = self.round
            if r is not None and r.task.round_id == round_id and r.secagg is not None:
                return r.secagg.view(device_id, self.coord.poll_interval_s)
            out = self.outcomes().get(str(round_id))
            if out is None:
                raise NotFound(f"statistics round {round_id} does not exist", code="unknown_stats_round")
            phase = {"published": "done", "failed": "failed"}.get(out["state"], "closed")
            return {"round_id": round_id, "phase": phase, "reason": out.get("reason"),
                    "retry_after": self.coord.poll_interval_s}

    def plain(self, device_id: str, round_id: int, vector: list) -> dict:
        with self._lock:
            self.tick()
            r = self.round
            if r is None or r.task.round_id != round_id:
                raise Conflict(f"statistics round {round_id} is not open", code="stats_round_closed")
            try:
                r.contribute_plain(device_id, np.asarray(vector, dtype=np.float64))
            except (InputError, TypeError, ValueError) as e:
                raise Unprocessable(f"statistics vector refused: {e}", code="invalid_stats_vector") from None
            self.tick()
            return {"round_id": round_id, "accepted": True}

    def published_rounds(self) -> list[int]:
        """Every published round's id, oldest first."""
        return sorted(int(k) for k, v in self.outcomes().items() if v.get("state") == "published")

    def published(self, round_id: int | None = None) -> dict:
        """The newest published sum (with ``published_rounds``: every id), or round ``round_id``'s."""
        return json.loads(self.published_json(round_id))

    def published_json(self, round_id: int | None = None) -> bytes:
        """:meth:`published` as the JSON body the API sends. A published sum never changes, so it is
        read, validated and encoded once per (round, list of published rounds), not at every request:
        each device downloads it, and ξ's trunk-feature moments are a d×d matrix (≈ 5 MB of JSON at
        d = 512) whose parsing and re-encoding took most of the server's time in a 102-device round."""
        done = self.published_rounds()
        if round_id is None:
            if not done:
                raise NotFound("no statistics sum published yet", code="no_stats")
            round_id = done[-1]
        path = self.dir / f"published-r{round_id:06d}.json"
        if not path.is_file():
            raise NotFound(f"statistics round {round_id} published nothing", code="no_stats")
        key = (int(round_id), path.stat().st_mtime_ns, tuple(done))
        # requests run on many threads: the cache is replaced whole, never changed in place
        cached = getattr(self, "_published_cache", {}).get(key)
        if cached is None:
            load_published(path)                            # validates
            body = {**json.loads(path.read_text()), "round_id": round_id, "published_rounds": done}
            cached = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            self._published_cache = {**getattr(self, "_published_cache", {}), key: cached}
            if len(self._published_cache) > 8:             # a few rounds' bodies are all a fleet asks for
                self._published_cache = {key: cached}
        return cached


def install_stats_routes(app: FastAPI, coord: Any, device: Callable[..., str], admin: Callable[..., str],
                         errors: Callable[..., dict], body_timeout_s: float = 120.0,
                         receive_slots: Any = None) -> StatsDesk:
    """The statistics round's endpoints (and the secure-aggregation routes under
    ``/v1/stats-round``); ``errors(*statuses)`` documents their refusals (the app's ``{error,
    reason}`` body) so the OpenAPI schema lists every status they answer."""
    import asyncio

    from .secagg_routes import install_secagg_routes

    desk = StatsDesk(coord)
    coord.stats_desk = desk
    refusals = errors(400, 401, 403, 404, 409, 410, 413, 422)

    @app.post("/v1/admin/stats-round", tags=["statistics"], responses=refusals)
    def open_stats(body: dict = Body(...), _: str = Security(admin)) -> dict:
        return desk.open(body)

    @app.post("/v1/admin/stats-round/{round_id}/advance", tags=["statistics"], responses=refusals)
    def advance_stats(round_id: int = Path(ge=1), _: str = Security(admin)) -> dict:
        return desk.advance(round_id)

    @app.get("/v1/admin/stats-rounds", tags=["statistics"], responses=refusals)
    def stats_rounds(_: str = Security(admin)) -> dict:
        """Every statistics round's outcome and what the automatic rounds did (opened, skipped: why)."""
        from .stats_auto import STATE

        with desk._lock:
            return {"rounds": desk.outcomes(), "automatic": desk._meta(STATE, {})}

    @app.get("/v1/admin/stats-round/{round_id}", tags=["statistics"], responses=refusals)
    def stats_status(round_id: int = Path(ge=1), _: str = Security(admin)) -> dict:
        return desk.status(round_id)

    @app.get("/v1/stats-round", tags=["statistics"], responses=refusals)
    def stats_view(device_id: str = Security(device)) -> dict:
        return desk.view(device_id)

    @app.put("/v1/stats-round/{round_id}/plain", tags=["statistics"], responses=refusals)
    def stats_plain(round_id: int = Path(ge=1), body: dict = Body(...), device_id: str = Security(device)) -> dict:
        return desk.plain(device_id, round_id, body.get("vector"))

    @app.get("/v1/stats", tags=["statistics"], responses=refusals)
    def stats_published(_: str = Security(device)) -> dict:
        return Response(desk.published_json(), media_type="application/json")

    @app.get("/v1/stats/rounds", tags=["statistics"], responses=refusals)
    def stats_published_rounds(_: str = Security(device)) -> dict:
        """The ids of every published sum (a device downloads each once and keeps it)."""
        return {"published_rounds": desk.published_rounds()}

    @app.get("/v1/stats/{round_id}", tags=["statistics"], responses=refusals)
    def stats_published_round(round_id: int = Path(ge=1), _: str = Security(device)) -> dict:
        return Response(desk.published_json(round_id), media_type="application/json")

    install_secagg_routes(app, desk, device, errors, body_timeout_s,
                          receive_slots if receive_slots is not None else asyncio.Semaphore(16),
                          prefix="/v1/stats-round", tag="statistics")
    return desk


__all__ = ["StatsDesk", "install_stats_routes", "PLAIN_TIMEOUT_S"]
