"""The batched executor's paths give the sequential updates: the client-folded trunk and vmap,
ξ computed once or at every step, uint8 or float images, 1×1 convolutions as convolutions or
matrix products; a chunk that runs out of memory is split and retried with the same result;
chunks are sized from a memory probe before the first one is built."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest_sim import RandomClients, make_tasks, max_diff, setup_method, xi  # noqa: F401
from device_sim.executors import (BatchedExecutor, ChunkResult, ClientTask, LocalConfig, MemoryPlan,
                                  SequentialExecutor, train_splitting)
from device_sim.methods import parse_method
from device_sim.xi_cache import feature_caches
from device_sim.executors.folding import NotFoldable, check_folding, fold_input, fold_module, folded_call, unfold_output
from fedfs_sdk.nn.backbones import get_backbone
from fedfs_sdk.nn.model import FaceNet, ModelConfig

# every layer trained (the papers' scope): the trunk is what the folded path folds
SPECS = ["fedfs:scope=all", "feduv:scope=all", "fedfs+feduv:scope=all"]


@pytest.fixture(scope="module")
def data() -> RandomClients:
    return RandomClients()


def _uint8(tasks: list[ClientTask]) -> list[ClientTask]:
    """The same clients with their images as uint8 pixel levels (quantized first, so both
    forms hold the same values)."""
    levels = [torch.round(t.images * 127.5 + 127.5).clamp(0, 255) for t in tasks]
    for t, q in zip(tasks, levels):
        t.images = (q - 127.5) / 127.5
    return [ClientTask(t.client, q.to(torch.uint8), t.params, t.consts, t.seed) for t, q in zip(tasks, levels)]


@pytest.mark.parametrize("spec", SPECS)
def test_folded_and_vmap_equal_sequential(spec: str, xi, data) -> None:
    m = setup_method(spec, xi)
    plan, tasks = make_tasks(m, data, [0, 1, 2, 3])           # 7, 12, 5, 9 images: padded, masked steps
    cfg = LocalConfig(batch_size=4)
    seq = SequentialExecutor().train(m, plan, tasks, cfg)
    folded_ex = BatchedExecutor("cpu")
    folded = folded_ex.train(m, plan, tasks, cfg)
    assert folded_ex.path == "folded", folded_ex.path_note
    vm_ex = BatchedExecutor("cpu", fold="off")
    vm = vm_ex.train(m, plan, tasks, cfg)
    assert vm_ex.path == "vmap"
    start = {g: {k: torch.stack([t.params[g][k] for t in tasks]) for k in w} for g, w in tasks[0].params.items()}
    moved = max_diff(seq.params, start)
    assert moved > 1e-4                                      # the weights moved: the equality is not trivial
    # The paths sum the same float32 terms in other orders (and torch's thread count changes the
    # order again: one thread per xdist worker in CI): the bound is float rounding relative to
    # the update, not a fixed 1e-5 (fedfs+feduv, one thread: vmap 1.05e-5 off on an update of 4.56).
    bound = max(1e-5, 1e-4 * moved)
    assert max_diff(seq.params, folded.params) < bound, (moved, bound)
    assert max_diff(seq.params, vm.params) < bound, (moved, bound)
    assert torch.equal(folded.client_steps, seq.client_steps)
    for k in seq.metrics:
        assert torch.allclose(seq.metrics[k], folded.metrics[k], atol=1e-5), k


def test_folded_mobilefacenet_with_matmul_pointwise_equals_sequential(data) -> None:
    """MobileFaceNet at 32 px ends in 2×2 maps, where group-norm gradients amplify rounding:
    measured 3.3e-5 (vmap and folded alike) against the sequential executor at 2 torch threads,
    1.2e-7 at 1 thread — the order of mkldnn's threaded reductions, not the math. The bound is
    above that and 15× under the weights' movement (1.5e-3)."""
    torch.manual_seed(0)
    xi_m = FaceNet(ModelConfig("mobilefacenet", embedding_dim=32, input_size=32)).eval().requires_grad_(False)
    m = setup_method("fedfs:scope=all", xi_m)
    plan, tasks = make_tasks(m, data, [0, 2])
    cfg = LocalConfig(batch_size=4, local_epochs=1)
    seq = SequentialExecutor().train(m, plan, tasks, cfg)
    for pointwise, channels_last in (("conv", False), ("matmul", False), ("conv", True)):
        ex = BatchedExecutor("cpu", pointwise=pointwise, channels_last=channels_last)
        got = ex.train(m, plan, tasks, cfg)
        assert ex.path == "folded"
        assert max_diff(seq.params, got.params) < 1e-4, (pointwise, channels_last)


