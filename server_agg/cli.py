"""``fedfs serve``: run the aggregation server.

    fedfs serve --state ./server --init-backbone tiny --code-length 127 --method feduv \\
                --rounds 5 --min-participants 3

Policy flags (``--method`` … ``--device-ttl``) are stored in the state directory; flags
given on a later start override the stored values, omitted ones keep them.

Start-up order: flags are checked (including that the method can run on the model), the
port is bound, the state directory is locked (one server per state), and only then is
anything written to the state — so a refused start leaves a new state directory absent.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.backbones import DEFAULTS as BACKBONE_NAMES
from fedfs_sdk.training.objective import uses_fedfs

log = logging.getLogger("fedfs.server")

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


def initial_checkpoint(args: argparse.Namespace, xi: bytes | None = None, method: str = "feduv",
                       train: dict[str, Any] | None = None) -> bytes | None:
    """Bytes of the model to publish as version 1: --init-model (heads the method needs added),
    --init-backbone, or — with neither — ξ's architecture started from ξ (:mod:`.model_source`)."""
    from .model_source import config_of, head_sizes, initial_from_xi, read_model_spec, with_heads

    if args.init_model is not None and args.init_backbone is not None:
        raise InputError("give --init-model or --init-backbone, not both")
    xi_config = config_of(xi, "--xi") if xi is not None else None
    code_length, proj_dim = head_sizes(method, xi_config, train or {}, args.code_length, args.proj_dim)
    if args.init_model is not None:
        data = read_model_spec(args.init_model, "--init-model")
        return with_heads(data, code_length, proj_dim, args.init_seed, "--init-model")
    if args.init_backbone is None and xi is None:
        return None
    from fedfs_sdk.nn.checkpoint import FORMAT
    from fedfs_sdk.nn.model import ModelConfig
    from fedfs_sdk.training.trainer import initial_global_weights
    from fedfs_sdk.federation.wire import encode_weights

    backbone = args.init_backbone or xi_config["backbone"]
    same = xi_config is not None and xi_config["backbone"] == backbone
    config = ModelConfig(backbone=backbone,
                         embedding_dim=args.embedding_dim or (xi_config["embedding_dim"] if same else None),
                         input_size=args.input_size or (xi_config["input_size"] if same else None),
                         proj_dim=proj_dim, code_length=code_length,
                         width=args.width or (xi_config.get("width") if same else None)).resolved()
    if xi is not None and (args.init_backbone is None or uses_fedfs(method)):
        # the global model starts from ξ (the simulator's ϕ does): same architecture, or refused naming both
        return initial_from_xi(xi, config, args.init_seed, backbone)
    weights = initial_global_weights(config, None, seed=args.init_seed)
    return encode_weights(weights, {"format": FORMAT, "model_config": config.to_json(),
                                    "meta": json.dumps({"init": args.init_backbone, "seed": args.init_seed})})


def model_config_of(checkpoint: bytes) -> dict[str, Any]:
    """The model config a fedfs checkpoint's header declares (``InputError`` if unreadable)."""
    from fedfs_sdk.federation.wire_format import read_header

    try:
        _, meta = read_header(checkpoint)
        config = json.loads(meta.get("model_config", "null"))
    except (InputError, ValueError) as e:
        raise InputError(f"the initial model is not a fedfs checkpoint: {e}") from None
    if not isinstance(config, dict):
        raise InputError("the initial model is not a fedfs checkpoint (no model_config)")
    return config


def check_start(args: argparse.Namespace, method: str, model_config: dict[str, Any] | None,
                installs_initial: bool, where: str = "the initial model") -> None:
    """Refuse (``InputError``) a start whose method cannot run on its model, or a FedFS
    start from ``--init-backbone`` without the ξ its backbone must be copied from."""
    from .config import mismatch_reason, missing_model_field

    missing = missing_model_field(method, model_config)
    if missing is not None:
        fix = {"code_length": "give --code-length 127|255|511", "proj_dim": "give --proj-dim N"}
        how = fix[missing] if installs_initial else "install a model that has it (POST /v1/admin/model?method=…)"
        raise InputError(f"{mismatch_reason(method, missing, where)}: {how}, or choose a --method it supports")
    if installs_initial and args.init_backbone is not None and uses_fedfs(method) and args.xi is None:
        raise InputError(f"method {method!r} starts the global backbone from the pre-trained ξ: give --xi CKPT "
                         "with --init-backbone (or publish a trained model with --init-model)")


