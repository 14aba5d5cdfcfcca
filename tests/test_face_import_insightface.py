"""insightface's recognizer imports (fedfs_sdk.nn.face_import onto backbone ``insightface-mbf``).

The test re-builds arcface_torch's "mbf" MobileFaceNet (``get_mbf``: blocks (1, 4, 6, 2),
scale 2, BatchNorm, PReLU, ``Linear(512, 512, bias=False)`` + BatchNorm1d — what buffalo_s /
buffalo_sc's ``w600k_mbf.onnx`` was exported from) with arcface_torch's module names and random
weights and BatchNorm statistics, exports it to ONNX the way insightface did (eval mode: every
BatchNorm2d folded into its conv) and two other ways (BatchNormalization nodes kept; folded by
ONNX Runtime's optimizer), and checks that fedfs imports each — and the ``.pth`` state dict —
with embeddings within 1e-4 (relative) of the source, records the input convention, refuses
OpenCV's SFace naming what differs, and that the result serves as ξ, trains ϕ and exports.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from fedfs_sdk.nn.checkpoint import load_checkpoint
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.face_import import import_onnx, import_state_dict, save_imported
from fedfs_sdk.nn.model import FaceNet

# ---------------------------------------------------------------- the reference (arcface_torch layout)


def _images(n: int = 3, seed: int = 7) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, (n, 3, 112, 112)).astype(np.float32))


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1)            # as arcface_torch: Shape/Gather/Reshape in the graph


class _ConvBlock(nn.Module):
    """arcface_torch ``ConvBlock`` (act=True) / ``LinearBlock`` (act=False): keys ``layers.{0,1,2}``."""

    def __init__(self, cin: int, cout: int, k: int, s: int, p: int, groups: int = 1, act: bool = True) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Conv2d(cin, cout, k, s, p, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            mods.append(nn.PReLU(cout))
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _DepthWise(nn.Module):
    def __init__(self, cin: int, cout: int, residual: bool, stride: int, groups: int) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(_ConvBlock(cin, groups, 1, 1, 0), _ConvBlock(groups, groups, 3, stride, 1, groups),
                                    _ConvBlock(groups, cout, 1, 1, 0, act=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return x + y if self.residual else y


class _Residual(nn.Module):
    def __init__(self, c: int, n: int, groups: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[_DepthWise(c, c, True, 1, groups) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _GDC(nn.Module):
    def __init__(self, emb: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(_ConvBlock(512, 512, 7, 1, 0, groups=512, act=False), _Flatten(),
                                    nn.Linear(512, emb, bias=False), nn.BatchNorm1d(emb))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ArcfaceMBF(nn.Module):
    """arcface_torch ``get_mbf(fp16=False, num_features=512)``, re-implemented for the test."""

    def __init__(self, emb: int = 512, blocks: tuple[int, int, int, int] = (1, 4, 6, 2), scale: int = 2) -> None:
        super().__init__()
        c = 64 * scale
        self.layers = nn.ModuleList([
            _ConvBlock(3, c, 3, 2, 1), _ConvBlock(c, c, 3, 1, 1, groups=64),
            _DepthWise(c, c, False, 2, 128), _Residual(c, blocks[1], 128),
            _DepthWise(c, 2 * c, False, 2, 256), _Residual(2 * c, blocks[2], 256),
            _DepthWise(2 * c, 2 * c, False, 2, 512), _Residual(2 * c, blocks[3], 256)])
        self.conv_sep = _ConvBlock(2 * c, 512, 1, 1, 0)
        self.features = _GDC(emb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.layers:
            x = f(x)
        return self.features(self.conv_sep(x))


def _randomized(seed: int) -> ArcfaceMBF:
    """Random weights, BatchNorm affine parameters and PReLU slopes; BatchNorm running statistics
    measured on random images (as training would leave them), then jittered; eval mode. (With
    arbitrary statistics the activations drift layer by layer and every image gets nearly the
    same embedding — a parity check on such a network could not fail.)"""
    torch.manual_seed(seed)
    net = ArcfaceMBF()
    bns = [m for m in net.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.momentum = None                               # cumulative average over the batches
            elif isinstance(m, nn.PReLU):
                m.weight.uniform_(0.05, 0.4)
        net.train()
        for i in range(2):
            net(_images(16, seed=100 + i))
        for m in bns:
            m.running_mean.add_(torch.empty_like(m.running_mean).uniform_(-0.05, 0.05))
            m.running_var.mul_(torch.empty_like(m.running_var).uniform_(0.8, 1.25))
    return net.eval()


@pytest.fixture(scope="module")
def ref() -> ArcfaceMBF:
    return _randomized(11)


def _rel(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _export(net: nn.Module, path: Path, how: str) -> Path:
    """``insightface``: as arcface_torch's torch2onnx (eval mode, BN folded into the convs, input
    "data", batch 1 then made dynamic); ``bn-kept``: BatchNormalization nodes preserved;
    ``ort-optimized``: the BN-kept graph after ONNX Runtime's basic optimizations (Conv+BN fused)."""
    x = torch.zeros(1, 3, 112, 112)
    if how == "insightface":
        torch.onnx.export(net, (x,), str(path), input_names=["data"], keep_initializers_as_inputs=False,
                          opset_version=13, dynamo=False)
        m = onnx.load(str(path))
        m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "None"
        onnx.save(m, str(path))
        return path
    torch.onnx.export(net, (x,), str(path), input_names=["input.1"], output_names=["fc1"],
                      dynamic_axes={"input.1": {0: "n"}, "fc1": {0: "n"}}, opset_version=17, dynamo=False,
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    if how == "ort-optimized":
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(path.with_suffix(".opt.onnx"))
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return path.with_suffix(".opt.onnx")
    return path


def _ort(path: Path, feed: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: feed[i:i + 1]})[0] for i in range(len(feed))])

