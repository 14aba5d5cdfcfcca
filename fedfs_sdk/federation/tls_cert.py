"""The aggregation server's TLS certificate, made by ``fedfs ca tls-cert`` (issue 30).

A self-signed X.509 certificate (ECDSA P-256) that devices pin (``fedfs device --tls-ca``):
no public CA is involved, so the only certificate a device accepts for the server is this
one. Its subjectAltNames hold what devices dial — ``127.0.0.1``, ``::1``, ``localhost`` and
each ``--host`` (an IP address or a DNS name): a certificate without the name in the URL is
refused by the TLS client, which is how a hand-made certificate without a SAN for
``127.0.0.1`` failed before. The key is written 0600.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Iterable

from ..errors import InputError


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.strip().lower()
    if not name or len(name) > 253 or any(c in name for c in " /:@"):
        raise InputError(f"--host {host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(name)


def write_server_certificate(folder: str | os.PathLike[str], hosts: Iterable[str] = (),
                             days: float = 365.0) -> tuple[Path, Path]:
    """Write ``server.pem`` and ``server.key`` (0600) into ``folder``; refuses to overwrite a key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from ..fileio import atomic_write_bytes

    d = Path(folder)
    if (d / "server.key").exists():
        raise InputError(f"{d / 'server.key'} exists: remove it first to make a new TLS certificate")
    names = ["127.0.0.1", "::1", "localhost"] + [h for h in hosts if h not in ("127.0.0.1", "::1", "localhost")]
    sans = [_san(h) for h in names]
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[3] if len(names) > 3 else "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=float(days)))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            # CA:TRUE so that the pinned self-signed certificate is its own trust anchor
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_bytes(d / "server.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()), mode=0o600)
    atomic_write_bytes(d / "server.pem", cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return d / "server.pem", d / "server.key"


__all__ = ["write_server_certificate"]
