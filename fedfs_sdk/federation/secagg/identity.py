"""Long-lived device identities for secure aggregation against an active server.

Bonawitz et al. 2017 (§4, the active-adversary variant) assume a PKI: every device holds a
signing key whose public half the others can trust, so the server can neither invent devices
nor replace a device's advertised keys. Here:

* the **operator CA** is an Ed25519 key pair that is *not* the aggregation server's
  (``fedfs ca init``); its public key is pinned on every device (device config);
* a **device identity** is an Ed25519 signing key created on the device and kept in its state
  (0600, never sent); the device sends a request with a proof of possession
  (``fedfs ca request``) and the operator signs it into a :class:`Certificate`
  (``fedfs ca sign``): subject, the device's public key, validity, the CA's key id;
* in a round each device signs its advertised X25519 keys (:mod:`.auth`) and every device
  checks every roster entry's certificate against the pinned CA and its signature.

Why not X.509: a fedfs certificate has one job — "the CA vouches for this Ed25519 key" — and
is verified by every device for every roster entry; a few fields signed as canonical JSON
keep that check to one Ed25519 verification and no ASN.1 parsing. Not implemented, and said
so in docs/privacy.md: revocation (a stolen device key stays valid until ``not_after``).
Since issue 30: revocation by a CA-signed list (:mod:`.revocation`).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ...errors import FedFSError, InputError

CA_FORMAT = "fedfs-ca/1"
CERT_FORMAT = "fedfs-device-cert/1"
REQUEST_FORMAT = "fedfs-identity-request/1"
KEY_BYTES = 32
SIG_BYTES = 64
MAX_SUBJECT = 256


class IdentityError(FedFSError):
    """A certificate, request or signature does not verify, or a key file is unusable."""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any, what: str, length: int) -> bytes:
    if not isinstance(text, str):
        raise IdentityError(f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise IdentityError(f"{what} is not valid base64: {e}") from None
    if len(raw) != length:
        raise IdentityError(f"{what} must be {length} bytes, got {len(raw)}")
    return raw


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces, ASCII (ints and strings only)."""
    return json.dumps(dict(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def key_id(public_key: bytes) -> str:
    """SHA-256 of a raw Ed25519 public key, hex: how a certificate names its CA."""
    return hashlib.sha256(public_key).hexdigest()


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``data`` under ``public_key``."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIG_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), data)
        return True
    except (InvalidSignature, ValueError):
        return False


def _public_raw(sk: Ed25519PrivateKey) -> bytes:
    return sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_key_pem(sk: Ed25519PrivateKey) -> bytes:
    return sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())


def load_private_key(path: str | os.PathLike[str], what: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PKCS#8 PEM file (refused if group/other may read it)."""
    p = Path(path)
    try:
        if os.name == "posix" and p.stat().st_mode & 0o077:
            raise IdentityError(f"{what} {p} may be read by others (mode {p.stat().st_mode & 0o777:o}); "
                                f"chmod 600 {p}")
        sk = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except OSError as e:
        raise IdentityError(f"cannot read {what} {p}: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:
        raise IdentityError(f"{what} {p} is not a PEM private key: {e}") from None
    if not isinstance(sk, Ed25519PrivateKey):
        raise IdentityError(f"{what} {p} is not an Ed25519 key")
    return sk


def write_private_key(path: str | os.PathLike[str], sk: Ed25519PrivateKey) -> None:
    """Write ``sk`` as PKCS#8 PEM, mode 0600, atomically (the file never exists with wider rights)."""
    from ...fileio import atomic_write_bytes

    atomic_write_bytes(path, private_key_pem(sk), mode=0o600)


def _load(cls, path: str | os.PathLike[str], what: str, kind: str):
    """``cls.from_json`` of the JSON file ``path``; :class:`InputError` naming the file and what
    it should have been (``what``: "the certificate"; ``kind``: "a fedfs device certificate …")."""
    p = Path(path)
    try:
        return cls.from_json(json.loads(p.read_text()))
    except OSError as e:
        raise InputError(f"cannot read {what} {p}: {e.strerror or e}") from None
    except (ValueError, IdentityError) as e:
        raise InputError(f"{p} is not {kind}: {e}") from None


@dataclass(frozen=True)
class CaPublicKey:
    """The operator CA's public key: what devices pin (``ca.pub``)."""

    public_key: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.public_key, bytes) or len(self.public_key) != KEY_BYTES:
            raise IdentityError("a CA public key is 32 raw Ed25519 bytes")

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def to_json(self) -> dict[str, Any]:
        return {"format": CA_FORMAT, "public_key": _b64(self.public_key), "key_id": self.key_id}

    @classmethod
    def from_json(cls, doc: Any) -> "CaPublicKey":
        if not isinstance(doc, Mapping) or doc.get("format") != CA_FORMAT:
            raise IdentityError(f"not a {CA_FORMAT} public key")
        ca = cls(_unb64(doc.get("public_key"), "CA public_key", KEY_BYTES))
        if doc.get("key_id") not in (None, ca.key_id):
            raise IdentityError("the CA file's key_id does not match its public key")
        return ca

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "CaPublicKey":
        """Read a ``ca.pub`` file (``fedfs ca init``); :class:`InputError` naming the problem."""
        return _load(cls, path, "the CA public key", "a fedfs CA public key (fedfs ca init writes ca.pub)")


@dataclass(frozen=True)
class Certificate:
    """The CA's statement "``public_key`` is a device's identity key" (canonical JSON, Ed25519)."""

    subject: str
    public_key: bytes
    ca_key_id: str
    serial: str
    not_before: int
    not_after: int | None
    signature: bytes

    def tbs(self) -> dict[str, Any]:
        """The signed fields ("to be signed")."""
        return {"format": CERT_FORMAT, "subject": self.subject, "public_key": _b64(self.public_key),
                "ca": self.ca_key_id, "serial": self.serial, "not_before": self.not_before,
                "not_after": self.not_after}

    def to_json(self) -> dict[str, Any]:
        return {**self.tbs(), "signature": _b64(self.signature)}

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(canonical(self.to_json())).hexdigest()

    @classmethod
    def from_json(cls, doc: Any) -> "Certificate":
        """Parse (not verify: see :meth:`verify`); :class:`IdentityError` if malformed."""
        if not isinstance(doc, Mapping) or doc.get("format") != CERT_FORMAT:
            raise IdentityError(f"not a {CERT_FORMAT} certificate")
        extra = sorted(set(doc) - {"format", "subject", "public_key", "ca", "serial", "not_before", "not_after",
                                   "signature"})
        if extra:
            raise IdentityError(f"certificate has unknown fields {extra}")
        subject, ca, serial = doc.get("subject"), doc.get("ca"), doc.get("serial")
        nb, na = doc.get("not_before"), doc.get("not_after")
        if not isinstance(subject, str) or not 0 < len(subject) <= MAX_SUBJECT:
            raise IdentityError("certificate subject must be a non-empty string")
        if not isinstance(ca, str) or len(ca) != 64 or not isinstance(serial, str) or not serial:
            raise IdentityError("certificate ca / serial are malformed")
        if isinstance(nb, bool) or not isinstance(nb, int) or (na is not None and (isinstance(na, bool)
                                                                                   or not isinstance(na, int))):
            raise IdentityError("certificate validity must be integer seconds")
        return cls(subject, _unb64(doc.get("public_key"), "certificate public_key", KEY_BYTES), ca, serial,
                   nb, na, _unb64(doc.get("signature"), "certificate signature", SIG_BYTES))

    def verify(self, ca: CaPublicKey, now: float | None = None) -> None:
        """Raise :class:`IdentityError` unless ``ca`` signed this certificate and it is valid now."""
        if self.ca_key_id != ca.key_id:
            raise IdentityError(f"certificate of {self.subject!r} is issued by CA {self.ca_key_id[:12]}…, "
                                f"not by the pinned CA {ca.key_id[:12]}…")
        if not verify(ca.public_key, self.signature, canonical(self.tbs())):
            raise IdentityError(f"certificate of {self.subject!r} does not verify under the pinned CA")
        t = time.time() if now is None else now
        if t < self.not_before - 300 or (self.not_after is not None and t > self.not_after):
            raise IdentityError(f"certificate of {self.subject!r} is not valid now (valid "
                                f"{self.not_before}…{self.not_after})")

    def save(self, path: str | os.PathLike[str]) -> None:
        from ...fileio import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(self.to_json(), indent=1).encode(), mode=0o644)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Certificate":
        return _load(cls, path, "the certificate", "a fedfs device certificate (fedfs ca sign writes one)")


class CertificateAuthority:
    """The operator's signing key (``fedfs ca init``). Keep it away from the aggregation server:
    whoever holds it can mint devices."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._sk = private_key
        self.public = CaPublicKey(_public_raw(private_key))

    @classmethod
    def generate(cls) -> "CertificateAuthority":
        return cls(Ed25519PrivateKey.generate())

    def save(self, directory: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write ``ca.key`` (0600) and ``ca.pub`` into ``directory`` (created 0700); refuses to
        overwrite an existing ``ca.key``."""
        from ...fileio import atomic_write_bytes

        d = Path(directory)
        if (d / "ca.key").exists():
            raise InputError(f"{d / 'ca.key'} exists: a CA key is never overwritten (choose another folder)")
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private_key(d / "ca.key", self._sk)
        atomic_write_bytes(d / "ca.pub", json.dumps(self.public.to_json(), indent=1).encode(), mode=0o644)
        return d / "ca.key", d / "ca.pub"

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "CertificateAuthority":
        p = Path(directory)
        return cls(load_private_key(p / "ca.key" if p.is_dir() else p, "CA key"))

    def sign_bytes(self, data: bytes) -> bytes:
        """The CA's signature of ``data`` (a revocation list's canonical bytes: :mod:`.revocation`)."""
        return self._sk.sign(data)

    def issue(self, subject: str, public_key: bytes, valid_days: float | None = 365.0,
              now: float | None = None) -> Certificate:
        """Certify ``public_key`` (32 raw Ed25519 bytes) as the identity key of ``subject``."""
        if not isinstance(subject, str) or not 0 < len(subject) <= MAX_SUBJECT:
            raise InputError(f"the subject must be a non-empty string of ≤ {MAX_SUBJECT} characters")
        if not isinstance(public_key, bytes) or len(public_key) != KEY_BYTES:
            raise InputError("the device public key must be 32 raw Ed25519 bytes")
        t = int(time.time() if now is None else now)
        not_after = None if valid_days is None else t + int(valid_days * 86400)
        unsigned = Certificate(subject, public_key, self.public.key_id, secrets.token_hex(16), t, not_after, b"\0" * 64)
        return replace(unsigned, signature=self._sk.sign(canonical(unsigned.tbs())))

    def sign_request(self, request: Any, subject: str | None = None, valid_days: float | None = 365.0) -> Certificate:
        """Issue a certificate for a device's request (:meth:`DeviceIdentity.request`), after
        checking its proof of possession (the device signed the request with the key)."""
        if not isinstance(request, Mapping) or request.get("format") != REQUEST_FORMAT:
            raise InputError(f"not a {REQUEST_FORMAT} request (fedfs ca request writes one)")
        try:
            pk = _unb64(request.get("public_key"), "request public_key", KEY_BYTES)
            pop = _unb64(request.get("proof"), "request proof", SIG_BYTES)
        except IdentityError as e:
            raise InputError(str(e)) from None
        tbs = {k: v for k, v in request.items() if k != "proof"}
        if not verify(pk, pop, canonical(tbs)):
            raise InputError("the request's proof of possession does not verify: it was not signed by the "
                             "key it asks to certify")
        return self.issue(subject or str(request.get("subject") or ""), pk, valid_days)


class DeviceIdentity:
    """A device's signing key and (once the operator signed it) its certificate."""

    def __init__(self, signing_key: Ed25519PrivateKey, certificate: Certificate | None = None) -> None:
        self._sk = signing_key
        self.public_key = _public_raw(signing_key)
        if certificate is not None and certificate.public_key != self.public_key:
            raise IdentityError(f"the certificate of {certificate.subject!r} is for another key than this device's")
        self.certificate = certificate

    @classmethod
    def generate(cls) -> "DeviceIdentity":
        return cls(Ed25519PrivateKey.generate())

    def with_certificate(self, certificate: Certificate) -> "DeviceIdentity":
        return DeviceIdentity(self._sk, certificate)

    def sign(self, data: bytes) -> bytes:
        return self._sk.sign(data)

    def request(self, subject: str) -> dict[str, Any]:
        """A certification request with a proof of possession (JSON-able; holds no secret)."""
        tbs = {"format": REQUEST_FORMAT, "subject": subject, "public_key": _b64(self.public_key)}
        return {**tbs, "proof": _b64(self.sign(canonical(tbs)))}

    def private_pem(self) -> bytes:
        """The private key as PKCS#8 PEM: for the device's own state only."""
        return private_key_pem(self._sk)

    def save_key(self, path: str | os.PathLike[str]) -> None:
        """Write the private key to ``path`` (PKCS#8 PEM, 0600, atomically) — the device's state."""
        write_private_key(path, self._sk)


__all__ = ["CaPublicKey", "Certificate", "CertificateAuthority", "DeviceIdentity", "IdentityError", "verify",
           "canonical", "key_id", "load_private_key", "write_private_key", "CA_FORMAT", "CERT_FORMAT",
           "REQUEST_FORMAT"]