# ---------------------------------------------------------------- the tests


def test_reference_has_arcface_torch_names_and_shapes(ref: ArcfaceMBF) -> None:
    sd = ref.state_dict()
    # the keys arcface_torch's backbone.pth has (spot checks) and the grouped (64 groups) stem conv
    assert sd["layers.0.layers.0.weight"].shape == (128, 3, 3, 3)
    assert sd["layers.1.layers.0.weight"].shape == (128, 2, 3, 3)
    assert sd["layers.3.layers.0.layers.0.layers.0.weight"].shape == (128, 128, 1, 1)
    assert sd["layers.6.layers.0.layers.0.weight"].shape == (512, 256, 1, 1)
    assert sd["conv_sep.layers.1.running_var"].shape == (512,)
    assert sd["features.layers.0.layers.0.weight"].shape == (512, 1, 7, 7)
    assert sd["features.layers.2.weight"].shape == (512, 512) and "features.layers.2.bias" not in sd
    assert sd["features.layers.3.running_mean"].shape == (512,)
    # fedfs' re-implementation has the same parameters, BatchNorm statistics aside
    from fedfs_sdk.nn.backbones import get_backbone

    fedfs = get_backbone("insightface-mbf")
    n_params = sum(p.numel() for p in fedfs.parameters())
    assert n_params == sum(p.numel() for p in ref.parameters()) == 2_059_520


@torch.no_grad()
@pytest.mark.parametrize("how", ["insightface", "bn-kept", "ort-optimized"])
def test_onnx_imports_onto_insightface_mbf_within_1e4(ref: ArcfaceMBF, how: str, tmp_path: Path) -> None:
    path = _export(ref, tmp_path / "w600k_mbf.onnx", how)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    n_bn = ops.count("BatchNormalization")
    # 49 BatchNorm2d + the final BatchNorm1d; torch's eval export folds the 2-d ones into the convs,
    # ORT's optimizer the 1-d one into the Gemm too
    assert n_bn == {"bn-kept": 50, "insightface": 1, "ort-optimized": 0}[how], n_bn
    model, rep = import_onnx(path)
    assert model.config.backbone == "insightface-mbf" and model.config.embedding_dim == 512
    assert rep.complete and not rep.unmapped_source and len(rep.folded) == 50
    assert rep.max_rel_diff is not None and rep.max_rel_diff <= 1e-4
    x = _images()
    assert _rel(model(x).embedding, ref(x)) <= 1e-4
    assert _rel(model(x).embedding, _ort(path, x.numpy())) <= 1e-4
    assert rep.input_convention["source"] == "RGB, (x − 127.5) / 127.5 before the graph"
    assert rep.input_convention["absorbed"] == ""


@torch.no_grad()
def test_arcface_torch_state_dict_imports(ref: ArcfaceMBF, tmp_path: Path) -> None:
    torch.save(ref.state_dict(), tmp_path / "backbone.pth")          # arcface_torch's checkpoint layout
    from fedfs_sdk.nn.face_import import read_state_dict

    model, rep = import_state_dict(read_state_dict(tmp_path / "backbone.pth"))
    assert model.config.backbone == "insightface-mbf" and model.config.embedding_dim == 512
    assert rep.complete and len(rep.folded) == 50
    # BatchNorm statistics were folded, nothing else left over
    assert all(k.endswith("num_batches_tracked") for k in rep.unmapped_source)
    x = _images()
    assert _rel(model(x).embedding, ref(x)) <= 1e-4
    # arcface_torch's resume file wraps it with the margin layer's weights and the step count
    torch.save({"epoch": 3, "global_step": 10, "state_dict_backbone": ref.state_dict(),
                "state_dict_softmax_fc": {"weight": torch.zeros(10, 512)}}, tmp_path / "checkpoint_gpu_0.pt")
    model2, _ = import_state_dict(read_state_dict(tmp_path / "checkpoint_gpu_0.pt"))
    assert torch.equal(model2(x).embedding, model(x).embedding)


