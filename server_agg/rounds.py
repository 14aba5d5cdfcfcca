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
"""
from __future__ import annotations

import json
import logging
import random
import secrets
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.federation.wire import (MODEL_FORMAT, check_finite, check_layout, clip_update, decode_update,
                            decode_weights, encode_update, encode_weights, model_nbytes, sha256_hex)

from .aggregate import StreamingFedAvg
from .auth import device_id_of, hash_token, new_device_id, new_device_token, tokens_equal
from .config import RoundPolicy, mismatch_reason, missing_model_field, proj_dim_mismatch
from .dp import DpFedAvg, DpParams, Ledger, dp_epsilon_cached, publish_record
from .errors import BadRequest, Conflict, Forbidden, Gone, NotFound, Unauthorized, Unprocessable
from .secagg_coord import SecAggCoordinator
from .secagg_rounds import SecAggRound
from .store import Database, Layout, atomic_write, commit_file, write_temp

log = logging.getLogger("fedfs.server")

BASE_BITS = 32
SEEN_WRITE_INTERVAL_S = 5.0
"""``devices.last_seen`` is rewritten at most this often per device (it only has to survive a
restart; the in-memory time decides liveness). A polling device costs no write per poll."""
@dataclass(frozen=True)
class GlobalModel:
    """A published global version held in memory (the reference of the open round)."""

    version: int
    sha256: str
    weights: dict[str, torch.Tensor]
    model_config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return model_nbytes(self.weights)


@dataclass
class OpenRound:
    id: int
    model_version: int
    task: dict[str, Any]
    policy: RoundPolicy
    participants: frozenset[str]
    quorum: int
    opened_at: float
    deadline: float
    acc: StreamingFedAvg | DpFedAvg
    accepted: dict[str, dict[str, Any]] = field(default_factory=dict)
    secagg: SecAggRound | None = None          # a secure-aggregation round (server_agg.secagg_rounds)


def _event(msg: str, **fields: Any) -> None:
    log.info(msg, extra={"fields": fields})


class Coordinator(SecAggCoordinator):
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

    # ---- devices -----------------------------------------------------------------------

    def register(self) -> dict[str, Any]:
        """A new device: id, bearer token (only its hash is stored) and a unique ``b_u``."""
        with self._lock:
            for _ in range(64):
                device_id, base = new_device_id(), secrets.randbits(BASE_BITS)
                token = new_device_token(device_id)
                try:
                    with self.db.transaction() as c:
                        now = self.clock()
                        c.execute("INSERT INTO devices(id, token_hash, base, created_at, last_seen)"
                                  " VALUES (?, ?, ?, ?, ?)", (device_id, hash_token(token), base, now, now))
                except sqlite3.IntegrityError:
                    continue  # id or b_u already taken: draw again (b_u is never reissued)
                self._seen[device_id] = self._seen_written[device_id] = now
                _event("device registered", device_id=device_id)
                return {"device_id": device_id, "token": token, "base_vector": base, "base_bits": BASE_BITS,
                        "secure_aggregation": bool(self.policy.secure_aggregation)}
        raise Conflict("could not allocate a unique base vector", code="base_space_exhausted")

    def authenticate(self, token: str | None) -> str:
        """The device id a bearer token belongs to; :class:`Unauthorized` otherwise."""
        if not token:
            raise Unauthorized("missing bearer token", code="missing_token")
        device_id = device_id_of(token)
        if device_id is None:
            raise Unauthorized("malformed device token", code="invalid_token")
        with self._lock:
            stored = self.db.scalar("SELECT token_hash FROM devices WHERE id = ?", device_id)
        if stored is None:
            raise Unauthorized(f"unknown device {device_id}", code="unknown_device")
        if not tokens_equal(token, stored):
            raise Unauthorized(f"invalid token for device {device_id}", code="invalid_token")
        self._saw(device_id)
        return device_id

    def _saw(self, device_id: str) -> None:
        """Record an authenticated request of ``device_id`` (its liveness); the database copy
        is written by a later :meth:`tick`, at most every ``SEEN_WRITE_INTERVAL_S`` seconds
        per device (it only has to survive a restart)."""
        now = self.clock()
        with self._lock:
            self._seen[device_id] = now
            self._seen_dirty.add(device_id)

    def _flush_seen(self, everything: bool = False) -> None:
        """Write the pending ``last_seen`` values that are ``SEEN_WRITE_INTERVAL_S`` newer
        than the stored ones (``everything``: all pending ones) in one transaction."""
        with self._lock:
            if not self._seen_dirty:
                return
            due = sorted(d for d in self._seen_dirty if everything or
                         self._seen[d] - self._seen_written.get(d, float("-inf")) >= SEEN_WRITE_INTERVAL_S)
            if not due:
                return
            with self.db.transaction() as c:
                c.executemany("UPDATE devices SET last_seen = ? WHERE id = ?", [(self._seen[d], d) for d in due])
            for d in due:
                self._seen_written[d] = self._seen[d]
            self._seen_dirty.difference_update(due)

    def device_count(self) -> int:
        with self._lock:
            return int(self.db.scalar("SELECT COUNT(*) FROM devices"))

    def eligible_devices(self, policy: RoundPolicy | None = None) -> list[str]:
        """Sorted ids of the devices a round may sample: all registered ones, or with a
        liveness window (``policy.device_ttl`` > 0) those seen within it."""
        ttl = (policy or self.policy).device_ttl
        with self._lock:
            since = self.clock() - ttl
            return sorted(d for d, t in self._seen.items() if ttl <= 0 or t >= since)

    # ---- models ------------------------------------------------------------------------

    def install_model(self, data: bytes, method: str | None = None) -> dict[str, Any]:
        """Publish an admin-supplied fedfs checkpoint as the next global version; with
        ``method``, also switch the policy's method in the same step. The model must be
        able to run the (resulting) method: else 409 ``model_method_mismatch``."""
        weights, config = self._decode_model(data)
        with self._lock:
            if self.round is not None:
                raise Conflict(f"round {self.round.id} is open; close it before installing a model",
                               code="round_open")
            policy = self.policy
            if method is not None:
                try:
                    policy = policy.updated({"method": method})
                except InputError as e:
                    raise Unprocessable(str(e), code="invalid_policy") from None
            missing = missing_model_field(policy.method, config)
            if missing is not None:
                hint = "" if method is not None else " (to switch both, POST the model with ?method=…)"
                raise Conflict(f"model rejected: {mismatch_reason(policy.method, missing)}{hint}",
                               code="model_method_mismatch")
            why = self._xi_mismatch(policy, config)
            if why is not None:
                raise Conflict(f"model rejected: {why}", code="proj_dim_mismatch")
            if policy != self.policy:
                self.db.set_meta("policy", json.dumps(policy.to_json()))
                self.policy = policy
            version = (self.model.version if self.model else 0) + 1
            self._publish(version, weights, config, round_id=None, count=0, samples=0)
        _event("model installed", version=version, method=self.policy.method)
        return self.model_info()

    @staticmethod
    def _decode_model(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Weights and model config of a fedfs checkpoint; 422 ``invalid_model`` if it is not one."""
        from fedfs_sdk.nn.model import FaceNet, ModelConfig

        try:
            weights, meta = decode_weights(data)
            if meta.get("format") != MODEL_FORMAT:
                raise InputError(f"not a fedfs checkpoint (format={meta.get('format')!r})")
            config = ModelConfig.from_json(meta.get("model_config", "null")).resolved()
            expected = FaceNet(config).state_dict()
            check_layout(weights, expected, "model")
            check_finite(weights, "model")
        except (InputError, TypeError, ValueError, RuntimeError, RecursionError) as e:
            # RuntimeError: torch refusing the architecture (ModelConfig bounds the sizes first)
            raise Unprocessable(f"model rejected: {str(e)[:300]}", code="invalid_model") from None
        return weights, json.loads(config.to_json())

    def _publish(self, version: int, weights: dict[str, torch.Tensor], model_config: dict[str, Any],
                 round_id: int | None, count: int, samples: int | None, reason: str | None = None,
                 dp: dict[str, Any] | None = None) -> str:
        """Write version ``version`` and close its round. ``samples`` is ``Σ|D_c|``, or None in a
        DP round: the accountant covers the model, not the sample counts, so they are not published."""
        meta = {"version": version, "round_id": round_id, "num_updates": count, "total_samples": samples}
        if dp is not None:
            meta["dp"] = dp                            # the (ε, δ) this version is published with
        data = encode_weights(weights, {"format": MODEL_FORMAT, "model_config": json.dumps(model_config, sort_keys=True),
                                        "meta": json.dumps(meta)})
        path = self.layout.model_file(version)
        atomic_write(path, data)                       # the file first …
        sha = sha256_hex(data)
        with self.db.transaction() as c:               # … then the row that makes it visible
            c.execute("INSERT INTO models(version, file, sha256, round_id, num_updates, total_samples, created_at)"
                      " VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (version, path.name, sha, round_id, count, samples or 0, self.clock()))
            if round_id is not None:
                c.execute("UPDATE rounds SET state = 'closed', closed_at = ?, result_version = ?, reason = ?"
                          " WHERE id = ?", (self.clock(), version, reason, round_id))
            if dp is not None:
                c.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                          (f"dp_model_v{version}", json.dumps(dp)))
        self.model = GlobalModel(version, sha, {k: v.clone() for k, v in weights.items()}, model_config)
        return sha

    def model_info(self) -> dict[str, Any]:
        with self._lock:
            m = self.model
            if m is None:
                raise NotFound("no global model yet", code="no_model")
            dp = self.db.get_meta(f"dp_model_v{m.version}")
            from .impostor_store import impostors_sha256   # what ships with the model (docs/protocol.md)

            return {"version": m.version, "sha256": m.sha256, "config": m.model_config,
                    "nbytes": m.nbytes, "dp": json.loads(dp) if dp else None,
                    "xi_sha256": self.db.get_meta("xi_sha256"), "impostors_sha256": impostors_sha256(self)}

    def model_file(self, version: int) -> tuple[Path, str]:
        with self._lock:
            row = self.db.one("SELECT file, sha256 FROM models WHERE version = ?", version)
        if row is None:
            raise NotFound(f"model version {version} does not exist", code="unknown_model_version")
        return self.layout.models / row["file"], row["sha256"]

    def _xi_mismatch(self, policy: RoundPolicy, model_config: Mapping[str, Any] | None) -> str | None:
        """Why devices could not train ``policy`` on ``model_config`` with the served ξ, if so."""
        if not self.layout.xi.is_file() or model_config is None:
            return None
        from fedfs_sdk.nn.model import ModelConfig
        from fedfs_sdk.federation.wire_format import read_header

        try:
            meta = read_header(self.layout.xi.read_bytes())[1]
            xi_config = json.loads(ModelConfig.from_json(meta.get("model_config", "null")).resolved().to_json())
        except (OSError, InputError, ValueError):
            return None                       # a ξ without a readable config: nothing to compare
        bad = proj_dim_mismatch(policy.method, model_config, xi_config, policy.train)
        if bad is None:
            return None
        have, need, xi_dim, combine = bad
        return (f"proj_dim {have} cannot be trained with the served ξ: its embedding has {xi_dim} dims and "
                f"FedFS (combine={combine!r}) needs proj_dim = {need}")

    def xi_sha256(self) -> str | None:
        with self._lock:
            return self.db.get_meta("xi_sha256")

    def install_xi(self, data: bytes) -> str:
        """Store the frozen ξ checkpoint that FedFS devices may download (read-only)."""
        validate_xi(data)
        sha = sha256_hex(data)
        with self._lock:
            atomic_write(self.layout.xi, data)
            self.db.set_meta("xi_sha256", sha)
        _event("xi installed", sha256=sha)
        return sha

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
                        f"{len(devices)} of {registered} registered device(s) contacted the server in the last "
                        f"device_ttl_s = {policy.device_ttl:g} s")
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
                    "xi_sha256": self.db.get_meta("xi_sha256")}
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
            new = r.acc.result()
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
            p = self.policy
            if self.round is None and p.rounds > 0 and self.model is not None and self._completed() < p.rounds:
                if len(self.eligible_devices(p)) >= p.min_participants and not self._dp_exhausted():
                    self.open_round()

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
            return {"action": "wait", "retry_after": self.poll_interval_s,
                    "round_id": r.id if r is not None else None}

    def check_upload(self, device_id: str, round_id: int) -> None:
        """Refuse, before its body is read, an upload that no body could make acceptable:
        the round is not open (and the device has no accepted update in it to retry), its
        deadline passed, or the device was not sampled. An upload that may be a retry of an
        accepted body passes (its hash decides, in :meth:`submit_update`)."""
        with self._lock:
            r = self.round
            if r is not None and r.id == round_id and device_id in r.accepted:
                return
            if (r is None or r.id != round_id) and self.db.scalar(
                    "SELECT 1 FROM updates WHERE round_id = ? AND device_id = ?", round_id, device_id) is not None:
                return
            self._upload_target(device_id, round_id)

    def submit_update(self, device_id: str, round_id: int, body: bytes) -> dict[str, Any]:
        """Validate and accept one upload. Returns the receipt (``duplicate`` on a retry)."""
        body_sha = sha256_hex(body)
        with self._lock:
            prev = self._previous(device_id, round_id, body_sha)
            if prev is not None:
                return prev
            r = self._upload_target(device_id, round_id)
            reference, policy, base_version = self.model.weights, r.policy, r.model_version  # type: ignore[union-attr]
        weights, n, norm, clipped, stored = self._validate(body, round_id, base_version, reference, policy)
        tmp = write_temp(self.layout.round_dir(round_id), stored)
        try:
            with self._lock:
                prev = self._previous(device_id, round_id, body_sha)   # a concurrent retry won
                if prev is not None:
                    return prev
                r = self._upload_target(device_id, round_id)   # it may have closed meanwhile
                final = self.layout.update_file(round_id, device_id)
                commit_file(tmp, final)
                received = self.clock()
                try:
                    with self.db.transaction() as c:
                        c.execute("INSERT INTO updates(round_id, device_id, num_samples, body_sha256, file, file_sha256,"
                                  " norm, clipped, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                  (round_id, device_id, n, body_sha, final.name, sha256_hex(stored), norm,
                                   int(clipped), received))
                except BaseException:
                    final.unlink(missing_ok=True)
                    raise
                r.acc.add(weights, n)
                receipt = self._receipt(round_id, device_id, n, body_sha, norm, clipped, received)
                r.accepted[device_id] = receipt
                _event("update accepted", round_id=round_id, device_id=device_id, num_samples=n,
                       norm=round(norm, 6), clipped=clipped, accepted=len(r.accepted), quorum=r.quorum)
                if len(r.accepted) >= r.quorum:
                    self._close_locked("quorum")
                return dict(receipt, duplicate=False)
        finally:
            tmp.unlink(missing_ok=True)

    def _past_state(self, round_id: int) -> str:
        """State of a round that is not the open one; 404 if it never existed."""
        state = self.db.scalar("SELECT state FROM rounds WHERE id = ?", round_id)
        if state is None:
            raise NotFound(f"round {round_id} does not exist", code="unknown_round")
        return str(state)

    def _upload_target(self, device_id: str, round_id: int) -> OpenRound:
        r = self.round
        if r is None or r.id != round_id:
            raise Gone(f"round {round_id} is {self._past_state(round_id)}; it accepts no more uploads",
                       code="round_closed")
        if r.secagg is not None:
            raise Conflict(f"round {round_id} runs secure aggregation: a plain update is refused; send a masked "
                           f"input (PUT /v1/rounds/{round_id}/secagg/masked-input)", code="secure_round")
        if self.clock() >= r.deadline:
            self._close_locked("deadline")
            raise Gone(f"round {round_id} passed its deadline", code="deadline_passed")
        if device_id not in r.participants:
            raise Forbidden(f"device {device_id} was not sampled for round {round_id}", code="not_selected")
        return r

    def _previous(self, device_id: str, round_id: int, body_sha: str) -> dict[str, Any] | None:
        """The receipt of an already accepted identical upload (a retry: same answer,
        counted once) — also after the round closed, so a device whose answer was lost
        learns its update counted. A *different* second body in an open round → 409."""
        r = self.round
        if r is not None and r.id == round_id:
            prev = r.accepted.get(device_id)
            if prev is None:
                return None
            if prev["sha256"] != body_sha:
                raise Conflict(f"device {device_id} already has an accepted update in round {round_id}; "
                               "a different second update is refused", code="already_uploaded")
            return dict(prev, duplicate=True)
        u = self.db.one("SELECT * FROM updates WHERE round_id = ? AND device_id = ?", round_id, device_id)
        if u is None or u["body_sha256"] != body_sha:
            return None                            # → _upload_target says why it is refused
        if self.db.scalar("SELECT state FROM rounds WHERE id = ?", round_id) == "failed":
            # accepted once, but the round ended without aggregating: it did not count
            raise Gone(f"round {round_id} failed (too few updates by its deadline); "
                       "this update was received but not aggregated", code="round_failed")
        return dict(self._receipt(round_id, device_id, u["num_samples"], u["body_sha256"], u["norm"],
                                  bool(u["clipped"]), u["received_at"]), duplicate=True)

    @staticmethod
    def _receipt(round_id: int, device_id: str, n: int, sha: str, norm: float, clipped: bool,
                 received: float) -> dict[str, Any]:
        return {"round_id": round_id, "device_id": device_id, "num_samples": n, "sha256": sha,
                "update_norm": norm, "clipped": clipped, "received_at": received}

    @staticmethod
    def _validate(body: bytes, round_id: int, base_version: int, reference: Mapping[str, torch.Tensor],
                  policy: RoundPolicy) -> tuple[dict[str, torch.Tensor], int, float, bool, bytes]:
        try:
            weights, meta = decode_update(body)
        except InputError as e:
            raise BadRequest(f"malformed update: {e}", code="malformed_update") from None
        if meta.round_id != round_id:
            raise BadRequest(f"update is for round {meta.round_id} but was sent to round {round_id}",
                             code="round_mismatch")
        if meta.model_version != base_version:
            raise Conflict(f"stale update: trained from model version {meta.model_version}, round {round_id} "
                           f"aggregates version {base_version}", code="stale_model_version")
        if meta.num_samples > policy.max_num_samples:
            raise Unprocessable(f"num_samples={meta.num_samples} exceeds the limit {policy.max_num_samples}",
                                code="too_many_samples")
        try:
            check_layout(weights, reference)
            check_finite(weights)
        except InputError as e:
            raise Unprocessable(str(e), code="invalid_update") from None
        clipped_w, norm, clipped = clip_update(weights, reference, policy.max_update_norm)
        stored = body if not clipped else encode_update(clipped_w, round_id=round_id, model_version=base_version,
                                                        num_samples=meta.num_samples)
        return clipped_w, meta.num_samples, norm, clipped, stored

    # ---- user-level DP (server_agg.dp) -------------------------------------------------

    def _dp_ledger(self) -> Ledger:
        return Ledger.from_json(self.db.get_meta("dp_ledger"))

    def _dp_check_budget(self, policy: RoundPolicy, eligible: int) -> tuple[Ledger, DpParams | None]:
        """The ledger with the round about to open charged, and its DP mechanism (None: no
        DP). 409 ``dp_budget_exhausted`` if the round would take ε above the budget."""
        ledger = self._dp_ledger()
        if not policy.dp:
            return ledger.charge_non_private(), None
        q, sigma = policy.participation, float(policy.dp_noise_multiplier)  # type: ignore[arg-type]
        after = ledger.charge(q, sigma)
        if policy.dp_epsilon_budget is not None:
            eps = dp_epsilon_cached(after.to_json(), float(policy.dp_delta), policy.dp_accountant)  # type: ignore[arg-type]
            if eps > policy.dp_epsilon_budget:
                now = dp_epsilon_cached(ledger.to_json(), float(policy.dp_delta), policy.dp_accountant)  # type: ignore[arg-type]
                why = (f"{ledger.non_private} round(s) of this state ran without DP, so no finite ε holds"
                       if ledger.non_private else f"ε = {now:.4g} spent in {ledger.rounds} round(s)")
                raise Conflict(f"privacy budget exhausted: {why}; one more round (q = {q:g}, σ = {sigma:g}) would "
                               f"reach ε = {eps:.4g} > dp_epsilon_budget = {policy.dp_epsilon_budget:g} at "
                               f"δ = {policy.dp_delta:g}", code="dp_budget_exhausted")
        params = DpParams(clip=float(policy.max_update_norm), noise_multiplier=sigma,  # type: ignore[arg-type]
                          denominator=q * eligible, weight_cap=policy.dp_weight_cap)
        return after, params

    def _dp_exhausted(self) -> bool:
        """Whether the budget refuses the next round (False without DP or without a budget)."""
        p = self.policy
        if not p.dp or p.dp_epsilon_budget is None:
            return False
        after = self._dp_ledger().charge(p.participation, float(p.dp_noise_multiplier))  # type: ignore[arg-type]
        return dp_epsilon_cached(after.to_json(), float(p.dp_delta), p.dp_accountant) > p.dp_epsilon_budget  # type: ignore[arg-type]

    def _dp_statement(self, policy: RoundPolicy, params: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The (ε, δ) a version published now carries (None when DP was never on)."""
        ledger = self._dp_ledger()
        if params is None and not ledger.counts:
            return None
        delta = policy.dp_delta if policy.dp_delta is not None else self.policy.dp_delta
        if delta is None:
            return None
        return publish_record(ledger, float(delta), policy.dp_epsilon_budget, policy.dp_accountant,
                              DpParams.from_json(params) if params is not None else None,
                              policy.participation if params is not None else None)

    def _dp_status(self) -> dict[str, Any] | None:
        p = self.policy
        if not p.dp and not self._dp_ledger().counts:
            return None
        ledger = self._dp_ledger()
        st = publish_record(ledger, float(p.dp_delta), p.dp_epsilon_budget, p.dp_accountant, None, None) \
            if p.dp_delta is not None else {}
        return {**st, "epsilon_budget": p.dp_epsilon_budget, "budget_exhausted": self._dp_exhausted(),
                "noise_multiplier": p.dp_noise_multiplier, "clip": p.max_update_norm,
                "sampling_rate": p.participation if p.dp else None}

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

    # ---- recovery ----------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild memory from disk: the latest version, and the open round's running sum
        from its persisted updates; drop files that no committed row refers to."""
        with self._lock:
            self._seen = {r["id"]: r["last_seen"] if r["last_seen"] is not None else float("-inf")
                          for r in self.db.all("SELECT id, last_seen FROM devices")}
            self._seen_written = dict(self._seen)
            row = self.db.one("SELECT * FROM models ORDER BY version DESC LIMIT 1")
            latest = 0
            if row is not None:
                latest = row["version"]
                data = self._read_checked(self.layout.models / row["file"], row["sha256"], f"model v{latest}")
                weights, meta = decode_weights(data)
                self.model = GlobalModel(latest, row["sha256"], weights, json.loads(meta["model_config"]))
            for p in self.layout.models.iterdir():       # versions written but never committed
                if p.name.startswith(".") or not p.name.startswith("v") or _version_of(p) > latest:
                    p.unlink(missing_ok=True)
            open_row = self.db.one("SELECT * FROM rounds WHERE state = 'open'")
            if open_row is not None:
                self._recover_round(open_row)
            for d in self.layout.updates.iterdir():
                if self.round is not None and d == self.layout.round_dir(self.round.id):
                    continue
                if self.keep_updates and d.is_dir():
                    for t in d.glob(".*"):
                        t.unlink(missing_ok=True)
                else:
                    shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
            self._secagg_cleanup()
            if self.round is not None and len(self.round.accepted) >= self.round.quorum:
                self._close_locked("quorum")             # crashed between the last accept and the close

    def _recover_round(self, row: sqlite3.Row) -> None:
        if self.model is None or self.model.version != row["model_version"]:
            raise CheckpointError(f"round {row['id']} is open on model version {row['model_version']}, "
                                  "which is not the latest published version: state is inconsistent")
        rid = row["id"]
        policy = RoundPolicy.from_json(json.loads(row["policy"]))
        participants = frozenset(r[0] for r in self.db.all("SELECT device_id FROM participants WHERE round_id = ?", rid))
        task = json.loads(row["task"])
        acc = StreamingFedAvg(self.model.weights) if "dp" not in task else \
            DpFedAvg(self.model.weights, DpParams.from_json(task["dp"]))
        r = OpenRound(rid, row["model_version"], task, policy, participants, row["quorum"],
                      row["opened_at"], row["deadline"], acc)
        if "secagg" in task:           # restore the protocol state, or fail the round cleanly
            if self._secagg_recover(r):
                self.round = r
                _event("round recovered", round_id=rid, secure_aggregation=r.secagg.counts())  # type: ignore[union-attr]
            return
        keep: set[str] = set()
        for u in self.db.all("SELECT * FROM updates WHERE round_id = ? ORDER BY received_at", rid):
            path = self.layout.round_dir(rid) / u["file"]
            data = self._read_checked(path, u["file_sha256"], f"update of {u['device_id']} in round {rid}")
            weights, _ = decode_update(data)
            r.acc.add(weights, u["num_samples"])
            r.accepted[u["device_id"]] = self._receipt(rid, u["device_id"], u["num_samples"], u["body_sha256"],
                                                       u["norm"], bool(u["clipped"]), u["received_at"])
            keep.add(u["file"])
        rdir = self.layout.round_dir(rid)
        if rdir.is_dir():
            for p in rdir.iterdir():                   # files of requests interrupted before their commit
                if p.name not in keep:
                    p.unlink(missing_ok=True)
        self.round = r
        _event("round recovered", round_id=rid, accepted=len(r.accepted), total_samples=r.acc.total_samples)

    @staticmethod
    def _read_checked(path: Path, sha: str, what: str) -> bytes:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{what}: cannot read {path}: {e}") from None
        if sha256_hex(data) != sha:
            raise CheckpointError(f"{what}: {path} does not match its recorded SHA-256; the state is corrupt")
        return data

    def close(self) -> None:
        with self._lock:
            self._flush_seen(everything=True)
            self.db.close()


def validate_xi(data: bytes) -> None:
    """:class:`CheckpointError` unless ``data`` is a readable fedfs checkpoint (for ξ)."""
    try:
        _, meta = decode_weights(data)
    except InputError as e:
        raise CheckpointError(f"ξ is not a readable safetensors checkpoint: {e}") from None
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"ξ is not a fedfs checkpoint (format={meta.get('format')!r})")


def _version_of(p: Path) -> int:
    try:
        return int(p.name[1:].split(".")[0])
    except ValueError:
        return 1 << 62  # not a version file: treated as an orphan


__all__ = ["Coordinator", "GlobalModel", "OpenRound", "validate_xi"]
