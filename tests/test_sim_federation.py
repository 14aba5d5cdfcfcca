"""The round loop: FedAvg through server_agg, loss goes down, exact resume, chunk invariance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_sim import RandomClients, xi  # noqa: F401
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig, client_seed, latest_checkpoint, checkpoint_path
from device_sim.methods import parse_method
from fedfs_sdk.errors import CheckpointError, InputError


@pytest.fixture(scope="module")
def data() -> RandomClients:
    return RandomClients()


def fed(spec: str, xi, data, **kw) -> Federation:
    local = kw.pop("local", LocalConfig(batch_size=4))
    cfg = FederationConfig(**{"rounds": 3, "participation": 0.5, "seed": 1, "local": local, **kw})
    return Federation(parse_method(spec), data, xi, cfg)


@pytest.mark.parametrize("spec", ["fedfs", "feduv"])
def test_federation_lowers_the_loss(spec: str, xi, data) -> None:
    f = fed(spec, xi, data, participation=1.0, local=LocalConfig(batch_size=4, lr=0.05 if spec == "fedfs" else 0.1))
    recs = f.run(4)
    first = [r.metrics["loss_first"] for r in recs]
    assert first[-1] < first[0] - 0.02, first             # each round starts from a better global model
    assert all(r.participants == 6 and r.num_samples == 51 for r in recs)
    if f.store is not None:
        assert f.store.touched().tolist() == list(range(6))


def test_participation_and_sampling_are_deterministic(xi, data) -> None:
    a, b = fed("feduv", xi, data), fed("feduv", xi, data)
    assert a.clients_per_round == 3
    pa = [a.sample_participants() for _ in range(3)]
    pb = [b.sample_participants() for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb))
    assert all(len(set(p.tolist())) == 3 for p in pa)
    assert client_seed(0, 1, 2) != client_seed(0, 2, 1)


@pytest.mark.parametrize("spec", ["fedfs+feduv", "feduv:neg=early,neg_rounds=1"])
def test_resume_reproduces_the_next_round_exactly(spec: str, xi, data, tmp_path) -> None:
    full = fed(spec, xi, data)
    full.run(1)
    ck = full.save(checkpoint_path(tmp_path, 1))
    torch.manual_seed(1234)                      # unrelated global RNG use between save and load
    full.run(2)
    resumed = fed(spec, xi, data)
    resumed.load(latest_checkpoint(tmp_path))
    assert resumed.round == 1 and len(resumed.history) == 1
    resumed.run(2)
    for k, v in full.global_weights.items():
        assert torch.equal(v, resumed.global_weights[k]), k
    if full.store is not None:
        a, b = full.store.state_tensors(), resumed.store.state_tensors()
        assert torch.equal(a["rows"], b["rows"]) and torch.equal(a["data"], b["data"])
    assert full.history[1].metrics == resumed.history[1].metrics


def test_checkpoint_of_another_run_is_refused(xi, data, tmp_path) -> None:
    f = fed("feduv", xi, data)
    f.run(1)
    ck = f.save(tmp_path / "a.safetensors")
    other = fed("feduv:c=255", xi, data)
    with pytest.raises(CheckpointError, match="different run"):
        other.load(ck)
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        f.load(tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="not found"):
        f.load(tmp_path / "missing.safetensors")


def test_chunking_and_executor_do_not_change_the_round(xi, data) -> None:
    ref = fed("fedfs", xi, data, chunk_size=64, executor="sequential")
    ref.run(1)
    for kw in ({"chunk_size": 1, "executor": "sequential"}, {"chunk_size": 2, "executor": "batched"}):
        other = fed("fedfs", xi, data, **kw)
        other.run(1)
        for k, v in ref.global_weights.items():
            assert torch.allclose(v, other.global_weights[k], atol=1e-5), (kw, k)
        for c in ref.store.touched().tolist():
            a, b = ref.private_weights(c), other.private_weights(c)
            assert all(torch.allclose(a["personal"][k], b["personal"][k], atol=1e-5) for k in a["personal"])


def test_pretrained_only_has_no_rounds(xi, data) -> None:
    f = fed("pretrained", xi, data)
    assert f.run() == [] and f.round == 0
    with pytest.raises(InputError, match="does not train"):
        f.run_round()


def test_bad_config() -> None:
    with pytest.raises(InputError, match="participation"):
        FederationConfig(participation=0)
    with pytest.raises(InputError, match="rounds"):
        FederationConfig(rounds=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("location", ["pinned", "cuda"])
def test_cuda_round_with_half_precision_store_matches_cpu(location: str, xi, data) -> None:
    cpu = fed("fedfs", xi, data, executor="sequential")
    cpu.run(2)
    gpu = fed("fedfs", xi, data, device="cuda", executor="batched", store_dtype="fp16", store_location=location,
              local=LocalConfig(batch_size=4, amp="bf16"))
    gpu.run(2)
    for k, v in cpu.global_weights.items():
        assert torch.allclose(v, gpu.global_weights[k], atol=5e-2), k
    assert gpu.store.touched().tolist() == cpu.store.touched().tolist()