@torch.no_grad()
def test_bgr_graph_with_its_own_normalization(ref: ArcfaceMBF, tmp_path: Path) -> None:
    """A graph fed 0–255 BGR pixels that normalizes itself (``Sub`` 127.5, ``Mul`` 1/128, as
    MXNet-converted models and OpenCV's SFace do): the import absorbs both into the first conv."""
    bgr = copy.deepcopy(ref)
    with torch.no_grad():
        bgr.layers[0].layers[0].weight.copy_(ref.layers[0].layers[0].weight.flip(1))

    class RawPixels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = bgr

        def forward(self, p: torch.Tensor) -> torch.Tensor:
            return self.net((p - 127.5) * 0.0078125)

    path = _export(RawPixels().eval(), tmp_path / "raw_bgr.onnx", "bn-kept")
    assert [n.op_type for n in onnx.load(str(path)).graph.node if n.op_type != "Constant"][:2] == ["Sub", "Mul"]
    u = _images()                                            # fedfs' input: RGB, (x − 127.5)/127.5
    as_rgb, _ = import_onnx(path)       # faithful to the graph fed RGB, but the graph wants BGR: wrong colours
    assert _rel(as_rgb(u).embedding, ref(u * (127.5 / 128))) > 1e-2
    model, rep = import_onnx(path, rgb=False)
    conv = rep.input_convention
    assert conv["source"].startswith("BGR, 0–255 pixels, then (x − 127.5) / 128 inside the graph")
    assert "input scaled by [0.996094, 0.996094, 0.996094]" in conv["absorbed"] and "BGR → RGB" in conv["absorbed"]
    pixels_bgr = (u.numpy().astype(np.float64) * 127.5 + 127.5)[:, ::-1]
    out = _ort(path, np.ascontiguousarray(pixels_bgr, dtype=np.float32))
    assert _rel(model(u).embedding, out) <= 1e-4
    # and it is the reference network: the same face, the same embedding
    assert _rel(model(u).embedding, ref(u * (127.5 / 128))) <= 1e-4
    ck = save_imported(tmp_path / "xi.safetensors", model, rep, str(path))
    _, meta = load_checkpoint(ck)
    assert meta["input_convention"]["fedfs"].startswith("RGB, (x − 127.5) / 127.5")
    assert "BGR" in meta["input_convention"]["source"]


def test_a_shifted_input_convention_is_refused(ref: ArcfaceMBF, tmp_path: Path) -> None:
    path = _export(ref, tmp_path / "mbf.onnx", "insightface")
    with pytest.raises(InputError, match=r"maps mid-grey 127\.5 to \[[-0-9.e, ]+\], not 0"):
        import_onnx(path, input_mean=0.0, input_std=255.0)      # pixels / 255: grey is 0.5, not 0


class _SFaceLike(nn.Module):
    """OpenCV SFace's layout, narrowed: a stride-1 32-filter stem, 3×3 depthwise + 1×1 pairs
    (no inverted residuals) to 1024 channels at 7×7, BatchNorm, FC on the flattened map → 128."""

    def __init__(self) -> None:
        super().__init__()
        chans = [(32, 64, 2), (64, 128, 2), (128, 256, 2), (256, 1024, 2)]
        mods: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.PReLU(32)]
        for cin, cout, s in chans:
            mods += [nn.Conv2d(cin, cin, 3, s, 1, groups=cin, bias=False), nn.BatchNorm2d(cin), nn.PReLU(cin),
                     nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.PReLU(cout)]
        mods += [nn.BatchNorm2d(1024), nn.Flatten(), nn.Linear(1024 * 7 * 7, 128), nn.BatchNorm1d(128)]
        self.net = nn.Sequential(*mods)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return self.net((p - 127.5) * 0.0078125)


def test_sface_is_refused_naming_what_differs(tmp_path: Path) -> None:
    path = _export(_SFaceLike().eval(), tmp_path / "face_recognition_sface_2021dec.onnx", "bn-kept")
    with pytest.raises(InputError) as e:
        import_onnx(path)
    msg = str(e.value)
    assert "insightface-mbf: first layer that does not map: source" in msg and "[32, 3, 3, 3] → model" in msg
    assert "OpenCV's SFace" in msg and "flattened 1024×7×7 map" in msg and "cannot be imported" in msg


