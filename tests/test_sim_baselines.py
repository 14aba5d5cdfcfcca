"""Baselines: each loss and server step against hand-computed small cases, and each
method's contract with the executors (pure, maskable, vmappable objective; server state)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.func import vmap

from conftest_baselines import EMB, images, make_method, participants, start_params, tiny_xi  # noqa: F401
from device_sim.methods import parse_method
from device_sim.methods.baselines.dplc import gaussian_delta, mean_sensitivity
from device_sim.methods.baselines import (dplc, dplc_sigma, gradient_correction_step, softmax_regularizer,
                                          spreadout_regularizer, spreadout_step)
from device_sim.methods.baselines.common import (arcface_logit, consensus_similarity, cosface_logit,
                                                 init_class_embeddings, positive_loss, unit)
from device_sim.methods.baselines.privacyface import consensus_aware_loss
from device_sim.methods.baselines.server_held import DELTA
from fedfs_sdk.errors import CheckpointError, InputError


def on_circle(*angles: float) -> torch.Tensor:
    return torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=torch.float64)


def tangent(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient through x/‖x‖ at a unit x: the component orthogonal to x."""
    return g - (g @ w) * w


# ---- FedAwS spread-out regularizer (FedUV §3.3) ----------------------------------------------

def test_spreadout_value_and_gradient_on_three_vectors() -> None:
    W = on_circle(0.0, 0.5, 2.0).requires_grad_(True)
    nu = 0.9
    # chord lengths 2 sin(Δ/2): 0.4948 (active), 1.6829 and 1.3633 (beyond ν)
    d01 = 2 * math.sin(0.25)
    assert 2 * math.sin(0.75) > nu and 2 * math.sin(1.0) > nu
    expected = 2 * (nu - d01) ** 2                       # the pair counted as (0,1) and (1,0)
    reg = spreadout_regularizer(W, nu)
    assert float(reg.detach()) == pytest.approx(expected, rel=1e-9)
    (grad,) = torch.autograd.grad(reg, W)
    w = W.detach()
    g0 = -4 * (nu - d01) * (w[0] - w[1]) / d01           # ∂/∂ŵ0 of 2(ν − ‖ŵ0 − ŵ1‖)²
    assert torch.allclose(grad[0], tangent(w[0], g0), atol=1e-9)
    assert torch.allclose(grad[1], tangent(w[1], -g0), atol=1e-9)
    assert torch.allclose(grad[2], torch.zeros(2, dtype=torch.float64))


def test_spreadout_step_pushes_close_pair_apart_and_is_chunk_independent() -> None:
    W = on_circle(0.0, 0.5, 2.0).float()
    full = spreadout_step(W, 0.9, step=0.1, chunk=1024)
    blocks = spreadout_step(W, 0.9, step=0.1, chunk=1)
    assert torch.allclose(full, blocks, atol=1e-6)
    new = unit(full)
    assert float(new[0] @ new[1]) < float(W[0] @ W[1])  # the close pair moved apart
    assert torch.allclose(full[2], W[2])                 # the far one did not move


def test_spreadout_ignores_scale_of_rows_and_identical_rows_stay_finite() -> None:
    W = torch.tensor([[3.0, 0.0], [3.0, 0.0], [0.0, 0.5]])
    reg = spreadout_regularizer(W, 0.9)
    assert float(reg) == pytest.approx(2 * 0.9 ** 2, rel=1e-5)   # identical pair at distance 0
    assert torch.isfinite(spreadout_step(W, 0.9, 1.0)).all()


# ---- FedGC softmax regularizer (FedGC Eq. 5, Alg. 1) -----------------------------------------

