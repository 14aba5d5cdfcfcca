"""Model checkpoints as safetensors files with the architecture in the header.

No pickle anywhere: the weights are safetensors, the config is JSON in the metadata, so a
checkpoint from an untrusted source cannot run code when loaded.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..fileio import fsync_directory, fsync_file
from .model import FaceNet, ModelConfig

FORMAT = "fedfs-checkpoint/1"


def write_safetensors_atomic(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor],
                             metadata: dict[str, str]) -> Path:
    """Write ``tensors`` + string ``metadata`` to ``path`` via a temporary file, ``fsync`` and a
    rename (then ``fsync`` of the folder where supported), so a crash — power loss included —
    leaves either the old file or the new one, never half of one. Streams to the file rather
    than going through :func:`fileio.atomic_write_bytes`: a federation checkpoint holds the
    client store and can be gigabytes, which must not be doubled in memory as ``bytes``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        fsync_file(tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(p.parent)
    return p


def read_safetensors(path: str | os.PathLike[str], fmt: str,
                     what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a local safetensors file whose ``format`` metadata is
    ``fmt``; :class:`CheckpointError` naming ``what`` if missing, unreadable or another format."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{what} not found: {p}")
    try:
        from safetensors import safe_open
        with safe_open(str(p), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"not a readable {what}: {p} ({e})") from e
    check_format(header, fmt, what, p)
    return tensors, header


SIMULATION_FORMAT = "fedfs-federation/1"
"""A ``fedfs simulate`` checkpoint (``device_sim.federation``): the whole federation, not one model."""


def check_format(header: Mapping[str, Any], wanted: str, what: str, name: Any) -> None:
    """:class:`CheckpointError` unless ``header`` is of format ``wanted``; a simulation checkpoint
    where one model was expected says what takes it."""
    found = header.get("format")
    if found == wanted:
        return
    hint = ("" if found != SIMULATION_FORMAT else
            "; it is a `fedfs simulate` checkpoint (the whole federation): `fedfs export --checkpoint` and "
            "`fedfs enroll --model` take it — its global model, or `--client N` for a client's verifier")
    raise CheckpointError(f"{name} is not a {what} (format={found!r}){hint}")


def save_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, config: ModelConfig,
                    meta: dict[str, Any] | None = None) -> None:
    """Save ``model``'s state dict with ``config`` (and JSON-able ``meta``) atomically."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    header = {"format": FORMAT, "model_config": config.to_json(), "meta": json.dumps(meta or {})}
    write_safetensors_atomic(path, tensors, header)


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Return ``(state_dict, config, meta)``; :class:`CheckpointError` if unusable."""
    state, header = read_safetensors(path, FORMAT, "fedfs checkpoint")
    config, meta = _config_and_meta(header, path)
    return state, config, meta


def _config_and_meta(header: dict[str, str], name: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Any]]:
    if "model_config" not in header:
        raise CheckpointError(f"{name} cannot be rebuilt from its header: it has no model_config")
    try:
        config = ModelConfig.from_json(header["model_config"])
        meta = json.loads(header.get("meta", "{}"))
    except (KeyError, ValueError, TypeError) as e:   # bad JSON, unknown fields / backbone
        raise CheckpointError(f"{name} cannot be rebuilt from its header: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{name}: checkpoint meta must be a JSON object")
    return config, meta


