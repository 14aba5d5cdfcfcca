"""Helpers shared by the CLI commands."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError


def load_backend(model_path: str, device: str = "cpu", client: int | None = None):
    """An :class:`~fedfs_sdk.runtime.inference.InferenceBackend` for a ``.onnx`` file (ONNX
    Runtime, no torch), a fedfs ``.safetensors`` checkpoint (torch), or a simulation
    checkpoint (``fedfs-federation/1`` from ``fedfs simulate --checkpoint-every``): its
    global model, or client ``client``'s verifier (:mod:`device_sim.sim_export`); or a built-in
    model's name (``dlib-resnet``, :mod:`fedfs_sdk.nn.builtin_models`)."""
    from ..nn.builtin_models import builtin_name

    name = builtin_name(model_path)
    if name is not None:
        if client is not None:
            raise InputError(f"--client picks a client of a simulation checkpoint; {name} is a built-in model")
        from ..nn.builtin_models import load_builtin
        from ..nn.model import VerifierNet
        from ..runtime.inference import TorchBackend

        model, meta = load_builtin(name)
        return TorchBackend(VerifierNet(model.backbone).eval(), meta["model_id"], device=device)
    p = Path(model_path)
    if not p.is_file():
        raise InputError(f"model not found: {p}" + (" (a folder, not a model file)" if p.is_dir() else ""))
    if p.suffix == ".onnx":
        if client is not None:
            raise InputError("--client picks a client of a simulation checkpoint; an .onnx model has none")
        from ..runtime.onnx_backend import OnnxBackend
        return OnnxBackend(str(p))
    from ..nn.checkpoint import load_verifier
    from ..runtime.inference import TorchBackend
    if is_simulation_checkpoint(p):
        import tempfile

        from device_sim.sim_export import export_federation_model
        with tempfile.TemporaryDirectory() as tmp:       # read into memory, then gone
            export_federation_model(p, Path(tmp) / "model.safetensors", client)
            verifier, mid = load_verifier(Path(tmp) / "model.safetensors")
        return TorchBackend(verifier, mid, device=device)
    if client is not None:
        raise InputError(f"--client picks a client of a simulation checkpoint; {p} is a single model")
    verifier, mid = load_verifier(p)
    return TorchBackend(verifier, mid, device=device)


def is_simulation_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a ``fedfs simulate`` checkpoint (``fedfs-federation/1``)."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".safetensors"):
        return False
    import json
    try:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100_000_000:
                return False
            header = json.loads(f.read(n))
        return (header.get("__metadata__") or {}).get("format") == "fedfs-federation/1"
    except Exception:       # unreadable or not safetensors: the model loader says why
        return False


def read_key(path: str, create: bool) -> bytes:
    """The enrollment key (32 raw bytes) from ``path``; created with mode 0600 if asked."""
    from ..runtime.enrollment import generate_key
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