def test_fedgc_regularizer_two_client_toy_normalized() -> None:
    s, ang = 4.0, 0.3
    W = on_circle(0.0, ang).requires_grad_(True)
    c = math.cos(ang)
    # each anchor k: −log(e^{s} / (e^{s} + e^{s·c}))
    assert float(softmax_regularizer(W, s).detach()) == pytest.approx(2 * math.log1p(math.exp(s * (c - 1))), rel=1e-9)
    (grad,) = torch.autograd.grad(softmax_regularizer(W, s), W)
    w = W.detach()
    p = math.exp(s * c) / (math.exp(s) + math.exp(s * c))     # p(z | k): the cross-client softmax
    # only the cross-client term reaches W_z (Eq. 11); the self term vanishes on the sphere
    assert torch.allclose(grad[1], tangent(w[1], s * p * w[0]), atol=1e-9)
    assert torch.allclose(grad[0], tangent(w[0], s * p * w[1]), atol=1e-9)
    stepped = unit(gradient_correction_step(W.detach(), s, step=0.5))
    assert float(stepped[0] @ stepped[1]) < c                   # the correction spreads them out


def test_fedgc_regularizer_two_client_toy_raw_dot_products() -> None:
    w1, w2 = torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64)
    W = torch.stack([w1, w2]).requires_grad_(True)
    a11, a22, a12 = float(w1 @ w1), float(w2 @ w2), float(w1 @ w2)
    p1 = math.exp(a11) / (math.exp(a11) + math.exp(a12))      # anchor 1 keeps its class
    p2 = math.exp(a22) / (math.exp(a22) + math.exp(a12))
    assert float(softmax_regularizer(W, 0.0).detach()) == pytest.approx(-math.log(p1) - math.log(p2), rel=1e-9)
    (grad,) = torch.autograd.grad(softmax_regularizer(W, 0.0), W)
    # ∂/∂w1 = −(1 − p1)·w1' (own term) + (1 − p2)·w2' (as the other class of anchor 2)
    assert torch.allclose(grad[0], -(1 - p1) * w1 + (1 - p2) * w2, atol=1e-9)
    assert torch.allclose(grad[1], -(1 - p2) * w2 + (1 - p1) * w1, atol=1e-9)
    assert torch.allclose(gradient_correction_step(W.detach(), 0.0, 0.5, chunk=1), W.detach() - 0.5 * grad)


def test_fedgc_correction_mines_hard_pairs() -> None:
    W = on_circle(0.0, 0.2, 1.4).requires_grad_(True)
    (grad,) = torch.autograd.grad(softmax_regularizer(W, 8.0), W)
    # 0 and 1 are 0.2 rad apart, 2 is ≥ 1.2 rad from both: the close pair gets the larger push
    assert float(grad[0].norm()) > 5 * float(grad[2].norm())


# ---- margins and PrivacyFace's consensus-aware loss (Eq. 2, 3, 5) ----------------------------

@pytest.mark.parametrize("theta,expected_angle", [(0.2, 0.0), (1.3, 0.0), (1.5, 0.2), (2.5, 1.2), (3.0, 1.7)])
def test_consensus_similarity_at_hand_picked_angles(theta: float, expected_angle: float) -> None:
    s, rho = 64.0, 1.3
    mu = consensus_similarity(torch.tensor([math.cos(theta)], dtype=torch.float64), s, rho)
    assert float(mu) == pytest.approx(s * math.cos(expected_angle), abs=1e-6)   # s·cos(max(θ − ρ, 0))


def test_arcface_and_cosface_logits() -> None:
    s, m = 64.0, 0.5
    cos = torch.tensor([math.cos(0.7), math.cos(3.0)], dtype=torch.float64)
    arc = arcface_logit(cos, s, m)
    assert float(arc[0]) == pytest.approx(s * math.cos(1.2), abs=1e-6)          # s·cos(θ + m)
    # θ + m > π: insightface's monotone continuation cos θ − m·sin m
    assert float(arc[1]) == pytest.approx(s * (math.cos(3.0) - math.sin(math.pi - m) * m), abs=1e-6)
    assert float(cosface_logit(cos[:1], 30.0, 0.35)) == pytest.approx(30 * (math.cos(0.7) - 0.35))