def xi_config_of(xi: bytes | None) -> dict[str, Any] | None:
    """The resolved model config of a ξ checkpoint (``None`` without one)."""
    if xi is None:
        return None
    from fedfs_sdk.nn.model import ModelConfig

    try:
        return json.loads(ModelConfig.from_json(json.dumps(model_config_of(xi))).resolved().to_json())
    except (InputError, TypeError, ValueError) as e:
        raise InputError(f"--xi: cannot read its model config: {e}") from None


def check_proj_dim(method: str, model_config: dict[str, Any] | None, xi_config: dict[str, Any] | None,
                   train: dict[str, Any], where: str = "the initial model") -> None:
    """Refuse (``InputError``) a FedFS start whose projection size does not fit ξ
    (:func:`~server_agg.config.proj_dim_mismatch`): the round would open and every device fail."""
    from .config import proj_dim_mismatch

    bad = proj_dim_mismatch(method, model_config, xi_config, train)
    if bad is not None:
        have, need, xi_dim, combine = bad
        fix = f"give --proj-dim {need}" if where == "the initial model" else \
            f"install a model with proj_dim = {need} (POST /v1/admin/model) or give the matching --xi"
        raise InputError(f"--proj-dim {have} cannot be trained with this ξ: ξ's embedding has {xi_dim} dims and "
                         f"FedFS (combine={combine!r}) needs proj_dim = {need} for {where}; {fix}")


def check_plain_bind(host: str, tls: bool, insecure_plain_http: bool) -> None:
    """Refuse plain HTTP on an interface other machines reach, unless named (issue 30)."""
    from fedfs_sdk.federation.secagg.http_device import is_loopback

    if not tls and not insecure_plain_http and not is_loopback(f"http://[{host}]" if ":" in host else f"http://{host}"):
        raise InputError(f"--host {host} without TLS: other machines would talk to this server in plain HTTP, "
                         "readable and rewritable on the path; give --tls-cert/--tls-key (fedfs ca tls-cert makes "
                         "them) or --insecure-plain-http")


