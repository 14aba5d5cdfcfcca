"""The do-no-harm check's per-round work is shared by the methods of a run (issue 31)."""
from __future__ import annotations

import numpy as np

from device_sim.methods.client_stats import FederationStats, shared_round
from device_sim.methods.selection import draws_from_factor
from fedfs_sdk.stats import StatSum, standard_draws
from fedfs_sdk.stats.impostor_model import gaussian_factor, impostor_features


def test_draws_from_the_kept_factor_are_the_impostor_draws_bit_for_bit():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 16))
    mu, cov = rng.standard_normal(16), a.T @ a / 40
    z = standard_draws(16, 512, seed=3)
    assert np.array_equal(draws_from_factor(mu, gaussian_factor(cov), z), impostor_features(mu, cov, z=z))


def test_one_statistics_round_per_run_recomputed_when_its_inputs_change():
    xi, pop, calls = object(), object(), []

    def compute():
        calls.append(1)
        return FederationStats(StatSum())

    a = shared_round((xi, pop), ("cfg", 0), compute)
    assert shared_round((xi, pop), ("cfg", 0), compute) is a and len(calls) == 1
    b = shared_round((object(), pop), ("cfg", 0), compute)       # another ξ (the same by value is not enough)
    c = shared_round((xi, pop), ("cfg", 1), compute)             # another seed
    assert len(calls) == 3 and b is not a and c is not b
