"""The round loop: FedAvg through server_agg, loss goes down, exact resume, chunk invariance."""
from __future__ import annotations

import json

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
    # bit equality is what the design promises here: the same code path, executor and seeds
    # on the same machine, deterministic CPU ops, state restored bit for bit (safetensors)
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


# ---- review fixes -----------------------------------------------------------------------------

def _saved(f: Federation, path):
    f.run(1)
    return f.save(path)


def test_resume_refuses_other_data_split_or_xi(xi, data, tmp_path) -> None:
    import copy

    from device_sim.datasets import SynthDataset
    from device_sim.population import Population
    from device_sim.splits import make_splits
    from device_sim.synthfaces import SynthFaces
    from fedfs_sdk.nn.checkpoint import read_safetensors, write_safetensors_atomic

    ck = _saved(fed("feduv", xi, data), tmp_path / "a.safetensors")
    fed("feduv", xi, data).load(ck)                                         # same everything: fine
    with pytest.raises(CheckpointError, match=r"data\.images"):            # same count, other images
        fed("feduv", xi, RandomClients(seed=1)).load(ck)
    xi2 = copy.deepcopy(xi)
    with torch.no_grad():
        next(xi2.parameters()).add_(1e-3)
    with pytest.raises(CheckpointError, match=r"differs in: xi \(the pre-trained ξ weights\)$|differs in: xi "):
        fed("feduv", xi2, data).load(ck)
    # a Population: another split of the same dataset is named as such
    ds = SynthDataset(SynthFaces(0, 32), images_per_identity=5, num_identities=20, cache_bytes=0)
    pops = [Population(ds, make_splits(20, 2, 6, 1, 4, 1, seed=s)) for s in (0, 1)]
    ck2 = _saved(fed("feduv", xi, pops[0]), tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"data\.splits \(the public / client / new-user split\)"):
        fed("feduv", xi, pops[1]).load(ck2)
    # a checkpoint from before the fingerprints is refused with its own message
    tensors, meta = read_safetensors(ck, "fedfs-federation/1", "federation checkpoint")
    ident = json.loads(meta["identity"])
    meta["identity"] = json.dumps({k: v for k, v in ident.items() if k not in ("data", "xi")}, sort_keys=True)
    write_safetensors_atomic(tmp_path / "old.safetensors", tensors, meta)
    with pytest.raises(CheckpointError, match="no data/ξ fingerprints"):
        fed("feduv", xi, data).load(tmp_path / "old.safetensors")


def test_first_participation_starts_theta_c_from_the_current_global(xi, data) -> None:
    from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig

    lc = LocalConfig(batch_size=4, lr=0.05)
    for seed in range(20):                                   # a seed where some client joins in round 2
        r1, r2 = _rounds(fed("fedfs", xi, data, seed=seed), 2)
        if set(r2) - set(r1):
            break
    else:
        pytest.fail("no seed in 0..19 has a client that first trains in round 2")
    c = sorted(set(r2) - set(r1))[0]                         # trains for the first time in round 2
    f = fed("fedfs", xi, data, seed=seed, local=lc)
    theta0 = {k: v.clone() for k, v in f.global_weights.items()}
    f.run(1)
    g2 = {k: v.clone() for k, v in f.global_weights.items()}
    assert f.private_weights(c) is None
    assert max(float((g2[k] - theta0[k]).abs().max()) for k in g2) > 1e-3   # the global model moved
    f.run(2)
    ref = LocalTrainer(f.method.model_config, TrainConfig(method="fedfs", batch_size=4, lr=0.05), xi=xi).train(
        g2, data.train_images(c), personal_weights=None, seed=client_seed(seed, 2, c))
    got = f.private_weights(c)["personal"]
    assert max(float((ref.personal_weights[k] - got[k]).abs().max()) for k in got) < 1e-6


def _rounds(f: Federation, n: int) -> list[list[int]]:
    return [f.sample_participants().tolist() for _ in range(n)]


def test_chunked_fedavg_does_not_round_chunk_means_to_float32(xi, data) -> None:
    ref = fed("fedfs", xi, data, participation=1.0, chunk_size=64, executor="sequential")
    ref.run(1)
    for chunk in (1, 4):                                    # 6 clients: chunks of 1, and of 4 + 2
        other = fed("fedfs", xi, data, participation=1.0, chunk_size=chunk, executor="sequential")
        other.run(1)
        # The design keeps chunk means in float64 and casts once: the chunking changes nothing
        # beyond float64 rounding, which can still land the one float32 cast on the other side
        # of a rounding boundary — so at most one float32 ulp (not bit equality; a float32
        # chunk mean would be off by many ulps).
        for k, v in ref.global_weights.items():
            o = other.global_weights[k]
            ulp = (torch.nextafter(v, torch.full_like(v, float("inf"))) - v).abs()
            assert bool(((v - o).abs() <= ulp).all()), (chunk, k, float((v - o).abs().max()))


def test_round_metrics_skip_clients_without_steps(xi) -> None:
    from device_sim.executors import ClientTask, SequentialExecutor

    d = RandomClients(num_clients=4, sizes=(1, 8, 6, 9))    # client 0: one image, FedFS needs batches of 2
    f = fed("fedfs", xi, d, participation=1.0)
    g0, priv = f.global_weights, f.method.init_private(f.global_weights)
    rec = f.run_round()
    plan = f.method.configure_round(1, np.arange(4))
    tasks = [ClientTask(c, d.train_images(c), {"global": g0, **priv}, {}, client_seed(1, 1, c)) for c in range(4)]
    for cache in f.feature_caches:       # the frozen features the federation computed for the run, as it hands them over
        cache.fill(tasks)
    res = SequentialExecutor().train(f.method, plan, tasks, LocalConfig(batch_size=4))
    # the mean over the 3 clients that trained (rel 1e-6: float rounding of the federation's float64
    # accumulation; a mean over all 4 clients would be 25 % off)
    for k, v in res.metrics.items():
        assert float(v[0]) == 0 and rec.metrics[k] == pytest.approx(float(v[1:].double().mean()), rel=1e-6), k
    assert rec.metrics["loss_mean"] > 0
    assert res.client_steps.tolist()[0] == 0 and min(res.client_steps.tolist()[1:]) > 0
    assert rec.participants == 4 and rec.clients_with_steps == 3
    lone = fed("fedfs", xi, RandomClients(num_clients=2, sizes=(1,)), participation=1.0).run_round()
    assert lone.clients_with_steps == 0 and lone.metrics == {}


def test_latest_checkpoint_orders_by_round_number(tmp_path) -> None:
    for name in ("round_99999.safetensors", "round_100000.safetensors", "round_00007.safetensors",
                 "round_x.safetensors", "round_200000.safetensors.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert latest_checkpoint(tmp_path).name == "round_100000.safetensors"
    assert checkpoint_path(tmp_path, 123456).name == "round_123456.safetensors"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_checkpoint_is_fsynced_before_the_rename(xi, data, tmp_path, monkeypatch) -> None:
    import os

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    f = fed("feduv", xi, data)
    f.save(tmp_path / "c.safetensors")
    assert events[:2] == ["fsync", "replace"] and events.count("fsync") >= 1
    if os.name == "posix":
        assert events[2:] == ["fsync"]                       # and the folder, so the rename is durable
    f.load(tmp_path / "c.safetensors")
