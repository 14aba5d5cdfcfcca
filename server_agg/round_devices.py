"""Devices of the aggregation server: registration (id, bearer token, a unique FedUV base vector ``b_u``),
authentication and liveness (``last_seen``). A mixin of :class:`server_agg.rounds.Coordinator`.

Liveness counts authenticated requests only: registering is not one. A device registered ahead of
its first run (``fedfs ca request --server``) that then never runs — e.g. ``fedfs device`` refuses
its photos — is never sampled, so it cannot stall a secure round until the phase deadline.
"""
from __future__ import annotations

import secrets
import sqlite3
from typing import Any

from .auth import device_id_of, hash_token, new_device_id, new_device_token, tokens_equal
from .config import RoundPolicy
from .errors import Conflict, Unauthorized
from .round_state import BASE_BITS, SEEN_WRITE_INTERVAL_S, _event


class DeviceRegistry:
    """A mixin of :class:`~server_agg.rounds.Coordinator` (it uses the coordinator's ``_lock``,
    ``db``, ``layout``, ``policy``, ``model``, ``round``, ``clock`` and ``poll_interval_s``)."""

    def register(self) -> dict[str, Any]:
        """A new device: id, bearer token (only its hash is stored) and a unique ``b_u``."""
        with self._lock:
            for _ in range(64):
                device_id, base = new_device_id(), secrets.randbits(BASE_BITS)
                token = new_device_token(device_id)
                try:
                    with self.db.transaction() as c:
                        now = self.clock()
                        # last_seen NULL: not seen until its first authenticated request (a poll)
                        c.execute("INSERT INTO devices(id, token_hash, base, created_at, last_seen)"
                                  " VALUES (?, ?, ?, ?, NULL)", (device_id, hash_token(token), base, now))
                except sqlite3.IntegrityError:
                    continue  # id or b_u already taken: draw again (b_u is never reissued)
                self._seen[device_id] = self._seen_written[device_id] = float("-inf")
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

    def device_ttl(self, policy: RoundPolicy | None = None) -> float:
        """The liveness window in seconds under ``policy`` (default: the current one) and this
        server's poll interval (:meth:`RoundPolicy.device_ttl`)."""
        return (policy or self.policy).device_ttl(self.poll_interval_s)

    def eligible_devices(self, policy: RoundPolicy | None = None) -> list[str]:
        """Sorted ids of the devices a round may sample: all registered ones, or with a
        liveness window (:meth:`device_ttl` > 0) those whose last authenticated request is
        within it — never one that only registered."""
        ttl = self.device_ttl(policy)
        with self._lock:
            since = self.clock() - ttl
            return sorted(d for d, t in self._seen.items() if ttl <= 0 or t >= since)


__all__ = ["DeviceRegistry"]