def test_consensus_aware_loss_hand_case_excludes_own_centre() -> None:
    s, m, rho = 8.0, 0.5, 0.4
    f = on_circle(0.1).float()                        # [1, 2]
    w = on_circle(0.0).float()[0]
    centres = on_circle(1.0, 0.1).float()             # another client's at 0.9 rad, own centre at f
    keep = torch.tensor([True, False])
    loss = consensus_aware_loss(f, w, centres, keep, s, m, rho, "arcface")
    u = s * math.cos(0.1 + m)
    mu = s * math.cos(0.9 - rho)
    assert float(loss) == pytest.approx(math.log(math.exp(u) + math.exp(mu)) - u, rel=1e-5)
    alone = consensus_aware_loss(f, w, centres[:0], keep[:0], s, m, rho)
    assert float(alone) == pytest.approx(0.0, abs=1e-6)   # no negatives: one-class softmax is 0


def test_positive_loss_is_squared_distance() -> None:
    f, w = on_circle(0.0, 1.0)
    assert float(positive_loss(f, w)) == pytest.approx(float(((f - w) ** 2).sum()), rel=1e-12)


# ---- DPLC (PrivacyFace Alg. 1, Theorem 2) ----------------------------------------------------

def test_dplc_sigma_matches_theorem_2_and_gaussian_mechanism() -> None:
    size, rho, eps, delta = 10, 1.3, 1.0, 1e-5
    sigma = dplc_sigma(size, rho, eps, delta)
    assert sigma == pytest.approx(2 / (size * eps) * math.sqrt((1 - math.cos(2 * rho)) * math.log(1.25 / delta)))
    sens = math.sqrt(2 - 2 * math.cos(2 * rho)) / size        # Δ₂ of the cluster mean
    assert sigma == pytest.approx(sens / eps * math.sqrt(2 * math.log(1.25 / delta)))   # Definition 3
    assert sigma == pytest.approx(0.93365, abs=1e-4)
    assert dplc_sigma(size, rho, math.inf, delta) == 0.0
    for bad in [dict(epsilon=0.0, delta=delta), dict(epsilon=1.0, delta=0.0), dict(epsilon=1.0, delta=1.5)]:
        with pytest.raises(InputError):
            dplc_sigma(size, rho, **bad)


def test_dplc_noise_is_dp_for_every_epsilon_and_margin() -> None:
    """The exact δ of the Gaussian mechanism (Balle & Wang 2018) at the σ used is ≤ the target:
    Theorem 2's classical formula where it is valid (ε ≤ 1), the analytic σ beyond, which is
    tight (1 % less noise breaks δ). ρ > π/2 must not understate the sensitivity."""
    delta = 5e-5
    for eps in (0.5, 1.0, 10.0, 100.0):
        for rho in (1.3, 2.5, 3.0):
            sens = mean_sensitivity(1, rho)
            sigma = dplc_sigma(1, rho, eps, delta)
            assert gaussian_delta(sigma, sens, eps) <= delta * (1 + 1e-6), (eps, rho)
            if eps > 1:
                assert gaussian_delta(0.99 * sigma, sens, eps) > delta
    # the classical formula would not be DP at ε = 10 (the reason for the analytic σ)
    classical = mean_sensitivity(1, 1.3) / 10 * math.sqrt(2 * math.log(1.25 / delta))
    assert gaussian_delta(classical, mean_sensitivity(1, 1.3), 10) > delta
    assert mean_sensitivity(1, 2.5) == pytest.approx(2.0) and mean_sensitivity(4, math.pi / 2) == pytest.approx(0.5)
    with pytest.raises(InputError, match="ρ"):
        dplc_sigma(1, 0.0, 1.0, delta)      # ρ = 0 would release nothing


