"""Durable server state: one SQLite database (WAL) plus immutable tensor files.

Layout of the state directory::

    server.db                      devices, rounds, participants, updates, models, policy
    .lock                          held (flock) by the one ``fedfs serve`` using this state; holds its pid
    admin_token                    generated admin token (0600), only if none was supplied
    xi.safetensors                 frozen ξ checkpoint served read-only (optional)
    models/v000001.safetensors     published global versions (fedfs checkpoints)
    updates/r000001/<device>.safetensors   accepted updates of the open round

Crash-safety rule: a tensor file is written (temp file, fsync, rename, fsync dir) *before*
the database row that refers to it is committed; the commit is the moment of acceptance.
On start-up, files without a row are orphans of an interrupted request and are removed,
so a SIGKILL at any instant leaves every accepted update exactly once.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fedfs_sdk.errors import FedFSError
from fedfs_sdk.fileio import lock_file, unlock_file

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices(
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL,
    base INTEGER NOT NULL UNIQUE,           -- FedUV b_u: UNIQUE and never deleted, so never reissued
    created_at REAL NOT NULL,
    last_seen REAL);                        -- last authenticated request (liveness for sampling)
CREATE TABLE IF NOT EXISTS models(
    version INTEGER PRIMARY KEY,
    file TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    round_id INTEGER,                       -- NULL for a model installed by the admin
    num_updates INTEGER NOT NULL DEFAULT 0,
    total_samples INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rounds(
    id INTEGER PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('open', 'closed', 'failed')),
    model_version INTEGER NOT NULL,
    task TEXT NOT NULL,                     -- JSON snapshot: method, model config, train settings
    policy TEXT NOT NULL,                   -- JSON snapshot of the RoundPolicy it was opened with
    quorum INTEGER NOT NULL,
    opened_at REAL NOT NULL,
    deadline REAL NOT NULL,
    closed_at REAL,
    result_version INTEGER,
    reason TEXT);
CREATE UNIQUE INDEX IF NOT EXISTS one_open_round ON rounds(state) WHERE state = 'open';
CREATE TABLE IF NOT EXISTS participants(
    round_id INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    PRIMARY KEY (round_id, device_id));
CREATE TABLE IF NOT EXISTS updates(
    round_id INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    num_samples INTEGER NOT NULL,
    body_sha256 TEXT NOT NULL,              -- of the bytes received (identifies a retry)
    file TEXT NOT NULL,
    file_sha256 TEXT NOT NULL,              -- of the bytes stored (differs when clipped)
    norm REAL NOT NULL,
    clipped INTEGER NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (round_id, device_id));
"""


@dataclass(frozen=True)
class Layout:
    """Paths inside the state directory."""

    root: Path

    @property
    def db(self) -> Path:
        return self.root / "server.db"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def admin_token(self) -> Path:
        return self.root / "admin_token"

    @property
    def xi(self) -> Path:
        return self.root / "xi.safetensors"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def updates(self) -> Path:
        return self.root / "updates"

    def model_file(self, version: int) -> Path:
        return self.models / f"v{version:06d}.safetensors"

    def model_top_file(self, version: int) -> Path:
        """Version ``version``'s top-only body (``fedfs-model-top/1``: ``server_agg/round_models.py``)."""
        return self.models / f"v{version:06d}.top.safetensors"

    def round_dir(self, round_id: int) -> Path:
        return self.updates / f"r{round_id:06d}"

    def update_file(self, round_id: int, device_id: str) -> Path:
        return self.round_dir(round_id) / f"{device_id}.safetensors"

    def create(self) -> None:
        for d in (self.root, self.models, self.updates):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)


class StateInUse(FedFSError):
    """Another ``fedfs serve`` holds the state directory."""


class StateLock:
    """An exclusive, non-blocking ``flock`` on ``STATE/.lock`` for the life of one server.

    Taken before anything else is written to the state, so a second server on the same
    directory stops at once instead of serving (and overwriting) stale data. The lock file
    holds the owner's pid for the error message; the kernel drops the lock when the
    process ends, however it ends, so a stale file never blocks a restart.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = root / ".lock"
        fd = lock_file(path)
        if fd is None:
            try:
                owner = path.read_text("ascii", "replace").strip() or "unknown"
            except OSError:
                owner = "unknown"
            raise StateInUse(f"state {root} is in use by another fedfs serve (pid {owner})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            unlock_file(self._fd)
            self._fd = None

    def __enter__(self) -> "StateLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(directory: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh fsynced temp file in ``directory`` (0600); return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".incoming.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def commit_file(tmp: Path, final: Path) -> None:
    """Atomically move an fsynced temp file into place and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def atomic_write(path: Path, data: bytes) -> None:
    commit_file(write_temp(path.parent, data), path)


class Database:
    """Thin wrapper over one SQLite connection. Not thread-safe on its own: the
    coordinator serializes every call under its lock."""

    def __init__(self, path: Path) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so a transaction is exactly
        # the block under `transaction()`.
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")   # a COMMIT survives power loss, not just SIGKILL
        self.conn.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring a database written by an older server up to :data:`SCHEMA`."""
        columns = {r["name"] for r in self.conn.execute("PRAGMA table_info(devices)")}
        if "last_seen" not in columns:      # added with device liveness; NULL = not seen since
            self.conn.execute("ALTER TABLE devices ADD COLUMN last_seen REAL")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")

    def one(self, sql: str, *args: Any) -> sqlite3.Row | None:
        return self.conn.execute(sql, args).fetchone()

    def all(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        return self.conn.execute(sql, args).fetchall()

    def scalar(self, sql: str, *args: Any) -> Any:
        row = self.conn.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def get_meta(self, key: str) -> str | None:
        return self.scalar("SELECT value FROM meta WHERE key = ?", key)

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as c:
            c.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                      (key, value))

    def close(self) -> None:
        self.conn.close()


__all__ = ["Layout", "Database", "StateLock", "StateInUse", "write_temp", "commit_file", "atomic_write", "fsync_dir"]
