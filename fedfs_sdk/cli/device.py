"""``fedfs device``: run one device against an aggregation server.

    fedfs device --server http://127.0.0.1:8080 --images ./me --state ./device --rounds 5 --enroll
    fedfs device ... --artifacts ./phone-export     # ONNX Runtime training, no torch in the process

The first run checks its inputs (server URL, images, ``--xi``, ``--artifacts``,
``--key-file``), then registers and creates the device state (token, ``b_u``, ``r_u``,
codeword, θ_c, enrollment); later runs reuse it.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..training.methods import SCORES, VERIFY_MODELS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="server URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--images", required=True, type=Path, help="folder of the device owner's images")
    p.add_argument("--state", required=True, type=Path, help="device-state directory (created on first run, 0700)")
    p.add_argument("--rounds", type=int, default=1, help="rounds to take part in (0: until the server is done; default 1)")
    p.add_argument("--xi", type=Path, metavar="CKPT", help="frozen ξ for FedFS methods (default: download the server's)")
    p.add_argument("--device", default="cpu", help="torch device for local training (cpu, cuda)")
    p.add_argument("--artifacts", type=Path, metavar="DIR",
                   help="train and verify from this export folder (fedfs export --formats onnx,ort-training) "
                        "with ONNX Runtime, as a phone does: torch is never imported")
    p.add_argument("--wait-timeout", type=float, default=3600.0,
                   help="give up after this many seconds without progress: no task, or the server unreachable "
                        "(default 3600)")
    p.add_argument("--registration-token", default=os.environ.get("FEDFS_REGISTRATION_TOKEN"),
                   help="token the server requires for registration (default $FEDFS_REGISTRATION_TOKEN)")
    p.add_argument("--detect-face", action="store_true", help="align the largest face to the 112×112 five-point template (dlib, the 'faces' extra; falls back to an OpenCV Haar crop without it)")
    p.add_argument("--enroll", action="store_true", help="after the last round, enroll the owner (writes "
                   "STATE/verifier.safetensors and the encrypted STATE/enrollment.fedfs)")
    p.add_argument("--q", type=float, default=0.9, help="enrollment target TPR (default 0.9)")
    p.add_argument("--outliers", choices=("mad", "none"), default="mad",
                   help="with --enroll: drop warm-up images whose score is far below the others (e.g. someone "
                        "else's photo) before the threshold is set: 'mad' (default; robust z-score, k=3.5) or 'none'")
    p.add_argument("--score", choices=SCORES, default=None,
                   help="with --enroll, FedUV methods: 'head-template' (a cosine template of W·g; the fedfs+feduv "
                        "default) or 'codeword' (FedUV Eq. 5 against the secret codeword; the feduv default)")
    p.add_argument("--verify", choices=VERIFY_MODELS, default=None,
                   help="with --enroll, fedfs+feduv: which model verifies: 'both' (unit(W q') ⊕ unit(W r'), the "
                        "default), 'personal' (θ_c, FedFS's reading) or 'global'")
    p.add_argument("--require-secure-aggregation", action=argparse.BooleanOptionalAction, default=None,
                   help="take part only in secure-aggregation rounds (the server then sees only the sum of the "
                        "round's updates); a plain round is refused, nothing is trained or sent. Default: required "
                        "with a server on another machine, once the server has offered secure aggregation, or with "
                        "--secagg-ca; "
                        "--no-require-secure-aggregation accepts plain rounds")
    g = p.add_argument_group("secure aggregation: this device's own floors (the server cannot lower them)")
    g.add_argument("--secagg-ca", type=Path, metavar="CA_PUB",
                   help="pin the operator CA (ca.pub of fedfs ca init): take part only in authenticated rounds "
                        "(fedfs-secagg/2), checking every other device's certificate and signed keys")
    g.add_argument("--identity-cert", type=Path, metavar="CERT",
                   help="this device's identity certificate (fedfs ca sign of the request fedfs ca request wrote); "
                        "checked and stored in the state")
    g.add_argument("--secagg-min-roster", type=int, default=3, metavar="N",
                   help="refuse a secure round with fewer devices (≥ 3; default 3)")
    g.add_argument("--secagg-threshold-rule", choices=("two-thirds", "majority"), default="two-thirds",
                   help="refuse a threshold below ⌊2m/3⌋+1 (two-thirds; default: needed against an active server) "
                        "or ⌊m/2⌋+1 (majority: honest-but-curious server only) of the m share holders")
    g.add_argument("--secagg-min-neighbours", type=int, default=4, metavar="K",
                   help="SecAgg+: refuse a sparse graph of degree below K (default 4)")
    g.add_argument("--allow-unauthenticated-secagg", action="store_true",
                   help="also take part in fedfs-secagg/1 rounds (no identities): safe against an honest-but-curious "
                        "server only — an active server reads every update (off: only fedfs-secagg/2 with --secagg-ca)")
    g.add_argument("--secagg-revocation-max-age", type=float, metavar="SECONDS",
                   help="require the operator's signed revocation list (fedfs ca revoke) in every authenticated "
                        "round, issued at most SECONDS ago (e.g. 172800: the operator re-issues it daily)")
    g.add_argument("--dp-min-noise", type=float, metavar="SIGMA",
                   help="distributed DP: refuse a round whose noise multiplier σ is below this")
    p.add_argument("--tls-ca", type=Path, metavar="PEM",
                   help="trust only these certificates for an https:// server: a CA bundle, or the server's own "
                        "(self-signed) certificate, which pins it (default: the system's CAs)")
    p.add_argument("--impostors", type=Path, metavar="FILE",
                   help="public impostor set (`fedfs impostors`) for the do-no-harm check, instead of the one the "
                        "server ships with its model: with --enroll the device keeps --holdout of its photos out of "
                        "training and enrolls with whichever of ξ, the global model and its personalized model "
                        "verifies them best against these impostors")
    p.add_argument("--no-stats", dest="stats", action="store_false",
                   help="take no part in the server's statistics rounds and do not use their sums at enrollment "
                        "(default: take part under secure aggregation, and choose with the in-domain check, "
                        "norm-adapt ξ and the federation's verdict; docs/protocol.md, 'Statistics rounds')")
    p.add_argument("--select", choices=("auto", "off"), default="auto",
                   help="with --enroll: 'auto' (default) runs the do-no-harm check — in the federation's conditions "
                        "from the statistics rounds' sums where the server published them, else on the public "
                        "impostors (--impostors, else the server's; without any it keeps ξ); 'off' enrolls the "
                        "method's own model unchecked (the papers' behaviour)")
    p.add_argument("--holdout", type=float, default=0.2, help="share of the owner's photos kept out of training for "
                   "that check (at least 2; default 0.2)")
    p.add_argument("--far", type=float, default=None, help="enrollment false-accept target (e.g. 1e-3): set on a "
                   "public impostor set — --impostors, or the server's — with ≥ ⌈1/far⌉−1 photos, else in the "
                   "federation's capture conditions from the statistics rounds' published tail (xi.tail) or --far-stats")
    p.add_argument("--far-stats", type=Path, default=None, metavar="FILE",
                   help="with --far: a statistics round's published sum (xi.features, xi.tail) to use instead of the "
                        "one the server's automatic rounds published")
    p.add_argument("--key-file", type=Path, help="32-byte device key: encrypts the enrollment and the FedUV "
                   "secrets (default: STATE/enrollment.key, created 0600)")
    p.add_argument("--audit-dir", type=Path, help="write a copy of every request body sent (to audit what "
                   "leaves the device; a new folder is 0700, files 0600)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout per request (s)")


def _printer(name: str, fields: dict[str, Any]) -> None:
    if name == "server_unreachable":
        print(f"[device] server unreachable, retrying until {fields['retrying_until']}: {fields['error']}",
              file=sys.stderr, flush=True)
        return
    if name == "enrollment_outliers":          # warm-up images dropped before τ was set (one line each)
        from .enroll import outlier_lines
        for line in outlier_lines(fields["rule"], fields["dropped"], fields["n_given"],
                                  fields.get("kept_at_floor", ()), fields.get("min_warmup")):
            print(f"[device] enrollment {line}", file=sys.stderr, flush=True)
        return
    parts = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
                     if not isinstance(v, dict))
    print(f"[device] {name} {parts}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from ..federation.agent import DeviceAgent
    from ..federation.device_config import DeviceConfig, check_local_inputs
    from ..federation.server_client import ServerClient, check_server_url
    from ..federation.ort_runtime import OrtRuntime
    from ..federation.device_state import DeviceState
    from ..errors import InputError
    from ..runtime.preprocess import list_images
    from .common import read_key

    # Everything local is checked before the state folder is created and before the device
    # registers: a mistake here must not leave a registered device that stalls every round.
    if args.rounds < 0:
        raise InputError(f"--rounds must be ≥ 0 (0: until the server is done), got {args.rounds}")
    if not args.timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.wait_timeout > 0:
        raise InputError(f"--wait-timeout must be > 0 seconds, got {args.wait_timeout}")
    check_server_url(args.server)
    key = read_key(str(args.key_file), create=False) if args.key_file is not None and args.key_file.exists() else None
    images = [str(p) for p in list_images(args.images)]
    from ..federation.secagg.identity import CaPublicKey
    from ..federation.secagg.policy import DevicePolicy

    policy = DevicePolicy(ca=CaPublicKey.load(args.secagg_ca) if args.secagg_ca is not None else None,
                          min_roster=args.secagg_min_roster, threshold_rule=args.secagg_threshold_rule,
                          min_neighbours=args.secagg_min_neighbours, min_noise_multiplier=args.dp_min_noise,
                          allow_unauthenticated=args.allow_unauthenticated_secagg,
                          max_revocation_age_s=args.secagg_revocation_max_age)
    if args.identity_cert is not None and not args.identity_cert.is_file():
        raise InputError(f"--identity-cert: no such file {args.identity_cert}")
    config = DeviceConfig(rounds=args.rounds, device=args.device, artifacts=args.artifacts, xi_path=args.xi,
                          wait_timeout_s=args.wait_timeout,
                          detect_face=args.detect_face, enroll=args.enroll, q=args.q, enrollment_key=key,
                          registration_token=args.registration_token, outliers=args.outliers,
                          score=args.score, verify=args.verify,
                          require_secure_aggregation=args.require_secure_aggregation, secagg=policy,
                          identity_certificate=args.identity_cert,
                          impostors=args.impostors, holdout=args.holdout, far=args.far, select=args.select,
                          stats=args.stats, far_stats=args.far_stats)
    runtime = OrtRuntime(args.artifacts) if args.artifacts is not None else None
    batches = check_local_inputs(images, config, runtime)
    if args.key_file is not None and key is None:
        config.enrollment_key = read_key(str(args.key_file), create=True)

    def on_retry(why: str, delay: float) -> None:
        print(f"[device] retrying in {delay:.1f} s: {why}", file=sys.stderr, flush=True)

    with DeviceState(args.state) as state, ServerClient(args.server, timeout=args.timeout, audit_dir=args.audit_dir,
                                                        on_retry=on_retry, tls_ca=args.tls_ca) as client:
        report = DeviceAgent(client, state, images, config, on_event=_printer, runtime=runtime,
                             batches=batches).run()
    print(f"took part in {len(report.rounds)} round(s)"
          + (f", lost {len(report.lost_rounds)}" if report.lost_rounds else "")
          + (", server finished" if report.finished_by_server else "")
          + (f", enrolled (τ={report.enrollment.threshold:.4f})" if report.enrollment is not None else ""))
    if report.enrollment is not None:
        from ..runtime.operating_point import describe
        choice = report.enrollment.meta.get("model_choice")
        print((f"verifies with: {choice} ({report.enrollment.meta['selection']['reason']}); "
               if "selection" in report.enrollment.meta else "") + describe(report.enrollment.meta))
    return 0