def _read_impostors(args: argparse.Namespace) -> bytes | None:
    """The bytes of --impostors, checked to be a fedfs impostor set (None without the flag)."""
    path = getattr(args, "impostors", None)
    if path is None:
        return None
    from fedfs_sdk.runtime.impostors import load_impostors

    load_impostors(path)                      # a clear one-line error for anything else
    return Path(path).read_bytes()


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before the state is touched so a busy
    port fails the start without writing anything (uvicorn then serves on it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)      # "localhost": IPv4 first, as devices dial it
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not SO_REUSEPORT: a busy port stays busy
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from .config import RoundPolicy
    from .logs import setup_logging
    from .rounds import validate_xi
    from .store import Layout, StateLock
    from .transport import http_parser

    setup_logging(args.log_level)
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout", "limit_concurrency", "decode_workers",
                 "receive_workers"):
        v = getattr(args, flag)
        if not v > 0 or v != v or v == float("inf"):
            raise InputError(f"--{flag.replace('_', '-')} must be a positive finite number, got {v}")
    installed = http_parser()
    if args.http_parser == "httptools" and installed != "httptools":
        raise InputError("--http-parser httptools: httptools is not installed (pip install 'fedfs[server]')")
    if args.http_parser == "auto":
        args.http_parser = installed             # _serve builds the protocol and logs this one
    xi = None
    if args.xi is not None:
        from .model_source import read_model_spec

        xi = read_model_spec(args.xi, "--xi")
        validate_xi(xi)
    impostors = _read_impostors(args)
    overrides = policy_overrides(args)
    from .transport import tls_files

    tls = tls_files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    check_plain_bind(args.host, tls is not None, bool(getattr(args, "insecure_plain_http", False)))
    if overrides.get("dp_noise_multiplier") is not None:
        from .dp import require_accountant

        require_accountant()                   # DP without its accountant: say so now, not at round 1
    layout = Layout(args.state.resolve())
    if layout.root.exists() and not layout.root.is_dir():
        raise InputError(f"--state {args.state} exists and is not a directory")
    new_state = not layout.db.exists()
    if new_state and "method" not in overrides:
        from .model_source import default_method

        overrides["method"] = default_method(xi is not None)   # the simulator's default where ξ is given
    try:
        start_policy = RoundPolicy().updated(overrides)
    except InputError as e:
        raise InputError(f"invalid round policy: {e}") from None
    # bad flags fail before the state is touched; an existing state's model is not replaced
    init = initial_checkpoint(args, xi, start_policy.method, dict(start_policy.train)) \
        if new_state or args.init_model is not None or args.init_backbone is not None else None
    init_config = model_config_of(init) if init is not None else None
    if new_state:                              # a new state: its policy is the defaults + flags
        try:
            policy = RoundPolicy().updated(overrides)
        except InputError as e:
            raise InputError(f"invalid round policy: {e}") from None
        check_start(args, policy.method, init_config, installs_initial=init is not None)
        check_proj_dim(policy.method, init_config, xi_config_of(xi), dict(policy.train))
    sock = bind_listener(args.host, args.port)
    try:
        with StateLock(layout.root):
            return _serve(args, layout, sock, overrides, init, init_config, xi, tls, impostors)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, layout: Any, sock: socket.socket, overrides: dict[str, Any],
           init: bytes | None, init_config: dict[str, Any] | None, xi: bytes | None,
           tls: tuple[str, str] | None = None, impostors: bytes | None = None) -> int:
    """Everything after the port is bound and the state locked."""
    import uvicorn

    from .app import create_app
    from .auth import load_admin_token
    from .transport import deadline_protocol
    from .rounds import Coordinator

    coord = Coordinator(layout, keep_updates=args.keep_updates, poll_interval_s=args.poll_interval)
    try:
        method = coord.policy.updated(overrides).method
        installs = init is not None and coord.model is None
        where = "the initial model" if installs or coord.model is None else f"the state's model v{coord.model.version}"
        model_config = init_config if installs else (coord.model.model_config if coord.model else None)
        check_start(args, method, model_config, installs_initial=installs, where=where)
        stored_xi = layout.xi.read_bytes() if xi is None and layout.xi.is_file() else None
        check_proj_dim(method, model_config, xi_config_of(xi if xi is not None else stored_xi),
                       dict(coord.policy.updated(overrides).train), where=where)
        if not coord.configure(overrides, init) and init is not None:
            log.info("initial model ignored: the state already has one",
                     extra={"fields": {"model_version": coord.model.version}})
        if xi is not None:
            coord.install_xi(xi)
        if impostors is not None:
            from .impostor_store import install_impostors

            install_impostors(coord, impostors)
        admin_token, generated = load_admin_token(layout.admin_token, args.admin_token)
        if generated:
            log.info("admin token generated", extra={"fields": {"path": str(layout.admin_token)}})
        app = create_app(coord, admin_token=admin_token, registration_token=args.registration_token,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), tick_interval_s=args.tick_interval,
                         body_timeout_s=args.body_timeout, decode_workers=args.decode_workers,
                         receive_workers=args.receive_workers)
        port = sock.getsockname()[1]
        scheme = "https" if tls else "http"
        log.info("serving", extra={"fields": {"url": f"{scheme}://{args.host}:{port}", "state": str(layout.root),
                                              "pid": os.getpid(), "http_parser": args.http_parser,
                                              "model_version": coord.model.version if coord.model else None,
                                              "policy": coord.policy.to_json()}})
        # A thread holding the GIL keeps it up to the switch interval (5 ms by default) each
        # time the event loop wants it back — for every socket call. 1 ms bounds that wait
        # while decode threads run Python code (measured in benchmarks/server_http_load.py).
        sys.setswitchinterval(0.001)
        config = uvicorn.Config(app, log_config=None, access_log=False, log_level=args.log_level,
                                timeout_graceful_shutdown=5, http=deadline_protocol(args.header_timeout, args.http_parser),
                                timeout_keep_alive=args.keep_alive_timeout,  # type: ignore[arg-type]
                                limit_concurrency=args.limit_concurrency,
                                ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # pragma: no cover - uvicorn handles SIGINT itself
            pass
        return 0 if server.started else 3
    finally:
        coord.close()


__all__ = ["add_arguments", "run", "policy_overrides", "initial_checkpoint", "check_start", "check_proj_dim",
           "xi_config_of", "bind_listener"]