def separable_clusters(sizes=(6, 4, 3), dim: int = 16, spread: float = 0.05) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    groups = [unit(torch.eye(dim)[k] + spread * torch.randn(n, dim, generator=g)) for k, n in enumerate(sizes)]
    order = torch.randperm(sum(sizes), generator=g)
    return torch.cat(groups)[order], groups


def test_dplc_without_noise_recovers_cluster_centres_largest_first() -> None:
    W, groups = separable_clusters()
    out = dplc(W, rho=0.6, min_cluster=2, queries=5, epsilon=math.inf, delta=1e-5)
    assert out.sizes == (6, 4, 3) and out.sigmas == (0.0, 0.0, 0.0)
    for got, group in zip(out.centres, groups):
        assert torch.allclose(got, unit(group.mean(0)), atol=1e-5)
    assert torch.allclose(out.centres, out.clean)
    assert dplc(W, 0.6, min_cluster=4, queries=5, epsilon=math.inf, delta=1e-5).sizes == (6, 4)   # T stops
    assert dplc(W, 0.6, min_cluster=2, queries=1, epsilon=math.inf, delta=1e-5).sizes == (6,)     # Q stops


def test_dplc_noise_is_calibrated_gaussian() -> None:
    W, groups = separable_clusters(sizes=(5,), dim=64, spread=0.02)
    out = dplc(W, 0.6, 1, 1, epsilon=2.0, delta=1e-5, generator=torch.Generator().manual_seed(7))
    sigma = dplc_sigma(5, 0.6, 2.0, 1e-5)
    v = torch.randn(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * sigma
    p = unit(groups[0].double()).mean(0)
    assert out.sigmas == (pytest.approx(sigma),)
    assert torch.allclose(out.centres[0], unit(p + v).float(), atol=1e-6)   # p̂ = (p + v)/‖p + v‖


def test_dplc_rejects_bad_input() -> None:
    with pytest.raises(InputError):
        dplc(torch.zeros(0, 4), 1.3, 1, 1, 1.0, 1e-5)
    with pytest.raises(InputError):
        dplc(torch.eye(3), 1.3, 0, 1, 1.0, 1e-5)


# ---- the methods' contract with the executors ------------------------------------------------

SPECS = ["softmax", "softmax:scale=30", "fedaws", "fedgc", "privacyface", "privacyface:loss=cosface"]


@pytest.mark.parametrize("spec", SPECS)
def test_objective_is_finite_masked_and_vmappable(spec: str, tiny_xi) -> None:
    m = make_method(spec, tiny_xi)
    params = start_params(m)
    plan = m.configure_round(1, participants(0, 1, 2, 3))
    consts = [m.client_consts(plan, m.client_state_init(c)) for c in (0, 1)]
    x = images(2 * 4).reshape(2, 4, 3, 32, 32)
    single = [m.objective(plan, params, consts[i], x[i], None) for i in range(2)]
    for loss, parts in single:
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in parts.values())
    # padded samples (mask False) change nothing
    padded = torch.cat([x[0], images(3, seed=9)])
    mask = torch.tensor([True] * 4 + [False] * 3)
    assert float(m.objective(plan, params, consts[0], padded, mask)[0]) == pytest.approx(float(single[0][0]), rel=1e-5)
    # vmap over two clients = each client alone (the batched executor's contract)
    stacked = {g: {k: torch.stack([v, v]) for k, v in w.items()} for g, w in params.items()}
    sc = {k: torch.stack([c[k] for c in consts]) for k in consts[0]}
    batched = vmap(lambda p, c, xx, mm: m.objective(plan, p, c, xx, mm)[0])(stacked, sc, x, torch.ones(2, 4, dtype=torch.bool))
    assert torch.allclose(batched, torch.stack([s[0] for s in single]), rtol=1e-5, atol=1e-6)


