"""The torch-free half of the wire format (see :mod:`fedfs_sdk.federation.wire`): constants, the
safetensors header check and the update header — what a phone-like process that has only
numpy and ONNX Runtime needs to talk to the server.

:mod:`fedfs_sdk.federation.wire` (torch tensors) and :mod:`fedfs_sdk.training.ort_device` (numpy arrays) both
build on this module, so the two device runtimes send byte-compatible bodies.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InputError

UPDATE_FORMAT = "fedfs-update/1"
MODEL_FORMAT = "fedfs-checkpoint/1"  # == fedfs_sdk.nn.checkpoint.FORMAT (kept literal: no model import here)
MEDIA_TYPE = "application/octet-stream"

MAX_HEADER_BYTES = 8 << 20
"""Refuse safetensors headers larger than this before parsing their JSON."""

MAX_ID = 2**63 - 1
"""Largest round id, model version or sample count (SQLite INTEGER)."""

SAFETENSORS_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"})
"""dtype names a fedfs body may use."""


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


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
    except (ValueError, RecursionError) as e:   # bad JSON / UTF-8, 4300+-digit ints, deep nesting
        raise InputError(f"safetensors header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise InputError("safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("safetensors __metadata__ must map strings to strings")
    payload = len(mv) - 8 - n
    end = 0
    for name, e in header.items():
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in SAFETENSORS_DTYPES:
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


@dataclass(frozen=True)
class UpdateMeta:
    """The header fields of an uploaded update."""

    round_id: int
    model_version: int
    num_samples: int


UPDATE_META_KEYS = frozenset({"format", "round_id", "model_version", "num_samples"})
"""The only ``__metadata__`` keys an upload may carry: anything else (an embedding, an image,
a free-text note) is refused rather than stored next to the update."""

MAX_INT_DIGITS = len(str(MAX_ID))


def parse_decimal(raw: str, what: str) -> int:
    """A non-negative integer written in canonical ASCII decimal (``"0"``, ``"37"``).

    Stricter than :func:`int`, which also takes ``" 7 "``, ``"1_0"``, ``"+7"`` and non-ASCII
    digits such as ``"٧"``: two writers of one number must write the same bytes, so a
    header that a second parser would read differently is refused (:class:`InputError`).
    """
    if (not isinstance(raw, str) or not raw or not raw.isascii() or not raw.isdigit()
            or (len(raw) > 1 and raw[0] == "0")):
        raise InputError(f"{what}={raw[:30]!r} is not an integer written in ASCII digits (no sign, "
                         "spaces, underscores or leading zeros)")
    if len(raw) > MAX_INT_DIGITS:
        raise InputError(f"{what}={raw[:30]}… has more than {MAX_INT_DIGITS} digits")
    return int(raw)


def _int_field(meta: Mapping[str, str], key: str, minimum: int) -> int:
    raw = meta.get(key)
    if raw is None:
        raise InputError(f"update metadata lacks {key!r}")
    v = parse_decimal(raw, f"update metadata {key}")
    if not minimum <= v <= MAX_ID:
        raise InputError(f"update metadata {key}={raw[:30]} must be in [{minimum}, {MAX_ID}]")
    return v


def update_metadata(*, round_id: int, model_version: int, num_samples: int) -> dict[str, str]:
    """The safetensors metadata of an upload: ``(round, version, |D_c|)``, nothing else."""
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples <= 0:
        raise InputError(f"num_samples must be a positive integer, got {num_samples!r}")
    return {"format": UPDATE_FORMAT, "round_id": str(int(round_id)),
            "model_version": str(int(model_version)), "num_samples": str(int(num_samples))}


def parse_update_metadata(meta: Mapping[str, str]) -> UpdateMeta:
    """:class:`UpdateMeta` of an upload's metadata; :class:`InputError` if it is not one."""
    if meta.get("format") != UPDATE_FORMAT:
        raise InputError(f"body is not a fedfs update (format={meta.get('format')!r}, expected {UPDATE_FORMAT!r})")
    extra = sorted(set(meta) - UPDATE_META_KEYS)
    if extra:
        named = ", ".join(repr(k[:40]) for k in extra[:5]) + (" …" if len(extra) > 5 else "")
        raise InputError(f"update metadata has unknown keys {named}; an update carries only "
                         f"{sorted(UPDATE_META_KEYS)}")
    return UpdateMeta(_int_field(meta, "round_id", 1), _int_field(meta, "model_version", 1),
                      _int_field(meta, "num_samples", 1))


# ---- the round task's training settings (JSON) ------------------------------------------

