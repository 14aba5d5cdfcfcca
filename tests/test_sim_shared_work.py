"""Work a simulation shares instead of redoing (issue 31): the do-no-harm check's per-round work across
methods, the hold-out kept out of training, and what `fedfs simulate` loads and sets before it runs."""
from __future__ import annotations

import numpy as np

from device_sim.methods.client_stats import FederationStats, shared_round
from fedfs_sdk.stats.impostor_model import draws_from_factor
from fedfs_sdk.stats import StatSum, standard_draws
from fedfs_sdk.stats.impostor_model import gaussian_factor, impostor_features


def test_draws_from_the_kept_factor_are_the_impostor_draws_bit_for_bit():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 16))
    mu, cov = rng.standard_normal(16), a.T @ a / 40
    z = standard_draws(16, 512, seed=3)
    assert np.array_equal(draws_from_factor(mu, gaussian_factor(cov), z), impostor_features(mu, cov, z=z))


def test_one_statistics_round_per_run_recomputed_when_its_inputs_change():
    class Obj:      # weak-referenceable, as ξ and a population are
        pass

    xi, pop, calls = Obj(), Obj(), []

    def compute():
        calls.append(1)
        return FederationStats(StatSum())

    a = shared_round((xi, pop), ("cfg", 0), compute)
    assert shared_round((xi, pop), ("cfg", 0), compute) is a and len(calls) == 1
    other = Obj()
    b = shared_round((other, pop), ("cfg", 0), compute)          # another ξ (the same by value is not enough)
    c = shared_round((xi, pop), ("cfg", 1), compute)             # another seed
    assert len(calls) == 3 and b is not a and c is not b
    import gc
    import weakref

    gone = weakref.ref(pop)
    del xi, pop, other
    gc.collect()
    assert gone() is None           # the kept round does not keep a finished run's population alive


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


def test_simulate_starts_without_scikit_learn_and_with_sleeping_torch_threads():
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; import fedfs_sdk.cli.main, device_sim.cli_simulate, os; "
            "print('sklearn' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "PASSIVE"]      # scikit-learn is imported where a metric needs it
