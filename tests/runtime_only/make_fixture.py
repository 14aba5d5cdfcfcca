"""Build what the runtime-only tests need, with torch: an exported ONNX verifier and face images.

The runtime-only suite (tests/runtime_only) runs in an install without torch (``pip install
fedfs`` on a second Python, .ci/run); it cannot export a model itself, so the full install
writes one here first::

    python tests/runtime_only/make_fixture.py DIR

DIR gets ``verifier.onnx`` (the tiny backbone's personalized verifier, fedfs's own export),
``owner/`` (12 images of one synthetic identity) and ``other/`` (6 images of others).
"""
from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from export.onnx_inference import export_onnx  # noqa: E402
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet  # noqa: E402


def identity_images(seed: int, n: int, size: int = 64) -> list[np.ndarray]:
    """``n`` jittered views of one smooth random colour pattern (BGR uint8): the same kind of
    structured stand-in face as tests/conftest_export.py, large enough for every input check."""
    rng = np.random.default_rng(seed)
    proto = cv2.resize(rng.uniform(0, 255, (4, 4, 3)).astype(np.float32), (size, size),
                       interpolation=cv2.INTER_CUBIC)
    out = []
    for _ in range(n):
        img = np.roll(proto, tuple(rng.integers(-2, 3, size=2)), axis=(0, 1))
        img = img * rng.uniform(0.9, 1.1) + rng.normal(0, 6, img.shape)
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def build(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = FaceNet(ModelConfig("tiny")).eval()
    export_onnx(VerifierNet(model.backbone, model.uv_head).eval(), folder / "verifier.onnx", model_version="fixture")
    for name, seeds, n in (("owner", [1], 12), ("other", [2, 3, 4, 5, 6, 7], 1)):
        (folder / name).mkdir(exist_ok=True)
        k = 0
        for s in seeds:
            for img in identity_images(s, n):
                cv2.imwrite(str(folder / name / f"{k:02d}.png"), img)
                k += 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/runtime_only/make_fixture.py DIR")
    build(Path(sys.argv[1]))
