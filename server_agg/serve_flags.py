"""The ``fedfs serve`` command line: its flags (:func:`add_arguments`) and which of them are
round policy (``_POLICY_FLAGS``: flag dest → :class:`~server_agg.config.RoundPolicy` field),
stored in the state directory, so :func:`policy_overrides` returns only those given on this
start (omitted ones keep the stored values). Re-exported by :mod:`server_agg.cli`.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.backbones import DEFAULTS as BACKBONE_NAMES

_POLICY_FLAGS: dict[str, tuple[str, type]] = {
    # flag dest: (policy field, type)
    "method": ("method", str), "neg_codewords": ("neg_codewords", int), "participation": ("participation", float),
    "min_participants": ("min_participants", int), "quorum": ("quorum", float), "min_updates": ("min_updates", int),
    "round_timeout": ("round_timeout_s", float), "rounds": ("rounds", int),
    "max_update_norm": ("max_update_norm", float), "max_num_samples": ("max_num_samples", int), "seed": ("seed", int),
    "device_ttl": ("device_ttl_s", float),
    # user-level DP-FedAvg (server_agg.dp; docs/privacy.md)
    "dp_noise_multiplier": ("dp_noise_multiplier", float), "dp_delta": ("dp_delta", float),
    "dp_epsilon_budget": ("dp_epsilon_budget", float), "dp_weight_cap": ("dp_weight_cap", int),
    "dp_accountant": ("dp_accountant", str), "dp_noise": ("dp_noise", str),
    # secure aggregation (server_agg.secagg_rounds; docs/privacy.md)
    "secure_aggregation": ("secure_aggregation", bool), "secagg_threshold": ("secagg_threshold", int),
    "secagg_neighbours": ("secagg_neighbours", int), "secagg_clip": ("secagg_clip", float),
    "secagg_scale_bits": ("secagg_scale_bits", int), "secagg_min_devices": ("secagg_min_devices", int),
    "secagg_phase_timeout": ("secagg_phase_timeout_s", float),
    "stats_rounds": ("stats_rounds", bool),
    "stats_dp_noise_multiplier": ("stats_dp_noise_multiplier", float), "stats_dp_noise": ("stats_dp_noise", str),
    "stats_dp_delta": ("stats_dp_delta", float), "stats_bound": ("stats_bound", float),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0: any free port, logged at start)")
    p.add_argument("--state", required=True, type=Path, help="state directory (database, model versions, updates)")
    p.add_argument("--admin-token", help="admin bearer token (else $FEDFS_ADMIN_TOKEN, else generated into STATE/admin_token)")
    p.add_argument("--registration-token", default=os.environ.get("FEDFS_REGISTRATION_TOKEN"),
                   help="if set (or $FEDFS_REGISTRATION_TOKEN), devices must present it to register")
    g = p.add_argument_group("initial model (used only while the state has no model)")
    g.add_argument("--init-model", metavar="CKPT|NAME",
                   help="publish this fedfs checkpoint (any built-in architecture, e.g. what fedfs import-model "
                        "wrote) or built-in model (dlib-resnet) as version 1; the FedUV head / FedFS projection the "
                        "method needs are added when it lacks them")
    g.add_argument("--init-backbone", choices=sorted(BACKBONE_NAMES),
                   help="publish a freshly initialized model with this backbone as version 1 (with --xi: must be "
                        "ξ's architecture, whose weights it starts from; default then)")
    g.add_argument("--code-length", type=int, choices=(127, 255, 511),
                   help="FedUV head size c (needed by the feduv and fedfs+feduv methods; default 127 when the "
                        "server adds the head)")
    g.add_argument("--proj-dim", type=int,
                   help="FedFS extra linear layer size (needed by the fedfs and fedfs+feduv methods; default: "
                        "what ξ's embedding size asks for)")
    g.add_argument("--embedding-dim", type=int, help="embedding size (default: ξ's, else the backbone's)")
    g.add_argument("--input-size", type=int, help="input image side in pixels (default: ξ's, else the backbone's)")
    g.add_argument("--width", type=int, help="width multiplier of the tiny / feduv_cnn backbones (default: the backbone's)")
    g.add_argument("--init-seed", type=int, default=0, help="seed of the random initialization")
    p.add_argument("--xi", metavar="CKPT|NAME", help="frozen ξ served read-only to devices: a fedfs checkpoint of "
                   "any built-in architecture or a built-in model (dlib-resnet). A new state without --init-model "
                   "starts the global model from it (ξ's architecture) and runs fedfs+feduv by default, as "
                   "fedfs simulate does")
    p.add_argument("--impostors", type=Path, metavar="NPZ",
                   help="public impostor set shipped with the model (fedfs impostors): devices download it for the "
                        "do-no-harm check at enrollment (without one they keep ξ)")
    g = p.add_argument_group("round policy (stored; see docs/protocol.md)")
    g.add_argument("--method", choices=("feduv", "fedfs", "fedfs+feduv"),
                   help="what devices train (a new state: fedfs+feduv with a ξ, the simulator's default; feduv "
                        "without); must fit the model: feduv needs a FedUV head, fedfs a projection, fedfs+feduv both")
    g.add_argument("--train", metavar="JSON", help='training settings, e.g. \'{"lr": 0.1, "local_epochs": 1}\'')
    g.add_argument("--neg-codewords", type=int, help="random codewords per device for FedUV ℓ_neg")
    g.add_argument("--participation", type=float, help="fraction of devices sampled per round (0, 1]")
    g.add_argument("--min-participants", type=int, help="devices needed to open a round (and sampled at least)")
    g.add_argument("--quorum", type=float, help="fraction of sampled devices that closes a round early (0, 1]")
    g.add_argument("--min-updates", type=int, help="updates needed to aggregate at the deadline")
    g.add_argument("--round-timeout", type=float, help="seconds from opening to the deadline")
    g.add_argument("--rounds", type=int, help="run this many rounds automatically (0: admin opens rounds)")
    g.add_argument("--max-update-norm", type=float, help="clip ‖w_c − w‖₂ to this bound")
    g.add_argument("--max-num-samples", type=int, help="largest |D_c| a device may claim")
    g.add_argument("--seed", type=int, help="seed of the participant sampling")
    g.add_argument("--device-ttl", type=float, metavar="SECONDS",
                   help="sample only devices that polled the server (any authenticated request; registering is "
                        "not one) within this many seconds (default: 10 × --poll-interval, at least 60 s; "
                        "0: every registered device, even one that never polled)")
    g.add_argument("--dp-noise-multiplier", type=float, metavar="SIGMA",
                   help="user-level DP-FedAvg: Gaussian noise σ·C on each round's sum, C = --max-update-norm "
                        "(needs --dp-delta; rounds then use Poisson sampling at --participation)")
    g.add_argument("--dp-delta", type=float, help="δ at which ε is reported with every model version")
    g.add_argument("--dp-epsilon-budget", type=float, metavar="EPS",
                   help="refuse to open a round that would take ε above this; the federation stops")
    g.add_argument("--dp-weight-cap", type=int, metavar="N", help="a device weighs min(|D_c|/N, 1) in a DP round")
    g.add_argument("--dp-accountant", choices=("rdp", "pld"), help="privacy accountant (dp-accounting)")
    g.add_argument("--dp-noise", choices=("central", "distributed"),
                   help="with --secure-aggregation: 'distributed' = each device adds its share of the noise to "
                        "its masked input, so the server never sees a noiseless sum (docs/privacy.md)")
    g.add_argument("--stats-dp-noise-multiplier", type=float, metavar="Z",
                   help="DP on the automatic statistics rounds: Gaussian noise of Z × each statistic's sensitivity "
                        "on the published sums, (ε, δ) in the result (docs/protocol.md; off by default)")
    g.add_argument("--stats-dp-noise", choices=("central", "distributed"),
                   help="where the statistics' DP noise is added: the server, once (central), or each device, "
                        "1/m of it before masking (distributed)")
    g.add_argument("--stats-dp-delta", type=float, metavar="DELTA", help="the δ of the statistics rounds' ε (N^-1.1)")
    g.add_argument("--stats-bound", type=float, metavar="B",
                   help="each photo's L2 clip in the automatic rounds' ξ moments (default 1e3); under DP set it "
                        "near ξ's embedding/feature norms: the noise grows with B²")
    g.add_argument("--stats-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="with --rounds and a served ξ (default on): open the statistics rounds of the default "
                        "do-no-harm rule — ξ's moments before round 1, the devices' check results after the last "
                        "round — under secure aggregation (fedfs-secagg/2 with --secagg-ca); --no-stats-rounds: "
                        "devices fall back to the public impostors")
    g.add_argument("--secure-aggregation", action=argparse.BooleanOptionalAction, default=None,
                   help="rounds run secure aggregation: the server learns only the sum of the surviving "
                        "devices' n·w and n (with --dp-noise-multiplier: of their clipped, weighted w_c − w, "
                        "noised by the server; docs/privacy.md); --no-secure-aggregation turns it off")
    g.add_argument("--secagg-threshold", type=int, metavar="T",
                   help="shares needed to unmask (stored default: ⌊2m/3⌋+1 of m share holders; ≥ majority)")
    g.add_argument("--secagg-neighbours", type=int, metavar="K", help="SecAgg+: each device masks with K "
                   "neighbours (even) instead of all devices")
    g.add_argument("--secagg-clip", type=float, help="fixed-point range: weights are clipped to [-clip, clip]")
    g.add_argument("--secagg-scale-bits", type=int, help="fixed-point resolution 2^-bits")
    g.add_argument("--secagg-min-devices", type=int, help="a secure round with fewer devices fails (≥ 3)")
    g.add_argument("--secagg-phase-timeout", type=float, metavar="SECONDS",
                   help="deadline of each key-exchange / unmasking phase of a secure round")
    g.add_argument("--secagg-ca", metavar="CA_PUB",
                   help="the operator CA's public key (ca.pub of fedfs ca init): secure rounds run fedfs-secagg/2 "
                        "(devices' identity certificates, signed keys, consistency check; defends against an "
                        "active server); 'none' goes back to fedfs-secagg/1")
    from .config import RoundPolicy

    initial = RoundPolicy()
    for action in g._group_actions:            # show what a new state starts with
        field = _POLICY_FLAGS.get(action.dest, (None,))[0]
        if field is not None and "default" not in (action.help or ""):
            value = getattr(initial, field)
            action.help = f"{action.help} (stored; a new state starts with {'none' if value is None else value})"
    g = p.add_argument_group("service")
    g.add_argument("--tls-cert", type=Path, metavar="PEM",
                   help="serve HTTPS with this certificate (chain) — devices then connect with https:// and check it "
                        "(fedfs device --tls-ca); needs --tls-key")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--insecure-plain-http", action="store_true",
                   help="listen on a non-loopback --host without TLS: anyone on the path reads and rewrites every "
                        "request (tokens, updates, the secure-aggregation protocol); refused without this flag")
    g.add_argument("--max-body-mb", type=float, default=256.0, help="request body limit in MiB; "
                   "uploads are also limited to the model's size plus 1 MiB")
    g.add_argument("--keep-updates", action="store_true", help="keep update files of closed rounds (audit)")
    g.add_argument("--poll-interval", type=float, default=2.0, help="retry_after hint for waiting devices (s)")
    g.add_argument("--tick-interval", type=float, default=0.5, help="how often deadlines are checked (s)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log lines (JSON on stderr) at this level and above")
    g = p.add_argument_group("connection limits (what a slow or hostile client may hold)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a connection must send a complete request head within this time (else it is closed)")
    g.add_argument("--http-parser", choices=("auto", "httptools", "h11"), default="auto",
                   help="HTTP/1.1 parser: httptools (C; installed by the server extra) or h11 (pure Python, "
                        "slower under connection bursts); auto: httptools where installed")
    g.add_argument("--body-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="a request body must be complete within this time (else 408 and the connection is closed)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="an idle kept-alive connection is closed after this time")
    g.add_argument("--limit-concurrency", type=int, default=1024, metavar="N",
                   help="open connections / requests beyond this are answered 503")
    g.add_argument("--receive-workers", type=int, default=16, metavar="N",
                   help="model-sized bodies received at once (the others wait their turn, unread)")
    g.add_argument("--decode-workers", type=int, default=2, metavar="N",
                   help="uploads decoded, validated and aggregated at once (each holds a few copies of the "
                        "model in memory; bodies waiting for a slot are spooled to a temp file)")


def policy_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The policy settings given explicitly on the command line."""
    out: dict[str, Any] = {}
    for dest, (name, _) in _POLICY_FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            out[name] = v
    if args.train is not None:
        try:
            out["train"] = json.loads(args.train)
        except json.JSONDecodeError as e:
            raise InputError(f"--train is not valid JSON: {e}") from None
    ca = getattr(args, "secagg_ca", None)
    if ca is not None:
        from fedfs_sdk.federation.secagg import CaPublicKey

        out["secagg_ca"] = None if ca == "none" else CaPublicKey.load(ca).to_json()
    return out


__all__ = ["add_arguments", "policy_overrides"]
