"""What travels between a device and the aggregation server, and how it is checked.

Tensors go over the wire as **safetensors** only: a JSON header plus raw little-endian
buffers, parsed by the ``safetensors`` library (Rust, bounds-checked). Nothing received
from the network is ever unpickled or passed to ``torch.load``.

Two body kinds, told apart by ``__metadata__["format"]``:

* a model version (server → device): a fedfs checkpoint (``fedfs-checkpoint/1``, see
  :mod:`fedfs_sdk.nn.checkpoint`), so a downloaded model is also a loadable checkpoint;
* an update (device → server): ``fedfs-update/1`` with ``round_id``, ``model_version`` and
  ``num_samples`` — the new global weights ``w_c`` and ``|D_c|`` of FedFS Alg. 1 / FedUV
  Alg. 1, nothing else.

The checks here (layout, finiteness, L2 bound) are shared by the server, which enforces
them, and by the client, which refuses to upload something the server would refuse.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..errors import InputError
from .wire_format import (MAX_HEADER_BYTES, MEDIA_TYPE, MODEL_FORMAT, UPDATE_FORMAT, UpdateMeta,  # noqa: F401
                          TRAIN_KEYS, parse_update_metadata, read_header, sha256_hex, split_train_json,
                          update_metadata)

Weights = dict[str, torch.Tensor]


def encode_weights(weights: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize a state dict (moved to CPU, made contiguous) with string ``metadata``."""
    if not weights:
        raise InputError("cannot serialize an empty state dict")
    tensors = {}
    for k, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
        tensors[k] = t.detach().to("cpu").contiguous()
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return _st_save(tensors, metadata=meta)


def decode_weights(data: bytes) -> tuple[Weights, dict[str, str]]:
    """Safely deserialize a safetensors body into CPU tensors + metadata (:class:`InputError` if malformed)."""
    entries, meta = read_header(data)
    if not entries:
        raise InputError("safetensors body holds no tensors")
    try:
        tensors = _st_load(bytes(data))
    except Exception as e:  # SafetensorError and friends: any parse failure is bad input
        raise InputError(f"not a valid safetensors body: {e}") from None
    return tensors, meta


# ---- updates ---------------------------------------------------------------------------

def encode_update(weights: Mapping[str, torch.Tensor], *, round_id: int, model_version: int,
                  num_samples: int) -> bytes:
    """The body a device uploads: ``w_c`` as safetensors + ``(round, version, |D_c|)``."""
    return encode_weights(weights, update_metadata(round_id=round_id, model_version=model_version,
                                                   num_samples=num_samples))


def decode_update(data: bytes) -> tuple[Weights, UpdateMeta]:
    """Parse an update body; :class:`InputError` when it is not a well-formed fedfs update."""
    weights, meta = decode_weights(data)
    return weights, parse_update_metadata(meta)


# ---- validation ------------------------------------------------------------------------

def check_layout(weights: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                 what: str = "update") -> None:
    """Keys, shapes and dtypes of ``weights`` must equal ``reference``'s exactly."""
    missing = sorted(set(reference) - set(weights))
    unexpected = sorted(set(weights) - set(reference))
    if missing or unexpected:
        raise InputError(f"{what} keys differ from the model: missing {missing[:5]}"
                         f"{' …' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' …' if len(unexpected) > 5 else ''}")
    for k, ref in reference.items():
        t = weights[k]
        if t.shape != ref.shape:
            raise InputError(f"{what}: {k} has shape {list(t.shape)}, the model has {list(ref.shape)}")
        if t.dtype != ref.dtype:
            raise InputError(f"{what}: {k} has dtype {t.dtype}, the model has {ref.dtype}")


def check_finite(weights: Mapping[str, torch.Tensor], what: str = "update") -> None:
    """Every floating tensor must be free of NaN and ±Inf."""
    for k, t in weights.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if t.dtype == torch.float64:
            finite = bool(torch.isfinite(t).all())
        else:
            # One pass, no mask: a float64 sum of ≤ 32-bit floats cannot overflow, and any
            # NaN/Inf makes it non-finite (Inf − Inf = NaN).
            finite = math.isfinite(float(t.sum(dtype=torch.float64)))
        if not finite:
            raise InputError(f"{what}: {k} contains NaN or Inf")


def update_norm(weights: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """``‖w_c − w‖₂`` over all floating tensors, in float64."""
    sq = 0.0
    for k, ref in reference.items():
        if ref.is_floating_point() and ref.numel():
            # subtract in float64: two finite float32 weights near ±3e38 overflow in float32
            sq += float(torch.linalg.vector_norm(weights[k].double() - ref.double())) ** 2
    return math.sqrt(sq)


def clip_update(weights: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                max_norm: float | None) -> tuple[Weights, float, bool]:
    """Clip the update ``Δ = w_c − w`` to L2 norm ``max_norm``: ``w + Δ·min(1, max_norm/‖Δ‖)``.

    Bounds one device's influence on the average (the usual defence against a single
    poisoned update). Returns ``(weights, ‖Δ‖ before clipping, clipped?)``.
    """
    norm = update_norm(weights, reference)
    if max_norm is None or norm <= max_norm:
        return dict(weights), norm, False
    scale = max_norm / norm
    out: Weights = {}
    for k, ref in reference.items():
        if ref.is_floating_point():
            r64 = ref.to(torch.float64)
            out[k] = (r64 + (weights[k].to(torch.float64) - r64) * scale).to(ref.dtype)
        else:
            out[k] = weights[k]
    return out, norm, True


def model_nbytes(reference: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data in a state dict (a valid update is this plus a small header)."""
    return sum(t.numel() * t.element_size() for t in reference.values())


__all__ = ["UPDATE_FORMAT", "MODEL_FORMAT", "MEDIA_TYPE", "UpdateMeta", "sha256_hex", "encode_weights",
           "read_header", "decode_weights", "encode_update", "decode_update", "check_layout",
           "check_finite", "update_norm", "clip_update", "model_nbytes"]


# ---- the round task's training settings (JSON) ------------------------------------------

def train_config_from_json(method: str, train: Mapping[str, Any] | None, device: str = "cpu"):
    """Build the :class:`~fedfs_sdk.training.trainer.TrainConfig` a round task asks for.

    ``train`` holds :data:`~fedfs_sdk.federation.wire_format.TRAIN_KEYS`; ``objective`` may hold
    ``uv_weight``, ``lambda_neg`` and ``fedfs`` (the fields of
    :class:`~fedfs_sdk.training.losses.fedfs.FedFSLossConfig`). Unknown keys or invalid values raise
    :class:`InputError`, so the server can check a task before publishing it and a device
    never trains with a half-understood one.
    """
    from dataclasses import fields

    from ..training.losses.fedfs import FedFSLossConfig
    from ..training.objective import ObjectiveConfig, check_method
    from ..training.trainer import TrainConfig

    check_method(method)
    scalars, obj, fedfs_kw = split_train_json(train)
    known_fedfs = {f.name for f in fields(FedFSLossConfig)}
    if set(fedfs_kw) - known_fedfs:
        raise InputError(f"unknown FedFS loss settings {sorted(set(fedfs_kw) - known_fedfs)}; known: {sorted(known_fedfs)}")
    try:
        objective = ObjectiveConfig(fedfs=FedFSLossConfig(**fedfs_kw), **obj)
        return TrainConfig(method=method, device=device, objective=objective, **scalars)
    except (TypeError, ValueError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"invalid training settings: {e}") from None


__all__ += ["TRAIN_KEYS", "train_config_from_json"]