@pytest.mark.parametrize("spec", ["fedfs", "fedfs+feduv"])
def test_frozen_stem_once_per_chunk_gives_the_sequential_updates(spec: str, xi, data, monkeypatch) -> None:
    """scope=top (the SDK default): the batched executor runs ξ's frozen trunk once per image of
    the chunk and trains only the top on its outputs; the updates equal the sequential
    executor's (which runs the trunk inside the objective), and the trunk's tensors stay ξ's."""
    m = setup_method(spec, xi)
    assert m.scope == "top" and m.frozen_stem() is not None and not m.trunks() and m.trains is True
    assert parse_method("pretrained").trains is False       # the per-tensor hook leaves the class flag alone
    plan, tasks = make_tasks(m, data, [0, 1, 2, 3])
    cfg = LocalConfig(batch_size=4)
    seq = SequentialExecutor().train(m, plan, tasks, cfg)
    stem, calls = m.frozen_stem(), []

    def counted(*a, **k):
        calls.append(1)
        return stem(*a, **k)
    monkeypatch.setattr(m, "frozen_stem", lambda: counted)
    ex = BatchedExecutor("cpu")
    got = ex.train(m, plan, tasks, cfg)
    assert ex.path == "vmap" and len(calls) == 1              # 36 images, one batch of the stem
    assert max_diff(seq.params, got.params) < 1e-5
    start = {g: {k: torch.stack([t.params[g][k] for t in tasks]) for k in w} for g, w in tasks[0].params.items()}
    moved = [k for g, w in got.params.items() for k in w if not torch.equal(w[k], start[g][k])]
    assert moved and all(m.trains_tensor("global", k) for k in moved), moved     # only the top moved …
    frozen = [k for k in start["global"] if not m.trains_tensor("global", k)]
    assert frozen and all(torch.equal(seq.params[g][k], start[g][k]) for g in start for k in start[g] if k in frozen)


def test_xi_once_gives_the_updates_of_xi_at_every_step(xi, data) -> None:
    """ξ is frozen: its features computed once per image (per chunk, or cached for the run by the
    federation) give the same client updates as running ξ inside every local step."""
    m = setup_method("fedfs+feduv:scope=all", xi)
    plan, tasks = make_tasks(m, data, [0, 1, 3])
    cfg = LocalConfig(batch_size=4)
    every_step = BatchedExecutor("cpu", xi_once=False).train(m, plan, tasks, cfg)
    once = BatchedExecutor("cpu").train(m, plan, tasks, cfg)
    assert max_diff(every_step.params, once.params) <= 1e-5
    seq_every = SequentialExecutor().train(m, plan, tasks, cfg)
    for t in tasks:                                            # as the federation's XiCache hands them over
        with torch.no_grad():
            t.xi_features = xi(t.images).embedding
    seq_cached = SequentialExecutor().train(m, plan, tasks, cfg)
    assert max_diff(seq_every.params, seq_cached.params) <= 1e-5


def test_uint8_images_give_the_float_updates(xi, data) -> None:
    m = setup_method("fedfs:scope=all", xi)
    plan, tasks = make_tasks(m, data, [0, 1])
    u8 = _uint8(tasks)
    cfg = LocalConfig(batch_size=4)
    for ex in (SequentialExecutor(), BatchedExecutor("cpu")):
        a = ex.train(m, plan, tasks, cfg)
        b = ex.train(m, plan, u8, cfg)
        assert max_diff(a.params, b.params) == 0.0, ex.name


# ---- folding -----------------------------------------------------------------------------------

def test_fold_input_and_output_layouts() -> None:
    x = torch.arange(2 * 3 * 4 * 1 * 1, dtype=torch.float32).reshape(2, 3, 4, 1, 1)   # [K, B, C, H, W]
    f = fold_input(x)
    assert f.shape == (3, 8, 1, 1)
    assert torch.equal(f[1, 4:8, 0, 0], x[1, 1, :, 0, 0])      # client 1's channels follow client 0's
    assert torch.equal(unfold_output(f.flatten(1), 2), x.flatten(2))


@pytest.mark.parametrize("name,size", [("tiny", 32), ("mobilefacenet", 32), ("mobilefacenet-affine", 32),
                                       ("feduv_cnn", 64), ("insightface-mbf", 32)])
