"""``fedfs serve``: run the aggregation server.

    fedfs serve --state ./server --init-backbone tiny --code-length 127 --method feduv \\
                --rounds 5 --min-participants 3

Policy flags (``--method`` … ``--seed``) are stored in the state directory; flags given
on a later start override the stored values, omitted ones keep them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from fedfs_sdk.errors import InputError

log = logging.getLogger("fedfs.server")

_POLICY_FLAGS: dict[str, tuple[str, type]] = {
    # flag dest: (policy field, type)
    "method": ("method", str), "neg_codewords": ("neg_codewords", int), "participation": ("participation", float),
    "min_participants": ("min_participants", int), "quorum": ("quorum", float), "min_updates": ("min_updates", int),
    "round_timeout": ("round_timeout_s", float), "rounds": ("rounds", int),
    "max_update_norm": ("max_update_norm", float), "max_num_samples": ("max_num_samples", int), "seed": ("seed", int),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    p.add_argument("--state", required=True, type=Path, help="state directory (database, model versions, updates)")
    p.add_argument("--admin-token", help="admin bearer token (else $FEDFS_ADMIN_TOKEN, else generated into STATE/admin_token)")
    p.add_argument("--registration-token", default=os.environ.get("FEDFS_REGISTRATION_TOKEN"),
                   help="if set (or $FEDFS_REGISTRATION_TOKEN), devices must present it to register")
    g = p.add_argument_group("initial model (used only while the state has no model)")
    g.add_argument("--init-model", type=Path, metavar="CKPT", help="publish this fedfs checkpoint as version 1")
    g.add_argument("--init-backbone", choices=("tiny", "feduv_cnn", "mobilefacenet"),
                   help="publish a freshly initialized model with this backbone as version 1")
    g.add_argument("--code-length", type=int, choices=(127, 255, 511), help="FedUV head size c (feduv methods)")
    g.add_argument("--proj-dim", type=int, help="FedFS extra linear layer size (fedfs methods)")
    g.add_argument("--embedding-dim", type=int)
    g.add_argument("--input-size", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--xi", type=Path, metavar="CKPT", help="frozen ξ checkpoint served read-only to FedFS devices")
    g = p.add_argument_group("round policy (stored; see docs/protocol.md)")
    g.add_argument("--method", choices=("feduv", "fedfs", "fedfs+feduv"))
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
    g = p.add_argument_group("service")
    g.add_argument("--max-body-mb", type=float, default=256.0, help="request body limit in MiB (default 256); "
                   "uploads are also limited to the model's size plus 1 MiB")
    g.add_argument("--keep-updates", action="store_true", help="keep update files of closed rounds (audit)")
    g.add_argument("--poll-interval", type=float, default=2.0, help="retry_after hint for waiting devices (s)")
    g.add_argument("--tick-interval", type=float, default=0.5, help="how often deadlines are checked (s)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


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
    return out


def initial_checkpoint(args: argparse.Namespace) -> bytes | None:
    """Bytes of the model to publish as version 1, from --init-model or --init-backbone."""
    if args.init_model is not None and args.init_backbone is not None:
        raise InputError("give --init-model or --init-backbone, not both")
    if args.init_model is not None:
        if not args.init_model.is_file():
            raise InputError(f"--init-model: no such file {args.init_model}")
        return args.init_model.read_bytes()
    if args.init_backbone is None:
        return None
    from fedfs_sdk.checkpoint import FORMAT, load_checkpoint
    from fedfs_sdk.model import ModelConfig
    from fedfs_sdk.trainer import initial_global_weights
    from fedfs_sdk.wire import encode_weights

    config = ModelConfig(backbone=args.init_backbone, embedding_dim=args.embedding_dim, input_size=args.input_size,
                         proj_dim=args.proj_dim, code_length=args.code_length, width=args.width).resolved()
    xi = load_checkpoint(args.xi)[0] if (args.xi is not None and args.proj_dim) else None
    weights = initial_global_weights(config, xi, seed=args.init_seed)
    return encode_weights(weights, {"format": FORMAT, "model_config": config.to_json(),
                                    "meta": json.dumps({"init": args.init_backbone, "seed": args.init_seed})})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .auth import load_admin_token
    from .logs import setup_logging
    from .rounds import Coordinator
    from .store import Layout

    setup_logging(args.log_level)
    if args.xi is not None and not args.xi.is_file():
        raise InputError(f"--xi: no such file {args.xi}")
    overrides = policy_overrides(args)
    init = initial_checkpoint(args)            # bad flags fail before the state is touched
    layout = Layout(args.state.resolve())
    layout.create()
    admin_token, generated = load_admin_token(layout.admin_token, args.admin_token)
    if generated:
        log.info("admin token generated", extra={"fields": {"path": str(layout.admin_token)}})
    coord = Coordinator(layout, policy_overrides=overrides, keep_updates=args.keep_updates,
                        poll_interval_s=args.poll_interval)
    if args.xi is not None:
        coord.install_xi(args.xi.read_bytes())
    if init is not None:
        if coord.model is None:
            coord.install_model(init)
        else:
            log.info("initial model ignored: the state already has one",
                     extra={"fields": {"model_version": coord.model.version}})
    app = create_app(coord, admin_token=admin_token, registration_token=args.registration_token,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)), tick_interval_s=args.tick_interval)
    log.info("serving", extra={"fields": {"url": f"http://{args.host}:{args.port}", "state": str(layout.root),
                                          "model_version": coord.model.version if coord.model else None,
                                          "policy": coord.policy.to_json()}})
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                    log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        coord.close()
    return 0


__all__ = ["add_arguments", "run", "policy_overrides", "initial_checkpoint"]
