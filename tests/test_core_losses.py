"""FedFS (Eq. 2–9) and FedUV (Eq. 4, Lemma 1) losses against hand values and properties."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedfs_sdk.errors import InputError
from fedfs_sdk.training.losses import (FedFSLossConfig, adaptive_soft_labels, combine, f_insub, f_reg, f_total,
                              feduv_neg_loss, feduv_pos_loss, insub_logits, resolve_k, uv_score)
from fedfs_sdk.nn.model import scale_to_sqrt_c



@pytest.fixture(autouse=True)
def _float64():
    """Hand values are checked in float64; restored so other modules see float32."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# ---------------------------------------------------------------- FedUV ----------

def _pm1(c: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (c,), generator=g).double() * 2 - 1


def test_lemma1_lpos_zero_iff_output_equals_codeword() -> None:
    c = 127
    v = _pm1(c, 0)
    assert feduv_pos_loss(scale_to_sqrt_c(v[None]), v).item() == pytest.approx(0.0, abs=1e-12)
    # any other direction with norm √c has ℓ_pos > 0
    for seed in range(5):
        z = scale_to_sqrt_c(v[None] + 0.3 * torch.randn(1, c, generator=torch.Generator().manual_seed(seed)))
        assert feduv_pos_loss(z, v).item() > 1e-6
    # the scaled positive multiple 2v is mapped back to v by σ: still zero
    assert feduv_pos_loss(scale_to_sqrt_c(2.0 * v[None]), v).item() == pytest.approx(0.0, abs=1e-12)
    # a flipped bit: 1 − (c−2)/c = 2/c exactly
    w = v.clone()
    w[3] = -w[3]
    assert feduv_pos_loss(w[None], v).item() == pytest.approx(2.0 / c)


def test_sigma_scales_to_sqrt_c() -> None:
    z = torch.randn(4, 255)
    assert torch.allclose(scale_to_sqrt_c(z).norm(dim=1), torch.full((4,), math.sqrt(255)))


def test_lpos_hand_value_and_hinge() -> None:
    v = torch.tensor([1.0, -1.0, 1.0, 1.0])
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 1.0, 1.0]])   # both norm 2 = √4
    assert uv_score(s, v).tolist() == pytest.approx([0.5, 1.0])
    assert feduv_pos_loss(s, v).item() == pytest.approx((0.5 + 0.0) / 2)


def test_lneg_is_max_correlation_with_other_codewords() -> None:
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    others = torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, 1.0, -1.0]])
    assert feduv_neg_loss(s, others).item() == pytest.approx(0.5)


# ---------------------------------------------------------------- FedFS ----------

def test_combine_concat_and_sum() -> None:
    r, q = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    assert combine(r, q, "concat").tolist() == [[1.0, 2.0, 3.0, 4.0]]
    assert combine(r, q, "sum").tolist() == [[4.0, 6.0]]
    assert FedFSLossConfig(combine="concat").projection_dim(128) == 64
    assert FedFSLossConfig(combine="sum").projection_dim(128) == 128
    with pytest.raises(InputError):
        FedFSLossConfig(combine="concat").projection_dim(127)


def test_resolve_k_ratio_and_count() -> None:
    assert resolve_k(4, 32) == 4          # count ("K is set to 4")
    assert resolve_k(0.25, 32) == 8       # ratio of the batch ("K ratio")
    assert resolve_k(0.01, 32) == 1       # never 0
    assert resolve_k(4, 3) == 3           # never more than the batch


@pytest.mark.parametrize("top_k,n,k", [(0.28, 25, 7), (0.07, 100, 7), (0.14, 50, 7), (0.7, 10, 7),
                                       (0.3, 10, 3), (0.29, 25, 8), (0.999, 1000, 999)])
def test_resolve_k_ratio_is_exact(top_k: float, n: int, k: int) -> None:
    """⌈K·N⌉ of the decimal written: 0.28·25 is 7.000000000000001 in floats (ceil → 8)."""
    assert resolve_k(top_k, n) == k
    assert resolve_k(np.float32(top_k), n) == k and resolve_k(np.float64(top_k), n) == k


