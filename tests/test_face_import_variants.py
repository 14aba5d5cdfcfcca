"""``fedfs import-model`` on what training scripts actually save (issue 23): checkpoint wrappers
(``{'epoch', 'net_state_dict'}``, ``model_state_dict``, ``module.`` prefixes, nested), the keys
named when no state dict is found, a 112×96 MobileFaceNet (GDC 7×6) and a ReLU6 MobileFaceNet —
each checked against a reference network of its published topology, and, where ``../shared``
exists, on the real files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedfs_sdk.cli.main import main
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.face_import import import_onnx, import_state_dict, read_state_dict
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from shared_assets import MODELS

XIAOCCER = MODELS / "xiaoccer-mobilefacenet-casia-112x96.ckpt"
FACEGATE = MODELS / "facegate-mobilefacenet-relu6.onnx"


class _Block(nn.Module):
    """A ``conv → BatchNorm → [PReLU]`` unit with the module names of Xiaoccer's MobileFaceNet."""

    def __init__(self, cin: int, cout: int, k, s: int, p: int, dw: bool = False, linear: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s, p, groups=cin if dw else 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.prelu = None if linear else nn.PReLU(cout)

    def forward(self, x):
        x = self.bn(self.conv(x))
        return x if self.prelu is None else self.prelu(x)


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, cout: int, s: int, t: int) -> None:
        super().__init__()
        self.connect = s == 1 and cin == cout
        h = cin * t
        self.conv = nn.Sequential(nn.Conv2d(cin, h, 1, 1, 0, bias=False), nn.BatchNorm2d(h), nn.PReLU(h),
                                  nn.Conv2d(h, h, 3, s, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.PReLU(h),
                                  nn.Conv2d(h, cout, 1, 1, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return x + self.conv(x) if self.connect else self.conv(x)


class Mfn112x96(nn.Module):
    """The 112×96 MobileFaceNet as Xiaoccer/MobileFaceNet_Pytorch publishes it (core/model.py):
    the same module names, so its checkpoint loads with ``strict=True`` — which checks the topology."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = _Block(3, 64, 3, 2, 1)
        self.dw_conv1 = _Block(64, 64, 3, 1, 1, dw=True)
        blocks, cin = [], 64
        for t, c, n, s in ((2, 64, 5, 2), (4, 128, 1, 2), (2, 128, 6, 1), (4, 128, 1, 2), (2, 128, 2, 1)):
            for i in range(n):
                blocks.append(_Bottleneck(cin, c, s if i == 0 else 1, t))
                cin = c
        self.blocks = nn.Sequential(*blocks)
        self.conv2 = _Block(128, 512, 1, 1, 0)
        self.linear7 = _Block(512, 512, (7, 6), 1, 0, dw=True, linear=True)
        self.linear1 = _Block(512, 128, 1, 1, 0, linear=True)

    def forward(self, x):
        x = self.linear1(self.linear7(self.conv2(self.blocks(self.dw_conv1(self.conv1(x))))))
        return x.flatten(1)


def _randomized(net: nn.Module, seed: int = 0) -> nn.Module:
    """Trained-like BatchNorm statistics and PReLU slopes (not the γ=1, β=0, μ=0, σ²=1 of a fresh net)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
                m.running_mean.uniform_(-0.2, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
            elif isinstance(m, nn.PReLU):
                m.weight.uniform_(0.05, 0.4, generator=g)
    return net.eval()


def _parity_112x96(reference: nn.Module, imported: FaceNet, std: float) -> float:
    """Relative max |Δ| between the reference on the centre 96 columns of 112×112 faces in its own
    convention ((x − 127.5)/std) and the imported model on the whole face in fedfs' (x − 127.5)/127.5."""
    px = torch.from_numpy(np.random.default_rng(1).uniform(0, 255, (3, 3, 112, 112)).astype(np.float32))
    with torch.no_grad():
        ref = reference((px[:, :, :, 8:104] - 127.5) / std)
        got = imported((px - 127.5) / 127.5).embedding
    return float((ref - got).abs().max() / ref.abs().max())


@pytest.mark.parametrize("wrap", ["net_state_dict", "model_state_dict+module+nested"])
def test_wrapped_checkpoints_are_unwrapped(tmp_path: Path, wrap: str) -> None:
    ref = _randomized(Mfn112x96())
    sd = ref.state_dict()
    obj = {"net_state_dict": {"epoch": 68, "net_state_dict": sd},          # Xiaoccer's layout
           "model_state_dict+module+nested": {"epoch": 3, "optimizer_state_dict": {"state": {}},
                                              "model": {"model_state_dict": {f"module.{k}": v for k, v in sd.items()}}},
           }[wrap]
    path = tmp_path / "w.ckpt"
    torch.save(obj, path)
    state = read_state_dict(path)
    model, rep = import_state_dict(state, input_std=128.0)
    assert model.config.backbone == "mobilefacenet-affine-112x96" and rep.complete
    assert _parity_112x96(ref, model, 128.0) <= 1e-5


def test_no_state_dict_names_the_keys_it_saw(tmp_path: Path) -> None:
    path = tmp_path / "opt.ckpt"
    torch.save({"epoch": 4, "optimizer": {"lr": torch.tensor(0.1), "momentum": 0.9}, "best_acc": 0.93}, path)
    with pytest.raises(InputError) as e:
        read_state_dict(path)
    msg = str(e.value)
    assert "'epoch'" in msg and "'optimizer'" in msg and "'best_acc'" in msg and "opt.ckpt" in msg


def test_relu6_and_112x96_backbones_train_and_export_shapes() -> None:
    for name, gdc in (("mobilefacenet-affine-112x96", (7, 6)), ("mobilefacenet-relu6", (7, 7))):
        m = FaceNet(ModelConfig(name, code_length=127))
        assert tuple(m.backbone.gdc[0].weight.shape[2:]) == gdc
        out = m(torch.randn(2, 3, 112, 112))
        out.uv.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.skipif(not XIAOCCER.is_file(), reason="../shared/models not present")
def test_real_xiaoccer_112x96_checkpoint(tmp_path: Path, capsys) -> None:
    ref = Mfn112x96()
    ref.load_state_dict(torch.load(XIAOCCER, map_location="cpu", weights_only=True)["net_state_dict"], strict=True)
    ref.eval()
    out = tmp_path / "xi.safetensors"
    assert main(["import-model", str(XIAOCCER), "--input-std", "128", "--out", str(out)]) == 0
    assert "mobilefacenet-affine-112x96" in capsys.readouterr().out
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    model, meta = load_checkpoint(out)
    assert _parity_112x96(ref, model, 128.0) <= 1e-4


@pytest.mark.skipif(not FACEGATE.is_file(), reason="../shared/models not present")
def test_real_facegate_relu6_onnx(tmp_path: Path) -> None:
    model, rep = import_onnx(FACEGATE)              # its own parity check against ONNX Runtime
    assert model.config.backbone == "mobilefacenet-relu6"
    assert rep.max_rel_diff is not None and rep.max_rel_diff <= 1e-4
    assert main(["import-model", str(FACEGATE), "--out", str(tmp_path / "fg.safetensors")]) == 0


def _trained_like(name: str) -> FaceNet:
    torch.manual_seed(1)
    model = FaceNet(ModelConfig(name, code_length=127)).eval()
    with torch.no_grad():
        for n, p in model.backbone.named_parameters():
            if p.dim() == 1:
                (p.uniform_(-0.1, 0.1) if n.endswith(".bias") else p.uniform_(0.5, 1.5))
    return model


@pytest.mark.slow
def test_112x96_centre_crop_through_core_ml_fp16() -> None:
    """The centre-column Slice (MIL slice_by_index) in Core ML's fp16 reference."""
    pytest.importorskip("coremltools")
    import tempfile

    from export.coreml import NUMERICS_TOLERANCE, check_coreml_numerics, export_coreml
    from fedfs_sdk.nn.model import VerifierNet

    model = _trained_like("mobilefacenet-affine-112x96")
    verifier = VerifierNet(model.backbone, model.uv_head).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = export_coreml(verifier, Path(tmp) / "v.mlpackage", precision="fp16", check_numerics=False)
        bounds = check_coreml_numerics(path, verifier)["max_score_change"]
    assert 0 < max(bounds.values()) <= NUMERICS_TOLERANCE            # measured 1.1e-3


def test_relu6_trains_in_onnx_runtime_like_torch(tmp_path: Path) -> None:
    """ReLU6 exports as Clip, which ONNX Runtime training differentiates: one FedUV step equals torch's."""
    pytest.importorskip("onnxruntime.training")
    from export.ort_training import export_training_artifacts, train_config_of
    from fedfs_sdk.runtime.codes import make_codeword
    from fedfs_sdk.training.ort_device import OrtDeviceTrainer
    from fedfs_sdk.training.trainer import LocalTrainer

    model = _trained_like("mobilefacenet-relu6")
    info = export_training_artifacts("feduv", model, tmp_path / "art", lr=0.05, local_epochs=1, batch_size=4)
    x = np.random.default_rng(3).uniform(-1, 1, size=(4, 3, 112, 112)).astype(np.float32)
    cw = make_codeword(11, 127, rng=np.random.default_rng(0))[0]
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = LocalTrainer(model.config, train_config_of(info)).train(w0, x, codeword=cw)
    got = OrtDeviceTrainer(tmp_path / "art").train({k: v.numpy() for k, v in w0.items()}, x, codeword=cw)
    err = sum(float(((torch.from_numpy(got.weights[k]) - ref.weights[k]) ** 2).sum()) for k in w0)
    size = sum(float(((ref.weights[k] - w0[k]) ** 2).sum()) for k in w0)
    assert size > 1e-4 and (err / size) ** 0.5 <= 1e-4               # measured 7.5e-7
