"""The device's long-lived identity key in its state directory (secure aggregation against an
active server: :mod:`fedfs_sdk.federation.secagg.identity`).

Files (in the device state, beside ``token``)::

    identity.key    Ed25519 private key, PKCS#8 PEM, mode 0600 — never sent, never leaves
    identity.cert   the operator CA's certificate of its public key (``fedfs ca sign``)

The flow: ``fedfs ca request --state DIR --out REQ`` creates the key (first time) and writes a
request holding the public key and a proof of possession; the operator signs it with the CA
(``fedfs ca sign``); the device installs the certificate (``fedfs device --identity-cert``),
which is checked against the pinned CA and its own key first. The server sees the certificate
and signatures made with the key, never the key (``tests/test_secagg_identity.py`` checks
the bytes sent). An app should keep the key in the platform keystore instead (Android
Keystore has Ed25519 from API 33; iOS Secure Enclave has P-256 only, so an iOS port would
sign with P-256).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError
from .device_state import DeviceState, DeviceStateError
from .secagg.identity import CaPublicKey, Certificate, DeviceIdentity, IdentityError, load_private_key

KEY_FILE = "identity.key"
CERT_FILE = "identity.cert"


def _key_path(state: DeviceState) -> Path:
    return state.path / KEY_FILE


def create_identity(state: DeviceState) -> DeviceIdentity:
    """The device's identity, created (a fresh Ed25519 key, 0600) if it has none yet."""
    if state.read_only:
        raise DeviceStateError(f"device state {state.path} is open read-only; cannot create an identity key")
    if _key_path(state).is_file():
        return load_identity(state, require_certificate=False)
    ident = DeviceIdentity.generate()
    ident.save_key(_key_path(state))        # the one place the private key is written
    return ident


def load_identity(state: DeviceState, require_certificate: bool = True) -> DeviceIdentity:
    """The identity key and its certificate from the state; :class:`DeviceStateError` naming
    what is missing and how to get it."""
    p = _key_path(state)
    if not p.is_file():
        raise DeviceStateError(f"device state {state.path} has no identity key: run `fedfs ca request --state "
                               f"{state.path} --out REQUEST.json`, have the operator sign it (`fedfs ca sign`), then "
                               "start the device with --identity-cert CERT.json")
    try:
        sk = load_private_key(p, "identity key")
    except IdentityError as e:
        raise DeviceStateError(str(e)) from None
    cert = None
    c = state.path / CERT_FILE
    if c.is_file():
        try:
            cert = Certificate.load(c)
        except InputError as e:
            raise DeviceStateError(str(e)) from None
    elif require_certificate:
        raise DeviceStateError(f"device state {state.path} has an identity key but no certificate: have the operator "
                               "sign the request (`fedfs ca sign`) and start the device with --identity-cert CERT.json")
    try:
        return DeviceIdentity(sk, cert)
    except IdentityError as e:
        raise DeviceStateError(f"{c}: {e}") from None


def install_certificate(state: DeviceState, certificate: Certificate | str | Path, ca: CaPublicKey) -> DeviceIdentity:
    """Check ``certificate`` (for this device's key, issued by ``ca``, valid now) and store it."""
    cert = certificate if isinstance(certificate, Certificate) else Certificate.load(certificate)
    ident = load_identity(state, require_certificate=False)
    if cert.public_key != ident.public_key:
        raise InputError(f"the certificate of {cert.subject!r} is for another key than this device's identity key "
                         f"({state.path / KEY_FILE})")
    try:
        cert.verify(ca)
    except IdentityError as e:
        raise InputError(f"the identity certificate does not verify: {e}") from None
    from ..fileio import atomic_write_bytes

    atomic_write_bytes(state.path / CERT_FILE, json.dumps(cert.to_json(), indent=1).encode(), mode=0o600)
    return ident.with_certificate(cert)


def identity_request(state: DeviceState, subject: str | None = None) -> dict[str, Any]:
    """A certification request for this device's identity key (created if missing)."""
    ident = create_identity(state)
    info = state.info
    return ident.request(subject or (info.device_id if info is not None else f"device-{ident.public_key[:6].hex()}"))


__all__ = ["create_identity", "load_identity", "install_certificate", "identity_request", "KEY_FILE", "CERT_FILE"]