def test_every_backbone_folds_exactly(name: str, size: int) -> None:
    kw = {"width": 4, "embedding_dim": 64} if name == "feduv_cnn" else {}
    net = get_backbone(name, input_size=size, **kw)
    err = check_folding(net, fold_module(net), size, torch.device("cpu"), clients=3)
    assert err < 1e-5


class _Mixer(nn.Module):
    """A backbone whose forward mixes channels (a mean over them): not per client when folded."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, 2, 1, bias=False)
        self.input_size = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return (y - y.mean(dim=1, keepdim=True)).flatten(1)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(3)
        self.input_size = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).flatten(1)


def test_folding_refuses_what_it_cannot_prove() -> None:
    mixer = _Mixer()
    with pytest.raises(NotFoldable, match="mixes channels"):
        check_folding(mixer, fold_module(mixer), 8, torch.device("cpu"))
    with pytest.raises(NotFoldable, match="BatchNorm2d"):
        fold_module(_Odd())
    dlib = get_backbone("dlib-resnet")            # zero-pads channels in its residual adds: not per client
    with pytest.raises(NotFoldable, match="not per channel"):
        check_folding(dlib, fold_module(dlib), 150, torch.device("cpu"), batch=1)


def test_folded_call_gradients_match_autograd_per_client() -> None:
    net = get_backbone("tiny", input_size=32, embedding_dim=8, width=4)
    folded = fold_module(net)
    g = torch.Generator().manual_seed(1)
    params = {k: (v.unsqueeze(0) + 0.1 * torch.randn((2,) + tuple(v.shape), generator=g)).requires_grad_()
              for k, v in net.state_dict().items()}
    x = torch.randn(2, 3, 3, 32, 32, generator=g)
    out = folded_call(folded, params, x)
    out.square().sum().backward()
    for c in range(2):
        own = {k: v[c].detach().clone().requires_grad_() for k, v in params.items()}
        torch.func.functional_call(net, own, (x[c],)).square().sum().backward()
        for k in own:
            torch.testing.assert_close(params[k].grad[c], own[k].grad, rtol=1e-4, atol=1e-5)


# ---- out of memory ------------------------------------------------------------------------------

class _SmallMemory(BatchedExecutor):
    """A CPU executor that 'runs out of memory' above ``limit`` clients, as CUDA would."""

    def __init__(self, limit: int, **kw) -> None:
        super().__init__("cpu", **kw)
        self.limit, self.calls = limit, []

    def train(self, method, plan, tasks, cfg, max_steps=None):
        self.calls.append(len(tasks))
        if len(tasks) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.91 GiB (injected)")
        return super().train(method, plan, tasks, cfg, max_steps)


def test_out_of_memory_chunk_is_split_and_gives_the_unsplit_result(xi, data) -> None:
    m = setup_method("fedfs:scope=all", xi)
    plan, tasks = make_tasks(m, data, [0, 1, 2, 3, 4])
    cfg = LocalConfig(batch_size=4)
    whole = BatchedExecutor("cpu", chunk_size=5).train(m, plan, tasks, cfg)
    ex = _SmallMemory(limit=2, chunk_size=5)
    got = train_splitting(ex, m, plan, tasks, cfg)
    assert ex.calls == [5, 3, 2, 1, 2]            # 5 → 3 + 2 → (2 + 1) + 2
    assert ex.oom_splits == 2 and ex.chunk_size == 2
    assert got.clients == whole.clients and torch.equal(got.num_samples, whole.num_samples)
    assert max_diff(whole.params, got.params) < 1e-6
    for k in whole.metrics:
        assert torch.allclose(whole.metrics[k], got.metrics[k], atol=1e-6), k


def test_a_client_that_never_fits_says_what_to_change(xi, data) -> None:
    m = setup_method("fedfs:scope=all", xi)
    plan, tasks = make_tasks(m, data, [0, 1])
    with pytest.raises(torch.OutOfMemoryError, match="one client .* does not fit.*--batch-size"):
        train_splitting(_SmallMemory(limit=0), m, plan, tasks, LocalConfig(batch_size=4))


def test_chunk_result_concat_keeps_client_order() -> None:
    def res(clients, v):
        k = len(clients)
        return ChunkResult(clients, torch.full((k,), 3), {"global": {"w": torch.full((k, 2), v)}},
                           {"loss_mean": torch.full((k,), v)}, k, torch.ones(k, dtype=torch.long))
    out = ChunkResult.concat([res([4, 1], 1.0), res([7], 2.0)])
    assert out.clients == [4, 1, 7] and out.steps == 3
    assert out.params["global"]["w"][:, 0].tolist() == [1.0, 1.0, 2.0]


# ---- calibration ----------------------------------------------------------------------------------

def test_memory_plan_from_probes_hand_computed() -> None:
    mib = 2 ** 20
    # 1 client: 1,100 MiB, 2 clients: 2,100 MiB → 1,000 MiB per client, 100 MiB fixed;
    # 0.8 × 80,000 MiB free − 100 = 63,900 → 63 clients
    p = MemoryPlan.from_probes([(1, 1100 * mib, 80000 * mib), (2, 2100 * mib, 80000 * mib)], 0.8)
    assert (p.chunk_size, p.per_client, p.fixed) == (63, 1000 * mib, 100 * mib)
    one = MemoryPlan.from_probes([(1, 1100 * mib, 80000 * mib)], 0.8)      # one probe: all of it per client
    assert one.chunk_size == 58 and one.fixed == 0
    assert MemoryPlan.from_probes([(1, 900 * mib, 100 * mib)], 0.5).chunk_size == 1
    assert "63 clients" in p.describe()


class _ProbedExecutor(BatchedExecutor):
    """CPU executor with a fake memory probe: 'peak' grows with the images and weights the probe
    step holds, like CUDA memory would; records the order of probes and chunks."""

    def __init__(self, events: list, free: int) -> None:
        super().__init__("cpu")
        self.needs_calibration = True
        self.events = events

        def probe(fn):
            self.events.append("probe")
            fn()
            return free, self._last_k * 1000 + 500
        self.probe = probe

    def train(self, method, plan, tasks, cfg, max_steps=None):
        self._last_k = len(tasks)
        if max_steps is None:
            self.events.append(("chunk", len(tasks)))
        return super().train(method, plan, tasks, cfg, max_steps)


def test_federation_calibrates_before_building_the_first_chunk(xi, data) -> None:
    from device_sim.federation import Federation, FederationConfig

    events: list = []
    fed = Federation(parse_method("fedfs:scope=all"), data, xi,
                     FederationConfig(rounds=1, participation=1.0, local=LocalConfig(batch_size=4), executor="batched"))
    fed.executor = _ProbedExecutor(events, free=5000)     # (0.8 × 5000 − 500) / 1000 → 3 clients per chunk
    fed.run_round()
    assert events[:2] == ["probe", "probe"]
    assert events[2:] == [("chunk", 3), ("chunk", 3)]
    assert fed.executor.memory_plan.chunk_size == 3 and not fed.executor.needs_calibration


def test_federation_xi_cache_computes_each_client_once(xi, data) -> None:
    from device_sim.federation import Federation, FederationConfig

    fed = Federation(parse_method("fedfs:scope=all"), data, xi,
                     FederationConfig(rounds=2, participation=0.5, local=LocalConfig(batch_size=4)))
    calls = []
    (cache,) = fed.feature_caches
    real = cache.model.forward
    cache.model.forward = lambda x: (calls.append(int(x.shape[0])), real(x))[1]
    fed.run(2)
    assert len(cache) >= 3                                  # every participant of both rounds is cached
    assert sum(calls) == sum(int(data.x[c].shape[0]) for c in cache._v)   # each image once over 2 rounds


def test_federation_caches_the_frozen_stem_and_xi_on_it(xi, data) -> None:
    """scope=top: the trunk's outputs are computed once per image for the run, ξ's features from
    them (ξ's top, not ξ's trunk again); the batched federation gives the sequential one's model."""
    import copy

    from device_sim.federation import Federation, FederationConfig

    # the trunk's cache is per ξ module and lives as long as it (device_sim/trunk_cache.py): a ξ of
    # its own, so images an earlier test cached under the session's ξ do not hide trunk calls here
    xi = copy.deepcopy(xi)

    def run(executor: str) -> tuple[Federation, list[int]]:
        fed = Federation(parse_method("fedfs"), data, xi, FederationConfig(
            rounds=2, participation=0.5, executor=executor, local=LocalConfig(batch_size=4)))
        stem_cache, xi_cache = fed.feature_caches
        assert (stem_cache.attr, xi_cache.source) == ("stem_features", "stem_features")
        calls: list[int] = []
        real = stem_cache.model.forward
        stem_cache.model.forward = lambda x: (calls.append(int(x.shape[0])), real(x))[1]
        fed.run(2)
        return fed, calls
    batched, calls = run("batched")
    top = sum(v.numel() for g, w in batched.method.init_private(batched.global_weights).items() for k, v in w.items()
              if batched.method.trains_tensor(g, k))
    assert batched.store.params_per_client == top                     # the frozen trunk is not stored per client
    assert sum(calls) == sum(int(data.x[c].shape[0]) for c in batched.feature_caches[0]._v)
    sequential, _ = run("sequential")
    assert max_diff({"g": batched.global_weights}, {"g": sequential.global_weights}) < 1e-5


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_real_cuda_out_of_memory_is_split_and_retried(data) -> None:
    """A real CUDA OOM: the process is capped so that a chunk of 4 MobileFaceNet@112 clients does
    not fit but 2 do; the split result equals the unsplit one."""
    torch.manual_seed(0)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    xi_m = FaceNet(ModelConfig("mobilefacenet", input_size=112)).eval().requires_grad_(False)
    m = setup_method("fedfs:scope=all", xi_m, device="cuda")
    g = torch.Generator().manual_seed(0)
    plan = m.configure_round(1, np.arange(4))
    w = m.init_global()
    tasks = [ClientTask(c, torch.randint(0, 256, (20, 3, 112, 112), generator=g, dtype=torch.uint8),
                        {"global": w, **m.init_private(w)}, {}, seed=c) for c in range(4)]
    cfg = LocalConfig(batch_size=10, local_epochs=1)
    whole = BatchedExecutor("cuda", chunk_size=4).train(m, plan, tasks, cfg)
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    BatchedExecutor("cuda", chunk_size=1).train(m, plan, tasks[:1], cfg)
    one = torch.cuda.max_memory_allocated(dev) - base
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + 2.6 * one) / total), dev)
    try:
        ex = BatchedExecutor("cuda", chunk_size=4)
        got = train_splitting(ex, m, plan, tasks, cfg)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert ex.oom_splits >= 1 and ex.chunk_size <= 2
    assert got.clients == whole.clients
    cpu = {gr: {k: v.cpu() for k, v in wt.items()} for gr, wt in got.params.items()}
    assert max_diff({gr: {k: v.cpu() for k, v in wt.items()} for gr, wt in whole.params.items()}, cpu) < 1e-4


