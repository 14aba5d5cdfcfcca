"""A persistent, content-addressed cache of where the face of each photo is (issue 31).

Finding a face is the slow part of reading a folder of real photos (dlib's MMOD CNN takes
seconds where HOG finds nothing); the chip cut from it, and any capture shift, take
milliseconds. So what a detector found is kept per photo, under the run cache directory
(``$FEDFS_CACHE_DIR/faces``, ``--cache-dir DIR`` → ``DIR/faces``), keyed by

* the sha256 of the file's bytes (not its path: a copied or renamed folder hits, an edited
  photo misses),
* what is located (``dlib-chip`` / ``align``), the detector settings
  (:class:`~fedfs_sdk.runtime.align.DetectSettings`), dlib's version and
  :data:`FACE_CODE_VERSION` (bumped when the detection code changes what it finds).

One small JSON file per entry (``faces/<k[:2]>/<k>.json``), written to a temporary file and
renamed over (``os.replace``): concurrent runs of the same folder write the same bytes and a
reader sees a whole file or none. Each entry carries the sha256 of its own payload; an entry
that does not parse, or whose checksum or key does not match (a torn disk write, an edit),
is treated as missing and redone.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fedfs_sdk.fileio import atomic_write_bytes

__all__ = ["FaceCache", "FACE_CODE_VERSION", "default_face_cache_dir", "entry_key", "file_digest"]

FACE_CODE_VERSION = "31.1"
"""Bump when :mod:`fedfs_sdk.runtime.align`'s search changes what it finds for the same settings."""


def default_face_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``DIR/faces`` for ``--cache-dir DIR``, else ``$FEDFS_CACHE_DIR/faces`` (``~/.cache/fedfs/faces``)."""
    if cache_dir:
        return Path(cache_dir) / "faces"
    return Path(os.environ.get("FEDFS_CACHE_DIR", Path.home() / ".cache" / "fedfs")) / "faces"


def file_digest(data: bytes) -> str:
    """sha256 hex of a photo's bytes."""
    return hashlib.sha256(data).hexdigest()


def _dlib_version() -> str:
    try:
        import dlib
    except ImportError:
        return "none"
    return str(getattr(dlib, "__version__", "?"))


def entry_key(digest: str, what: str) -> str:
    """The cache key of a photo's ``digest`` for ``what`` (kind + settings, e.g.
    ``"dlib-chip|eq1-cnn1-320"``; a fallback adds the folder's prior box)."""
    blob = f"{digest}|{what}|dlib {_dlib_version()}|code {FACE_CODE_VERSION}"
    return hashlib.sha256(blob.encode()).hexdigest()


class FaceCache:
    """The entries under ``root`` (created on first write). ``hits`` / ``misses`` / ``corrupt``
    count this object's lookups."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.hits = self.misses = self.corrupt = 0

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The payload stored under ``key``, or None (missing, unreadable or corrupt)."""
        p = self.path(key)
        try:
            raw = p.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            doc = json.loads(raw)
            body = json.dumps(doc["payload"], sort_keys=True, separators=(",", ":"))
            ok = doc.get("key") == key and doc.get("sha256") == hashlib.sha256(body.encode()).hexdigest()
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            self.corrupt += 1
            self.misses += 1
            return None
        self.hits += 1
        return doc["payload"]

    def put(self, key: str, payload: dict[str, Any]) -> None:
        """Store ``payload`` (JSON-able) under ``key``: a temporary file renamed over the entry."""
        body = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        doc = json.dumps({"key": key, "sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": payload},
                         sort_keys=True, separators=(",", ":")).encode()
        atomic_write_bytes(self.path(key), doc, durable=False)    # a lost entry is redone
