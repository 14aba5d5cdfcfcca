"""User-level DP-FedAvg: the accountant against reference values, clipping by hand, and the
noise scale checked statistically (fedfs_sdk.federation.dp, server_agg.dp)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedfs_sdk.federation.dp import DpParams, clip_delta, clip_flat_update, user_weight
from fedfs_sdk.errors import InputError
from server_agg.dp import DpFedAvg, Ledger, calibrate_noise, default_delta, epsilon


# ---- accountant ------------------------------------------------------------------------

def test_gaussian_composition_matches_the_exact_analytic_value():
    """3 rounds of the (unsampled) Gaussian with σ = √3 = one Gaussian with σ = 1, whose exact
    δ(ε) is Φ(1/2σ − εσ) − e^ε Φ(−1/2σ − εσ) (Balle & Wang 2018): δ(1) = Φ(−½) − e·Φ(−1.5) =
    0.126936 — also the reference value of dp-accounting's own PLD test (test_gaussian_basic)."""
    exact_delta = stats.norm.cdf(-0.5) - math.e * stats.norm.cdf(-1.5)
    assert exact_delta == pytest.approx(0.126936, abs=1e-6)
    assert epsilon([(1.0, math.sqrt(3), 3)], exact_delta, "pld") == pytest.approx(1.0, abs=1e-2)
    # RDP is an upper bound: never below the exact value (loose at this large δ: 1.504)
    eps_rdp = epsilon([(1.0, math.sqrt(3), 3)], exact_delta, "rdp")
    assert 1.0 - 1e-9 <= eps_rdp <= 1.6


def test_poisson_subsampled_gaussian_matches_the_library_reference():
    """dp-accounting's test_self_composed_subsampled_gaussian: q = 0.2, σ = 0.5, 3 rounds →
    ε = 1 at δ = 0.15594 (PLD; our discretization 1e-3 → tolerance 1e-2)."""
    assert epsilon([(0.2, 0.5, 3)], 0.15594, "pld") == pytest.approx(1.0, abs=1e-2)
    # the same rounds split into groups (how the server's ledger stores them) give the same ε
    assert epsilon([(0.2, 0.5, 1), (0.2, 0.5, 2)], 0.15594, "pld") == pytest.approx(1.0, abs=1e-2)
    rdp = epsilon([(0.2, 0.5, 3)], 0.15594, "rdp")
    assert rdp >= 1.0 - 1e-2                         # RDP never claims more privacy than PLD


def test_epsilon_edge_cases_and_ledger():
    assert epsilon([], 1e-5) == 0.0
    assert epsilon([(0.1, 0.0, 1)], 1e-5) == math.inf           # no noise: no privacy
    with pytest.raises(InputError, match="δ"):
        epsilon([(0.1, 1.0, 1)], 1.0)
    led = Ledger().charge(0.5, 2.0).charge(0.5, 2.0).charge(0.25, 3.0)
    assert led.rounds == 3 and Ledger.from_json(led.to_json()) == led
    assert led.epsilon(1e-5) == pytest.approx(epsilon([(0.5, 2.0, 2), (0.25, 3.0, 1)], 1e-5))
    assert led.charge_non_private().epsilon(1e-5) == math.inf   # one round in the clear: ε = ∞
    # more rounds never cost less
    assert led.charge(0.5, 2.0).epsilon(1e-5) > led.epsilon(1e-5)


def test_calibrated_noise_reaches_the_target():
    sigma = calibrate_noise(4.0, 1e-5, 0.1, 100)
    assert epsilon([(0.1, sigma, 100)], 1e-5) <= 4.0 + 1e-9
    assert epsilon([(0.1, sigma * 0.97, 100)], 1e-5) > 4.0      # and not much more noise than needed
    assert calibrate_noise(math.inf, 1e-5, 0.1, 100) == 0.0
    assert default_delta(100) == pytest.approx(100 ** -1.1)


# ---- clipping --------------------------------------------------------------------------

def test_clip_delta_by_hand():
    d, norm, was = clip_delta(np.array([3.0, 4.0]), 1.0)          # ‖Δ‖ = 5 → Δ/5
    np.testing.assert_allclose(d, [0.6, 0.8], rtol=0, atol=1e-15)
    assert norm == 5.0 and was
    d, norm, was = clip_delta(np.array([0.3, 0.4]), 1.0)          # inside the ball: untouched
    np.testing.assert_array_equal(d, [0.3, 0.4])
    assert norm == pytest.approx(0.5) and not was
    with pytest.raises(InputError, match="non-finite"):
        clip_delta(np.array([np.nan, 1.0]), 1.0)
    with pytest.raises(InputError, match="clip"):
        clip_delta(np.array([1.0]), 0.0)


def test_clip_flat_update_over_a_state_dict():
    """Δ spans two tensors: (1, 2) and (2,) − reference → ‖(1, 2, 2)‖ = 3, C = 1.5 → Δ/2;
    an integer buffer is passed through."""
    ref = {"a": np.zeros(2, np.float32), "b": np.ones(1, np.float32), "n": np.array([7], np.int64)}
    new = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3.0], np.float32), "n": np.array([9], np.int64)}
    out, norm, was = clip_flat_update(new, ref, 1.5)
    assert norm == pytest.approx(3.0) and was
    np.testing.assert_allclose(out["a"], [0.5, 1.0])
    np.testing.assert_allclose(out["b"], [2.0])
    assert out["a"].dtype == np.float32 and out["n"][0] == 9