@pytest.mark.gpu
def test_cuda_calibration_sizes_the_chunk_before_training(data) -> None:
    torch.manual_seed(0)
    xi_m = FaceNet(ModelConfig("mobilefacenet", input_size=112)).eval().requires_grad_(False)
    m = setup_method("fedfs:scope=all", xi_m, device="cuda")
    plan = m.configure_round(1, np.arange(2))
    w = m.init_global()
    tasks = [ClientTask(c, torch.zeros(57, 3, 112, 112, dtype=torch.uint8), {"global": w, **m.init_private(w)}, {},
                        seed=c) for c in range(2)]
    ex = BatchedExecutor("cuda")
    assert ex.needs_calibration
    p = ex.calibrate(m, plan, tasks, LocalConfig(batch_size=10, amp="bf16"))
    assert not ex.needs_calibration and ex.chunk_size == p.chunk_size >= 1
    assert p.per_client > 0 and p.chunk_size * p.per_client + p.fixed <= p.free


def test_sequential_shares_the_frozen_trunk_when_the_stem_features_are_given(xi, data) -> None:
    """With the federation's stem outputs (scope=top) the sequential executor hands every client
    the round's frozen trunk tensors instead of private copies: the result broadcasts them
    (stride 0), they are the round's tensors untouched, and the top's updates are those of the
    path that runs the trunk inside the objective."""
    m = setup_method("fedfs+feduv", xi)
    plan, tasks = make_tasks(m, data, [0, 1, 2])
    cfg = LocalConfig(batch_size=4)
    ref = SequentialExecutor().train(m, plan, tasks, cfg)          # no stem features: private copies
    before = {g: {k: v.clone() for k, v in w.items()} for g, w in tasks[0].params.items()}
    for cache in feature_caches(m, "cpu", "off"):
        cache.fill(tasks)
    assert all(t.stem_features is not None for t in tasks)
    got = SequentialExecutor().train(m, plan, tasks, cfg)
    assert max_diff(ref.params, got.params) < 1e-5
    frozen = [(g, k) for g, w in got.params.items() for k in w if not m.trains_tensor(g, k)]
    assert frozen
    for g, k in frozen:
        assert got.params[g][k].stride(0) == 0, (g, k)
        assert torch.equal(got.params[g][k][0], before[g][k]) and torch.equal(tasks[0].params[g][k], before[g][k])
    top = [(g, k) for g, w in got.params.items() for k in w if m.trains_tensor(g, k)]
    assert top and all(got.params[g][k].stride(0) != 0 for g, k in top)
