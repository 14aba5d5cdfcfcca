"""Where ``fedfs serve``'s models come from: ξ and the initial global model from anything
``fedfs simulate`` can start from — a fedfs checkpoint of any built-in architecture (e.g. one
``fedfs import-model`` wrote) or a built-in model by name (``dlib-resnet``) — and the start-up
defaults that make the server run what the simulator runs (``fedfs+feduv``, ϕ started from ξ).

Why it is strict about architectures: a ``mobilefacenet-affine`` checkpoint (BatchNorm folded
into per-channel affines) has the same tensor names and shapes as a ``mobilefacenet`` one
(GroupNorm), so ``load_state_dict(strict=True)`` took one for the other without a word and the
enrolled verifier accepted everyone (issue 29). Here a ξ whose architecture differs from the
global model's it is copied into is refused, in one line naming both.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fedfs_sdk.errors import InputError

ARCH_FIELDS = ("backbone", "embedding_dim", "input_size", "width")
"""The fields of a model config that make an architecture (the heads are added on top)."""

DEFAULT_CODE_LENGTH = 127
"""FedUV's c when the server adds the head itself (the simulator's default, FedUV Table 1)."""


def read_model_spec(spec: str | Path, flag: str) -> bytes:
    """The bytes of a fedfs checkpoint named by ``spec``: a file, or a built-in model's name
    (``dlib-resnet``, :mod:`fedfs_sdk.nn.builtin_models`; an existing file of that name wins).
    :class:`InputError` (one line, naming ``flag``) for anything else: a missing file, a file
    that is not a fedfs checkpoint (an ``.onnx`` / ``.pt`` to import first), a built-in model
    this install lacks."""
    from fedfs_sdk.federation.wire_format import MODEL_FORMAT, read_header
    from fedfs_sdk.nn.builtin_models import builtin_name, builtin_names

    name = builtin_name(str(spec))
    if name is not None:
        return builtin_checkpoint(name, flag)
    p = Path(spec)
    if not p.is_file():
        raise InputError(f"{flag}: no such file {p} (nor a built-in model: {', '.join(builtin_names())})")
    data = p.read_bytes()
    try:
        fmt = read_header(data)[1].get("format")
    except InputError:
        fmt = None
    if fmt != MODEL_FORMAT:
        raise InputError(f"{flag}: {p} is not a fedfs checkpoint; import it first: "
                         f"fedfs import-model {p} --out {p.stem}.safetensors")
    return data


def builtin_checkpoint(name: str, flag: str) -> bytes:
    """Built-in model ``name`` as fedfs checkpoint bytes (what ``fedfs import-model NAME`` writes)."""
    from fedfs_sdk.extras import MissingExtraError
    from fedfs_sdk.federation.wire import encode_weights
    from fedfs_sdk.federation.wire_format import MODEL_FORMAT
    from fedfs_sdk.nn.builtin_models import load_builtin

    try:
        model, meta = load_builtin(name)
    except MissingExtraError as e:
        raise InputError(f"{flag} {name}: {e}") from None
    return encode_weights(model.state_dict(), {"format": MODEL_FORMAT, "model_config": model.config.to_json(),
                                               "meta": json.dumps(meta)})


def config_of(data: bytes, flag: str) -> dict[str, Any]:
    """The resolved model config a checkpoint's header declares."""
    from fedfs_sdk.federation.wire_format import read_header
    from fedfs_sdk.nn.model import ModelConfig

    try:
        meta = read_header(data)[1]
        return json.loads(ModelConfig.from_json(meta.get("model_config", "null")).resolved().to_json())
    except (InputError, TypeError, ValueError) as e:
        raise InputError(f"{flag}: cannot read its model config: {e}") from None


def describe(config: Mapping[str, Any]) -> str:
    """``mobilefacenet-affine (128-d, 112 px)``: an architecture in a few words."""
    width = f", width {config['width']}" if config.get("width") else ""
    return f"{config['backbone']} ({config['embedding_dim']}-d, {config['input_size']} px{width})"


def architecture_mismatch(a: Mapping[str, Any], a_name: str, b: Mapping[str, Any], b_name: str) -> str | None:
    """One line naming both when resolved configs ``a`` and ``b`` are different architectures."""
    if all(a.get(k) == b.get(k) for k in ARCH_FIELDS):
        return None
    return f"{a_name} is {describe(a)} but {b_name} is {describe(b)}"


def shape_mismatch(got: Mapping[str, Any], want: Mapping[str, Any], got_name: str, want_name: str) -> str | None:
    """One line naming both when two state dicts differ in tensor names or shapes (the first
    difference): a load between them would fail or fill other layers."""
    for k in sorted(set(got) | set(want)):
        if k not in want:
            return f"{got_name} has tensor {k} that {want_name} lacks"
        if k not in got:
            return f"{got_name} lacks tensor {k} of {want_name}"
        if tuple(got[k].shape) != tuple(want[k].shape):
            return (f"tensor {k} is {list(got[k].shape)} in {got_name} but {list(want[k].shape)} in {want_name}")
    return None


