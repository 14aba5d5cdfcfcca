"""Bring your own face model (fedfs_sdk.nn.face_import): an insightface-style ONNX exported by the
test itself imports back with embeddings within 1e-5; a torch state dict maps by name or by
shape order; a BatchNorm MobileFaceNet (BN kept in the graph, BN folded into the convs by the
exporter, or a state dict with running statistics) imports onto ``mobilefacenet-affine``
within 1e-5 of ONNX Runtime / torch; a foreign graph is refused naming the first layer that
does not map; the result is a fedfs checkpoint that loads as ξ and trains as ϕ's start."""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from fedfs_sdk.nn.backbones.layers import GroupNormP, PReLUP
from fedfs_sdk.nn.checkpoint import load_checkpoint
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.face_import import (import_onnx, import_state_dict, map_onto, read_state_dict,
                                   save_imported)
from fedfs_sdk.nn.model import FaceNet, ModelConfig


def _trained_like(seed: int = 0) -> FaceNet:
    """A MobileFaceNet whose norm and PReLU parameters differ per channel, as after training
    (fresh ones are all 1 / 0 / 0.25, which torch.onnx would store once)."""
    torch.manual_seed(seed)
    m = FaceNet(ModelConfig("mobilefacenet", input_size=112).resolved()).eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, GroupNormP):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, PReLUP):
                mod.weight.uniform_(0.05, 0.4)
    return m


def _export(net: nn.Module, path: Path) -> Path:
    """insightface layout: input "input.1" [N, 3, 112, 112] RGB in [−1, 1], one output."""
    torch.onnx.export(net, (torch.zeros(1, 3, 112, 112),), str(path), input_names=["input.1"],
                      output_names=["fc1"], dynamic_axes={"input.1": {0: "n"}, "fc1": {0: "n"}},
                      opset_version=17, dynamo=False)
    return path


class _EmbeddingOnly(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[FaceNet, Path]:
    model = _trained_like()
    return model, _export(_EmbeddingOnly(model.backbone), tmp_path_factory.mktemp("onnx") / "mbf.onnx")


def _images(n: int = 3, seed: int = 7) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, (n, 3, 112, 112)).astype(np.float32))


@torch.no_grad()
def test_onnx_round_trip_matches_within_1e5(exported: tuple[FaceNet, Path], tmp_path: Path) -> None:
    model, path = exported
    imported, rep = import_onnx(path)
    assert rep.complete and rep.max_abs_diff is not None and rep.max_abs_diff <= 1e-5
    assert not rep.unmapped_source
    x = _images()
    diff = (imported(x).embedding - model(x).embedding).abs().max().item()
    assert diff <= 1e-5, diff
    # → a fedfs checkpoint that loads back as the same model (usable as --xi)
    ck = save_imported(tmp_path / "xi.safetensors", imported, rep, str(path))
    back, meta = load_checkpoint(ck)
    assert meta["kind"] == "xi" and meta["mapping"]["missing_target"] == []
    assert (back(x).embedding - model(x).embedding).abs().max().item() <= 1e-5


@torch.no_grad()
def test_untrained_model_with_shared_constants_round_trips(tmp_path: Path) -> None:
    # fresh norm/PReLU parameters are all equal: torch.onnx stores each value once and
    # aliases the other uses through Identity nodes
    torch.manual_seed(5)
    fresh = FaceNet(ModelConfig("mobilefacenet", input_size=112).resolved()).eval()
    path = _export(_EmbeddingOnly(fresh.backbone), tmp_path / "fresh.onnx")
    assert any(n.op_type == "Identity" for n in onnx.load(str(path)).graph.node)
    imported, rep = import_onnx(path)
    assert rep.max_abs_diff <= 1e-5
    x = _images(2)
    assert (imported(x).embedding - fresh(x).embedding).abs().max().item() <= 1e-5


@torch.no_grad()
def test_bgr_graph_is_imported_as_rgb(exported: tuple[FaceNet, Path], tmp_path: Path) -> None:
    model, path = exported
    g = onnx.load(str(path))
    first = next(i for i in g.graph.initializer if i.name == "backbone.features.0.0.weight")
    w = numpy_helper.to_array(first)[:, ::-1].copy()               # the graph now wants BGR
    first.CopyFrom(numpy_helper.from_array(w, first.name))
    bgr = tmp_path / "bgr.onnx"
    onnx.save(g, str(bgr))
    x = _images()
    as_rgb, _ = import_onnx(bgr)          # faithful to the graph, but it would be fed RGB: wrong colours
    assert (as_rgb(x).embedding - model(x).embedding).abs().max().item() > 1e-2
    imported, rep = import_onnx(bgr, rgb=False)
    assert rep.max_abs_diff <= 1e-5
    assert (imported(x).embedding - model(x).embedding).abs().max().item() <= 1e-5