def trainable_grads(m, params, plan, client: int, x: torch.Tensor) -> dict:
    leaves = {(g, k): v.clone().requires_grad_(True) for g, w in params.items() for k, v in w.items()}
    p = {g: {k: leaves[(g, k)] for k in w} for g, w in params.items()}
    loss, _ = m.objective(plan, p, m.client_consts(plan, m.client_state_init(client)), x, None)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {gk: (torch.zeros_like(leaves[gk]) if g is None else g) for gk, g in zip(leaves, grads)}


def test_softmax_updates_every_clients_class_embedding(tiny_xi) -> None:
    m = make_method("softmax", tiny_xi)
    grads = trainable_grads(m, start_params(m), m.configure_round(1, participants(1)), 1, images(4))
    rows = grads[("global", "classifier.weight")].norm(dim=1)
    assert bool((rows > 0).all())      # the shared classifier: client 1 moves everyone's w_u (FedUV's leak)
    assert any(float(v.abs().sum()) > 0 for (g, k), v in grads.items() if k.startswith("backbone."))


@pytest.mark.parametrize("spec", ["fedaws", "fedgc"])
def test_server_held_round_trip(spec: str, tiny_xi) -> None:
    m = make_method(spec, tiny_xi, num_clients=4)
    W0 = m.W.clone()
    plan = m.configure_round(1, participants(1, 3))
    assert torch.equal(m.client_consts(plan, m.client_state_init(3))["class_base"], W0[3])   # only its own row
    gw = m.init_global()
    with pytest.raises(RuntimeError, match="receive"):
        m.server_update(gw, plan)
    deltas = torch.zeros(2, EMB)
    deltas[0, 0], deltas[1, 1] = 0.5, -0.25
    m.receive(plan, [1, 3], {"global": {DELTA: deltas}}, torch.tensor([4, 4]))
    agg = {**gw, DELTA: torch.full((EMB,), 0.3)}
    out = m.server_update(agg, plan)
    assert torch.equal(out[DELTA], torch.zeros(EMB))                 # every round starts from Δ = 0
    assert torch.allclose(m.W.norm(dim=1), torch.ones(4), atol=1e-6)
    # random class embeddings are far apart: the regularizer step leaves the uploads as they are
    assert torch.allclose(m.W[1], unit(W0[1] + deltas[0]), atol=1e-5)
    assert torch.allclose(m.W[0], W0[0], atol=1e-6)
    spec_v = m.verifier(m.client_state_init(1), out, None)
    assert torch.allclose(spec_v.reference, m.W[1]) and spec_v.shared_key == "global"
    assert m.new_user_verifier(m.client_state_init(1), out).reference is None
    fresh = make_method(spec, tiny_xi, num_clients=4)
    fresh.load_server_state(m.server_state())
    assert torch.equal(fresh.W, m.W)
    with pytest.raises(CheckpointError):
        fresh.load_server_state({"class_embeddings": torch.zeros(3, EMB)})


def test_privacyface_shares_dp_centres_and_excludes_own(tiny_xi) -> None:
    m = make_method("privacyface:epsilon=inf", tiny_xi, num_clients=4)
    plan = m.configure_round(1, participants(0, 2))
    # first-timers release DPLC of their initial class embedding (Alg. 2 line 3); no noise at ε = inf
    assert plan.extras["owners"].tolist() == [0, 2]
    assert torch.allclose(plan.extras["centres"], m.R[[0, 2]], atol=1e-6)
    offsets = torch.zeros(2, EMB)
    offsets[1, 0] = 1.0
    m.receive(plan, [0, 2], {"class": {"offset": offsets}}, torch.tensor([3, 3]))
    m.server_update({}, plan)
    plan2 = m.configure_round(2, participants(1, 2))
    assert plan2.extras["owners"].tolist() == [0, 1, 2]
    w2 = unit(m.R[2] + offsets[1])
    assert torch.allclose(plan2.extras["centres"][2], w2, atol=1e-6)   # the updated w_c, released
    keep = plan2.extras["owners"] != m.client_consts(plan2, m.client_state_init(2))["client"]
    assert keep.tolist() == [True, True, False]
    ref = m.verifier(m.client_state_init(2), m.init_global(), {"class": {"offset": offsets[1]}}).reference
    assert torch.allclose(ref, w2, atol=1e-6)
    fresh = make_method("privacyface:epsilon=inf", tiny_xi, num_clients=4)
    fresh.load_server_state(m.server_state())
    assert torch.equal(fresh.configure_round(3, participants(3)).extras["centres"],
                       m.configure_round(3, participants(3)).extras["centres"])


