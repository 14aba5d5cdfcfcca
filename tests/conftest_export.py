"""Shared, cached builders for the export tests (imported explicitly by tests/test_export_*.py).

Exports are slow-ish (Core ML conversion, ORT artifact generation), so each is built once
per test session and cached here — module-level caches, not session fixtures, so several
test modules share one build. Everything lives under one temp folder removed at exit.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch
from no_torch import NO_TORCH

from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.training.trainer import initial_global_weights

ROOT = Path(__file__).resolve().parents[1]
TMP = Path(tempfile.mkdtemp(prefix="fedfs-export-tests-"))
atexit.register(shutil.rmtree, TMP, True)

TINY = ModelConfig("tiny", proj_dim=32, code_length=127)
"""Global model of every method: tiny backbone (64-d), FedFS projection (z = r ⊕ q = 64 = dim ξ),
FedUV head c = 127."""

TOL = 2e-5
"""Absolute tolerance of ORT-training vs torch weights after a few SGD steps (measured ≤ 2e-7)."""

NO_TORCH_PRELUDE = NO_TORCH + "sys.path.insert(0, {root!r})\n"
"""Prepended to every device subprocess: any attempt to import torch raises. The subprocess
also asserts ``'torch' not in sys.modules`` at its end."""


def faces(identities: int, per_identity: int, size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Simple structured "faces": each identity a smooth random colour pattern; each image a
    shifted, brightness-jittered, noisy view of it. float32 ``[N,3,S,S]`` normalized, labels."""
    rng = np.random.default_rng(seed)
    imgs, labels = [], []
    for i in range(identities):
        proto = cv2.resize(rng.uniform(0, 255, (4, 4, 3)).astype(np.float32), (size, size),
                           interpolation=cv2.INTER_CUBIC)
        for _ in range(per_identity):
            img = np.roll(proto, tuple(rng.integers(-2, 3, size=2)), axis=(0, 1))
            img = img * rng.uniform(0.8, 1.2) + rng.normal(0, 12, img.shape)
            imgs.append(np.clip(img, 0, 255).astype(np.uint8))
            labels.append(i)
    batch = ((np.stack(imgs).astype(np.float32) - 127.5) / 127.5).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(batch), np.asarray(labels)


@functools.lru_cache(maxsize=None)
def xi_model() -> FaceNet:
    torch.manual_seed(123)
    return FaceNet(ModelConfig("tiny")).eval()


@functools.lru_cache(maxsize=None)
def tiny_weights() -> dict[str, torch.Tensor]:
    """Round-0 global weights (backbone copied from ξ, as FedFS starts), head random."""
    return initial_global_weights(TINY, xi_model(), seed=0)


@functools.lru_cache(maxsize=None)
def checkpoints() -> dict[str, Path]:
    model = FaceNet(TINY)
    model.load_state_dict(tiny_weights())
    paths = {"global": TMP / "global.safetensors", "xi": TMP / "xi.safetensors"}
    save_checkpoint(paths["global"], model, TINY, {"round": 4})
    save_checkpoint(paths["xi"], xi_model(), xi_model().config, {"role": "xi"})
    return paths


@functools.lru_cache(maxsize=None)
def calibration_folder() -> Path:
    folder = TMP / "calibration"
    folder.mkdir()
    x, _ = faces(8, 4, seed=99)
    for i, img in enumerate(x):
        rgb = np.clip(img.transpose(1, 2, 0) * 127.5 + 127.5, 0, 255).round().astype(np.uint8)
        cv2.imwrite(str(folder / f"{i:03d}.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    return folder


@functools.lru_cache(maxsize=None)
def full_export() -> tuple[Path, dict]:
    """The tiny checkpoint exported in every format, all three training methods, with artifacts
    that train every layer (``scope="all"``: the papers' FedFS / FedUV client step)."""
    from export.pipeline import ExportOptions, run_export

    ck = checkpoints()
    out = TMP / "export-all"
    manifest = run_export(ck["global"], out, ExportOptions(
        formats=("onnx", "onnx-int8", "coreml", "ort-training"), xi=str(ck["xi"]),
        calibration=str(calibration_folder()), train={"scope": "all"}))
    return out, manifest


@functools.lru_cache(maxsize=None)
def top_export() -> tuple[Path, dict]:
    """The tiny checkpoint exported as ``fedfs export --formats onnx,ort-training`` does by default:
    artifacts that train the top on ``trunk.onnx``'s features (``scope="top"``, the methods' default)."""
    from export.pipeline import ExportOptions, run_export

    ck = checkpoints()
    out = TMP / "export-top"
    manifest = run_export(ck["global"], out, ExportOptions(formats=("onnx", "ort-training"), xi=str(ck["xi"])))
    return out, manifest


def run_device_script(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter that cannot import torch; return its stdout."""
    import subprocess

    full = NO_TORCH_PRELUDE.format(root=str(ROOT)) + code + "\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    r = subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"device subprocess failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r.stdout