def _batchnorm_mobilefacenet(seed: int = 1) -> nn.Module:
    """The project's MobileFaceNet topology as insightface builds it: nn.BatchNorm2d/1d with
    random affine parameters and running statistics, nn.PReLU; eval mode."""
    torch.manual_seed(seed)
    net = copy.deepcopy(FaceNet(ModelConfig("mobilefacenet", input_size=112).resolved()).backbone)
    with torch.no_grad():
        for mod in list(net.modules()):
            for cname, child in list(mod.named_children()):
                if isinstance(child, GroupNormP):
                    c = child.num_channels
                    bn = nn.BatchNorm1d(c) if cname == "embed_norm" else nn.BatchNorm2d(c)
                    bn.weight.uniform_(0.5, 1.5)
                    bn.bias.uniform_(-0.2, 0.2)
                    bn.running_mean.uniform_(-0.1, 0.1)
                    bn.running_var.uniform_(0.5, 2.0)
                    setattr(mod, cname, bn)
                elif isinstance(child, PReLUP):
                    pr = nn.PReLU(child.weight.shape[0])
                    pr.weight.uniform_(0.05, 0.4)
                    setattr(mod, cname, pr)
    return net.eval()


def _export_bn(net: nn.Module, path: Path, keep_bn: bool) -> Path:
    """EVAL mode folds BatchNorm into the preceding Conv (do_constant_folding); PRESERVE keeps
    the BatchNormalization nodes (the model is in eval mode either way)."""
    mode = torch.onnx.TrainingMode.PRESERVE if keep_bn else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(net, (torch.zeros(1, 3, 112, 112),), str(path), input_names=["input.1"],
                      output_names=["fc1"], dynamic_axes={"input.1": {0: "n"}, "fc1": {0: "n"}},
                      opset_version=17, dynamo=False, training=mode, do_constant_folding=True)
    return path


@pytest.fixture(scope="module")
def bn_net() -> nn.Module:
    return _batchnorm_mobilefacenet()


@torch.no_grad()
@pytest.mark.parametrize("keep_bn", [True, False], ids=["bn-kept", "bn-folded-into-conv"])
def test_batchnorm_graph_imports_onto_the_affine_variant(bn_net: nn.Module, keep_bn: bool, tmp_path: Path) -> None:
    path = _export_bn(bn_net, tmp_path / "bn.onnx", keep_bn)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    convs_with_bias = sum(1 for n in onnx.load(str(path)).graph.node if n.op_type == "Conv" and len(n.input) == 3)
    if keep_bn:      # 49 BatchNorm2d after convs + the BatchNorm1d after flatten
        assert ops.count("BatchNormalization") == 50 and convs_with_bias == 0
    else:            # the exporter folded every BatchNorm2d into its conv; the BatchNorm1d stays
        assert ops.count("BatchNormalization") == 1 and convs_with_bias == 49
    imported, rep = import_onnx(path)
    assert imported.config.backbone == "mobilefacenet-affine"
    assert rep.complete and not rep.unmapped_source and len(rep.folded) == 50
    assert rep.max_abs_diff is not None and rep.max_abs_diff <= 1e-5
    x = _images()
    assert (imported(x).embedding - bn_net(x)).abs().max().item() <= 1e-5
    assert "folded 50 BatchNorm layers" in rep.summary()


def test_bn_folding_is_hand_checkable() -> None:
    # conv with bias 4, then BatchNorm(γ=2, β=1, μ=3, σ²=15, ε=1)
    from fedfs_sdk.nn.face_import import fold_batchnorm

    sd = {"c.weight": torch.ones(1, 1, 1, 1), "c.bias": torch.tensor([4.0]),
          "n.weight": torch.tensor([2.0]), "n.bias": torch.tensor([1.0]),
          "n.running_mean": torch.tensor([3.0]), "n.running_var": torch.tensor([15.0]),
          "n.num_batches_tracked": torch.tensor(7), "p.weight": torch.ones(2, 1, 1, 1), "p.bias": torch.tensor([1.0, -1.0])}
    out, folded = fold_batchnorm(sd, eps=1.0)
    # a = 2/sqrt(16) = 0.5; b = 1 − 0.5·3 + 0.5·4 = 1.5; p's bias has no BatchNorm after it → (1, bias)
    assert out["n.weight"].tolist() == [0.5] and out["n.bias"].tolist() == [1.5]
    assert list(out) == ["c.weight", "n.weight", "n.bias", "p.weight", "p.bias:affine.weight", "p.bias:affine.bias"]
    assert out["p.bias:affine.weight"].tolist() == [1.0, 1.0] and out["p.bias:affine.bias"].tolist() == [1.0, -1.0]
    assert folded == ["c.bias", "n", "p.bias"]


