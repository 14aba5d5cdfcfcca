"""``dlib-resnet`` exports like the other backbones: ONNX inference (parity with torch, the face crop
in its metadata, so an OnnxBackend cuts dlib's chip by itself), ORT on-device training (one FedUV
step equals torch's), Core ML (the saved ML Program, run by the fp16 reference, within the
verification-score bound of torch). Random trained-like weights at 104 px (the smallest input
the network takes) where the real weights are not needed; the built-in weights where installed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfs_sdk.nn import builtin_models
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig

S = 104


def _trained_like(cfg: ModelConfig, seed: int = 2) -> FaceNet:
    torch.manual_seed(seed)
    model = FaceNet(cfg)
    with torch.no_grad():       # affines away from (1, 0), as trained ones are
        for name, p in model.backbone.named_parameters():
            if p.dim() == 1 and name.endswith(".bias"):          # ChannelAffine b
                p.uniform_(-0.1, 0.1)
            elif p.dim() == 1:                                   # ChannelAffine a
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_onnx_export_matches_torch_and_carries_the_chip(tmp_path: Path) -> None:
    from export.pipeline import ExportOptions, run_export
    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    model = _trained_like(ModelConfig("dlib-resnet", input_size=S, code_length=127))
    ck = tmp_path / "m.safetensors"
    save_checkpoint(ck, model, model.config)
    manifest = run_export(ck, tmp_path / "out", ExportOptions(formats=("onnx",)))
    assert manifest["artifacts"]["onnx"]["max_abs_diff_vs_torch"]["embedding"] <= 1e-4
    assert manifest["model"]["face_alignment"] == "dlib-chip"
    assert manifest["input_contract"]["onnx_and_ort_training"]["face_alignment"] == "dlib-chip"
    backend = OnnxBackend(tmp_path / "out" / "onnx" / "verifier.onnx")
    assert backend.alignment == "dlib-chip" and backend.input_size == S
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, S, S)).astype(np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x))
    got = backend.run(x)
    assert np.abs(got["embedding"] - ref.embedding.numpy()).max() <= 1e-4
    assert np.abs(got["uv"] - ref.uv.numpy()).max() <= 1e-4


def test_ort_training_step_equals_torch(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime.training")
    from export.ort_training import export_training_artifacts, train_config_of
    from fedfs_sdk.runtime.codes import make_codeword
    from fedfs_sdk.training.ort_device import OrtDeviceTrainer
    from fedfs_sdk.training.trainer import LocalTrainer

    cfg = ModelConfig("dlib-resnet", input_size=S, code_length=127)
    model = _trained_like(cfg)
    info = export_training_artifacts("feduv", model, tmp_path / "art", lr=0.05, local_epochs=1, batch_size=4)
    x = np.random.default_rng(3).uniform(-1, 1, size=(4, 3, S, S)).astype(np.float32)
    cw = make_codeword(11, 127, rng=np.random.default_rng(0))[0]
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = LocalTrainer(cfg, train_config_of(info)).train(w0, x, codeword=cw)
    got = OrtDeviceTrainer(tmp_path / "art").train({k: v.numpy() for k, v in w0.items()}, x, codeword=cw)
    err = sum(float(((torch.from_numpy(got.weights[k]) - ref.weights[k]) ** 2).sum()) for k in w0)
    size = sum(float(((ref.weights[k] - w0[k]) ** 2).sum()) for k in w0)
    assert size > 1e-4                              # the step moved the weights
    assert (err / size) ** 0.5 <= 1e-4               # measured 2e-7
    assert got.metrics["loss_first"] == pytest.approx(ref.metrics["loss_first"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not builtin_models.available("dlib-resnet"), reason="the 'faces' extra is not installed")
def test_coreml_fp16_of_the_builtin_is_within_the_score_bound(tmp_path: Path) -> None:
    pytest.importorskip("coremltools")
    from export.coreml import NUMERICS_TOLERANCE, check_coreml_numerics, export_coreml, validate_coreml
    from fedfs_sdk.nn.model import VerifierNet

    model, _ = builtin_models.load_builtin("dlib-resnet")
    verifier = VerifierNet(model.backbone).eval()
    path = export_coreml(verifier, tmp_path / "v.mlpackage", precision="fp16",
                         metadata={"fedfs.face_alignment": "dlib-chip"}, check_numerics=False)
    summary = validate_coreml(path, input_size=150, outputs={"embedding": 128}, precision="fp16")
    assert (summary["input"]["width"], summary["input"]["height"]) == (150, 150)
    bounds = check_coreml_numerics(path, verifier)           # the saved program run in fp16 vs torch
    print("Core ML fp16 max template-score change:", bounds["max_score_change"])
    assert 0 < bounds["max_score_change"]["embedding"] <= NUMERICS_TOLERANCE
