"""``fedfs ca``: the operator CA that certifies device identities for secure aggregation
against an active server (``fedfs-secagg/2``; docs/privacy.md).

    fedfs ca init --dir ./ca                                    # operator, once: ca.key (0600), ca.pub
    fedfs ca request --state ./device --out req.json            # on the device: identity key + request
    fedfs ca request ... --server URL --images ./me --enroll    # … registered only if `fedfs device` would run
    fedfs ca sign --ca ./ca --request req.json --out cert.json  # operator: checks, certifies
    fedfs device … --secagg-ca ./ca/ca.pub --identity-cert cert.json
    fedfs ca revoke --ca ./ca [--serial S | --cert cert.json]  # signed revocation list → ./ca/revocations.json
    fedfs ca tls-cert --ca ./ca --host fl.example.org           # the server's TLS certificate (SANs) → ./ca/tls/

Keep ``ca.key`` away from the aggregation server: whoever holds it can mint devices. The
operator decides whom to certify (e.g. after a platform attestation of the app); fedfs
checks only that the request was signed by the key it asks to certify.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ca_command", metavar="ACTION", required=True)
    i = sub.add_parser("init", help="create the operator CA key pair: DIR/ca.key (0600) and DIR/ca.pub (pin on devices)")
    i.add_argument("--dir", required=True, type=Path, help="folder for ca.key and ca.pub (created 0700)")
    r = sub.add_parser("request", help="(on the device) create its identity key in the device state if it has none, "
                                       "and write a certification request with a proof of possession")
    r.add_argument("--state", required=True, type=Path, help="the device-state directory (created if missing)")
    r.add_argument("--out", required=True, type=Path, help="where to write the request (JSON, no secret in it)")
    r.add_argument("--subject", help="name to certify (default: the device id; registered first with --server)")
    r.add_argument("--server", help="register the device with this server first (if its state is not registered "
                                    "yet), so the request names it by its device id")
    r.add_argument("--tls-ca", type=Path, metavar="PEM", help="with --server: trust only this certificate")
    r.add_argument("--registration-token", default=os.environ.get("FEDFS_REGISTRATION_TOKEN"),
                   help="with --server: the server's registration token (else $FEDFS_REGISTRATION_TOKEN)")
    r.add_argument("--images", type=Path, metavar="DIR",
                   help="the device owner's photo folder, checked as `fedfs device` checks it (every photo decodes; "
                        "with --enroll, enough photos for --q) before anything is registered or created: a device "
                        "registered with --server that `fedfs device` then refuses would be registered for nothing")
    r.add_argument("--enroll", action="store_true",
                   help="with --images: the device will enroll (`fedfs device --enroll`): needs ⌈1/(1−q)⌉ photos")
    r.add_argument("--q", type=float, default=None,
                   help="with --images --enroll: the enrollment's target TPR, as `fedfs device --q` (default 0.9)")
    r.add_argument("--detect-face", action="store_true",
                   help="with --images: every photo must hold a face, as `fedfs device --detect-face`")
    s = sub.add_parser("sign", help="certify a device's request with the CA key")
    s.add_argument("--ca", required=True, type=Path, help="the CA folder (or its ca.key)")
    s.add_argument("--request", required=True, type=Path, help="the device's request (fedfs ca request)")
    s.add_argument("--out", required=True, type=Path, help="where to write the certificate")
    s.add_argument("--subject", help="certify under this name instead of the request's")
    s.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")
    v = sub.add_parser("revoke", help="add certificates to the CA's signed revocation list (DIR/revocations.json; "
                                      "with no --serial/--cert: re-issue it, e.g. daily, so devices see a fresh one)")
    v.add_argument("--ca", required=True, type=Path, help="the CA folder")
    v.add_argument("--serial", action="append", default=[], help="a certificate serial to revoke (repeatable)")
    v.add_argument("--cert", action="append", default=[], type=Path, help="a certificate file to revoke (repeatable)")
    v.add_argument("--out", type=Path, help="also write the list here (e.g. the server's STATE/secagg_revocations.json)")
    t = sub.add_parser("tls-cert", help="the aggregation server's TLS certificate and key (self-signed, "
                                        "subjectAltNames 127.0.0.1, ::1, localhost and each --host); devices pin it")
    t.add_argument("--ca", required=True, type=Path, help="the CA folder: writes DIR/tls/server.pem and server.key")
    t.add_argument("--host", action="append", default=[], help="a name or IP address devices use (repeatable)")
    t.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..federation.secagg.identity import CertificateAuthority, IdentityError

    if args.ca_command == "init":
        key, pub = CertificateAuthority.generate().save(args.dir)
        print(f"CA key {key} (0600: keep it off the aggregation server); pin {pub} on the devices "
              "(fedfs device --secagg-ca) and the server (fedfs serve --secagg-ca)")
        return 0
    if args.ca_command == "request":
        from ..federation.device_identity import identity_request
        from ..federation.device_state import DeviceState
        from ..fileio import atomic_write_bytes

        _check_device_inputs(args)       # before the state folder is created and the device registered
        with DeviceState(args.state) as state:
            if args.server is not None and state.info is None:
                _register(state, args)
            req = identity_request(state, args.subject)
        atomic_write_bytes(args.out, json.dumps(req, indent=1).encode(), mode=0o644)
        print(f"identity request for {req['subject']!r} written to {args.out}; the private key stays in "
              f"{args.state / 'identity.key'}")
        return 0
    if args.ca_command == "revoke":
        return _revoke(args)
    if not args.days > 0:
        raise InputError(f"--days must be > 0, got {args.days}")
    if args.ca_command == "tls-cert":
        from ..federation.tls_cert import write_server_certificate

        cert, key = write_server_certificate(args.ca / "tls", args.host, args.days)
        print(f"TLS certificate {cert} (names: 127.0.0.1, ::1, localhost{''.join(', ' + h for h in args.host)}) and key "
              f"{key} (0600): fedfs serve --tls-cert {cert} --tls-key {key}; devices pin it with --tls-ca {cert}")
        return 0
    try:
        ca = CertificateAuthority.load(args.ca)
        request = json.loads(args.request.read_text())
    except IdentityError as e:
        raise InputError(str(e)) from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the request {args.request}: {e}") from None
    cert = ca.sign_request(request, args.subject, args.days)
    cert.save(args.out)
    print(f"certified {cert.subject!r} (key {cert.public_key.hex()[:16]}…, serial {cert.serial}) → {args.out}",
          file=sys.stdout)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..federation.secagg.identity import Certificate, CertificateAuthority, IdentityError
    from ..federation.secagg.revocation import FILENAME, RevocationList, issue

    try:
        ca = CertificateAuthority.load(args.ca)
    except IdentityError as e:
        raise InputError(str(e)) from None
    path = Path(args.ca) / FILENAME
    previous = RevocationList.load(path) if path.exists() else None
    serials = list(args.serial) + [Certificate.load(c).serial for c in args.cert]
    crl = issue(ca, previous, serials)
    crl.save(path)
    if args.out is not None:
        crl.save(args.out)
    print(f"revocation list number {crl.number}: {len(crl.revoked)} certificate(s) revoked → {path}"
          + (f" and {args.out}" if args.out is not None else ""))
    return 0


def _check_device_inputs(args: argparse.Namespace) -> None:
    """``fedfs device``'s own checks of its photos (:func:`~fedfs_sdk.federation.device_config.check_local_inputs`:
    a readable folder, every photo decodes, with ``--enroll`` at least ``⌈1/(1−q)⌉`` of them): a
    device that would refuse to run is never registered (deployment bug 2)."""
    from ..errors import InputError
    from ..federation.device_config import DeviceConfig, check_local_inputs
    from ..runtime.preprocess import list_images

    if args.images is None:
        if args.enroll or args.q is not None or args.detect_face:
            raise InputError("--enroll, --q and --detect-face describe the photos `fedfs device` will get: "
                             "give their folder with --images DIR")
        return
    q = 0.9 if args.q is None else args.q
    config = DeviceConfig(enroll=args.enroll, q=q, detect_face=args.detect_face)     # checks q as fedfs device does
    try:
        check_local_inputs([str(p) for p in list_images(args.images)], config)
    except InputError as e:
        raise InputError(f"{e} (nothing registered)") from None


def _register(state, args: argparse.Namespace) -> None:
    """Register the device (as ``fedfs device`` would) so its request names its device id."""
    from ..errors import InputError
    from ..federation.secagg.http_device import is_loopback
    from ..federation.server_client import ServerClient

    if not args.server.startswith("https://") and not is_loopback(args.server):
        raise InputError(f"--server {args.server}: plain http:// to another machine would send the device's token in "
                         "the clear; use https:// (fedfs ca tls-cert, fedfs serve --tls-cert) and --tls-ca")
    client = ServerClient(args.server, tls_ca=args.tls_ca)
    reg = client.register(args.registration_token)
    state.save_registration(client.base_url, reg["device_id"], reg["token"], reg["base_vector"])
    if reg.get("secure_aggregation") is True:
        state.mark_secure_aggregation()
