"""``fedfs simulate --dp-*``: the federation's FedAvg becomes DP-FedAvg (device_sim.dp_sim),
results.json and the table gain ε, and the σ calibrated for --dp-epsilon reaches it."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest_sim import RandomClients, setup_method, xi  # noqa: F401
from device_sim.dp_sim import SimDp, check_dp_method, from_experiment
from device_sim.experiment import DpConfig, ExperimentConfig, TrainConfig
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig
from device_sim.methods import parse_method
from fedfs_sdk.cli.main import main
from fedfs_sdk.errors import InputError
from server_agg.dp import epsilon

from test_sim_cli import TINY_DATA


def test_simulate_results_gain_epsilon(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["simulate", "--method", "pretrained", "feduv:c=127", *TINY_DATA, "--cache-dir", str(tmp_path / "c"),
                 "--rounds", "2", "--participation", "0.5", "--dp-epsilon", "8", "--dp-clip", "1.0",
                 "--dp-delta", "1e-3", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    pre, fed = res["methods"]
    assert "dp" not in pre                                   # ξ alone publishes nothing
    dp = fed["dp"]
    assert dp["delta"] == 1e-3 and dp["rounds"] == 2 and dp["sampling_rate"] == 0.5 and dp["clip"] == 1.0
    assert dp["epsilon"] <= 8.0 and dp["epsilon"] == pytest.approx(epsilon([(0.5, dp["noise_multiplier"], 2)], 1e-3))
    assert dp["epsilon"] > 7.0                               # σ is calibrated, not merely large
    assert dp["denominator"] == pytest.approx(0.5 * res["population"]["clients"])
    assert dp["noise_std"] == pytest.approx(dp["noise_multiplier"] * 1.0 / dp["denominator"])
    assert "ε (δ)" in printed and "ε (δ)" in (out / "results.md").read_text()


def test_dp_federation_round_is_the_clipped_noised_mean(xi) -> None:
    """One DP round on 6 clients: the new global model minus the old one equals
    (Σ clip_C(Δ_k) + noise)/(q·N) with the noise the accumulator draws for that round —
    recomputed here from the clients' own results, with σ = 0 (then the noise is 0)."""
    method = setup_method("feduv:c=127", xi, num_clients=6)
    data = RandomClients()
    cfg = FederationConfig(rounds=1, participation=0.5, local=LocalConfig(local_epochs=1), seed=3)
    fed = Federation(method, data, xi, cfg)
    before = {k: v.clone() for k, v in fed.global_weights.items()}
    fed.dp = SimDp(clip=1e-3, noise_multiplier=0.0, delta=1e-3, q=0.5, num_clients=6)
    rec = fed.run_round()
    change = np.concatenate([(fed.global_weights[k].double() - before[k].double()).numpy().ravel()
                             for k in before if before[k].is_floating_point()])
    # every participant's ‖Δ‖ ≫ 1e-3 here, so each contributes exactly C: ‖Σ‖ ≤ K·C/(q·N)
    assert rec.participants >= 1 and all(n > 1e-3 for n in fed.dp.norms)
    # the weights are float32: w + Δ is rounded to w's grid, half a spacing per element at most
    rounding = 0.5 * np.linalg.norm(np.concatenate([np.spacing(np.maximum(
        fed.global_weights[k].abs(), before[k].abs()).numpy()).astype(np.float64).ravel()
        for k in before if before[k].is_floating_point()]))
    assert np.linalg.norm(change) <= rec.participants * 1e-3 / 3.0 * (1 + 1e-9) + rounding
    assert np.linalg.norm(change) > 0


def test_dp_arguments_are_checked() -> None:
    cfg = ExperimentConfig(dp=DpConfig(dp_noise=1.0), train=TrainConfig(participation=0.5, rounds=3, seed=0))
    with pytest.raises(InputError, match="--dp-clip"):
        from_experiment(cfg, 10)
    cfg = cfg.with_fields(dp_clip=2.0)
    dp = from_experiment(cfg, 10)
    assert dp is not None and dp.delta == pytest.approx(10 ** -1.1) and dp.params.std == pytest.approx(1.0 * 2.0 / 5.0)
    with pytest.raises(InputError, match="not both"):
        from_experiment(cfg.with_fields(dp_epsilon=1.0), 10)
    cfg = cfg.with_fields(dp_noise=None, dp_epsilon=math.inf)
    assert from_experiment(cfg, 10).noise_multiplier == 0.0 and from_experiment(cfg, 10).epsilon(3) == math.inf
    with pytest.raises(InputError, match="drop --distributed"):
        from_experiment(cfg.with_fields(workers=2), 10)
    with pytest.raises(InputError, match="per-client uploads"):
        check_dp_method(parse_method("fedaws"))
    rng = np.random.default_rng(0)
    picks = [SimDp(1.0, 1.0, 1e-3, 0.3, 1000).sample(rng).size for _ in range(50)]
    assert abs(np.mean(picks) - 300) < 4 * math.sqrt(1000 * 0.3 * 0.7 / 50)   # Poisson sampling at rate q
    torch.manual_seed(0)