def read_checkpoint_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a checkpoint file; :class:`CheckpointError` if it is missing, a folder or
    unreadable. (Not parsed: see :func:`checkpoint_from_bytes`.)"""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"fedfs checkpoint not found: {p}"
                              + (" (a folder, not a .safetensors file)" if p.is_dir() else ""))
    try:
        return p.read_bytes()
    except OSError as e:
        raise CheckpointError(f"not a readable fedfs checkpoint: {p} ({e})") from e


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[FaceNet, dict[str, Any]]:
    """Build the :class:`FaceNet` described in the checkpoint file and load its weights.

    Reads the file (:func:`read_checkpoint_bytes`) and hands its bytes to
    :func:`checkpoint_from_bytes` (one implementation); :class:`CheckpointError` if the file
    is missing, unreadable or unusable."""
    return checkpoint_from_bytes(read_checkpoint_bytes(path), Path(path))


def checkpoint_from_bytes(data: bytes, name: str | os.PathLike[str] = "<bytes>") -> tuple[FaceNet, dict[str, Any]]:
    """:func:`load_checkpoint` of a checkpoint file's bytes (``name`` only labels errors).

    Lets a caller hash exactly the bytes it builds from (read the file once)."""
    from safetensors.torch import load as load_bytes

    from ..errors import InputError
    from ..federation.wire_format import read_header

    try:
        _, header = read_header(data)
        state = load_bytes(bytes(data))
    except (InputError, SafetensorError, ValueError) as e:
        raise CheckpointError(f"not a readable fedfs checkpoint: {name} ({e})") from e
    check_format(header, FORMAT, "fedfs checkpoint", name)
    config, meta = _config_and_meta(header, name)
    try:
        model = FaceNet(config)
    except (KeyError, ValueError, TypeError) as e:   # unknown backbone, out-of-range sizes
        raise CheckpointError(f"{name} cannot be rebuilt from its header: {e}") from e
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {name} does not match its own architecture: {e}") from e
    return model.eval(), meta


def verified_model_id(model: FaceNet, meta: dict[str, Any], name: str | os.PathLike[str] = "checkpoint") -> str:
    """The model id of ``model``'s verifier weights (everything but ``proj.*``), computed from the
    weights. A ``model_id`` recorded in the checkpoint's ``meta`` is never trusted on its own:
    :class:`CheckpointError` if it differs from the weights' id (an enrollment bound to it would
    otherwise carry over to other weights)."""
    mid = model_id_of({k: v for k, v in model.state_dict().items() if not k.startswith("proj.")},
                      model.config.backbone)
    recorded = meta.get("model_id")
    if recorded is not None and recorded != mid:
        raise CheckpointError(f"{name} records model_id {recorded!r} but its weights hash to {mid!r} "
                              "(tampered or mislabelled checkpoint)")
    return mid


def model_id_of(state: dict[str, torch.Tensor], architecture: str | None = None) -> str:
    """Content hash of a set of weights (and, for a backbone whose tensors another backbone shares,
    of its ``architecture``: :data:`~fedfs_sdk.runtime.onnx_backend.SALTED_ARCHITECTURES`):
    enrollments and thresholds are bound to it."""
    import hashlib

    from ..runtime.onnx_backend import architecture_salt

    h = hashlib.sha256(architecture_salt(architecture))
    for k in sorted(state):
        t = state[k].detach().to("cpu").contiguous()
        h.update(k.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_verifier(path: str | os.PathLike[str], backbone: torch.nn.Module, config: ModelConfig,
                  uv_head: torch.nn.Module | None = None, meta: dict[str, Any] | None = None) -> str:
    """Save what verifies on the device — the (personalized) backbone and, for FedUV, the
    global head ``W`` — as a FaceNet checkpoint without projection. Returns its model id."""
    from dataclasses import replace

    vcfg = replace(config.resolved(), proj_dim=None, code_length=config.code_length if uv_head is not None else None)
    model = FaceNet(vcfg)
    model.backbone.load_state_dict(backbone.state_dict())
    if uv_head is not None:
        model.uv_head.load_state_dict(uv_head.state_dict())
    mid = model_id_of(model.state_dict(), vcfg.backbone)
    save_checkpoint(path, model, vcfg, {**(meta or {}), "role": "verifier", "model_id": mid})
    return mid


def verifier_in_memory(backbone: torch.nn.Module, config: ModelConfig, uv_head: torch.nn.Module | None = None):
    """``(VerifierNet, model_id)``: what :func:`load_verifier` returns for the file
    :func:`save_verifier` would write, without writing it (the do-no-harm check builds every
    candidate; only the chosen one is saved). The net holds ``backbone`` and ``uv_head`` themselves."""
    from .model import VerifierNet

    # the modules themselves, not copies: the file's FaceNet would hold the same tensors under the
    # same names (backbone.*, uv_head.*), so the id is the one the file records
    net = VerifierNet(backbone, uv_head).eval()
    return net, model_id_of(net.state_dict(), config.resolved().backbone)


def load_verifier(path: str | os.PathLike[str]):
    """``(VerifierNet, model_id)`` from any fedfs checkpoint (projection layers are unused);
    ``(DualVerifierNet, model_id)`` from a ``verify=both`` verifier (:mod:`.dual_verifier`)."""
    from .dual_verifier import dual_verifier_from_state, is_dual_verifier
    from .model import VerifierNet

    state, config, meta = read_checkpoint(path)
    if is_dual_verifier(meta):
        return dual_verifier_from_state(state, config, meta, path)
    model, meta = load_checkpoint(path)
    mid = verified_model_id(model, meta, path)
    return VerifierNet(model.backbone, model.uv_head).eval(), mid
