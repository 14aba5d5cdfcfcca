"""What travels between a device and the aggregation server, and how it is checked.

Tensors go over the wire as **safetensors** only: a JSON header plus raw little-endian
buffers, parsed by the ``safetensors`` library (Rust, bounds-checked). Nothing received
from the network is ever unpickled or passed to ``torch.load``.

Two body kinds, told apart by ``__metadata__["format"]``:

* a model version (server → device): a fedfs checkpoint (``fedfs-checkpoint/1``, see
  :mod:`fedfs_sdk.checkpoint`), so a downloaded model is also a loadable checkpoint;
* an update (device → server): ``fedfs-update/1`` with ``round_id``, ``model_version`` and
  ``num_samples`` — the new global weights ``w_c`` and ``|D_c|`` of FedFS Alg. 1 / FedUV
  Alg. 1, nothing else.

The checks here (layout, finiteness, L2 bound) are shared by the server, which enforces
them, and by the client, which refuses to upload something the server would refuse.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from .errors import InputError

Weights = dict[str, torch.Tensor]

UPDATE_FORMAT = "fedfs-update/1"
MODEL_FORMAT = "fedfs-checkpoint/1"  # == fedfs_sdk.checkpoint.FORMAT (kept literal: no model import here)
MEDIA_TYPE = "application/octet-stream"

MAX_HEADER_BYTES = 8 << 20
"""Refuse safetensors headers larger than this before parsing their JSON."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


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


def read_header(data: bytes | memoryview) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Parse and sanity-check a safetensors header without touching the tensor data.

    Returns ``(entries, metadata)``; :class:`InputError` names what is malformed (short
    body, oversized header, bad JSON, offsets outside the body …).
    """
    mv = memoryview(data)
    if len(mv) < 8:
        raise InputError(f"body of {len(mv)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > MAX_HEADER_BYTES:
        raise InputError(f"safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > len(mv):
        raise InputError(f"truncated safetensors: header claims {n} bytes, body has {len(mv) - 8}")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise InputError("safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("safetensors __metadata__ must map strings to strings")
    payload = len(mv) - 8 - n
    end = 0
    for name, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in _DTYPES:
            raise InputError(f"tensor {name!r}: unsupported or missing dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)):
            raise InputError(f"tensor {name!r}: malformed shape or data_offsets")
        if not 0 <= offs[0] <= offs[1] <= payload:
            raise InputError(f"truncated safetensors: tensor {name!r} ends at byte {offs[1]} of a {payload}-byte payload")
        end = max(end, offs[1])
    if end != payload:
        raise InputError(f"safetensors payload has {payload - end} unexplained trailing bytes")
    return header, meta


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

@dataclass(frozen=True)
class UpdateMeta:
    """The header fields of an uploaded update."""

    round_id: int
    model_version: int
    num_samples: int


def _int_field(meta: Mapping[str, str], key: str, minimum: int) -> int:
    raw = meta.get(key)
    if raw is None:
        raise InputError(f"update metadata lacks {key!r}")
    try:
        v = int(raw, 10)
    except ValueError:
        raise InputError(f"update metadata {key}={raw!r} is not an integer") from None
    if v < minimum:
        raise InputError(f"update metadata {key}={v} must be ≥ {minimum}")
    return v


def encode_update(weights: Mapping[str, torch.Tensor], *, round_id: int, model_version: int,
                  num_samples: int) -> bytes:
    """The body a device uploads: ``w_c`` as safetensors + ``(round, version, |D_c|)``."""
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples <= 0:
        raise InputError(f"num_samples must be a positive integer, got {num_samples!r}")
    meta = {"format": UPDATE_FORMAT, "round_id": str(int(round_id)),
            "model_version": str(int(model_version)), "num_samples": str(int(num_samples))}
    return encode_weights(weights, meta)


def decode_update(data: bytes) -> tuple[Weights, UpdateMeta]:
    """Parse an update body; :class:`InputError` when it is not a well-formed fedfs update."""
    weights, meta = decode_weights(data)
    if meta.get("format") != UPDATE_FORMAT:
        raise InputError(f"body is not a fedfs update (format={meta.get('format')!r}, expected {UPDATE_FORMAT!r})")
    return weights, UpdateMeta(_int_field(meta, "round_id", 1), _int_field(meta, "model_version", 1),
                               _int_field(meta, "num_samples", 1))


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
            sq += float(torch.linalg.vector_norm(weights[k] - ref, dtype=torch.float64)) ** 2
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

TRAIN_KEYS = ("lr", "head_lr", "local_epochs", "batch_size", "momentum", "weight_decay", "seed", "objective")
"""Keys of the ``train`` object of a round task (the device picks its own ``device``)."""


def train_config_from_json(method: str, train: Mapping[str, Any] | None, device: str = "cpu"):
    """Build the :class:`~fedfs_sdk.trainer.TrainConfig` a round task asks for.

    ``train`` holds :data:`TRAIN_KEYS`; ``objective`` may hold ``uv_weight``, ``lambda_neg``
    and ``fedfs`` (the fields of :class:`~fedfs_sdk.losses.fedfs.FedFSLossConfig`). Unknown
    keys or invalid values raise :class:`InputError`, so the server can check a task
    before publishing it and a device never trains with a half-understood one.
    """
    from dataclasses import fields

    from .losses.fedfs import FedFSLossConfig
    from .objective import ObjectiveConfig, check_method
    from .trainer import TrainConfig

    check_method(method)
    train = dict(train or {})
    unknown = sorted(set(train) - set(TRAIN_KEYS))
    if unknown:
        raise InputError(f"unknown training settings {unknown}; known: {list(TRAIN_KEYS)}")
    for k in ("lr", "head_lr", "momentum", "weight_decay"):
        v = train.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise InputError(f"train.{k} must be a finite non-negative number, got {v!r}")
    for k, lo in (("local_epochs", 1), ("batch_size", 1), ("seed", 0)):
        v = train.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise InputError(f"train.{k} must be an integer ≥ {lo}, got {v!r}")
    raw_obj = train.pop("objective", None)
    raw_obj = {} if raw_obj is None else raw_obj
    if not isinstance(raw_obj, Mapping):
        raise InputError("train.objective must be an object")
    obj = dict(raw_obj)
    raw_fedfs = obj.pop("fedfs", None)
    raw_fedfs = {} if raw_fedfs is None else raw_fedfs
    if not isinstance(raw_fedfs, Mapping):
        raise InputError("train.objective.fedfs must be an object")
    fedfs_kw = dict(raw_fedfs)
    known_obj = {"uv_weight", "lambda_neg"}
    if set(obj) - known_obj:
        raise InputError(f"unknown objective settings {sorted(set(obj) - known_obj)}; known: {sorted(known_obj)}")
    known_fedfs = {f.name for f in fields(FedFSLossConfig)}
    if set(fedfs_kw) - known_fedfs:
        raise InputError(f"unknown FedFS loss settings {sorted(set(fedfs_kw) - known_fedfs)}; known: {sorted(known_fedfs)}")
    try:
        objective = ObjectiveConfig(fedfs=FedFSLossConfig(**fedfs_kw), **obj)
        return TrainConfig(method=method, device=device, objective=objective, **train)
    except (TypeError, ValueError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"invalid training settings: {e}") from None


__all__ += ["TRAIN_KEYS", "train_config_from_json"]
