"""A torch-free device's weights as numpy arrays: which ones it verifies with
(:func:`verifier_weights`: ``θ_c`` — FedFS' ``q'`` verifies — else the global backbone ``w``, plus
the FedUV head ``W``; :func:`dual_verifier_weights` for ``verify=both``), the upload body
``w_c`` + ``|D_c|`` and the server's model body (:func:`encode_update`, :func:`decode_model`:
the safetensors wire format of :mod:`fedfs_sdk.federation.wire_format`), and weights files
(:func:`save_weights`, :func:`load_weights`). No torch: used by
:mod:`fedfs_sdk.training.ort_device` and the ORT device runtime.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import InputError
from ..federation.wire_format import MODEL_FORMAT, read_header, update_metadata

Weights = dict[str, np.ndarray]


def verifier_weights(global_weights: Mapping[str, np.ndarray],
                     personal_weights: Mapping[str, np.ndarray] | None = None) -> Weights:
    """The weights a device verifies with, for :class:`~fedfs_sdk.runtime.onnx_backend.OnnxBackend`
    (``weights=``): the personalized backbone ``θ_c`` (FedFS: ``q'`` verifies) when there is
    one, else the global backbone, plus the global FedUV head ``W`` if the model has one."""
    src = personal_weights if personal_weights is not None else global_weights
    out = {k: np.asarray(v, dtype=np.float32) for k, v in src.items() if k.startswith("backbone.")}
    out.update({k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items() if k.startswith("uv_head.")})
    if not out:
        raise InputError("no backbone weights given")
    return out


def dual_verifier_weights(global_weights: Mapping[str, np.ndarray],
                          personal_weights: Mapping[str, np.ndarray]) -> Weights:
    """The weights of the ``verify=both`` verifier (``onnx/verifier-dual.onnx``,
    :class:`~fedfs_sdk.nn.model.DualVerifierNet`): ``backbone.*`` = ``θ_c``, ``global_backbone.*``
    = the global backbone ``w``, ``uv_head.*`` = the global head ``W``."""
    if personal_weights is None:
        raise InputError("verify=both needs the personalized weights θ_c")
    out = {k: np.asarray(v, dtype=np.float32) for k, v in personal_weights.items() if k.startswith("backbone.")}
    out.update({"global_" + k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items()
                if k.startswith("backbone.")})
    out.update({k: np.asarray(v, dtype=np.float32) for k, v in global_weights.items() if k.startswith("uv_head.")})
    if not any(k.startswith("uv_head.") for k in out):
        raise InputError("verify=both verifies through the FedUV head: the global model has none")
    return out


# ---- wire format without torch -------------------------------------------------------------

def encode_update(weights: Mapping[str, np.ndarray], *, round_id: int, model_version: int,
                  num_samples: int) -> bytes:
    """The upload body (``fedfs-update/1`` safetensors, like :func:`fedfs_sdk.federation.wire.encode_update`)
    built from numpy arrays: ``w_c`` and ``|D_c|``, nothing else."""
    from safetensors.numpy import save

    meta = update_metadata(round_id=round_id, model_version=model_version, num_samples=num_samples)
    if not weights:
        raise InputError("cannot upload an empty state dict")
    return save({k: np.ascontiguousarray(v) for k, v in weights.items()}, metadata=meta)


def decode_model(data: bytes) -> tuple[Weights, dict[str, str]]:
    """A model the server sent (a fedfs checkpoint body) as numpy arrays + header."""
    from safetensors.numpy import load

    _, header = read_header(data)
    try:
        weights = load(bytes(data))
    except Exception as e:  # SafetensorError and friends: malformed body
        raise InputError(f"model body is not valid safetensors: {e}") from None
    if header.get("format") != MODEL_FORMAT:
        raise InputError(f"body is not a fedfs model (format={header.get('format')!r})")
    return weights, header


def save_weights(path: str | os.PathLike[str], weights: Mapping[str, np.ndarray]) -> None:
    """Persist weights (e.g. the device's ``θ_c``) as safetensors, atomically, mode 0600."""
    from safetensors.numpy import save

    from ..fileio import atomic_write_bytes

    atomic_write_bytes(path, save({k: np.ascontiguousarray(v) for k, v in weights.items()}), mode=0o600)


def load_weights(path: str | os.PathLike[str]) -> Weights:
    from safetensors.numpy import load

    p = Path(path)
    if not p.is_file():
        raise InputError(f"weights file not found: {p}")
    try:
        return load(p.read_bytes())
    except Exception as e:
        raise InputError(f"{p} is not a safetensors weights file: {e}") from None


__all__ = ["Weights", "verifier_weights", "dual_verifier_weights", "encode_update", "decode_model", "save_weights",
           "load_weights"]
