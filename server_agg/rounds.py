"""The round state machine of the aggregation server (no HTTP here).

    no round ──open (admin, or automatic with policy.rounds)──▶ open
    open ──quorum of sampled devices uploaded──▶ closed  (FedAvg → new global version)
    open ──deadline / admin close, ≥ min_updates──▶ closed
    open ──deadline / admin close, < min_updates──▶ failed (global model unchanged)

A device registers once and gets an id, a bearer token and a unique FedUV base vector
``b_u`` (FedUV Alg. 2; 32 random bits, UNIQUE in the database and never reissued). In
an open round each sampled device downloads the round's global version, trains, and
uploads ``w_c`` with ``|D_c|``; the running FedAvg sum (``server_agg.aggregate``) is
updated as each upload is accepted, so closing costs one division.

All mutations happen under one lock; decoding and validating an upload (the expensive,
untrusted part) happens outside it. Acceptance = the database commit of the update row,
after its file is durable (see ``store.py``), so a crash never counts an update twice or
loses an acknowledged one.

The coordinator's parts live in their own modules (mixins): devices (:mod:`.round_devices`),
model versions and ξ (:mod:`.round_models`), plain uploads (:mod:`.round_uploads`), the DP
ledger (:mod:`.round_dp`), start-up recovery (:mod:`.round_recovery`), secure aggregation
(:mod:`.secagg_coord`); what they share (:mod:`.round_state`). This module keeps the state
machine itself: configure, policy, open / close / tick, the devices' view and the status.
"""
from __future__ import annotations

import json
import random
import shutil
import threading
import time
from typing import Any, Callable, Mapping

from fedfs_sdk.errors import InputError

from .aggregate import StreamingFedAvg
from .frozen_trunk import keep_frozen_trunk
from .config import RoundPolicy, mismatch_reason, missing_model_field
from .dp import DpFedAvg
from .errors import Conflict, NotFound, Unprocessable
from .round_devices import DeviceRegistry
from .round_dp import DpLedger
from .round_models import ModelStore, validate_xi
from .round_recovery import Recovery
from .round_state import BASE_BITS, SEEN_WRITE_INTERVAL_S, GlobalModel, OpenRound, _event, log  # noqa: F401 (re-exported)
from .round_uploads import UploadIntake
from . import stats_auto
from .secagg_coord import SecAggCoordinator
from .store import Database, Layout


