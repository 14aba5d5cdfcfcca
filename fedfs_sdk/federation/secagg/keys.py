"""Key agreement, key derivation and the authenticated share envelope (all ``cryptography``).

* X25519 (RFC 7748) for both key pairs of Bonawitz et al. 2017: ``c`` encrypts the share
  exchange, ``s`` derives the pairwise mask seeds ``s_uv``.
* HKDF-SHA256 (RFC 5869) turns a shared secret into a 32-byte key; ``info`` names the purpose,
  the round and the unordered pair, so keys never repeat across rounds or purposes.
* AES-256-GCM seals the Shamir shares u → v; the associated data binds the ciphertext to
  ``(round, sender, recipient)``, so a ciphertext replayed into another round, or routed to
  another device, fails authentication.
"""
from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import BadMessageError, IntegrityError

_PREFIX = b"fedfs-secagg/1"
NONCE_BYTES = 12


def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def private_bytes(sk: X25519PrivateKey) -> bytes:
    return sk.private_bytes_raw()


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(sk: X25519PrivateKey) -> bytes:
    return sk.public_key().public_bytes_raw()


def load_public(raw: bytes, what: str) -> X25519PublicKey:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != 32:
        raise BadMessageError(f"{what} must be a 32-byte X25519 public key")
    return X25519PublicKey.from_public_bytes(bytes(raw))


def _info(purpose: bytes, round_id: int, a: int, b: int) -> bytes:
    lo, hi = min(a, b), max(a, b)
    return b"|".join([_PREFIX, purpose, str(round_id).encode(), str(lo).encode(), str(hi).encode()])


def pair_key(sk: X25519PrivateKey, peer_pk: bytes, purpose: bytes, round_id: int, me: int, peer: int) -> bytes:
    """The 32-byte key both ends of the pair (me, peer) derive for ``purpose`` in this round."""
    try:
        shared = sk.exchange(load_public(peer_pk, f"public key of device {peer}"))
    except ValueError as e:   # all-zero shared secret: a low-order public key
        raise BadMessageError(f"public key of device {peer} is invalid: {e}") from e
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_info(purpose, round_id, me, peer)).derive(shared)


def _aad(round_id: int, sender: int, recipient: int) -> bytes:
    return b"|".join([_PREFIX, b"share", str(round_id).encode(), str(sender).encode(), str(recipient).encode()])


def seal(key: bytes, round_id: int, sender: int, recipient: int, plaintext: bytes) -> bytes:
    """``nonce ‖ AES-GCM(plaintext)`` bound to (round, sender, recipient)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(round_id, sender, recipient))


def open_sealed(key: bytes, round_id: int, sender: int, recipient: int, blob: bytes) -> bytes:
    """Inverse of :func:`seal`; :class:`IntegrityError` names the pair if it does not verify."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < NONCE_BYTES + 16:
        raise IntegrityError(f"share ciphertext from device {sender} is truncated")
    try:
        return AESGCM(key).decrypt(bytes(blob[:NONCE_BYTES]), bytes(blob[NONCE_BYTES:]),
                                   _aad(round_id, sender, recipient))
    except InvalidTag as e:
        raise IntegrityError(
            f"share ciphertext from device {sender} to device {recipient} does not authenticate for "
            f"round {round_id} (tampered, replayed from another round, or misrouted)") from e
