"""Helpers shared by the CLI commands."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError


def load_backend(model_path: str, device: str = "cpu"):
    """An :class:`~fedfs_sdk.inference.InferenceBackend` for a ``.onnx`` file (ONNX
    Runtime, no torch) or a fedfs ``.safetensors`` checkpoint (torch)."""
    p = Path(model_path)
    if not p.is_file():
        raise InputError(f"model not found: {p}")
    if p.suffix == ".onnx":
        from ..onnx_backend import OnnxBackend
        return OnnxBackend(str(p))
    from ..checkpoint import load_verifier
    from ..inference import TorchBackend
    verifier, mid = load_verifier(p)
    return TorchBackend(verifier, mid, device=device)


def read_key(path: str, create: bool) -> bytes:
    """The enrollment key (32 raw bytes) from ``path``; created with mode 0600 if asked."""
    from ..enrollment import generate_key
    from ..fileio import atomic_write_bytes

    p = Path(path)
    if p.is_file():
        key = p.read_bytes()
        if len(key) not in (16, 24, 32):
            raise InputError(f"key file {p} must hold 16, 24 or 32 raw bytes, has {len(key)}")
        return key
    if not create:
        raise InputError(f"key file not found: {p}")
    key = generate_key()
    atomic_write_bytes(p, key, mode=0o600)
    return key


def env_default(name: str, fallback: str | None = None) -> str | None:
    return os.environ.get(name, fallback)
