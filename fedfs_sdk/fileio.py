"""Crash-safe file writes (no torch): temp file in the same folder, fsync, ``os.replace``;
and the non-blocking lock file that keeps two processes off one state folder."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int | None = None,
                       durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never half.

    ``mode`` (e.g. ``0o600`` for secrets) is applied before the file becomes visible.
    ``durable=False`` skips the fsyncs: for caches that are rebuilt when lost (thousands of small
    entries, where a sync each would dominate), still atomic for concurrent readers.
    """
    path = Path(path)
    blocking = next((a for a in (path.parent, *path.parent.parents) if a.exists() and not a.is_dir()), None)
    if blocking is not None:   # mkdir would only say "File exists"
        raise NotADirectoryError(f"cannot write {path}: {blocking} is a file, not a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk (``fsync``; opened for writing, as Windows needs)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable (``fsync`` of the directory) where the platform
    allows it (POSIX); a no-op where directories cannot be opened or synced (Windows, some
    network file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_file(path: str | os.PathLike[str], shared: bool = False, mode: int = 0o600) -> int | None:
    """Take a non-blocking ``flock`` on ``path`` (created with ``mode`` if missing):
    exclusive, or ``shared`` (the file is then opened read-only). Returns the open file
    descriptor that holds the lock (release with :func:`unlock_file`), or None when another
    process holds a conflicting lock; the caller raises its own error. The kernel drops
    the lock when the process ends, however it ends, so a stale file never blocks.
    :class:`OSError` if the file cannot be opened."""
    import fcntl  # POSIX only

    flags = (os.O_RDONLY if shared else os.O_RDWR) | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, mode)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock_file(fd: int) -> None:
    """Release a lock taken with :func:`lock_file` and close its descriptor."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
