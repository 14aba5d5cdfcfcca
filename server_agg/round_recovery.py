"""Start-up recovery of the aggregation server: rebuild memory from disk (the latest version, the open
round's running sum from its persisted updates) and drop files no committed row refers to. A mixin
of :class:`server_agg.rounds.Coordinator`.
"""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

from fedfs_sdk.errors import CheckpointError
from fedfs_sdk.federation.wire import decode_update, decode_weights, sha256_hex

from .aggregate import StreamingFedAvg
from .config import RoundPolicy
from .dp import DpFedAvg, DpParams
from .round_models import _version_of
from .round_state import GlobalModel, OpenRound, _event


class Recovery:
    """A mixin of :class:`~server_agg.rounds.Coordinator` (it uses the coordinator's ``_lock``,
    ``db``, ``layout``, ``policy``, ``model``, ``round`` and ``clock``)."""

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


__all__ = ["Recovery"]