@pytest.mark.parametrize("top_k,n", [(0.28, 25), (0.07, 100), (0.14, 50), (0.3, 7), (0.5, 9)])
def test_tensor_k_agrees_with_resolve_k_padded_or_not(top_k: float, n: int) -> None:
    """The in-graph K (counting, per-client n_real under padding) is resolve_k's: α equals the
    loop reference with K = resolve_k(K, N), with and without padding."""
    rng = np.random.default_rng(n)
    z, v = rng.normal(size=(n, 6)), rng.normal(size=(n, 6))
    k = resolve_k(top_k, n)
    ref = _soft_labels_reference(z, v, k, 2.0)
    plain = adaptive_soft_labels(torch.from_numpy(z), torch.from_numpy(v), top_k, 2.0)
    np.testing.assert_allclose(plain.numpy(), ref, rtol=1e-12)
    if (top_k, n) in ((0.28, 25), (0.07, 100)):          # K = 8 would be a different α
        assert not np.allclose(_soft_labels_reference(z, v, k + 1, 2.0), ref)
    pad = rng.normal(size=(5, 6))
    mask = torch.tensor([True] * n + [False] * 5)
    padded = adaptive_soft_labels(torch.from_numpy(np.concatenate([z, pad])),
                                  torch.from_numpy(np.concatenate([v, pad])), top_k, 2.0, mask=mask)
    np.testing.assert_allclose(padded[:n, :n].numpy(), ref, rtol=1e-12, atol=1e-15)


def test_soft_labels_rows_sum_to_one_and_gamma_raises_diagonal() -> None:
    g = torch.Generator().manual_seed(1)
    z, v = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    # positive, moderate diagonal scores: γ > 1 raises them without saturating the softmax
    z, v = 0.3 * z, 0.3 * (v + 2 * z)
    a1 = adaptive_soft_labels(z, v, top_k=2, gamma=1.0)
    a3 = adaptive_soft_labels(z, v, top_k=2, gamma=3.0)
    assert torch.allclose(a1.sum(1), torch.ones(6))
    assert torch.allclose(a3.sum(1), torch.ones(6))
    assert (a3.diagonal() > a1.diagonal()).all()


def _soft_labels_reference(z: np.ndarray, v: np.ndarray, k: int, gamma: float) -> np.ndarray:
    """Eq. 5–6 with explicit loops, read straight from the paper."""
    n = z.shape[0]
    ass = np.array([[z[i] @ v[j] for j in range(n)] for i in range(n)])
    beta = np.zeros((n, n))
    for j in range(n):
        column = ass[:, j]
        top = set(np.argsort(-column, kind="stable")[:k])
        for i in range(n):
            if i == j:
                beta[i, j] = ass[i, j] * gamma
            elif i in top:
                beta[i, j] = ass[i, j]
    col_softmax = np.exp(beta) / np.exp(beta).sum(axis=0, keepdims=True)
    return col_softmax.T


def test_soft_labels_match_loop_reference() -> None:
    rng = np.random.default_rng(3)
    z, v = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    ours = adaptive_soft_labels(torch.from_numpy(z), torch.from_numpy(v), top_k=2, gamma=2.0).numpy()
    np.testing.assert_allclose(ours, _soft_labels_reference(z, v, 2, 2.0), rtol=1e-12)


def test_no_gradient_flows_through_alpha() -> None:
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 6, generator=g, requires_grad=True)
    v = torch.randn(5, 6, generator=g)
    alpha = adaptive_soft_labels(z, v)
    assert not alpha.requires_grad
    cfg = FedFSLossConfig(top_k=2)
    loss = f_insub(z, v, cfg)
    (grad,) = torch.autograd.grad(loss, z)
    # reference: same loss with α as a constant computed outside the graph
    z2 = z.detach().clone().requires_grad_(True)
    a = adaptive_soft_labels(z2.detach(), v, cfg.top_k, cfg.gamma)
    logits = insub_logits(z2, v, cfg.logits, cfg.logit_scale)
    ref = -(a * F.log_softmax(logits, -1)).sum(-1).mean()
    (grad_ref,) = torch.autograd.grad(ref, z2)
    assert torch.allclose(grad, grad_ref)


def test_f_insub_hand_computed_3x3() -> None:
    """z = v = I₃, γ = 2, s = 1: α_ii = e²/(e²+2), α_ij = 1/(e²+2); logits = I, so
    F_insub = log(e + 2) − e²/(e² + 2) for every anchor."""
    eye = torch.eye(3)
    cfg = FedFSLossConfig(logits="similarity", logit_scale=1.0, top_k=1, gamma=2.0)
    expected = math.log(math.e + 2) - math.e**2 / (math.e**2 + 2)
    assert f_insub(eye, eye, cfg).item() == pytest.approx(expected, rel=1e-12)
    # the pieces: α by Eq. 5–6 (top-1 of each column is the diagonal itself, others get β = 0)
    e2 = math.e ** 2
    alpha_hand = torch.full((3, 3), 1 / (e2 + 2), dtype=torch.float64).fill_diagonal_(e2 / (e2 + 2))
    assert torch.allclose(adaptive_soft_labels(eye.double(), eye.double(), top_k=1, gamma=2.0), alpha_hand,
                          rtol=0, atol=1e-12)
    assert torch.allclose(insub_logits(eye, eye, "similarity", 1.0), eye, rtol=0, atol=1e-6)
    # the literal Eq. 3 logits are 1 − cos = 1 − I: the diagonal logit is the *smallest*
    lit = FedFSLossConfig(logits="literal", top_k=1, gamma=2.0)
    lit_expected = math.log(2 * math.e + 1) - (2 / (math.e**2 + 2))
    assert f_insub(eye, eye, lit).item() == pytest.approx(lit_expected, rel=1e-12)


