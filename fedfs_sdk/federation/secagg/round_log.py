"""The round ids a device has taken part in, so it never runs one twice (issue 30, attack 1).

A server that re-runs one round id with the same task sees a device answer several times:
each run it may show the device another survivor set, another roster, another graph — and
combine what the runs reveal. A device therefore records a round id *before* its keys leave
(:meth:`SecAggDevice.advertise`) and refuses any later run of it, also after a restart: the
log is a small JSON file in the device state (written atomically, mode 0600).

Scope: round ids are the server's; a log is kept per ``scope`` (the pinned CA's key id, or
the server URL for an unauthenticated deployment), so a device enrolled with two operators
keeps the two apart. An operator whose server lost its database must start round ids above
the highest it used (docs/privacy.md) — the devices will not run a reused id again.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ...errors import InputError
from .errors import ReplayError

FORMAT = "fedfs-secagg-rounds/1"
FILENAME = "secagg_rounds.json"


class RoundLog:
    """Round ids taken part in, per scope; in memory when ``path`` is None (tests, simulation)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()
        self._seen: dict[str, set[int]] = {}
        self._crl: dict[str, int] = {}          # scope → highest revocation-list number accepted
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                if doc.get("format") != FORMAT:
                    raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT}")
                self._seen = {str(k): {int(r) for r in v} for k, v in doc["rounds"].items()}
                self._crl = {str(k): int(v) for k, v in doc.get("revocations", {}).items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                # never start from an empty log silently: that would re-open every past round id
                raise InputError(f"the device's secure-round log {self.path} is unreadable ({e}); restore it "
                                 "from a backup — deleting it lets a server re-run past rounds with this device")

    def seen(self, round_id: int, scope: str = "") -> bool:
        return int(round_id) in self._seen.get(scope, set())

    def check(self, round_id: int, scope: str, where: str) -> None:
        """:class:`ReplayError` if this device already took part in ``round_id``."""
        if self.seen(round_id, scope):
            raise ReplayError(f"{where}: this device already took part in round {round_id}; a server that runs a "
                              "round id again could combine what the runs reveal, so it is refused")

    def last_revocation(self, scope: str) -> int:
        """The highest revocation-list number accepted in ``scope`` (0: none yet)."""
        return self._crl.get(scope, 0)

    def note_revocation(self, scope: str, number: int) -> None:
        """Remember revocation list ``number`` (persisted): an older one is refused from now on."""
        with self._lock:
            if number > self._crl.get(scope, 0):
                self._crl[scope] = int(number)
                self._write()

    def _write(self) -> None:
        if self.path is not None:
            from ...fileio import atomic_write_bytes

            doc = {"format": FORMAT, "rounds": {k: sorted(v) for k, v in sorted(self._seen.items())},
                   "revocations": dict(sorted(self._crl.items()))}
            atomic_write_bytes(self.path, json.dumps(doc, separators=(",", ":")).encode(), mode=0o600)

    def record(self, round_id: int, scope: str, where: str) -> None:
        """Remember ``round_id`` (persisted before returning); :class:`ReplayError` if known."""
        with self._lock:
            self.check(round_id, scope, where)
            self._seen.setdefault(scope, set()).add(int(round_id))
            self._write()


__all__ = ["RoundLog", "FILENAME", "FORMAT"]