def test_server_aggregate_clips_weighs_and_divides_by_the_fixed_denominator():
    """σ = 0: w + Σ w_k clip_C(Δ_k) / (q·N), hand-computed. C = 2.5, ŵ = 10, q·N = 4."""
    ref = {"w": torch.zeros(2), "steps": torch.tensor(3)}
    acc = DpFedAvg(ref, DpParams(clip=2.5, noise_multiplier=0.0, denominator=4.0, weight_cap=10))
    acc.add({"w": torch.tensor([3.0, 4.0]), "steps": torch.tensor(99)}, 20)   # ‖Δ‖ 5 → (1.5, 2), weight 1
    acc.add({"w": torch.tensor([1.0, 0.0]), "steps": torch.tensor(99)}, 5)    # inside, weight 0.5
    out = acc.result()
    np.testing.assert_allclose(out["w"].numpy(), [(1.5 + 0.5) / 4, 2.0 / 4], rtol=0, atol=1e-7)
    assert int(out["steps"]) == 3                   # non-floating buffers are not aggregated
    assert acc.count == 2 and acc.total_samples == 25 and acc.clipped == 1
    assert user_weight(5, 10) == 0.5 and user_weight(50, 10) == 1.0


def test_a_stacked_chunk_adds_like_one_update_at_a_time():
    """The simulator's chunk path (add_stacked) is add() per client, up to float64 rounding."""
    rng = np.random.default_rng(1)
    ref = {"w": torch.from_numpy(rng.normal(size=(4, 5))).float(), "steps": torch.tensor(3)}
    stacked = {"w": ref["w"] + torch.from_numpy(rng.normal(size=(6, 4, 5)) * [[[0.1]], [[2.0]], [[0.3]],
                                                                              [[5.0]], [[0.01]], [[1.0]]]).float(),
               "steps": torch.full((6,), 9)}
    ns = [3, 40, 7, 12, 1, 10]
    one = DpFedAvg(ref, DpParams(clip=1.5, noise_multiplier=0.0, denominator=6.0, weight_cap=10))
    for i, n in enumerate(ns):
        one.add({k: v[i] for k, v in stacked.items()}, n)
    many = DpFedAvg(ref, DpParams(clip=1.5, noise_multiplier=0.0, denominator=6.0, weight_cap=10))
    many.add_stacked(stacked, ns)
    np.testing.assert_allclose(many._sum, one._sum, rtol=0, atol=1e-12)
    np.testing.assert_allclose(many.norms, one.norms, rtol=1e-12)
    assert (many.count, many.total_samples, many.clipped, many.weight_sum) == \
        (one.count, one.total_samples, one.clipped, pytest.approx(one.weight_sum))
    assert one.clipped >= 2                        # the chunk exercises both sides of the clip


def test_every_added_update_is_bounded_by_c_in_the_sum():
    """One user's influence on the sum is ≤ C whatever it sends (the sensitivity)."""
    rng = np.random.default_rng(0)
    ref = {"w": torch.from_numpy(rng.normal(size=300))}
    for scale in (1e-3, 1.0, 1e6):
        acc = DpFedAvg(ref, DpParams(clip=0.7, noise_multiplier=0.0, denominator=1.0, weight_cap=1))
        acc.add({"w": ref["w"] + torch.from_numpy(rng.normal(size=300) * scale)}, 1_000_000)
        change = acc.result()["w"].double() - ref["w"].double()
        assert float(change.norm()) <= 0.7 * (1 + 1e-12)


# ---- noise -----------------------------------------------------------------------------

def test_noise_std_is_sigma_c_over_the_denominator():
    """On a zero sum the published model minus w is pure noise: over d coordinates and
    several rounds' draws, (d−1)·s²/std² must lie in the 99.9 % chi-square interval for
    std = σ·C/(q·N) = 1.3 · 0.7 / 12.5, and the mean within 4 standard errors of 0."""
    d = 20_000
    p = DpParams(clip=0.7, noise_multiplier=1.3, denominator=12.5)
    expected = 1.3 * 0.7 / 12.5
    assert p.std == pytest.approx(expected)
    ref = {"w": torch.zeros(d, dtype=torch.float64)}
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], d - 1)
    acc = DpFedAvg(ref, p, rng=np.random.default_rng(1))
    for _ in range(5):
        x = acc.result()["w"].numpy()
        s2 = x.var(ddof=1)
        assert lo <= (d - 1) * s2 / expected ** 2 <= hi, (math.sqrt(s2), expected)
        assert abs(x.mean()) <= 4 * expected / math.sqrt(d)
    # a wrong scale (the clipped estimator's 2C, or forgetting the denominator) is rejected
    x = acc.result()["w"].numpy()
    for wrong in (2 * expected, 1.3 * 0.7):
        assert not lo <= (d - 1) * x.var(ddof=1) / wrong ** 2 <= hi


def test_dp_params_validation():
    with pytest.raises(InputError, match="clip"):
        DpParams(clip=-1.0, noise_multiplier=1.0, denominator=1.0)
    with pytest.raises(InputError, match="weight_cap"):
        DpParams(clip=1.0, noise_multiplier=1.0, denominator=1.0, weight_cap=0)
    p = DpParams(clip=1.0, noise_multiplier=2.0, denominator=3.0, weight_cap=4)
    assert DpParams.from_json(p.to_json()) == p