def test_iresnet_is_named() -> None:
    from fedfs_sdk.nn.face_import import _foreign_hint

    shapes = [(64, 3, 3, 3), (64,), (64, 64, 3, 3), (512, 512 * 7 * 7), (512,)]
    hint = _foreign_hint([(f"t{i}", torch.zeros(1).expand(*s)) for i, s in enumerate(shapes)])
    assert "IResNet (ArcFace R18/R34/R50/R100" in hint and "not supported" in hint


@pytest.fixture(scope="module")
def imported_xi(ref: ArcfaceMBF, tmp_path_factory: pytest.TempPathFactory) -> tuple[FaceNet, Path]:
    d = tmp_path_factory.mktemp("xi")
    path = _export(ref, d / "w600k_mbf.onnx", "insightface")
    model, rep = import_onnx(path)
    ck = save_imported(d / "xi.safetensors", model, rep, str(path))
    xi, meta = load_checkpoint(ck)
    assert xi.config.backbone == "insightface-mbf" and meta["mapping"]["max_rel_diff"] <= 1e-4
    return xi, ck


def test_imported_mbf_is_xi_and_phi_trains_from_it(imported_xi: tuple[FaceNet, Path], ref: ArcfaceMBF) -> None:
    """ξ frozen = the imported model; ϕ starts from its weights; 3 FedFS local steps on 6 images:
    the loss is finite, ϕ moves, ξ does not."""
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig
    from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights

    xi, _ = imported_xi
    before = {k: v.clone() for k, v in xi.state_dict().items()}
    cfg = replace(xi.config, proj_dim=FedFSLossConfig().projection_dim(xi.config.embedding_dim))
    w0 = initial_global_weights(cfg, xi)
    assert all(torch.equal(w0[f"backbone.{k}"], v) for k, v in xi.backbone.state_dict().items())
    res = LocalTrainer(cfg, TrainConfig(method="fedfs", local_epochs=1, batch_size=2), xi=xi).train(w0, _images(6))
    losses = [v for k, v in res.metrics.items() if k.endswith(("_first", "_last"))]
    assert losses and all(np.isfinite(v) for v in losses), res.metrics
    moved = max((res.weights[k] - w0[k]).abs().max().item() for k in w0)
    assert np.isfinite(moved) and moved > 0
    assert all(torch.equal(before[k], v) for k, v in xi.state_dict().items())
    with torch.no_grad():
        assert _rel(xi(_images(2)).embedding, ref(_images(2))) <= 1e-4


def test_imported_mbf_exports_for_inference(imported_xi: tuple[FaceNet, Path], tmp_path: Path) -> None:
    """The verifier ONNX of the imported model (export.onnx_inference, fused BatchNormalization/
    PRelu graph) embeds like the torch model, in ONNX Runtime."""
    from export.onnx_inference import export_onnx
    from fedfs_sdk.nn.model import VerifierNet

    xi, _ = imported_xi
    verifier = VerifierNet(xi.backbone).eval()
    out = export_onnx(verifier, tmp_path / "verifier.onnx")
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = _images(2)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = verifier(x)[0].numpy()
    assert got.shape == want.shape and _rel(got, want) <= 1e-4


def test_import_model_command_on_w600k_mbf(imported_xi: tuple[FaceNet, Path], tmp_path: Path) -> None:
    """``fedfs import-model w600k_mbf.onnx`` picks insightface-mbf by itself and says so."""
    import subprocess
    import sys

    xi, ck = imported_xi
    r = subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.import_model", str(ck.parent / "w600k_mbf.onnx"),
                        "--out", str(tmp_path / "xi.safetensors")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "mapped 183 tensors" in r.stdout and "folded 50 BatchNorm layers" in r.stdout
    assert "wrote" in r.stdout and "(insightface-mbf, 512-d, 112×112 RGB" in r.stdout
    back, meta = load_checkpoint(tmp_path / "xi.safetensors")
    assert back.config == xi.config and meta["input_convention"]["absorbed"] == ""
    assert all(torch.equal(v, xi.state_dict()[k]) for k, v in back.state_dict().items())


@torch.no_grad()
def _figures() -> None:
    """The table in docs/real-faces.md: ``python tests/test_face_import_insightface.py``."""
    import tempfile

    reference = _randomized(11)
    x = _images(8, seed=3)
    d = Path(tempfile.mkdtemp())
    for how in ("insightface", "bn-kept", "ort-optimized"):
        path = _export(reference, d / f"{how}.onnx", how)
        model, rep = import_onnx(path)
        print(f"ONNX {how:14s} import check rel {rep.max_rel_diff:.2e}; "
              f"vs the torch reference on 8 other images: rel {_rel(model(x).embedding, reference(x)):.2e}")
    model, _ = import_state_dict(dict(reference.state_dict()))
    print(f"state dict          vs the torch reference on 8 other images: rel {_rel(model(x).embedding, reference(x)):.2e}")


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    _figures()
