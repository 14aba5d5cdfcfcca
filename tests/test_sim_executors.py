"""Executors: the sequential one runs LocalTrainer's math; the batched (vmap) one gives the
same updates as the sequential one for uneven, padded, masked clients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_sim import RandomClients, make_tasks, max_diff, setup_method, xi  # noqa: F401
from device_sim.executors import (BatchedExecutor, LocalConfig, SequentialExecutor, client_batches, make_executor)
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig

SPECS = ["fedfs", "feduv", "fedfs+feduv:paper", "feduv:c=255,neg=all,neg_samples=3"]
# (the paper preset: the device trainer implements its lr; the default differs in lr and verifier only)


@pytest.fixture(scope="module")
def data() -> RandomClients:
    return RandomClients()


@pytest.mark.parametrize("spec,device_lr", [("fedfs", None), ("feduv", None), ("fedfs+feduv:paper", 5e-3),
                                             ("fedfs+feduv:norm_init=none", None)])
def test_sequential_equals_local_trainer(spec: str, device_lr, xi, data) -> None:
    """The simulator's local step is the device's; with ``device_lr=None`` the device's own
    default lr (fedfs_sdk.training.methods.DEFAULT_LR) must be the preset's, and with no scope the
    device's default scope (DEFAULT_SCOPE) the default preset's (a ``:paper`` preset trains every
    layer: the device is told so)."""
    m = setup_method(spec, xi)
    plan, tasks = make_tasks(m, data, [1])
    res = SequentialExecutor().train(m, plan, tasks, LocalConfig(batch_size=4))   # both default to DEFAULT_HEAD_LR
    t = tasks[0]
    scope = None if m.preset == "default" else m.scope
    ref = LocalTrainer(m.model_config, TrainConfig(method=m.sdk_method, lr=device_lr, batch_size=4, scope=scope),
                       xi=xi).train(
        t.params["global"], t.images, personal_weights=t.params.get("personal", {}).copy() or None,
        codeword=t.consts.get("codeword"), seed=t.seed)
    got = {k: v[0] for k, v in res.params["global"].items()}
    assert max(float((ref.weights[k] - got[k]).abs().max()) for k in got) < 1e-6
    if ref.personal_weights is not None:
        gp = {k: v[0] for k, v in res.params["personal"].items()}
        assert max(float((ref.personal_weights[k] - gp[k]).abs().max()) for k in gp) < 1e-6
    assert res.metrics["loss_first"][0] == pytest.approx(ref.metrics["loss_first"], rel=1e-5)


# fedfs+feduv:paper with momentum and weight decay amplifies float32 rounding: batched and
# sequential (the same math, other reduction orders) differ by 2.4e-6 at 2 torch threads and
# by 3.0e-4 at 1 thread (personal backbone; 1.2e-6 without momentum/decay at either count).
# The design promises the same math, not the same rounding, so that case gets a bound that
# rounding amplification stays under; every other case (and that spec without momentum/decay,
# below) keeps 1e-5, which catches a mask, momentum or decay applied on a skipped step.
AMPLIFIED = {"fedfs+feduv:paper": 1e-3}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("momentum,weight_decay", [(0.5, 1e-3), (0.0, 0.0)])
def test_batched_equals_sequential_on_uneven_clients(spec: str, momentum: float, weight_decay: float,
                                                     xi, data) -> None:
    m = setup_method(spec, xi)
    plan, tasks = make_tasks(m, data, [0, 1, 2, 3])          # 7, 12, 5, 9 images
    cfg = LocalConfig(batch_size=4, momentum=momentum, weight_decay=weight_decay)
    seq = SequentialExecutor().train(m, plan, tasks, cfg)
    bat = BatchedExecutor("cpu").train(m, plan, tasks, cfg)
    assert seq.clients == bat.clients and torch.equal(seq.num_samples, bat.num_samples)
    assert seq.steps == bat.steps and torch.equal(seq.client_steps, bat.client_steps)
    assert int(seq.client_steps.sum()) == seq.steps
    bound = AMPLIFIED.get(spec, 1e-5) if momentum else 1e-5
    assert max_diff(seq.params, bat.params) < bound
    # the weights did move, so the equality above is not trivial
    start = {g: {k: torch.stack([t.params[g][k] for t in tasks]) for k in w} for g, w in tasks[0].params.items()}
    assert max_diff(seq.params, start) > 1e-4
    for k in seq.metrics:
        assert torch.allclose(seq.metrics[k], bat.metrics[k], atol=bound), k


def test_client_batches_skip_lone_leftover_like_local_trainer() -> None:
    b = client_batches(9, 4, epochs=2, seed=3, min_batch=2)
    assert [len(i) for i in b] == [4, 4, 4, 4]                 # the leftover single image is skipped
    assert [len(i) for i in client_batches(9, 4, 1, 3, min_batch=1)] == [4, 4, 1]
    first = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(b[0], first[:4])


def test_make_executor_auto_and_errors() -> None:
    assert make_executor("auto", "cpu").name == "sequential"
    assert make_executor("batched", "cpu", 8).chunk_size == 8
    with pytest.raises(InputError, match="unknown executor"):
        make_executor("parallel", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="cuda"):
            make_executor("auto", "cuda")


def test_bad_learning_rate_and_empty_clients(xi, data) -> None:
    with pytest.raises(InputError, match="lr"):
        LocalConfig(lr=0)
    with pytest.raises(InputError, match="amp"):
        LocalConfig(amp="int8")
    m = setup_method("feduv", xi)
    plan, tasks = make_tasks(m, data, [0])
    with pytest.raises(InputError, match="no clients"):
        SequentialExecutor().train(m, plan, [], LocalConfig())
    tasks[0].images = torch.full_like(tasks[0].images, float("nan"))
    with pytest.raises(FloatingPointError, match="client 0"):
        SequentialExecutor().train(m, plan, tasks, LocalConfig())
    with pytest.raises(FloatingPointError, match=r"clients \[0\]"):
        BatchedExecutor("cpu").train(m, plan, tasks, LocalConfig())


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fedfs:scope=all", "fedfs+feduv:scope=all", "fedfs+feduv", "fedfs+feduv:paper",
                                  "feduv:neg=all,neg_samples=3"])
def test_batched_cuda_matches_sequential_cpu(spec: str, xi, data) -> None:
    """Every CUDA path (client-folded trunk with 1×1 as grouped conv or matmul, vmap) in float32
    equals the CPU sequential reference; bf16 lands close (H200, 2026-11-26: 1.5e-3 for fedfs
    with the weights moving 1.3e-2)."""
    m_cpu = setup_method(spec, xi)
    plan, tasks = make_tasks(m_cpu, data, [0, 1, 2, 3])
    cfg = LocalConfig(batch_size=4)
    ref = SequentialExecutor().train(m_cpu, plan, tasks, cfg)
    m_gpu = setup_method(spec, xi, device="cuda")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    for options in ({"pointwise": "conv"}, {"pointwise": "matmul"}, {"fold": "off"}):
        ex = BatchedExecutor("cuda", chunk_size=4, **options)
        got = ex.train(m_gpu, plan, tasks, cfg)
        # scope=top (the default) trains no trunk: nothing to fold, vmap over the top
        folds = options.get("fold") != "off" and bool(m_gpu.trunks())
        assert ex.path == ("folded" if folds else "vmap"), ex.path_note
        got_cpu = {g: {k: v.cpu() for k, v in w.items()} for g, w in got.params.items()}
        assert max_diff(ref.params, got_cpu) < 1e-4, options
    amp = BatchedExecutor("cuda", chunk_size=4).train(m_gpu, plan, tasks, LocalConfig(batch_size=4, amp="bf16"))
    amp_cpu = {g: {k: v.cpu() for k, v in w.items()} for g, w in amp.params.items()}
    start = {g: {k: torch.stack([t.params[g][k] for t in tasks]) for k in w} for g, w in tasks[0].params.items()}
    # bf16: close, not equal — fedfs measured on the H200 (a quarter of the movement); the other specs'
    # bound is the one the H100 run passed (their paper learning rates move the weights far more)
    bound = 0.25 * max_diff(ref.params, start) if spec.split(":")[0] in ("fedfs", "fedfs+feduv") and "paper" not in spec \
        else 5e-2
    assert max_diff(ref.params, amp_cpu) < bound
    assert all(torch.isfinite(v).all() for w in amp.params.values() for v in w.values())


@pytest.mark.gpu
def test_batched_cuda_calibrates_chunk_size(xi, data) -> None:
    m = setup_method("fedfs:scope=all", xi, device="cuda")
    plan, tasks = make_tasks(m, data, [0, 1])
    ex = BatchedExecutor("cuda")
    assert ex.needs_calibration
    plan_ = ex.calibrate(m, plan, tasks, LocalConfig(batch_size=4))   # the federation does this before chunk 1
    assert ex.chunk_size == plan_.chunk_size >= 1 and not ex.needs_calibration