def test_privacyface_release_noise_follows_the_budget(tiny_xi) -> None:
    """One class centre per client: E[cos(p, p̂)] ≈ 1/√(1 + σ²D) (docs/baselines.md) —
    pure noise at the paper's ε = 1 (σ ≈ 8.7), close to p at ε = 100 (analytic σ ≈ 0.18)."""
    def mean_cos(spec: str) -> float:
        m = make_method(spec, tiny_xi, num_clients=64)
        plan = m.configure_round(1, participants(*range(64)))
        return float((plan.extras["centres"] * m.R).sum(1).mean())
    sigma = dplc_sigma(1, 1.3, 1.0, 5e-5)
    assert sigma == pytest.approx(8.673, abs=1e-3)
    assert abs(mean_cos("privacyface")) < 0.15                       # ≈ 0.03 ± 0.03
    s100 = dplc_sigma(1, 1.3, 100.0, 5e-5)
    assert mean_cos("privacyface:epsilon=100") == pytest.approx(1 / math.sqrt(1 + s100**2 * EMB), abs=0.05)  # ≈ 0.81
    assert mean_cos("privacyface:epsilon=inf") == pytest.approx(1.0, abs=1e-5)


def test_privacyface_never_reuses_noise_between_releases(tiny_xi) -> None:
    m = make_method("privacyface", tiny_xi, num_clients=4)
    plan = m.configure_round(1, participants(0))
    first = plan.extras["centres"][0].clone()
    m.receive(plan, [0], {"class": {"offset": torch.zeros(1, EMB)}}, torch.tensor([3]))   # same w_0
    assert not torch.allclose(m.centres[0, 0], first)      # reused noise would cancel in differences
    again = make_method("privacyface", tiny_xi, num_clients=4).configure_round(1, participants(0))
    assert torch.equal(again.extras["centres"][0], first)  # but reproducible from the seed


def test_option_validation() -> None:
    for spec in ["privacyface:min_cluster=512", "privacyface:loss=sphereface", "fedaws:nu=0", "fedgc:scale=-1",
                 "softmax:verify=codeword", "privacyface:epsilon=0", "fedgc:lam=0"]:
        with pytest.raises(InputError):
            parse_method(spec)


def test_labels_name_the_non_default_options() -> None:
    assert parse_method("fedgc").label == "fedgc"
    assert parse_method("privacyface:epsilon=inf").label == "privacyface (epsilon=inf)"
    labels = {parse_method(s).label for s in ["privacyface", "privacyface:loss=cosface", "privacyface:rho=1.2",
                                              "fedaws", "fedaws:nu=0.5", "softmax", "softmax:scale=30"]}
    assert len(labels) == 7      # distinct specs → distinct result rows and checkpoint folders


def test_class_embeddings_init_deterministic_and_spread() -> None:
    a, b = init_class_embeddings(50, 32, seed=3), init_class_embeddings(50, 32, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, init_class_embeddings(50, 32, seed=4))
    cos = a @ a.t() - torch.eye(50)
    assert float(cos.abs().max()) < 0.8


def test_template_verification_option(tiny_xi) -> None:
    m = make_method("fedaws:verify=template", tiny_xi)
    spec = m.verifier(m.client_state_init(0), m.init_global(), None)
    assert spec.reference is None and spec.mode == "template"
    assert set(spec.weights) == {k for k in m.init_global() if k.startswith("backbone.")}