def test_a_foreign_graph_is_refused_naming_the_first_layer(tmp_path: Path) -> None:
    # a BatchNorm MobileFaceNet whose first conv has 32 filters instead of 64 (another topology)
    net = _batchnorm_mobilefacenet(2)
    net.features[0][0] = nn.Conv2d(3, 32, 3, 2, 1, bias=False)
    net.features[0][1] = nn.BatchNorm2d(32)
    net.features[0][2] = nn.PReLU(32)
    net.features[1][0] = nn.Conv2d(32, 64, 3, 1, 1, bias=False)
    path = _export_bn(net.eval(), tmp_path / "other.onnx", keep_bn=True)
    with pytest.raises(InputError, match=r"neither the project's MobileFaceNet \(BatchNorm, folded\) nor [\s\S]*insightface's mbf"
                                         r"[\s\S]*mobilefacenet-affine: first layer that does not map: "
                                         r"source \S+ \[32, 3, 3, 3\] → model features\.0\.0\.weight \[64, 3, 3, 3\]"
                                         r"[\s\S]*insightface-mbf: first layer that does not map: "
                                         r"source \S+ \[32, 3, 3, 3\] → model features\.0\.0\.weight \[128, 3, 3, 3\]"):
        import_onnx(path)


class _LinearHead(nn.Module):
    """insightface's classic MobileFaceNet head (fmobilefacenet; zhongyy/SFace's torch port):
    GDC → flatten → Linear(512, E) *with* bias → BatchNorm1d(eps=2e-5), convs' BatchNorm eps=1e-3."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.features, self.gdc = net.features, net.gdc
        self.fc = nn.Linear(512, 128, bias=True)
        self.bn = nn.BatchNorm1d(128, eps=2e-5)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.1, 0.1)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.bias.uniform_(-0.2, 0.2)
        for m in self.features.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps = 1e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(self.gdc(self.features(x)).flatten(1)))


@torch.no_grad()
def test_linear_embedding_with_bias_and_other_eps_imports(tmp_path: Path) -> None:
    net = _LinearHead(_batchnorm_mobilefacenet(3)).eval()
    path = _export_bn(net, tmp_path / "fmobilefacenet.onnx", keep_bn=True)
    assert "Gemm" in [n.op_type for n in onnx.load(str(path)).graph.node]
    imported, rep = import_onnx(path)
    assert imported.config.backbone == "mobilefacenet-affine" and imported.config.embedding_dim == 128
    assert rep.max_abs_diff <= 1e-5
    x = _images(2)
    assert (imported(x).embedding - net(x)).abs().max().item() <= 1e-5


def _fedfs_step_runs_from(xi: FaceNet) -> None:
    """ξ frozen, ϕ's backbone starts from ξ's weights; one FedFS local step on 2 images moves ϕ."""
    from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights

    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig

    cfg = replace(xi.config, proj_dim=FedFSLossConfig().projection_dim(xi.config.embedding_dim))
    w0 = initial_global_weights(cfg, xi)
    assert all(torch.equal(w0[f"backbone.{k}"], v) for k, v in xi.backbone.state_dict().items())
    res = LocalTrainer(cfg, TrainConfig(method="fedfs", local_epochs=1, batch_size=2), xi=xi).train(w0, _images(2))
    moved = max((res.weights[k] - w0[k]).abs().max().item() for k in w0)
    assert np.isfinite(moved) and moved > 0
    assert all(torch.isfinite(v).all() for v in res.weights.values())


def test_imported_batchnorm_model_loads_as_xi_and_trains_phi(bn_net: nn.Module, tmp_path: Path) -> None:
    path = _export_bn(bn_net, tmp_path / "bn.onnx", keep_bn=False)
    imported, rep = import_onnx(path)
    ck = save_imported(tmp_path / "xi.safetensors", imported, rep, str(path))
    xi, meta = load_checkpoint(ck)
    assert xi.config.backbone == "mobilefacenet-affine" and len(meta["mapping"]["folded_batchnorm"]) == 50
    x = _images(2)
    with torch.no_grad():
        assert (xi(x).embedding - bn_net(x)).abs().max().item() <= 1e-5
    _fedfs_step_runs_from(xi)


@torch.no_grad()
def test_batchnorm_state_dict_is_folded(bn_net: nn.Module, tmp_path: Path) -> None:
    sd = {f"module.{k}": v for k, v in bn_net.state_dict().items()}
    model, rep = import_state_dict(sd)
    assert model.config.backbone == "mobilefacenet-affine"
    assert rep.complete and not rep.unmapped_source and not rep.by_shape and len(rep.folded) == 50
    x = _images(2)
    assert (model(x).embedding - bn_net(x)).abs().max().item() <= 1e-5
    # renamed keys (another code base) map by shape order, statistics still folded
    regrouped: dict[str, torch.Tensor] = {}
    for k, v in bn_net.state_dict().items():                   # keep each module's keys under one prefix
        regrouped[f"m{k.rsplit('.', 1)[0].replace('.', '_')}.{k.rsplit('.', 1)[1]}"] = v
    model2, rep2 = import_state_dict(regrouped)
    assert rep2.complete and len(rep2.by_shape) == 183
    assert (model2(x).embedding - bn_net(x)).abs().max().item() <= 1e-5
    # a conv-folded state dict (biased convs, no statistics): the bias becomes the affine's b
    folded_net = copy.deepcopy(bn_net)
    from torch.nn.utils.fusion import fuse_conv_bn_eval
    for mod in list(folded_net.modules()):
        kids = list(mod.named_children())
        for (n1, c1), (n2, c2) in zip(kids, kids[1:]):
            if isinstance(c1, nn.Conv2d) and isinstance(c2, nn.BatchNorm2d):
                setattr(mod, n1, fuse_conv_bn_eval(c1, c2))
                setattr(mod, n2, nn.Identity())
    assert (folded_net(x) - bn_net(x)).abs().max().item() <= 1e-5
    model3, rep3 = import_state_dict(folded_net.state_dict())
    assert model3.config.backbone == "mobilefacenet-affine" and rep3.complete and not rep3.unmapped_source
    assert (model3(x).embedding - bn_net(x)).abs().max().item() <= 1e-5


@torch.no_grad()
def test_state_dict_by_name_with_prefixes(tmp_path: Path) -> None:
    src = _trained_like(2)
    sd = {f"module.backbone.{k}": v for k, v in src.backbone.state_dict().items()}
    torch.save(sd, tmp_path / "w.pth")
    model, rep = import_state_dict(read_state_dict(tmp_path / "w.pth"))
    assert rep.complete and not rep.by_shape and not rep.unmapped_source
    x = _images(2)
    assert torch.equal(model(x).embedding, src(x).embedding)


@torch.no_grad()
def test_state_dict_with_other_names_maps_by_shape_and_reports_batchnorm_stats() -> None:
    src = _trained_like(3)
    renamed: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(src.backbone.state_dict().items()):
        renamed[f"layer{i:03d}.{k.rsplit('.', 1)[-1]}"] = v
        if k.endswith("bias") and v.dim() == 1:                     # a BatchNorm-style checkpoint
            renamed[f"layer{i:03d}.running_mean"] = torch.zeros_like(v)
            renamed[f"layer{i:03d}.running_var"] = torch.ones_like(v)
    # explicit GroupNorm target: statistics are not folded but reported (a starting point for ϕ)
    model, rep = import_state_dict(renamed, ModelConfig("mobilefacenet", input_size=112))
    assert rep.complete and len(rep.by_shape) == len(src.backbone.state_dict())
    assert rep.unmapped_source and all(k.endswith(("running_mean", "running_var")) for k in rep.unmapped_source)
    assert "running_mean" in rep.summary()
    x = _images(2)
    assert torch.equal(model(x).embedding, src(x).embedding)


def test_partial_state_dict_lists_what_is_missing() -> None:
    sd = dict(list(_trained_like(4).backbone.state_dict().items())[:-3])
    with pytest.raises(InputError, match=r"does not fill the model[\s\S]*embed_norm\.bias"):
        import_state_dict(sd)
    model, rep = import_state_dict(sd, require_complete=False)
    assert rep.missing_target == ["embed.weight", "embed_norm.weight", "embed_norm.bias"]


def test_map_onto_stops_at_the_first_shape_mismatch() -> None:
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    src = [("a", torch.ones(4, 3)), ("b", torch.ones(4)), ("c", torch.ones(5, 4)), ("d", torch.ones(2))]
    rep = map_onto(target, src)
    assert [t for _, t in rep.mapped] == ["0.weight", "0.bias"]
    assert rep.unmapped_source == ["c", "d"] and rep.missing_target == ["1.weight", "1.bias"]


def test_unreadable_inputs_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(InputError, match=r"x\.onnx is not a readable ONNX model"):
        import_onnx(bad)
    (tmp_path / "w.pth").write_bytes(b"junk")
    with pytest.raises(InputError, match=r"w\.pth is not a readable state dict"):
        read_state_dict(tmp_path / "w.pth")


def test_import_model_command_writes_a_checkpoint_and_names_missing_keys(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest_server import cli_in_process
    from fedfs_sdk.cli.import_model import main as import_main

    src = _trained_like(6)
    torch.save(src.backbone.state_dict(), tmp_path / "full.pth")
    torch.save(dict(list(src.backbone.state_dict().items())[:-1]), tmp_path / "part.pth")
    cmd = [sys.executable, "-m", "fedfs_sdk.cli.import_model"]
    ok = subprocess.run(cmd + [str(tmp_path / "full.pth"), "--out", str(tmp_path / "xi.safetensors")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "mapped 183 tensors" in ok.stdout and "wrote" in ok.stdout
    model, meta = load_checkpoint(tmp_path / "xi.safetensors")
    x = _images(1)
    with torch.no_grad():
        assert torch.equal(model(x).embedding, src(x).embedding)
    # the refusal and --partial through the command's main in this process (the run above is the real one)
    bad = cli_in_process(str(tmp_path / "part.pth"), "--out", str(tmp_path / "p.safetensors"), main=import_main)
    assert bad.returncode == 2 and "embed_norm.bias" in bad.stderr and "--partial" in bad.stderr
    assert not (tmp_path / "p.safetensors").exists()
    part = cli_in_process(str(tmp_path / "part.pth"), "--out", str(tmp_path / "p.safetensors"), "--partial",
                          main=import_main)
    assert part.returncode == 0 and "model keys left at their initial values: embed_norm.bias" in part.stdout


def test_channel_affine_and_the_affine_backbone() -> None:
    from fedfs_sdk.nn.backbones import get_backbone
    from fedfs_sdk.nn.backbones.layers import ChannelAffine

    aff = ChannelAffine(2)
    with torch.no_grad():
        aff.weight.copy_(torch.tensor([2.0, 0.5]))
        aff.bias.copy_(torch.tensor([1.0, -1.0]))
    x = torch.tensor([[[[1.0, -2.0]], [[4.0, 0.0]]]])                   # [1, 2, 1, 2]
    assert aff(x).tolist() == [[[[3.0, -3.0]], [[1.0, -1.0]]]]
    assert aff(torch.tensor([[1.0, 4.0]])).tolist() == [[3.0, 1.0]]     # [B, C] (the embedding norm)
    # same topology and keys as the GroupNorm MobileFaceNet; no batch statistics (no buffers)
    a, g = get_backbone("mobilefacenet-affine"), get_backbone("mobilefacenet")
    assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in g.state_dict().items()]
    assert not list(a.buffers())
    # a per-sample layer: one image's output does not depend on the rest of the batch, in train mode too
    a.train()
    xb = _images(3, seed=1)
    with torch.no_grad():
        assert torch.allclose(a(xb)[:1], a(xb[:1]), atol=1e-5)


def test_import_model_command_folds_a_batchnorm_state_dict(bn_net: nn.Module, tmp_path: Path) -> None:
    from conftest_server import cli_in_process
    from fedfs_sdk.cli.import_model import main as import_main

    torch.save(bn_net.state_dict(), tmp_path / "bn.pth")      # the command's main in this process
    r = cli_in_process(str(tmp_path / "bn.pth"), "--out", str(tmp_path / "xi.safetensors"), main=import_main)
    assert r.returncode == 0, r.stderr
    assert "folded 50 BatchNorm layers" in r.stdout and "mobilefacenet-affine" in r.stdout
    xi, meta = load_checkpoint(tmp_path / "xi.safetensors")
    x = _images(2)
    with torch.no_grad():
        assert (xi(x).embedding - bn_net(x)).abs().max().item() <= 1e-5
