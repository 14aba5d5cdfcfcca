"""The coordinator's secure-aggregation part (a mixin of :class:`server_agg.rounds.Coordinator`).

Kept apart from ``rounds.py``: opening a secure round, serving each device its view,
accepting protocol messages, closing phases at their deadlines, publishing the unmasked
FedAvg, failing the round cleanly, and recovering it after a restart. Every method that
touches the round runs under the coordinator's lock.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from typing import TYPE_CHECKING, Any, Sequence

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import DevicePolicy, RefusedError, RoundFailedError, SecAggResult
from fedfs_sdk.federation.secagg.dp_input import DP_INPUT
from fedfs_sdk.federation.secagg.http_device import params_from_task, secure_tensors, task_context
from fedfs_sdk.federation.secagg.params import PROTOCOL_V2
from fedfs_sdk.federation.secagg.revocation import SERVER_FILENAME, RevocationList

from .errors import Conflict, Forbidden, Gone, NotFound
from .frozen_trunk import keep_frozen_trunk
from .secagg_rounds import SecAggRound, ca_of, task_fields
from .secure_layout import expand_top, secure_layout, unflatten

if TYPE_CHECKING:
    from .rounds import OpenRound

log = logging.getLogger("fedfs.server")

JSON_BODY_BASE = 16 << 10
JSON_BODY_PER_DEVICE = 1 << 10
"""A share-keys / unmask body holds at most a few hundred bytes per device of the round."""


class SecAggCoordinator:
    """Mixin: needs the coordinator's ``_lock``, ``round``, ``model``, ``layout``, ``db``,
    ``clock``, ``poll_interval_s``, ``keep_updates``, ``_publish`` and ``_past_state``."""

    round: "OpenRound | None"

    def _secagg_path(self, round_id: int) -> Any:
        return self.layout.root / "secagg" / f"r{round_id:06d}.json"  # type: ignore[attr-defined]

    def _secagg_open(self, policy: Any, round_id: int, selected: Sequence[str], model: Any,
                     opened: float, task: dict[str, Any]) -> SecAggRound | None:
        """The protocol state of a new round (None: not a secure round); 409 if the round
        cannot run securely (too few devices, a fixed-point range that does not fit). ``task``
        is the round's task so far: an authenticated round's signatures bind its digest."""
        if not policy.secure_aggregation:
            return None
        if len(selected) < policy.secagg_min_devices:
            raise Conflict(f"a secure-aggregation round needs at least secagg_min_devices = "
                           f"{policy.secagg_min_devices} devices; {len(selected)} sampled", code="too_few_devices")
        tensors, masked = secure_layout(policy, model.weights)
        fields = task_fields(policy, {k: tuple(t.shape) for k, t in masked.items()}, len(selected), tensors)
        fields = self._secagg_checked(policy, fields, round_id, len(selected))
        sr = SecAggRound(round_id, selected, fields, self._secagg_path(round_id), opened,
                         opened + policy.round_timeout_s, task_context({**task, "secagg": fields}), ca_of(policy))
        sr.path.parent.mkdir(parents=True, exist_ok=True)
        sr.save()                  # the file first, then the round's row (a row without a file fails cleanly)
        return sr

    def _secagg_checked(self, policy: Any, fields: dict[str, Any], round_id: int, n: int,
                        what: str = "round") -> dict[str, Any]:
        """``fields`` of a new secure round (weight or statistics round) with the operator's
        revocation list added under ``fedfs-secagg/2``, checked: 409 if the parameters do not fit
        or devices with the default floors would refuse them (issue 30)."""
        crl = self.layout.root / SERVER_FILENAME  # type: ignore[attr-defined]
        fields = dict(fields)
        if fields.get("protocol") == PROTOCOL_V2 and crl.is_file():   # the operator's list (issue 30)
            try:
                fields["revocations"] = RevocationList.load(crl).to_json()
            except InputError as e:
                raise Conflict(f"secure aggregation cannot run this {what}: {e}", code="secagg_revocations") from None
        try:
            params = params_from_task(round_id, fields)
            params.threshold_for(n)
            if params.authenticated:     # what every device with the default floors would refuse (issue 30)
                DevicePolicy(ca=ca_of(policy)).check_params(params, f"{what} {round_id}")
        except InputError as e:
            raise Conflict(f"secure aggregation cannot run this {what}: {e}", code="secagg_params") from None
        except RefusedError as e:
            raise Conflict(f"secure aggregation cannot run this {what}: devices with the default floors refuse it: "
                           f"{e}", code="secagg_params") from None
        return fields

    # ---- devices -----------------------------------------------------------------------
    def _secagg_target(self, device_id: str, round_id: int) -> "OpenRound":
        r = self.round
        if r is None or r.id != round_id:
            raise Gone(f"round {round_id} is {self._past_state(round_id)}; it takes no more messages",  # type: ignore[attr-defined]
                       code="round_closed")
        if r.secagg is None:
            raise Conflict(f"round {round_id} is not a secure-aggregation round; upload with "
                           f"PUT /v1/rounds/{round_id}/update", code="not_secure_round")
        self._secagg_tick(r)                    # a phase whose deadline passed closes first
        if self.round is not r:
            raise Gone(f"round {round_id} ended", code="round_closed")
        r.secagg.index_of(device_id)
        return r

    def secagg_check(self, device_id: str, round_id: int, step: str) -> int:
        """Refuse before the body is read what no body could make acceptable; returns the
        body limit in bytes (exactly the masked vector's size for ``masked-input``)."""
        with self._lock:  # type: ignore[attr-defined]
            r = self._secagg_target(device_id, round_id)
            assert r.secagg is not None
            if step == "masked-input":
                return 8 * r.secagg.params.words
            return JSON_BODY_BASE + JSON_BODY_PER_DEVICE * len(r.secagg.participants)

    def secagg_receive(self, device_id: str, round_id: int, step: str, payload: bytes) -> dict[str, Any]:
        with self._lock:  # type: ignore[attr-defined]
            r = self._secagg_target(device_id, round_id)
            assert r.secagg is not None
            ack = r.secagg.receive(device_id, step, payload)
            if step == "masked-input":
                ack["sha256"] = hashlib.sha256(payload).hexdigest()
            self._secagg_tick(r)                # everyone answered: close the phase now
            return ack

    def secagg_view(self, device_id: str, round_id: int) -> dict[str, Any]:
        with self._lock:  # type: ignore[attr-defined]
            r = self.round
            if r is not None and r.id == round_id and r.secagg is not None:
                self._secagg_tick(r)
                if self.round is r:
                    return r.secagg.view(device_id, self.poll_interval_s)  # type: ignore[attr-defined]
            row = self.db.one("SELECT state, result_version, reason, task FROM rounds WHERE id = ?",  # type: ignore[attr-defined]
                              round_id)
            if row is None:
                raise NotFound(f"round {round_id} does not exist", code="unknown_round")
            if "secagg" not in json.loads(row["task"]):
                raise Conflict(f"round {round_id} is not a secure-aggregation round", code="not_secure_round")
            if self.db.scalar("SELECT 1 FROM participants WHERE round_id = ? AND device_id = ?",  # type: ignore[attr-defined]
                              round_id, device_id) is None:
                raise Forbidden(f"device {device_id} was not sampled for round {round_id}", code="not_selected")
            phase = {"closed": "done", "failed": "failed"}.get(row["state"], "closed")
            return {"round_id": round_id, "phase": phase, "result_version": row["result_version"],
                    "reason": row["reason"], "retry_after": self.poll_interval_s}  # type: ignore[attr-defined]

    # ---- phases, end of round ----------------------------------------------------------
    def _secagg_tick(self, r: "OpenRound") -> None:
        assert r.secagg is not None
        try:
            result = r.secagg.advance(self.clock())  # type: ignore[attr-defined]
        except RoundFailedError as e:
            self._secagg_fail(r, str(e))
            return
        if result is not None:
            self._secagg_finish(r, result)

    def _secagg_summary(self, r: "OpenRound", result: SecAggResult | None) -> None:
        assert r.secagg is not None
        s = {**r.secagg.counts(), "survivors": len(result.survivors) if result else len(r.secagg.srv.u3),
             "total_samples": (None if "dp" in r.task else result.total_samples) if result else 0,
             "dropped": {k: len(v) for k, v in (result.dropped if result else r.secagg.srv.dropped).items()}}
        self.db.set_meta(f"secagg_r{r.id}", json.dumps(s))  # type: ignore[attr-defined]

    def _secagg_finish(self, r: "OpenRound", result: SecAggResult) -> None:
        model = self.model  # type: ignore[attr-defined]
        if "dp" in r.task:
            # DP-FedAvg: the unmasked sum is Σ n'·clip_C(Δ) (devices clipped and weighed); the
            # round's DpFedAvg adds N(0, σ²C²) once, here, and divides by the fixed q·N. The
            # server sees this sum without noise (central DP; docs/privacy.md says so).
            # With distributed noise (task secagg.dp_noise) each of the ≥ m inputs already carries
            # N(0, σ²C²/m): nothing is added here, and the server never saw a noiseless sum.
            # the unmasked sum in units of Σ w_k Δ_k: the weight words are 1 each (dp_weighted_delta), or Σ n'
            # of the previous input, where the mean is over Σ n' and the weights are n'/ŵ
            scale = float(result.total_samples) if r.secagg.fields.get("input") == DP_INPUT else \
                float(result.total_samples) / float(r.task["dp"]["weight_cap"])  # type: ignore[union-attr]
            full = expand_top(result.mean.astype("float64"), model.weights, secure_tensors(r.secagg.fields))
            r.acc.add_secure_sum(full * scale, len(result.survivors))
            distributed = r.secagg.min_inputs > 0  # type: ignore[union-attr]
            weights = r.acc.result(add_noise=not distributed)
        else:
            weights = unflatten(result.mean, model.weights, secure_tensors(r.secagg.fields))
        # scope=top: the trunk comes back as it went out, not with the fixed-point rounding (or DP noise)
        weights = keep_frozen_trunk(weights, model.weights, r.policy.train)
        dp = self._dp_statement(r.policy, r.task.get("dp"))  # type: ignore[attr-defined]  # as a plain round's
        if dp is not None and "dp" in r.task:
            dp = {**dp, "noise": "distributed" if r.secagg.min_inputs else "central",  # type: ignore[union-attr]
                  "noise_min_inputs": r.secagg.min_inputs or None}  # type: ignore[union-attr]
        self._secagg_summary(r, result)
        version = model.version + 1
        samples = None if "dp" in r.task else result.total_samples   # DP: Σn is not covered by ε, not published
        self._publish(version, weights, model.model_config, r.id, len(result.survivors),  # type: ignore[attr-defined]
                      samples, "secure aggregation", dp=dp)
        log.info("round closed", extra={"fields": {"round_id": r.id, "secure_aggregation": True,
                                                   "protocol": r.secagg.params.protocol,  # type: ignore[union-attr]
                                                   "survivors": len(result.survivors), "dropped": result.dropped,
                                                   "total_samples": samples, "new_version": version}})
        self._secagg_end(r)

    def _secagg_fail(self, r: "OpenRound", why: str) -> None:
        self._secagg_summary(r, None)
        with self.db.transaction() as c:  # type: ignore[attr-defined]
            c.execute("UPDATE rounds SET state = 'failed', closed_at = ?, reason = ? WHERE id = ?",
                      (self.clock(), why[:500], r.id))  # type: ignore[attr-defined]
        log.info("round failed", extra={"fields": {"round_id": r.id, "secure_aggregation": True, "reason": why}})
        self._secagg_end(r)

    def _secagg_end(self, r: "OpenRound") -> None:
        assert r.secagg is not None
        r.secagg.remove()
        self.round = None
        if not self.keep_updates:  # type: ignore[attr-defined]
            shutil.rmtree(self.layout.round_dir(r.id), ignore_errors=True)  # type: ignore[attr-defined]

    # ---- status, recovery --------------------------------------------------------------
    def _secagg_status(self, round_id: int) -> dict[str, Any] | None:
        r = self.round
        if r is not None and r.id == round_id and r.secagg is not None:
            return {**r.secagg.counts(), "survivors": len(r.secagg.srv.u3),
                    "total_samples": None if "dp" in r.task else 0}
        raw = self.db.get_meta(f"secagg_r{round_id}")  # type: ignore[attr-defined]
        return json.loads(raw) if raw else None

    def _secagg_recover(self, r: "OpenRound") -> bool:
        """Load the open secure round's state; False (round failed cleanly) if it is unreadable."""
        try:
            r.secagg = SecAggRound.load(self._secagg_path(r.id), r.id)
            return True
        except InputError as e:
            with self.db.transaction() as c:  # type: ignore[attr-defined]
                c.execute("UPDATE rounds SET state = 'failed', closed_at = ?, reason = ? WHERE id = ?",
                          (self.clock(), f"secure-aggregation state lost at restart: {e}"[:500], r.id))  # type: ignore[attr-defined]
            log.info("round failed", extra={"fields": {"round_id": r.id, "reason": str(e)}})
            return False

    def _secagg_cleanup(self) -> None:
        """Remove protocol files of rounds that are not open (a crash between file and row)."""
        d = self.layout.root / "secagg"  # type: ignore[attr-defined]
        if not d.is_dir():
            return
        keep = self.round.secagg.path if self.round is not None and self.round.secagg else None
        for p in d.iterdir():
            if keep is None or p.name.split(".")[0] != keep.stem:   # a stale sum file goes at the next save
                p.unlink(missing_ok=True)


__all__ = ["SecAggCoordinator"]
