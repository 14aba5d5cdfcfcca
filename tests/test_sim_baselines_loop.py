"""Baselines through the real round loop: 2 rounds on 6 tiny SynthFaces clients, then the
real evaluation; and resume-from-checkpoint of their server state."""
from __future__ import annotations

import math

import pytest
import torch

from conftest_baselines import tiny_xi  # noqa: F401
from device_sim.datasets import SynthDataset
from device_sim.evaluate import EvalConfig, evaluate
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig
from device_sim.methods import parse_method
from device_sim.population import Population
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces


@pytest.fixture(scope="module")
def population() -> Population:
    ds = SynthDataset(SynthFaces(seed=0, image_size=32), images_per_identity=12, num_identities=16)
    splits = make_splits(ds, num_public=0, num_clients=6, num_new=2, train_per_client=8, test_per_client=4, seed=0)
    return Population(ds, splits)


def federation(spec: str, population: Population, xi, participation: float = 1.0) -> Federation:
    cfg = FederationConfig(rounds=2, participation=participation, seed=0, executor="sequential",
                           local=LocalConfig(batch_size=4))
    return Federation(parse_method(spec), population, xi, cfg)


@pytest.mark.parametrize("spec", ["softmax", "fedaws", "fedgc", "privacyface"])
def test_two_rounds_train_and_evaluate(spec: str, population: Population, tiny_xi) -> None:
    fed = federation(spec, population, tiny_xi)
    records = fed.run()
    assert [r.round for r in records] == [1, 2]
    for r in records:
        assert all(math.isfinite(v) for v in r.metrics.values()), r.metrics
    first = records[0].metrics
    assert first["loss_last"] < first["loss_first"]          # local training lowers the objective
    assert records[1].metrics["loss_first"] < first["loss_first"]   # and the next round starts lower
    res = evaluate(fed.method, fed.global_weights, fed.private_weights, population, EvalConfig(q=0.75, batch_size=64))
    auroc = res["verification"]["auroc"]
    assert auroc["n"] == 6 and 0.0 <= auroc["mean"] <= 1.0
    assert 0.0 <= res["warmup"]["tpr"]["mean"] <= 1.0 and 0.0 <= res["new_users"]["tpr"]["mean"] <= 1.0


@pytest.mark.parametrize("spec", ["fedaws", "privacyface"])
def test_resume_reproduces_next_round_with_server_state(spec: str, population: Population, tiny_xi, tmp_path) -> None:
    full = federation(spec, population, tiny_xi, participation=0.5)
    full.run_round()
    ckpt = full.save(tmp_path / "round1.safetensors")
    full.run_round()
    resumed = federation(spec, population, tiny_xi, participation=0.5)
    resumed.load(ckpt)
    resumed.run_round()
    # same code path and seeds, state restored bit for bit: resume is promised to be exact
    for k, v in full.global_weights.items():
        assert torch.equal(v, resumed.global_weights[k]), k
    for k, v in full.method.server_state().items():
        assert torch.equal(v, resumed.method.server_state()[k]), k