TRAIN_KEYS = ("lr", "head_lr", "local_epochs", "batch_size", "momentum", "weight_decay", "seed", "scope", "objective")
"""Keys of the ``train`` object of a round task (the device picks its own ``device``)."""

TRAIN_SCOPES = ("all", "top")
"""``train.scope``: which layers the device trains (fedfs_sdk.training.scope.SCOPES)."""

OBJECTIVE_KEYS = ("uv_weight", "lambda_neg")
"""Keys of ``train.objective`` besides ``fedfs`` (FedFS loss settings)."""

TRAIN_INT_RANGES = {"local_epochs": (1, 10_000), "batch_size": (1, 1 << 16), "seed": (0, 2**32 - 1)}
"""Bounds of the integer settings. A task is published to every device: a ``batch_size``
of 2⁶² or a ``seed`` that numpy/torch cannot take would fail every device at once, so the
server refuses it when the admin sets it (``seed``: numpy's 32-bit legacy seed range)."""

TRAIN_FLOAT_MAX = {"lr": 100.0, "head_lr": 100.0, "momentum": 1.0, "weight_decay": 10.0}
"""Upper bounds of the float settings (all ≥ 0); far above any useful value, below overflow."""

OBJECTIVE_MAX = 1000.0
"""Upper bound of ``uv_weight`` and ``lambda_neg``."""


def split_train_json(train: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Check the types and ranges of a task's ``train`` object and split it into
    ``(scalars, objective, fedfs)``; :class:`InputError` names an unknown key or bad value."""
    train = dict(train or {})
    unknown = sorted(set(train) - set(TRAIN_KEYS))
    if unknown:
        raise InputError(f"unknown training settings {unknown}; known: {list(TRAIN_KEYS)}")
    nulls = [k for k, v in train.items() if v is None and k not in ("objective", "head_lr")]   # head_lr None: = lr
    if nulls:
        raise InputError(f"training settings {nulls} are null; omit a setting to keep its default")
    for k in ("lr", "head_lr", "momentum", "weight_decay"):
        _check_non_negative(f"train.{k}", train.get(k), TRAIN_FLOAT_MAX[k])
    if "scope" in train and train["scope"] not in TRAIN_SCOPES:
        raise InputError(f"train.scope must be one of {list(TRAIN_SCOPES)}, got {str(train['scope'])[:40]!r}")
    for k, (lo, hi) in TRAIN_INT_RANGES.items():
        v = train.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise InputError(f"train.{k} must be an integer ≥ {lo} and ≤ {hi}, got {str(v)[:40]}")
    raw_obj = train.pop("objective", None)
    raw_obj = {} if raw_obj is None else raw_obj
    if not isinstance(raw_obj, Mapping):
        raise InputError("train.objective must be an object")
    obj = dict(raw_obj)
    raw_fedfs = obj.pop("fedfs", None)
    raw_fedfs = {} if raw_fedfs is None else raw_fedfs
    if not isinstance(raw_fedfs, Mapping):
        raise InputError("train.objective.fedfs must be an object")
    if set(obj) - set(OBJECTIVE_KEYS):
        raise InputError(f"unknown objective settings {sorted(set(obj) - set(OBJECTIVE_KEYS))}; "
                         f"known: {sorted(OBJECTIVE_KEYS)}")
    if any(obj.get(k, 0) is None for k in OBJECTIVE_KEYS):
        raise InputError("train.objective settings must not be null; omit a setting to keep its default")
    for k in OBJECTIVE_KEYS:
        _check_non_negative(f"train.objective.{k}", obj.get(k), OBJECTIVE_MAX)
    return train, obj, dict(raw_fedfs)


def is_finite_number(v: Any) -> bool:
    """A JSON number that is finite as a float (huge integers overflow ``math.isfinite``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _check_non_negative(name: str, v: Any, maximum: float) -> None:
    if v is not None and (not is_finite_number(v) or not 0 <= v <= maximum):
        raise InputError(f"{name} must be a number in [0, {maximum:g}], got {str(v)[:40]}")


__all__ = ["TRAIN_KEYS", "TRAIN_SCOPES", "OBJECTIVE_KEYS", "TRAIN_INT_RANGES", "TRAIN_FLOAT_MAX", "OBJECTIVE_MAX",
           "UPDATE_META_KEYS", "parse_decimal", "split_train_json", "is_finite_number", "MAX_ID", "UPDATE_FORMAT", "MODEL_FORMAT", "MEDIA_TYPE", "MAX_HEADER_BYTES", "SAFETENSORS_DTYPES",
           "UpdateMeta", "sha256_hex", "read_header", "update_metadata", "parse_update_metadata"]
