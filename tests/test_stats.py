"""The statistics round's device functions and sum (fedfs_sdk.stats): hand-computed values, the
summed route against the old pooled computations, and the in-domain impostor model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest_sim import RandomClients, xi  # noqa: F401
from fedfs_sdk.errors import InputError
from fedfs_sdk.stats import (StatSum, check_contribution, embedding_moments, feature_dim, feature_length,
                             feature_moments, impostor_features, moments_of, norm_fold_from_sum, others_moments,
                             predicted_far, standard_draws, sum_contributions, threshold_at_far, verdict_from_sum)
from fedfs_sdk.training.selection import CandidateCheck, population_verdict


def test_embedding_moments_by_hand() -> None:
    e = np.array([[1.0, 2.0], [3.0, -1.0]])
    assert embedding_moments(e).tolist() == [4.0, 1.0, 10.0, 5.0, 2.0]
    # a photo beyond the L2 bound is scaled onto it: [3, 4] (norm 5) with bound 1 → [0.6, 0.8]
    assert np.allclose(embedding_moments(np.array([[3.0, 4.0]]), bound=1.0), [0.6, 0.8, 0.36, 0.64, 1.0])
    assert embedding_moments(np.ones((5, 2)), max_photos=3)[-1] == 3.0
    with pytest.raises(InputError, match="non-finite"):
        embedding_moments(np.array([[np.nan, 1.0]]))


def test_feature_moments_by_hand_and_inverse() -> None:
    f = np.array([[1.0, 2.0], [3.0, 4.0]])
    # Σf = [4, 6]; Σffᵀ = [[10, 14], [14, 20]] → upper triangle [10, 14, 20]; n = 2
    assert feature_moments(f).tolist() == [4.0, 6.0, 10.0, 14.0, 20.0, 2.0]
    assert feature_length(2) == 6 and feature_dim(6) == 2 and feature_dim(feature_length(512)) == 512
    mu, cov, n = moments_of(feature_moments(f))
    assert n == 2 and np.allclose(mu, [2.0, 3.0]) and np.allclose(cov, [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(InputError, match="no feature dimension"):
        feature_dim(7)


def test_sum_is_elementwise_counts_devices_and_refuses_too_few() -> None:
    a, b = {"s": np.array([1.0, 2.0])}, {"s": np.array([0.5, -1.0])}
    total = sum_contributions([a, b])
    assert total.count == 2 and total.sums["s"].tolist() == [1.5, 1.0]
    assert total.minus(a)["s"].tolist() == [0.5, -1.0]           # a device's view of the others
    assert StatSum.from_dict(total.to_dict()).sums["s"].tolist() == [1.5, 1.0]
    with pytest.raises(InputError, match="≥ 3 devices"):
        sum_contributions([a, b], min_contributors=3)
    with pytest.raises(InputError, match="names"):
        sum_contributions([a, {"t": np.zeros(2)}])
    with pytest.raises(InputError, match="length"):
        sum_contributions([a, {"s": np.zeros(3)}])


def _checks(rng: np.random.Generator) -> list[CandidateCheck]:
    return [CandidateCheck(n, 0.5, float(rng.normal(m, 0.5)), float(rng.uniform(0.9, 1.0)), 0.3, 4, 100)
            for n, m in (("xi", 0.0), ("global", 0.3), ("personalized", -0.1))]


def test_verdict_from_summed_checks_equals_population_verdict() -> None:
    rng = np.random.default_rng(0)
    devices = [_checks(rng) for _ in range(37)]
    names = ("global", "personalized")
    total = sum_contributions({"checks": check_contribution(d, names)} for d in devices)
    got = verdict_from_sum(total.sums["checks"], names)
    for name in names:
        want = population_verdict(name, devices)
        assert got[name].n == want.n == 37 and got[name].helps == want.helps
        for f in ("mean_margin_gain", "se", "mean_auroc_gain"):
            assert math.isclose(getattr(got[name], f), getattr(want, f), rel_tol=1e-9, abs_tol=1e-12)
    # by hand: gains 1 and 3 → mean 2, SE = sd/√2 = √2/√2 = 1; helps needs mean − 2·SE > 0 → no
    two = check_contribution([CandidateCheck("xi", 0, 0.0, 0.9, 0, 1, 1), CandidateCheck("g", 0, 1.0, 0.9, 0, 1, 1)], ["g"]) \
        + check_contribution([CandidateCheck("xi", 0, 0.0, 0.9, 0, 1, 1), CandidateCheck("g", 0, 3.0, 0.9, 0, 1, 1)], ["g"])
    v = verdict_from_sum(two, ["g"])["g"]
    assert (v.mean_margin_gain, v.se, v.n, v.helps) == (2.0, 1.0, 2, False)


def test_norm_fold_from_the_sum_equals_the_pooled_statistics() -> None:
    rng = np.random.default_rng(1)
    per_device = [rng.normal(3.0, 2.0, size=(int(rng.integers(3, 9)), 16)) for _ in range(20)]
    total = sum_contributions({"e": embedding_moments(e)} for e in per_device)
    mu, sd = norm_fold_from_sum(total.sums["e"])
    pooled = np.concatenate(per_device)
    assert np.allclose(mu, pooled.mean(0), atol=1e-12) and np.allclose(sd, pooled.std(0), atol=1e-12)
    assert norm_fold_from_sum(total.sums["e"], "center")[1] is None


def test_simulator_norm_fold_is_the_summed_route_and_equals_the_old_pooled_one(xi) -> None:  # noqa: F811
    from device_sim.methods.base import backbone_weights, verifier_net
    from device_sim.methods.client_stats import EMBEDDING, client_statistics
    from device_sim.methods.reference import norm_fold, pooled_embedding_stats

    data = RandomClients(5)
    net = verifier_net(xi.config.resolved(), with_head=False)
    w = backbone_weights(xi.state_dict())
    mu_old, sd_old, n_old = pooled_embedding_stats(net, w, data, range(5))
    mu, sd = norm_fold(net, w, data, "standardize")
    assert torch.allclose(mu, mu_old, atol=1e-5) and torch.allclose(sd, sd_old, atol=1e-5)
    stats = client_statistics(net, w, data, range(5))
    assert stats.total.count == 5 and stats.total.sums[EMBEDDING][-1] == n_old
    # each client's own contribution is the device function on its own photos
    from torch.func import functional_call
    e2 = functional_call(net, w, (data.train_images(2),))[0].double().numpy()
    assert np.allclose(stats.own[2][EMBEDDING], embedding_moments(e2), atol=1e-6)


def test_impostor_draws_carry_the_others_moments() -> None:
    rng = np.random.default_rng(2)
    a = rng.normal(size=(6, 6))
    cov = a @ a.T / 6 + 0.1 * np.eye(6)
    mu = rng.normal(size=6)
    f = impostor_features(mu, cov, draws=200_000, seed=3)
    assert np.allclose(f.mean(0), mu, atol=0.02) and np.allclose(np.cov(f.T), cov, atol=0.05)
    # a linear "top": score uᵀf is N(uᵀμ, uᵀCu) → predicted FAR at τ = m + 2σ ≈ 1 − Φ(2) = 0.02275
    u = rng.normal(size=6)
    s = f.astype(np.float64) @ u
    m, sd = float(u @ mu), math.sqrt(float(u @ cov @ u))
    assert abs(predicted_far(s, m + 2 * sd) - 0.02275) < 0.002
    assert abs(threshold_at_far(s, 1e-3) - (m + 3.0902 * sd)) < 0.05 * sd
    with pytest.raises(InputError, match="needs ≥ 1000"):
        threshold_at_far(s[:500], 1e-3)
    # the same draws for every candidate (common random numbers)
    assert np.array_equal(standard_draws(6, 10, 4), standard_draws(6, 10, 4))


def test_others_moments_leave_the_device_out() -> None:
    rng = np.random.default_rng(5)
    mine, rest = rng.normal(size=(4, 3)), rng.normal(size=(30, 3))
    total = feature_moments(mine) + feature_moments(rest)
    mu, cov, n = others_moments(total, feature_moments(mine))
    assert n == 30 and np.allclose(mu, rest.mean(0)) and np.allclose(cov, np.cov(rest.T, bias=True))
