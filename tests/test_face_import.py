"""Bring your own face model (fedfs_sdk.face_import): an insightface-style ONNX exported by the
test itself imports back with embeddings within 1e-5; a torch state dict maps by name or by
shape order with BatchNorm statistics reported; a foreign graph is refused; the result is a
fedfs checkpoint that loads as ξ."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from fedfs_sdk.backbones.layers import GroupNormP, PReLUP
from fedfs_sdk.checkpoint import load_checkpoint
from fedfs_sdk.errors import InputError
from fedfs_sdk.face_import import (import_onnx, import_state_dict, map_onto, read_state_dict,
                                   save_imported)
from fedfs_sdk.model import FaceNet, ModelConfig


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


def test_a_batchnorm_graph_is_refused_with_the_reason(tmp_path: Path) -> None:
    # insightface's MobileFaceNet uses BatchNorm (folded into the convolutions on export)
    net = copy.deepcopy(_trained_like(1).backbone)
    for name, mod in list(net.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, GroupNormP):
                bn = nn.BatchNorm2d(child.num_channels) if cname != "embed_norm" else nn.BatchNorm1d(child.num_channels)
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 2.0)
                setattr(mod, cname, bn)
    path = _export(_EmbeddingOnly(net.eval()), tmp_path / "bn.onnx")
    with pytest.raises(InputError, match="not the project's MobileFaceNet"):
        import_onnx(path)


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
    model, rep = import_state_dict(renamed)
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
    bad = subprocess.run(cmd + [str(tmp_path / "part.pth"), "--out", str(tmp_path / "p.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "embed_norm.bias" in bad.stderr and "--partial" in bad.stderr
    assert not (tmp_path / "p.safetensors").exists()
    part = subprocess.run(cmd + [str(tmp_path / "part.pth"), "--out", str(tmp_path / "p.safetensors"), "--partial"],
                          capture_output=True, text=True, timeout=300)
    assert part.returncode == 0 and "model keys left at their initial values: embed_norm.bias" in part.stdout
