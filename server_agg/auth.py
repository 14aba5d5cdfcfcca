"""Bearer tokens: per-device tokens stored as SHA-256 hashes, and the admin token.

A device token is ``<device_id>.<secret>`` with a 256-bit random secret; the server keeps
only ``sha256(token)``. Tokens are high-entropy, so an unsalted hash is enough (no password
stretching needed) and a database leak does not reveal usable tokens. Comparisons use
:func:`hmac.compare_digest` so their time does not depend on where the bytes differ.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fedfs_sdk.fileio import atomic_write_bytes

ADMIN_TOKEN_ENV = "FEDFS_ADMIN_TOKEN"
REGISTRATION_TOKEN_ENV = "FEDFS_REGISTRATION_TOKEN"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def tokens_equal(token: str, stored_hash: str) -> bool:
    """Constant-time check of ``token`` against a stored :func:`hash_token` value."""
    return hmac.compare_digest(hash_token(token), stored_hash)


def new_device_id() -> str:
    return "d" + secrets.token_hex(8)


def new_device_token(device_id: str) -> str:
    return f"{device_id}.{secrets.token_urlsafe(32)}"


def device_id_of(token: str) -> str | None:
    """The device id a token claims (verified against the stored hash by the caller)."""
    head, sep, secret = token.partition(".")
    if not sep or not secret or len(head) > 64 or not head.isalnum():
        return None
    return head


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    return token


def load_admin_token(path: Path, given: str | None) -> tuple[str, bool]:
    """The admin token: ``given`` (flag or $FEDFS_ADMIN_TOKEN), else the one stored at
    ``path``, else a new one written there with mode 0600. Returns ``(token, generated)``."""
    token = given or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        return token, False
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored, False
    token = secrets.token_urlsafe(32)
    atomic_write_bytes(path, (token + "\n").encode(), mode=0o600)
    return token, True


__all__ = ["hash_token", "tokens_equal", "new_device_id", "new_device_token", "device_id_of",
           "parse_bearer", "load_admin_token", "ADMIN_TOKEN_ENV", "REGISTRATION_TOKEN_ENV"]