def default_method(has_xi: bool) -> str:
    """The method a new state runs when ``--method`` is not given: the simulator's default,
    ``fedfs+feduv`` (with the devices' do-no-harm check), wherever there is a ξ to start from
    and distil; ``feduv`` (the only method that needs no ξ) otherwise."""
    return "fedfs+feduv" if has_xi else "feduv"


def head_sizes(method: str, xi_config: Mapping[str, Any] | None, train: Mapping[str, Any],
               code_length: int | None, proj_dim: int | None) -> tuple[int | None, int | None]:
    """``(code_length, proj_dim)`` the initial model gets: the flags', else what ``method`` needs
    (c = 127; the projection size ξ's embedding asks for, FedFS Eq. 2)."""
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig
    from fedfs_sdk.training.objective import uses_fedfs, uses_feduv

    if code_length is None and uses_feduv(method):
        code_length = DEFAULT_CODE_LENGTH
    if proj_dim is None and uses_fedfs(method) and xi_config is not None:
        cfg = FedFSLossConfig(**dict((train.get("objective") or {}).get("fedfs") or {}))
        proj_dim = cfg.projection_dim(int(xi_config["embedding_dim"]))
    return code_length, proj_dim


def initial_from_xi(xi: bytes, config: Any, seed: int, init: str) -> bytes:
    """Version 1 from ξ: ``config``'s model (ξ's architecture plus the heads) with the backbone
    copied from ξ — refused, naming both, unless the architecture and every tensor shape match."""
    from fedfs_sdk.federation.wire import decode_weights, encode_weights
    from fedfs_sdk.nn.checkpoint import FORMAT
    from fedfs_sdk.nn.model import FaceNet
    from fedfs_sdk.training.trainer import initial_global_weights

    why = architecture_mismatch(json.loads(config.to_json()), f"--init-backbone {config.backbone}",
                                config_of(xi, "--xi"), "ξ (--xi)")
    if why is not None:
        raise InputError(f"the initial model cannot start from this ξ: {why}; drop --init-backbone (the server "
                         "then builds ξ's architecture) or give a ξ of that architecture")
    xi_state = {k[len("backbone."):]: v for k, v in decode_weights(xi)[0].items() if k.startswith("backbone.")}
    import torch

    torch.manual_seed(seed)
    model = FaceNet(config)
    why = shape_mismatch(xi_state, model.backbone.state_dict(), "ξ", f"the {config.backbone} backbone")
    if why is not None:
        raise InputError(f"the initial model cannot start from this ξ: {why}")
    model.backbone.load_state_dict(xi_state, strict=True)
    weights = initial_global_weights(config, model, seed=seed)
    return encode_weights(weights, {"format": FORMAT, "model_config": config.to_json(),
                                    "meta": json.dumps({"init": init, "seed": seed, "backbone_from": "xi"})})


def with_heads(data: bytes, code_length: int | None, proj_dim: int | None, seed: int, flag: str) -> bytes:
    """Checkpoint ``data`` with the FedUV head / FedFS projection it lacks added (seeded random,
    as the simulator's round 0); its own weights are kept. A size the flag gives that differs
    from one the checkpoint already has is refused."""
    from dataclasses import replace

    from fedfs_sdk.federation.wire import decode_weights, encode_weights
    from fedfs_sdk.nn.checkpoint import FORMAT
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    weights, meta = decode_weights(data)
    config = ModelConfig.from_json(meta.get("model_config", "null")).resolved()
    for name, have, want in (("code_length", config.code_length, code_length), ("proj_dim", config.proj_dim, proj_dim)):
        if have is not None and want is not None and have != want:
            raise InputError(f"{flag} has {name} = {have}; --{name.replace('_', '-')} {want} does not match it")
    new = replace(config, code_length=config.code_length or code_length, proj_dim=config.proj_dim or proj_dim)
    if new == config:
        return data
    import torch

    torch.manual_seed(seed)
    model = FaceNet(new)
    state = model.state_dict()
    why = shape_mismatch({k: v for k, v in weights.items()}, {k: v for k, v in state.items() if k in weights},
                         flag, f"its own architecture {describe(json.loads(new.to_json()))}")
    if why is not None:
        raise InputError(f"{flag}: {why}")
    state.update(weights)
    model.load_state_dict(state, strict=True)
    return encode_weights(model.state_dict(), {"format": FORMAT, "model_config": new.to_json(),
                                               "meta": json.dumps({**json.loads(meta.get("meta", "{}") or "{}"),
                                                                   "heads_added_seed": seed})})


__all__ = ["read_model_spec", "builtin_checkpoint", "config_of", "describe", "architecture_mismatch",
           "shape_mismatch", "default_method", "head_sizes", "initial_from_xi", "with_heads", "DEFAULT_CODE_LENGTH"]
