"""Plain (not secure-aggregation) uploads of a round: refuse early, validate outside the lock, accept
once (the database commit of the update row, after its file is durable), answer retries with the
same receipt. A mixin of :class:`server_agg.rounds.Coordinator`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.wire import (check_finite, check_layout, clip_update, decode_update, encode_update,
                                       sha256_hex)

from .config import RoundPolicy
from .errors import BadRequest, Conflict, Forbidden, Gone, NotFound, Unprocessable
from .round_state import OpenRound, _event
from .store import commit_file, write_temp


class UploadIntake:
    """A mixin of :class:`~server_agg.rounds.Coordinator` (it uses the coordinator's ``_lock``,
    ``db``, ``layout``, ``policy``, ``model``, ``round`` and ``clock``)."""

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


__all__ = ["UploadIntake"]
