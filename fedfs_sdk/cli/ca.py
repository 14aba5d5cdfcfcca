"""``fedfs ca``: the operator CA that certifies device identities for secure aggregation
against an active server (``fedfs-secagg/2``; docs/privacy.md).

    fedfs ca init --dir ./ca                                    # operator, once: ca.key (0600), ca.pub
    fedfs ca request --state ./device --out req.json            # on the device: identity key + request
    fedfs ca sign --ca ./ca --request req.json --out cert.json  # operator: checks, certifies
    fedfs device … --secagg-ca ./ca/ca.pub --identity-cert cert.json

Keep ``ca.key`` away from the aggregation server: whoever holds it can mint devices. The
operator decides whom to certify (e.g. after a platform attestation of the app); fedfs
checks only that the request was signed by the key it asks to certify.
"""
from __future__ import annotations

import argparse
import json
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
    r.add_argument("--subject", help="name to certify (default: the device id once registered)")
    s = sub.add_parser("sign", help="certify a device's request with the CA key")
    s.add_argument("--ca", required=True, type=Path, help="the CA folder (or its ca.key)")
    s.add_argument("--request", required=True, type=Path, help="the device's request (fedfs ca request)")
    s.add_argument("--out", required=True, type=Path, help="where to write the certificate")
    s.add_argument("--subject", help="certify under this name instead of the request's")
    s.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")


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

        with DeviceState(args.state) as state:
            req = identity_request(state, args.subject)
        atomic_write_bytes(args.out, json.dumps(req, indent=1).encode(), mode=0o644)
        print(f"identity request for {req['subject']!r} written to {args.out}; the private key stays in "
              f"{args.state / 'identity.key'}")
        return 0
    if not args.days > 0:
        raise InputError(f"--days must be > 0, got {args.days}")
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
