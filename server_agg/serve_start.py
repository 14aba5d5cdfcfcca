"""What ``fedfs serve`` settles from its flags and models before it binds the port or touches the
state: the model to publish as version 1 (:func:`initial_checkpoint`: ``--init-model`` with the
heads the method needs — FedUV's ``W`` of size ``c``, FedFS's projection — ``--init-backbone``, or
ξ's architecture started from ξ), the model configs of a checkpoint and of ξ, and the refusals of a
start that could not run: a method its model cannot train (:func:`check_start`), a FedFS
projection size that does not fit ξ's embedding (:func:`check_proj_dim`), plain HTTP on an
interface other machines reach (:func:`check_plain_bind`). Re-exported by :mod:`server_agg.cli`.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from fedfs_sdk.errors import InputError
from fedfs_sdk.training.objective import uses_fedfs


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


__all__ = ["initial_checkpoint", "model_config_of", "check_start", "xi_config_of", "check_proj_dim", "check_plain_bind"]
