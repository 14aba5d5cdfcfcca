"""Primitive-built layers and backbones: numerics, gradients, vmap, profile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from fedfs_sdk.nn.backbones import GroupNormP, PReLUP, get_backbone, layers
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.nn.profile import profile_model


def forward(layer: torch.nn.Module, x: torch.Tensor, path: str) -> torch.Tensor:
    """``layer(x)`` eagerly (native kernels) or through a traced graph (the primitives every
    runtime differentiates, as in the ONNX / ORT training / Core ML exports)."""
    if path == "eager":
        return layer(x)
    return torch.jit.trace(layer, (x,), check_trace=False)(x)


@pytest.mark.parametrize("path", ["eager", "traced"])
def test_groupnorm_p_equals_torch_group_norm(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 5, 5, generator=g)
    layer = GroupNormP(4, 8)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, generator=g))
        layer.bias.copy_(torch.randn(8, generator=g))
    ref = F.group_norm(x, 4, layer.weight, layer.bias, eps=layer.eps)
    assert torch.allclose(forward(layer, x, path), ref, atol=1e-5)


@pytest.mark.parametrize("path", ["eager", "traced"])
def test_groupnorm_p_is_per_sample(path: str) -> None:
    """A sample's output does not depend on the rest of the batch (unlike BatchNorm)."""
    x = torch.randn(4, 8, 3, 3)
    layer = GroupNormP(2, 8)
    assert torch.allclose(forward(layer, x, path)[:1], forward(layer, x[:1], path), atol=1e-6)


@pytest.mark.parametrize("path", ["eager", "traced"])
def test_prelu_p_equals_torch_prelu(path: str) -> None:
    x = torch.randn(2, 6, 4, 4)
    layer = PReLUP(6, init=0.1)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-0.5, 0.5, 6))
    assert torch.allclose(forward(layer, x, path), F.prelu(x, layer.weight), atol=1e-6)


@pytest.mark.parametrize(("layer", "native"), [(GroupNormP(2, 4), "group_norm"), (PReLUP(4), "prelu")])
def test_traced_graphs_hold_primitives_and_eager_uses_the_native_kernel(layer: torch.nn.Module, native: str) -> None:
    """Traced (what every export sees): no native op, which ORT training could not differentiate.
    Eager: the native op (the fast path of device training and the simulator)."""
    x = torch.randn(2, 4, 3, 3)
    assert f"aten::{native}" not in str(torch.jit.trace(layer, (x,), check_trace=False).graph)
    with torch.autograd.profiler.profile() as prof:
        layer(x)
    assert any(native in e.name for e in prof.function_events), [e.name for e in prof.function_events]