def test_literal_logits_push_matching_pairs_apart() -> None:
    """Minimizing Eq. 7 with literal Eq. 3 lowers cos(z_i, v_i); the intended reading raises it."""
    g = torch.Generator().manual_seed(4)
    # large dot products make α ≈ I (γ = 2 dominates), isolating the effect of the logits
    v = 2 * torch.randn(6, 8, generator=g)
    z0 = v + 1.0 * torch.randn(6, 8, generator=g)

    def diag_cos_after_steps(mode: str) -> float:
        z = z0.clone().requires_grad_(True)
        cfg = FedFSLossConfig(logits=mode, top_k=1, gamma=2.0)
        for _ in range(10):
            loss = f_insub(z, v, cfg)
            (gz,) = torch.autograd.grad(loss, z)
            z = (z - 0.2 * gz).detach().requires_grad_(True)
        return F.cosine_similarity(z, v).mean().item()

    start = F.cosine_similarity(z0, v).mean().item()
    assert diag_cos_after_steps("similarity") > start
    assert diag_cos_after_steps("literal") < start


def test_f_reg_is_one_minus_cosine() -> None:
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    q = torch.tensor([[0.0, 2.0], [2.0, 2.0]])
    assert f_reg(r, q).item() == pytest.approx((1.0 + 0.0) / 2)
    rr, qq = torch.randn(7, 5), torch.randn(7, 5)
    assert f_reg(rr, qq).item() == pytest.approx((1 - F.cosine_similarity(rr, qq)).mean().item())


def test_f_total_is_lambda_mix() -> None:
    g = torch.Generator().manual_seed(5)
    rp, qp = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    r, q, v = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 6, generator=g)
    cfg = FedFSLossConfig(lam=0.7)
    total, parts = f_total(rp, qp, r, q, v, cfg)
    assert total.item() == pytest.approx(0.7 * parts["F_insub"].item() + 0.3 * parts["F_reg"].item())
    with pytest.raises(InputError, match="proj_dim"):
        f_total(rp, qp, r, q, torch.randn(4, 8), cfg)


def test_sum_and_concat_readings_differ() -> None:
    g = torch.Generator().manual_seed(6)
    r, q = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    v12, v6 = torch.randn(4, 12, generator=g), torch.randn(4, 6, generator=g)
    a = f_insub(combine(r, q, "concat"), v12, FedFSLossConfig(combine="concat"))
    b = f_insub(combine(r, q, "sum"), v6, FedFSLossConfig(combine="sum"))
    assert torch.isfinite(a) and torch.isfinite(b) and a.item() != pytest.approx(b.item())


def test_mask_equals_dropping_padded_samples() -> None:
    g = torch.Generator().manual_seed(7)
    rp, qp = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    r, q, v = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, 8, generator=g)
    mask = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    cfg = FedFSLossConfig(top_k=2)
    full, _ = f_total(rp, qp, r, q, v, cfg, mask=mask)
    cut, _ = f_total(rp[:4], qp[:4], r[:4], q[:4], v[:4], cfg)
    assert full.item() == pytest.approx(cut.item(), rel=1e-9)
    s = scale_to_sqrt_c(torch.randn(6, 127, generator=g))
    code = _pm1(127, 1)
    assert feduv_pos_loss(s, code, mask).item() == pytest.approx(feduv_pos_loss(s[:4], code).item())


@pytest.mark.parametrize("top_k", [0.5, 0.3, 0.28, 4])
def test_padding_does_not_change_soft_labels_or_k(top_k: float) -> None:
    """The batched simulator pads a client's batch and passes a mask: α over the real rows
    must be the unpadded α — in particular K < 1 is a ratio of the *real* batch."""
    from fedfs_sdk.training.losses.fedfs import adaptive_soft_labels

    g = torch.Generator().manual_seed(3)
    z, v = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    pad = torch.randn(3, 16, generator=g)
    mask = torch.tensor([1.0] * 5 + [0.0] * 3)
    plain = adaptive_soft_labels(z, v, top_k)
    padded = adaptive_soft_labels(torch.cat([z, pad]), torch.cat([v, pad]), top_k, mask=mask)
    assert torch.allclose(padded[:5, :5], plain, atol=1e-6)
    cfg = FedFSLossConfig(top_k=top_k)
    assert float(f_insub(torch.cat([z, pad]), torch.cat([v, pad]), cfg, mask)) == pytest.approx(
        float(f_insub(z, v, cfg)), rel=1e-5)
