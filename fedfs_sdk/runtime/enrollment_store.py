"""Encrypted, authenticated enrollment files (AES-256-GCM with a key the app supplies, e.g. from
the platform keystore), written atomically and never overwritten unless asked. Re-exported by
:mod:`fedfs_sdk.runtime.enrollment`."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import EnrollmentError, EnrollmentExistsError, InputError
from .enrollment_record import Enrollment

_MAGIC = b"FEDFSENR"
_VERSION = 1
_NONCE = 12


def generate_key() -> bytes:
    """A fresh 256-bit AES-GCM key (store it in the platform keystore)."""
    return os.urandom(32)


def _aesgcm(key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    if not isinstance(key, (bytes, bytearray)) or len(key) not in (16, 24, 32):
        raise InputError("enrollment key must be 16, 24 or 32 bytes")
    return AESGCM(bytes(key))


def save_enrollment(path: str | os.PathLike[str], enrollment: Enrollment, key: bytes,
                    overwrite: bool = False) -> None:
    """Encrypt (AES-GCM) and write atomically. An existing file is kept unless ``overwrite``."""
    from ..fileio import atomic_write_bytes

    p = Path(path)
    if p.exists() and not overwrite:
        raise EnrollmentExistsError(f"{p} already holds an enrollment; pass overwrite=True (`fedfs enroll --overwrite`) to replace it")
    header = _MAGIC + bytes([_VERSION])
    nonce = os.urandom(_NONCE)
    blob = header + nonce + _aesgcm(key).encrypt(nonce, enrollment.to_json(), header)
    atomic_write_bytes(p, blob, mode=0o600)


def load_enrollment(path: str | os.PathLike[str], key: bytes) -> Enrollment:
    """Read and authenticate an enrollment; :class:`EnrollmentError` if tampered or wrong key."""
    from cryptography.exceptions import InvalidTag

    p = Path(path)
    if not p.is_file():
        raise EnrollmentError(f"enrollment file not found: {p}")
    blob = p.read_bytes()
    header = _MAGIC + bytes([_VERSION])
    if not blob.startswith(_MAGIC):
        raise EnrollmentError(f"{p} is not a fedfs enrollment file")
    if blob[:len(header)] != header:
        raise EnrollmentError(f"{p} has unsupported enrollment version {blob[len(_MAGIC)]}")
    body = blob[len(header):]
    if len(body) < _NONCE + 16:
        raise EnrollmentError(f"{p} is truncated")
    try:
        plain = _aesgcm(key).decrypt(body[:_NONCE], body[_NONCE:], header)
    except InvalidTag:
        raise EnrollmentError(f"{p} failed authentication: the file was tampered with or the key is wrong") from None
    return Enrollment.from_json(plain)


__all__ = ["generate_key", "save_enrollment", "load_enrollment"]
