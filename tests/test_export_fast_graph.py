"""The fused inference graph (issue 13, defect 10) and the int8 export's numerics check.

``export_onnx`` writes :func:`export.inference_graph.inference_twin` of the verifier: the same
parameters under the same names, InstanceNormalization/BatchNormalization/PRelu instead of
the ORT-trainable primitives. These tests hold it to what the primitive graph guaranteed —
same function as torch, same model id, personalized weights swap in by name — and check the
int8 export's float/int8 split and its refusal to ship a model that moves scores too far.
No timing is asserted (shared machine); ``benchmarks/export_latency.py`` measures speed.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export.inference_graph import inference_twin
from export.onnx_inference import export_onnx, onnx_vs_torch
from export.quantize import Int8NumericsError, fp32_convs, quantize_int8, split_calibration
from export.score_bounds import decision_flip_rate, score_change_bound
from fedfs_sdk.nn.backbones.layers import ChannelAffine, GroupNormP, PReLUP
from fedfs_sdk.nn.checkpoint import model_id_of
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.onnx_backend import OnnxBackend

from conftest_export import faces


def _verifier(backbone: str, seed: int = 0) -> VerifierNet:
    torch.manual_seed(seed)
    m = FaceNet(ModelConfig(backbone, code_length=127)).eval()
    with torch.no_grad():   # non-trivial norm/PReLU parameters (fresh ones are all 1, 0, 0.25)
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return VerifierNet(m.backbone, m.uv_head).eval()


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet", "mobilefacenet-affine"])
def test_twin_has_the_same_parameters_and_function(backbone) -> None:
    v = _verifier(backbone)
    twin = inference_twin(v)
    assert not any(isinstance(m, (GroupNormP, PReLUP, ChannelAffine)) for m in twin.modules())
    assert any(isinstance(m, (GroupNormP, ChannelAffine)) for m in v.modules())        # original untouched
    assert model_id_of(twin.state_dict()) == model_id_of(v.state_dict())
    s = v.input_size
    x = torch.from_numpy(np.random.default_rng(1).uniform(-1, 1, (3, 3, s, s)).astype(np.float32))
    with torch.no_grad():
        for a, b in zip(v(x), twin(x)):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet"])
def test_fused_onnx_has_fused_ops_and_torch_parity(tmp_path, backbone) -> None:
    v = _verifier(backbone, seed=3)
    path = export_onnx(v, tmp_path / "v.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    n_norms = sum(isinstance(m, GroupNormP) for m in v.modules())
    assert ops.count("InstanceNormalization") == n_norms and ops.count("BatchNormalization") == n_norms
    assert ops.count("PRelu") == sum(isinstance(m, PReLUP) for m in v.modules())
    assert "ReduceMean" not in ops and "Neg" not in ops and "Shape" not in ops   # no primitive norm/PReLU, static reshapes
    assert OnnxBackend(path).model_id == model_id_of(v.state_dict())
    assert max(onnx_vs_torch(v, path).values()) <= 1e-4
    prim = export_onnx(v, tmp_path / "prim.onnx", fused=False)
    assert "ReduceMean" in {n.op_type for n in onnx.load(str(prim)).graph.node}
    assert OnnxBackend(prim).model_id == OnnxBackend(path).model_id


def test_personalized_weights_swap_into_the_fused_graph(tmp_path) -> None:
    """A device runs its own θ_c through the exported file (OnnxBackend(weights=…)): the fused
    graph must still take every parameter by its state-dict name, norms and PReLUs included."""
    v, mine = _verifier("tiny", seed=4), _verifier("tiny", seed=5)
    path = export_onnx(v, tmp_path / "v.onnx")
    weights = {k: t.numpy() for k, t in mine.state_dict().items()}
    backend = OnnxBackend(path, weights=weights)
    assert backend.model_id == model_id_of(mine.state_dict()) != model_id_of(v.state_dict())
    x, _ = faces(2, 3, seed=6)
    with torch.no_grad():
        want = mine(torch.from_numpy(x))
    got = backend.run(x)
    assert np.abs(got["embedding"] - want[0].numpy()).max() < 1e-4
    assert np.abs(got["uv"] - want[1].numpy()).max() < 1e-4


def test_int8_quantizes_only_the_dense_inner_convolutions(tmp_path) -> None:
    v = _verifier("mobilefacenet", seed=8)
    fp32 = export_onnx(v, tmp_path / "v.onnx")
    calib = faces(8, 2, size=112, seed=9)[0]
    info = quantize_int8(fp32, tmp_path / "v.int8.onnx", calib)     # 4 check images: measured, not enforced
    model = onnx.load(str(tmp_path / "v.int8.onnx"))
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    dq_out = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    quantized = {n.name for n in convs if n.input[1] in dq_out}
    kept = set(info["excluded_nodes"])
    assert quantized and quantized.isdisjoint(kept) and quantized | kept == {n.name for n in convs}
    # MobileFaceNet: 50 convs = first + 17 depthwise (16 + GDC) + 31 dense 1×1 + the embedding projection
    assert len(kept) == 19 and len(quantized) == 31
    groups = {n.name: next((a.i for a in n.attribute if a.name == "group"), 1) for n in convs}
    assert all(groups[n] == 1 for n in quantized)
    assert convs[0].name in kept and convs[-1].name in kept
    check = info["check"]
    assert check["held_out"] and check["images"] == 4 and info["calibration_images"] == 12
    assert check["enforced"] is False and set(check["decision_flip_rate"]) == {"embedding", "uv"}
    assert 0 < max(check["max_score_change"].values()) < 1
    assert fp32_convs(onnx.load(str(fp32))).keys() == kept


def test_int8_export_refuses_a_model_that_decides_unlike_fp32(tmp_path) -> None:
    """Calibrated on black images with one hot pixel, checked on the held-out faces (every 4th
    image): the group norms turn the pixel into activation spikes, the uint8 ranges fitted to
    them leave the faces' activations few levels, and more decisions flip (measured 2.9 %) than
    with face calibration (1.25 %); at a 2 % limit the first is refused with no file written."""
    v = _verifier("tiny", seed=10)
    fp32 = export_onnx(v, tmp_path / "v.onnx")
    held_out = faces(4, 2, seed=11)[0]
    x = np.zeros((32, 3, 32, 32), np.float32)
    x[:, :, 16, 16] = 1.0
    x[3::4] = held_out
    dst = tmp_path / "v.int8.onnx"
    with pytest.raises(Int8NumericsError, match=r"decides .* % of accept/reject decisions unlike fp32 .* "
                                                r"limit 2 %\) on 8 held-out calibration images"):
        quantize_int8(fp32, dst, x, max_flip_rate=0.02)
    assert not dst.exists()
    good = faces(8, 4, seed=11)[0]
    good[3::4] = held_out
    ok = quantize_int8(fp32, dst, good, max_flip_rate=0.02)
    assert ok["check"]["enforced"] and max(ok["check"]["decision_flip_rate"].values()) <= 0.02
    assert dst.exists()


def test_split_calibration_holds_out_every_fourth_image() -> None:
    x = np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1)
    calib, check, held = split_calibration(x)
    assert held and check.ravel().tolist() == [3, 7] and calib.ravel().tolist() == [0, 1, 2, 4, 5, 6, 8, 9]
    small = x[:7]
    assert split_calibration(small)[2] is False


def test_score_change_bounds_by_hand() -> None:
    c = 4
    want = np.ones((2, c))                      # ‖uv‖ = √c = 2
    have = want.copy()
    have[1, 0] += 0.4                           # ‖Δuv‖ = 0.4 → |Δ vᵀuv / c| ≤ 0.4 / √4 = 0.2 for every ±1 v
    assert score_change_bound("uv", have, want) == pytest.approx(0.2)
    v = np.array([1, 1, 1, 1.0])                # the codeword that attains it
    assert abs((have[1] - want[1]) @ v / c) == pytest.approx(0.1)   # 0.4/4 ≤ 0.2
    e = np.array([[1.0, 0.0]])
    assert score_change_bound("embedding", np.array([[0.0, 3.0]]), e) == pytest.approx(2 * np.sqrt(2))
    assert score_change_bound("embedding", 5 * e, e) == 0.0                       # scale-free
    assert score_change_bound("uv", np.array([[np.nan] * c, [1.0] * c]), want) == float("inf")


def test_decision_flip_rate_by_hand() -> None:
    want = np.array([[0.0, 1.0], [1.0, 0.2], [1.0, 1.3], [1.0, -1.9]])     # 6 pairs, no tied cosines
    assert decision_flip_rate("embedding", 4 * want, want) == 0.0            # scale: same cosines, same decisions
    assert decision_flip_rate("uv", want[[1, 0, 2, 3]], want) > 0             # swapped images decide differently
    assert decision_flip_rate("uv", np.full_like(want, np.nan), want) == 1.0
    assert decision_flip_rate("embedding", want[:1], want[:1]) == 0.0         # one image: no pair to decide