@pytest.mark.parametrize("path", ["native", "primitives"])
@pytest.mark.parametrize("layer", [GroupNormP(2, 4), PReLUP(4)])
def test_custom_layers_gradcheck(layer: torch.nn.Module, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """autograd vs central finite differences, inputs and parameters (float64), through the
    native kernels and through the primitives a traced graph holds (what ORT differentiates)."""
    if path == "primitives":
        monkeypatch.setattr(layers, "tracing", lambda: True)
    layer = layer.double()
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    params = tuple(p for p in layer.parameters())

    def f(inp, *ps):
        return functional_call(layer, {n: p for (n, _), p in zip(layer.named_parameters(), ps)}, (inp,))

    # PReLU's kink at 0 is measure-zero for random inputs
    assert torch.autograd.gradcheck(f, (x, *[p.detach().clone().requires_grad_(True) for p in params]),
                                    eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name,size,dim", [("tiny", 32, 64), ("feduv_cnn", 64, 1024), ("mobilefacenet", 112, 128)])
def test_backbone_shapes(name: str, size: int, dim: int) -> None:
    m = get_backbone(name).eval()
    assert (m.input_size, m.embedding_dim) == (size, dim)
    with torch.no_grad():
        assert m(torch.randn(2, 3, size, size)).shape == (2, dim)


def test_mobilefacenet_size_matches_paper() -> None:
    """Chen et al. 2018: ~0.99M parameters, ~221M multiply-adds at 112×112."""
    p = profile_model(ModelConfig("mobilefacenet"))
    assert 0.95e6 < p.params < 1.05e6
    assert 215 < p.mflops / 2 < 230


def test_mobilefacenet_512_embedding() -> None:
    m = FaceNet(ModelConfig("mobilefacenet", embedding_dim=512)).eval()
    with torch.no_grad():
        assert m(torch.randn(1, 3, 112, 112)).embedding.shape == (1, 512)


def test_unknown_backbone() -> None:
    with pytest.raises(InputError, match="unknown backbone 'resnet'"):
        get_backbone("resnet")


def test_vmap_over_clients_matches_loop() -> None:
    """Stacked per-client weights through functional_call + vmap equal a per-client loop."""
    model = FaceNet(ModelConfig("tiny", proj_dim=16, code_length=127)).eval()
    states = []
    for seed in range(3):
        torch.manual_seed(seed)
        states.append({k: v for k, v in FaceNet(ModelConfig("tiny", proj_dim=16, code_length=127)).state_dict().items()})
    stacked = {k: torch.stack([s[k] for s in states]) for k in states[0]}
    x = torch.randn(3, 4, 3, 32, 32)
    batched = vmap(lambda p, xb: functional_call(model, p, (xb,)).uv)(stacked, x)
    for i, s in enumerate(states):
        model.load_state_dict(s)
        assert torch.allclose(batched[i], model(x[i]).uv, atol=1e-5)


def test_model_config_bounds_every_size() -> None:
    """A config also comes from checkpoint headers: bad sizes are refused before allocation."""
    from fedfs_sdk.errors import InputError
    from fedfs_sdk.nn.model import ModelConfig

    for bad in (dict(embedding_dim=-1), dict(embedding_dim=10**6), dict(code_length=128), dict(code_length=True),
                dict(width=0), dict(input_size=4096), dict(proj_dim="8"), dict(backbone=["tiny"])):
        with pytest.raises(InputError):
            ModelConfig(**bad)
    with pytest.raises(InputError, match="JSON"):
        ModelConfig.from_json("[" * 5000)
    assert ModelConfig("mobilefacenet", code_length=511, proj_dim=64).resolved().embedding_dim == 128


# ---- l2_normalize / FedUV σ: overflow-proof in any precision (issue 13, defect 2) ------------

def _old_l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e3, 1e15])
def test_l2_normalize_is_x_over_its_norm_at_every_scale(scale: float) -> None:
    from fedfs_sdk.nn.backbones.layers import l2_normalize_scaled as l2_normalize

    x = torch.randn(6, 127, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale
    want = x / x.norm(dim=-1, keepdim=True)                      # float64 reference
    got = l2_normalize(x.float())
    assert torch.allclose(got.double(), want, rtol=0, atol=5e-7)  # a few float32 ulps of entries ≤ 1
    # float64: the only difference is ε = 1e-12 added to ‖u‖² ≥ 1 (relative ≤ 5e-13)
    assert torch.allclose(l2_normalize(x, dim=0), x / x.norm(dim=0, keepdim=True), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_l2_normalize_does_not_overflow_in_half_precision(dtype: torch.dtype) -> None:
    """‖x‖² = 1.3e8 ≫ fp16's 65504: the old Σx² overflowed to inf and σ returned 0."""
    from fedfs_sdk.nn.backbones import l2_normalize
    from fedfs_sdk.nn.model import scale_to_sqrt_c

    x = torch.randn(8, 511, generator=torch.Generator().manual_seed(2)) * 500
    want = x / x.norm(dim=-1, keepdim=True)
    got = l2_normalize(x.to(dtype)).float()
    assert torch.isfinite(got).all()
    assert torch.allclose(got.norm(dim=-1), torch.ones(8), atol=1e-2)
    assert (got - want).abs().max() < (2e-3 if dtype == torch.float16 else 1e-2)
    assert torch.allclose(scale_to_sqrt_c(x.to(dtype)).float().norm(dim=-1), torch.full((8,), 511 ** 0.5), rtol=1e-2)
    if dtype == torch.float16:                                       # the defect this guards against
        assert _old_l2_normalize(x.half()).abs().max() == 0


def test_l2_normalize_keeps_zero_at_zero() -> None:
    from fedfs_sdk.nn.backbones.layers import l2_normalize, l2_normalize_scaled

    assert torch.equal(l2_normalize_scaled(torch.zeros(2, 5)), torch.zeros(2, 5))   # exactly 0/tiny: no NaN
    assert torch.equal(l2_normalize(torch.zeros(2, 5)), torch.zeros(2, 5))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_l2_normalize_gradcheck(scale: float) -> None:
    """The detached mean magnitude leaves the gradient of x/‖x‖ exact (finite differences)."""
    from fedfs_sdk.nn.backbones.layers import l2_normalize_scaled as l2_normalize

    x = (torch.randn(3, 9, dtype=torch.float64) * scale).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: l2_normalize(t), (x,), eps=1e-6 * scale, atol=1e-5)
    w = torch.randn(3, 9, dtype=torch.float64)
    (g,) = torch.autograd.grad((l2_normalize(x) * w).sum(), x)
    (g_exact,) = torch.autograd.grad((x / x.norm(dim=-1, keepdim=True) * w).sum(), x)
    assert torch.allclose(g, g_exact, rtol=1e-9, atol=1e-9 / scale)


def test_l2_normalize_scaled_form_is_what_traced_graphs_and_half_precision_get() -> None:
    from fedfs_sdk.nn.backbones.layers import l2_normalize

    class Sigma(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return l2_normalize(x)

    ops = {n.kind() for n in torch.jit.trace(Sigma(), torch.ones(2, 7)).graph.nodes()}
    assert "aten::abs" in ops                                       # traced: the scaled form
    x = torch.randn(3, 7) * 300
    assert torch.isfinite(l2_normalize(x.half())).all()              # fp16 eager: the scaled form


def test_l2_normalize_onnx_does_not_overflow_in_float32(tmp_path) -> None:
    """The exported graph (ONNX Runtime, fp32) at ‖x‖² = 1e42 > float32's 3.4e38."""
    import warnings

    import numpy as np
    import onnxruntime as ort

    from fedfs_sdk.nn.backbones import l2_normalize

    class Sigma(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return l2_normalize(x)

    path = tmp_path / "sigma.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Sigma(), (torch.ones(2, 127),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    x = np.random.default_rng(3).standard_normal((4, 127)) * 1e20
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.astype(np.float32)})[0]
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, x / np.linalg.norm(x, axis=1, keepdims=True), rtol=0, atol=5e-7)
