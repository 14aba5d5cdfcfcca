"""Core ML fp16 numerics (issue 13, defect 2): an overflow-proof FedUV σ, a faithful fp16
reference that executes the saved ML Program, and an export that refuses a drifting program.

The head is scaled so ‖W g‖² ≥ 1e6 — far above fp16's 65504 — as after a real round of
MobileFaceNet fedfs+feduv (median 2.6e6 in the issue). The MobileFaceNet figures (100 genuine
+ 100 impostor) come from ``benchmarks/export_fp16_parity.py`` (docs/export.md); here the tiny
backbone keeps the tests fast.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import fedfs_sdk.nn.model as model_mod
from export.coreml import CoreMLNumericsError, check_coreml_numerics, export_coreml, validate_coreml
from export.coreml_reference import CoreMLReference
from export.parity import decide, disagreements, owner_codeword
from fedfs_sdk.nn.backbones.layers import GroupNormP, PReLUP
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet

from conftest_export import faces

C = 127


def _old_l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """The formula before issue 13: Σx² overflows fp16 once ‖x‖ > 256."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def trained_like_norms(model: torch.nn.Module) -> int:
    """Give every norm a trained model's affine (γ ≠ 1, β ≠ 0) and every PReLU its own slopes:
    with the init values (γ = 1, β = 0) coremltools drops the affine as identity, and a
    trained model's program (MIL ``batch_norm`` ops) would go untested."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, GroupNormP):
            mod.weight.uniform_(0.5, 1.5)
            mod.bias.normal_(0.0, 0.2)
            n += 1
        elif isinstance(mod, PReLUP):
            mod.weight.uniform_(0.05, 0.4)
    return n


@functools.lru_cache(maxsize=None)
def huge_head_verifier() -> VerifierNet:
    torch.manual_seed(5)
    m = FaceNet(ModelConfig("tiny", proj_dim=32, code_length=C)).eval()
    x, _ = data()
    with torch.no_grad():
        trained_like_norms(m)
        wg = m.backbone(torch.from_numpy(x)) @ m.uv_head.weight.t()
        m.uv_head.weight.mul_(float((4e6 / (wg * wg).sum(1).min()).sqrt()))   # every image ≥ 4e6
    return VerifierNet(m.backbone, m.uv_head).eval()


@functools.lru_cache(maxsize=None)
def data() -> tuple[np.ndarray, np.ndarray]:
    """Owner = identity 0 (30 images: 10 warm-up, 20 genuine); 20 impostors from 10 others."""
    own, _ = faces(1, 30, seed=11)
    others, _ = faces(10, 2, seed=12)
    return np.concatenate([own, others]), np.array([0] * 30 + [1] * 20)


def pixels(x: np.ndarray) -> np.ndarray:
    return (x * 127.5 + 127.5).astype(np.float32)


@functools.lru_cache(maxsize=None)
def exported(precision: str, tmp: str) -> str:
    path = f"{tmp}/huge.{precision}.mlpackage"
    export_coreml(huge_head_verifier(), path, precision=precision, check_pixels=pixels(data()[0]))
    return path


@pytest.fixture(scope="module")
def tmpdir_module(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("coreml"))


def test_head_is_far_beyond_fp16_range() -> None:
    x, _ = data()
    v = huge_head_verifier()
    with torch.no_grad():
        wg = v.backbone(torch.from_numpy(x)) @ v.uv_head.weight.t()
    assert float((wg * wg).sum(1).min()) >= 1e6 > 65504


def test_fp16_program_keeps_every_decision(tmpdir_module: str) -> None:
    x, labels = data()
    v = huge_head_verifier()
    path = exported("fp16", tmpdir_module)
    got = CoreMLReference(path).run(pixels(x))["uv"]
    with torch.no_grad():
        want = v(torch.from_numpy(x))[1].numpy()
    assert np.allclose(np.linalg.norm(got, axis=1), np.sqrt(C), rtol=5e-3)       # σ: norm √c, not 0
    assert np.linalg.norm(got - want, axis=1).max() / np.sqrt(C) < 0.01
    warm, gen, imp = slice(0, 10), slice(10, 30), slice(30, 50)
    code = owner_codeword(want[warm])
    ref, fp16 = decide(want[warm], want[gen], want[imp], code), decide(got[warm], got[gen], got[imp], code)
    assert disagreements(ref, fp16) == 0
    assert ref.fpr < 1.0                        # the scenario can reject: "accepts everyone" would show


def test_validate_coreml_checks_numerics_not_only_the_spec(tmpdir_module: str) -> None:
    path = exported("fp16", tmpdir_module)
    summary = validate_coreml(path, input_size=32, outputs={"embedding": 64, "uv": C}, precision="fp16",
                              verifier=huge_head_verifier(), pixels=pixels(data()[0][:8]))
    assert summary["numerics"]["images"] == 8
    assert 0 < summary["numerics"]["max_score_change"]["uv"] < 0.01     # fp16 rounding is visible, small
    other = FaceNet(ModelConfig("tiny", proj_dim=32, code_length=C)).eval()    # not the converted weights
    with pytest.raises(CoreMLNumericsError, match="'embedding'.*tolerance"):
        validate_coreml(path, input_size=32, outputs={"embedding": 64, "uv": C},
                        verifier=VerifierNet(other.backbone, other.uv_head), pixels=pixels(data()[0][:4]))


def test_old_sigma_formula_fails_the_fp16_export_loudly(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_mod, "l2_normalize", _old_l2_normalize)     # what the head used before
    path = tmp_path / "old.fp16.mlpackage"
    with pytest.raises(CoreMLNumericsError, match=r"'uv'.*(NaN/Inf|moves verification scores)"):
        export_coreml(huge_head_verifier(), path, precision="fp16", check_pixels=pixels(data()[0][:8]))
    assert not path.exists()                                              # nothing left to ship
    # the same graph in fp32 is fine: the check fails on numerics, not on the graph's shape
    export_coreml(huge_head_verifier(), tmp_path / "old.fp32.mlpackage", precision="fp32",
                  check_pixels=pixels(data()[0][:8]))


def test_reference_of_the_fp32_program_equals_torch(tmpdir_module: str) -> None:
    x, _ = data()
    path = exported("fp32", tmpdir_module)
    ref = CoreMLReference(path)
    got = ref.run(pixels(x[:6]))
    with torch.no_grad():
        e, uv = huge_head_verifier()(torch.from_numpy(x[:6]))
    assert np.abs(got["embedding"] - e.numpy()).max() < 1e-4
    assert np.abs(got["uv"] - uv.numpy()).max() < 1e-4
    one = ref.run(pixels(x[2:3]))                   # a batch evaluates like single images
    assert np.abs(one["uv"] - got["uv"][2:3]).max() < 1e-5


def test_trained_norms_convert_to_batch_norm_ops_the_reference_runs(tmpdir_module: str) -> None:
    """A trained model's norm affine becomes MIL ``batch_norm`` (coremltools fuses the
    per-channel mul + add); the reference ran none before, so every trained model's Core ML
    export failed its own numerics check. Numerics: test_reference_of_the_fp32_program_equals_torch."""
    import coremltools as ct

    spec = ct.utils.load_spec(exported("fp16", tmpdir_module))
    ops = [op.type for f in spec.mlProgram.functions.values()
           for blk in f.block_specializations.values() for op in blk.operations]
    norms = sum(isinstance(m, GroupNormP) for m in huge_head_verifier().modules())
    assert norms > 0 and ops.count("batch_norm") >= norms - 1


def test_reference_stores_in_the_programs_precision(tmpdir_module: str) -> None:
    """fp16 storage is real: the fp16 program's outputs sit on the fp16 grid, fp32's do not."""
    x, _ = data()
    e16 = CoreMLReference(exported("fp16", tmpdir_module)).run(pixels(x[:4]))["embedding"]
    e32 = CoreMLReference(exported("fp32", tmpdir_module)).run(pixels(x[:4]))["embedding"]
    assert np.array_equal(e16, e16.astype(np.float16).astype(np.float32))      # exact: a dtype round trip
    assert not np.array_equal(e32, e32.astype(np.float16).astype(np.float32))


def test_check_refuses_bad_pixels(tmpdir_module: str) -> None:
    from fedfs_sdk.errors import InputError

    with pytest.raises(InputError, match=r"\[N, 3, 32, 32\]"):
        check_coreml_numerics(exported("fp16", tmpdir_module), huge_head_verifier(), np.zeros((2, 32, 32, 3)))
