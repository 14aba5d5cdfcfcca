"""The public impostor set a server ships with its model (``fedfs serve --impostors``).

Devices need impostors for the do-no-harm check at enrollment (:mod:`fedfs_sdk.training.selection`)
and for a FAR-targeted threshold; a phone holds no one else's photos, so the set — photos of
public identities, never user data (:mod:`fedfs_sdk.runtime.impostors`) — ships with the model:
the server stores it next to ξ, names its SHA-256 in ``GET /v1/models/latest``
(``impostors_sha256``) and serves it read-only at ``GET /v1/impostors``. A device downloads it
once, checks the hash and keeps it in its state. Nothing about a device travels back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

IMPOSTORS_FILE = "impostors.npz"
META_KEY = "impostors_sha256"


def impostors_path(coord: Any) -> Path:
    return Path(coord.layout.root) / IMPOSTORS_FILE


def install_impostors(coord: Any, data: bytes) -> str:
    """Store ``data`` (a ``fedfs impostors`` set, already checked) as the set served with the model."""
    from fedfs_sdk.federation.wire_format import sha256_hex

    from .store import atomic_write

    sha = sha256_hex(data)
    with coord._lock:
        atomic_write(impostors_path(coord), data)
        coord.db.set_meta(META_KEY, sha)
    return sha


def impostors_sha256(coord: Any) -> str | None:
    """The SHA-256 of the served set, or None when the server ships none."""
    sha = coord.db.get_meta(META_KEY)
    return sha if sha and impostors_path(coord).is_file() else None


__all__ = ["install_impostors", "impostors_sha256", "impostors_path", "IMPOSTORS_FILE"]
