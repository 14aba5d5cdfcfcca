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


def test_holdout_view_trains_without_the_holdout_with_and_without_the_image_store(tmp_path):
    import torch

    from device_sim.cli_simulate import experiment_from_argv
    from device_sim.experiment_data import build_data
    from device_sim.image_cache import normalize
    from device_sim.image_store import plan_data_cache
    from device_sim.methods.selection import HoldoutView
    from device_sim.population import Population

    cfg = experiment_from_argv(["--clients", "3", "--new-users", "0", "--public", "2", "--out", str(tmp_path)])
    ds, splits = build_data(cfg)
    for store in (False, True):
        pop = Population(ds, splits)
        if store:
            pop.use_image_store(plan_data_cache("host", pop.image_store_bytes(), "cpu"))
        view = HoldoutView(pop, torch.zeros(2, 3, 8, 8), seed=1)
        chunk = view.train_chunk([2, 0])
        for c, x in zip([2, 0], chunk):
            x = normalize(x) if x.dtype == torch.uint8 else x
            assert x.shape[0] == view.num_train(c) < pop.train_images(c).shape[0]
            assert torch.allclose(x, view.train_images(c), atol=1e-6)         # the photos less the hold-out