class Coordinator(DeviceRegistry, ModelStore, UploadIntake, DpLedger, Recovery, SecAggCoordinator):
    """Devices, rounds and model versions, persisted under ``layout``.

    Args:
        layout: the state directory.
        policy_overrides: settings applied over the stored policy at start (CLI flags).
        keep_updates: keep update files of closed rounds (audit) instead of deleting them.
        poll_interval_s: the ``retry_after`` hint sent to waiting devices.
        clock: time source (seconds since the epoch).

    ``policy_overrides`` are applied with :meth:`configure`, so a method the state's model
    cannot run is refused (:class:`InputError`) before anything is stored.
    """

    def __init__(self, layout: Layout, *, policy_overrides: Mapping[str, Any] | None = None,
                 keep_updates: bool = False, poll_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        layout.create()
        self.layout = layout
        self.keep_updates = keep_updates
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self._lock = threading.RLock()
        self.db = Database(layout.db)
        stored = self.db.get_meta("policy")
        self.policy = RoundPolicy.from_json(json.loads(stored)) if stored else RoundPolicy()
        self.model: GlobalModel | None = None
        self.round: OpenRound | None = None
        self._seen: dict[str, float] = {}   # every device → its last authenticated request (-inf: never)
        self._seen_written: dict[str, float] = {}   # … and the value its database row holds
        self._seen_dirty: set[str] = set()  # devices whose ``last_seen`` is to be written by tick()/close()
        self._recover()
        if policy_overrides:
            self.configure(policy_overrides)
        elif stored is None:
            self.db.set_meta("policy", json.dumps(self.policy.to_json()))

    def configure(self, policy_overrides: Mapping[str, Any] | None = None,
                  initial_model: bytes | None = None) -> bool:
        """Apply start-up settings in one step: policy overrides, and ``initial_model``
        (published as the next version only while the state has no model). The method of the
        resulting policy is checked against the resulting model first; on a mismatch
        :class:`InputError` and nothing changes. Returns whether ``initial_model`` was
        published."""
        with self._lock:
            policy = self.policy.updated(policy_overrides or {})
            install = initial_model is not None and self.model is None
            if install:
                weights, config = self._decode_model(initial_model)   # type: ignore[arg-type]
            else:
                config = self.model.model_config if self.model is not None else None
            missing = missing_model_field(policy.method, config)
            if missing is not None:
                which = "the initial model" if install else f"the state's model v{self.model.version}"  # type: ignore[union-attr]
                raise InputError(mismatch_reason(policy.method, missing, which))
            if policy != self.policy or self.db.get_meta("policy") is None:
                self.db.set_meta("policy", json.dumps(policy.to_json()))
                self.policy = policy
            if install:
                self._publish(1, weights, config, round_id=None, count=0, samples=0)
                _event("model installed", version=self.model.version)  # type: ignore[union-attr]
            return install















    # ---- policy ------------------------------------------------------------------------

    def set_policy(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                policy = self.policy.updated(changes)
            except InputError as e:
                raise Unprocessable(str(e), code="invalid_policy") from None
            missing = missing_model_field(policy.method, self.model.model_config if self.model else None)
            if missing is not None:
                which = f"the global model v{self.model.version}"  # type: ignore[union-attr]
                raise Conflict(f"{mismatch_reason(policy.method, missing, which)}; "
                               "install one that has it with POST /v1/admin/model?method=…",
                               code="model_method_mismatch")
            why = self._xi_mismatch(policy, self.model.model_config if self.model else None)
            if why is not None:
                raise Conflict(f"{why}; keep the settings or install a model that fits (POST /v1/admin/model)",
                               code="proj_dim_mismatch")
            self.db.set_meta("policy", json.dumps(policy.to_json()))
            self.policy = policy
        _event("policy changed", keys=sorted(changes))
        return policy.to_json()

    # ---- rounds ------------------------------------------------------------------------

    def open_round(self) -> dict[str, Any]:
        """Sample participants and open the next round on the current global version."""
        with self._lock:
            if self.round is not None:
                raise Conflict(f"round {self.round.id} is already open", code="round_open")
            if self.model is None:
                raise Conflict("no global model: install one first (POST /v1/admin/model or --init-*)",
                               code="no_model")
            policy, model = self.policy, self.model
            cfg = model.model_config
            missing = missing_model_field(policy.method, cfg)
            if missing is not None:
                raise Conflict(mismatch_reason(policy.method, missing), code="model_method_mismatch")
            devices = self.eligible_devices(policy)
            if len(devices) < policy.min_participants:
                registered = self.device_count()
                have = (f"{len(devices)} device(s) registered" if registered == len(devices) else
                        f"{len(devices)} of {registered} registered device(s) polled the server in the last "
                        f"device_ttl_s = {self.device_ttl(policy):g} s (a device that only registered is not "
                        "sampled until it asks for a task)")
                raise Conflict(f"{have}; the policy needs {policy.min_participants}", code="too_few_devices")
            round_id = int(self.db.scalar("SELECT COALESCE(MAX(id), 0) FROM rounds")) + 1
            ledger, dp_params = self._dp_check_budget(policy, len(devices))
            if dp_params is not None:
                # DP-FedAvg: Poisson sampling at rate q from the OS's CSPRNG — the accountant's
                # privacy amplification assumes each device is in with probability q, secretly.
                pick = random.SystemRandom()
                selected = sorted(d for d in devices if pick.random() < policy.participation)
                k = len(selected)
            else:
                k = policy.sample_size(len(devices))
                # A string seed is hashed deterministically, so round t's sample is reproducible.
                selected = sorted(random.Random(f"fedfs-round:{policy.seed}:{round_id}").sample(devices, k))
            opened = self.clock()
            deadline = opened + policy.round_timeout_s
            task = {"round_id": round_id, "model_version": model.version, "model_sha256": model.sha256,
                    "method": policy.method, "model_config": cfg, "train": dict(policy.train),
                    "neg_codewords": policy.neg_codewords, "deadline": deadline,
                    "xi_sha256": self.db.get_meta("xi_sha256"),
                    # the version's top alone, for a device that puts ξ's trunk under it (federation/model_top.py)
                    "model_top_sha256": self.db.get_meta(f"model_top_v{model.version}")}
            if dp_params is not None:    # devices clip to C before uploading (the server clips again)
                task["dp"] = dp_params.to_json()
            quorum = policy.quorum_count(k)
            secagg = self._secagg_open(policy, round_id, selected, model, opened, task)
            if secagg is not None:   # phases: keys, masked input by the round timeout, unmasking
                task["secagg"] = {k: v for k, v in secagg.fields.items()}
                deadline = task["deadline"] = opened + policy.round_timeout_s + policy.secagg_phase_timeout_s
            with self.db.transaction() as c:
                c.execute("INSERT INTO rounds(id, state, model_version, task, policy, quorum, opened_at, deadline)"
                          " VALUES (?, 'open', ?, ?, ?, ?, ?, ?)",
                          (round_id, model.version, json.dumps(task), json.dumps(policy.to_json()), quorum,
                           opened, deadline))
                c.executemany("INSERT INTO participants(round_id, device_id) VALUES (?, ?)",
                              [(round_id, d) for d in selected])
                # the round is charged to the privacy budget when it opens, with the round itself
                c.execute("INSERT INTO meta(key, value) VALUES ('dp_ledger', ?) ON CONFLICT(key) DO UPDATE SET "
                          "value = excluded.value", (ledger.to_json(),))
            acc = StreamingFedAvg(model.weights) if dp_params is None else DpFedAvg(model.weights, dp_params)
            self.round = OpenRound(round_id, model.version, task, policy, frozenset(selected), quorum,
                                   opened, deadline, acc, secagg=secagg)
            _event("round opened", round_id=round_id, model_version=model.version, sampled=k,
                   eligible=len(devices), registered=self.device_count(), quorum=quorum, deadline=deadline)
            return self._round_status(round_id)

    def close_round(self, round_id: int, reason: str = "closed by admin") -> dict[str, Any]:
        with self._lock:
            r = self.round
            if r is None or r.id != round_id:
                raise Conflict(f"round {round_id} is already {self._past_state(round_id)}", code="round_not_open")
            self._close_locked(reason)
            return self._round_status(round_id)

    def _close_locked(self, reason: str) -> None:
        r = self.round
        assert r is not None and self.model is not None
        if r.secagg is not None:
            self._secagg_fail(r, f"{reason} before the secure-aggregation protocol finished")
            return
        if r.acc.count >= r.policy.min_updates:
            t0 = time.perf_counter()
            new = keep_frozen_trunk(r.acc.result(), self.model.weights, r.policy.train)
            version = self.model.version + 1
            self._publish(version, new, self.model.model_config, r.id, r.acc.count,
                          None if "dp" in r.task else r.acc.total_samples, reason,
                          dp=self._dp_statement(r.policy, r.task.get("dp")))
            _event("round closed", round_id=r.id, reason=reason, updates=r.acc.count,
                   total_samples=r.acc.total_samples, new_version=version,
                   aggregate_ms=round(1000 * (time.perf_counter() - t0), 2))
        else:
            why = f"{reason}: {r.acc.count} update(s), {r.policy.min_updates} needed"
            with self.db.transaction() as c:
                c.execute("UPDATE rounds SET state = 'failed', closed_at = ?, reason = ? WHERE id = ?",
                          (self.clock(), why, r.id))
            _event("round failed", round_id=r.id, reason=why)
        self.round = None
        if not self.keep_updates:
            shutil.rmtree(self.layout.round_dir(r.id), ignore_errors=True)

    def tick(self) -> None:
        """Close a round past its deadline; open the next one when running automatically;
        persist the devices' pending ``last_seen`` times."""
        with self._lock:
            self._flush_seen()
            if self.round is not None and self.round.secagg is not None:
                self._secagg_tick(self.round)       # phase deadlines
            elif self.round is not None and self.clock() >= self.round.deadline:
                self._close_locked("deadline")
            desk = getattr(self, "stats_desk", None)
            if desk is not None:
                desk.tick()                         # the statistics round's phase deadlines
            p = self.policy
            if self.round is None and p.rounds > 0 and self.model is not None and self._completed() < p.rounds:
                if len(self.eligible_devices(p)) >= p.min_participants and not self._dp_exhausted():
                    # the defaults' statistics first (issue 29, server_agg.stats_auto): ξ's moments round
                    if desk is None or stats_auto.before_weight_round(self, desk):
                        self.open_round()
            if desk is not None:
                stats_auto.after_weight_rounds(self, desk)   # the check-results round after the last round

    def stats_pending(self) -> list[str]:
        """The automatic statistics rounds still to come (:func:`server_agg.stats_auto.pending`)."""
        with self._lock:
            return stats_auto.pending(self)

    def _completed(self) -> int:
        return int(self.db.scalar("SELECT COUNT(*) FROM rounds WHERE state = 'closed'"))

    # ---- devices' view -----------------------------------------------------------------

    def task_for(self, device_id: str) -> dict[str, Any]:
        """``train`` (with the task) for a sampled device that has not uploaded yet,
        ``done`` once an automatic run has finished, else ``wait``."""
        with self._lock:
            r = self.round
            if r is not None and r.secagg is not None:
                self._secagg_tick(r)
                r = self.round
                if r is not None and r.secagg is not None and r.secagg.can_join(device_id):
                    return {"action": "train", **r.task, "secagg": r.secagg.task_for(device_id)}
            elif r is not None and self.clock() >= r.deadline:
                self._close_locked("deadline")
                r = None
            if r is not None and r.secagg is None and device_id in r.participants and device_id not in r.accepted:
                return {"action": "train", **r.task}
            if r is None and self.policy.rounds > 0 and self._completed() >= self.policy.rounds:
                return {"action": "done", "model_version": self.model.version if self.model else None}
            if r is None and self._dp_exhausted():     # the privacy budget ended the federation
                return {"action": "done", "model_version": self.model.version if self.model else None,
                        "reason": "dp_budget_exhausted"}
            desk = getattr(self, "stats_desk", None)
            sr = desk.round if desk is not None else None
            return {"action": "wait", "retry_after": self.poll_interval_s,
                    "round_id": r.id if r is not None else None,
                    # a statistics round open for this device: take part (GET /v1/stats-round)
                    **({"stats_round": sr.task.round_id} if sr is not None and device_id in sr.participants else {})}













    # ---- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"model_version": self.model.version if self.model else None,
                    "rounds_completed": self._completed(), "rounds_target": self.policy.rounds,
                    "devices": self.device_count(), "active_devices": len(self.eligible_devices()),
                    "round": self._round_status(self.round.id) if self.round else None,
                    "dp": self._dp_status()}

    def health(self) -> dict[str, Any]:
        """The public summary: the latest model version and the open round, if any. Reads
        two references without the lock (each is replaced whole), so it never waits for an
        upload's commit or a round's aggregation."""
        model, rnd = self.model, self.round
        return {"model_version": model.version if model else None, "round_id": rnd.id if rnd else None}

    def round_status(self, round_id: int) -> dict[str, Any]:
        with self._lock:
            return self._round_status(round_id)

    def _round_status(self, round_id: int) -> dict[str, Any]:
        row = self.db.one("SELECT * FROM rounds WHERE id = ?", round_id)
        if row is None:
            raise NotFound(f"round {round_id} does not exist", code="unknown_round")
        agg = self.db.one("SELECT COUNT(*) AS n, COALESCE(SUM(num_samples), 0) AS s FROM updates WHERE round_id = ?",
                          round_id)
        sampled = self.db.scalar("SELECT COUNT(*) FROM participants WHERE round_id = ?", round_id)
        sa = self._secagg_status(round_id)
        if sa is not None:       # no update rows: the masked inputs that counted and their Σn
            agg = {"n": sa["survivors"], "s": sa["total_samples"]}
        if "dp" in json.loads(row["task"]):   # a DP round: Σn is not covered by ε and not published
            agg = {"n": agg["n"], "s": None}
        return {"secure_aggregation": sa, "round_id": round_id, "state": row["state"], "model_version": row["model_version"],
                "sampled": sampled, "accepted": agg["n"], "total_samples": agg["s"], "quorum": row["quorum"],
                "opened_at": row["opened_at"], "deadline": row["deadline"], "closed_at": row["closed_at"],
                "result_version": row["result_version"], "reason": row["reason"]}




    def close(self) -> None:
        with self._lock:
            self._flush_seen(everything=True)
            self.db.close()






__all__ = ["Coordinator", "GlobalModel", "OpenRound", "validate_xi"]
