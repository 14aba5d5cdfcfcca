"""Data where the training is: the uint8 client image store, the chunk feed with prefetching,
and --data-cache's plan (device_sim/image_store.py, device_sim/prefetch.py)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest_sim import xi  # noqa: F401
from device_sim.datasets import ImageFolderDataset, SynthDataset
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig
from device_sim.image_store import DEVICE_SHARE, CachePlan, ClientImageStore, plan_data_cache
from device_sim.methods import parse_method
from device_sim.population import Population
from device_sim.prefetch import ChunkFeed, prefetch_enabled
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces, write_image_folder
from fedfs_sdk.errors import InputError

GB = 10 ** 9


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread (restored by conftest): these runs take < 1 s each with one, 10× more with
    two threads on a busy 2-core machine."""
    torch.set_num_threads(1)


def _pop(num_clients: int = 6, warmup: int = 2, size: int = 32) -> Population:
    ds = SynthDataset(SynthFaces(seed=4, image_size=size, num_threads=1), images_per_identity=12,
                      num_identities=40, cache_bytes=0)
    return Population(ds, make_splits(ds, num_public=0, num_clients=num_clients, num_new=1, train_per_client=6,
                                      test_per_client=3, warmup_per_user=warmup, seed=0))


def _plan(location: str, device: str = "cpu") -> CachePlan:
    return CachePlan(location, device, False, 0, None, "test")


def _with_store(location: str, **kw) -> Population:
    pop = _pop(**kw)
    pop.use_image_store(_plan(location))
    return pop


# ---- the store ------------------------------------------------------------------------------

@pytest.mark.parametrize("location", ["host", "none"])
def test_store_images_equal_the_datasets_exactly(location: str) -> None:
    """Every read through the store — train, test, warm-up, a chunk, the impostor pool — is the
    image the dataset renders, bit for bit (CPU)."""
    ref, pop = _pop(), _with_store(location)
    for c in range(ref.num_clients):
        assert torch.equal(pop.train_images(c), ref.train_images(c))
        assert torch.equal(pop.test_images(c), ref.test_images(c))
        assert torch.equal(pop.warmup_images(c), ref.warmup_images(c))
    chunk = pop.train_chunk([4, 1, 3])
    assert all(x.dtype == torch.uint8 for x in chunk)
    for c, x in zip([4, 1, 3], chunk):
        assert torch.equal((x.float() - 127.5) / 127.5, ref.train_images(c))
    ids, idx, own = ref.test_pairs(np.array([5, 0, 2]))
    keep = np.array([7, 0, 4, 3])                        # a sampled pool, out of order
    assert torch.equal(pop.images(ids[keep], idx[keep], clients=own[keep]), ref.images(ids[keep], idx[keep]))
    assert torch.equal(ref.train_chunk([2])[0], pop.train_chunk([2])[0])      # no store: the same uint8 API


def test_store_produces_each_image_once_and_chunks_equal_single_reads() -> None:
    pop = _with_store("host")
    ds, store = pop.dataset, pop.store
    a = torch.cat(pop.train_chunk([0, 3, 5]))             # one render of 18 images
    assert ds.rendered == 18 and store.produced == 18
    one = torch.cat([pop.train_chunk([c])[0] for c in (0, 3, 5)])      # served from the store
    assert torch.equal(a, one) and ds.rendered == 18
    pop.train_images(1)
    pop.test_images(3)
    pop.train_chunk([1, 0])
    assert ds.rendered == 18 + 6 + 3 and store.stats()["images_kept"] == 27
    none = _with_store("none")
    none.train_chunk([0])
    none.train_chunk([0])
    assert none.dataset.rendered == 12 and none.store.allocated_bytes == 0      # 'none' keeps nothing


def test_store_pages_hold_clients_across_page_boundaries() -> None:
    """Pages of 5 images: a client's run of rows spans pages; every image still comes back right."""
    ref = _pop()
    store = ClientImageStore(ref.dataset, ref.splits.clients, _plan("host"), page_bytes=5 * 3 * 32 * 32)
    u8, counts = store.images([2, 0, 5, 1], "train")
    assert counts == [6, 6, 6, 6] and len(store.pages) == 5 and store.page_rows == 5
    for c, x in zip([2, 0, 5, 1], torch.split(u8, counts)):
        assert torch.equal((x.float() - 127.5) / 127.5, ref.train_images(c))
    part, _ = store.images([0, 2], "test", positions=[np.array([2]), np.array([1, 0])])
    assert torch.equal((part.float() - 127.5) / 127.5, torch.cat([ref.test_images(0)[2:], ref.test_images(2)[[1, 0]]]))


def test_store_bad_requests() -> None:
    pop = _with_store("host")
    with pytest.raises(InputError, match="unknown client"):
        pop.store.images([6], "train")
    with pytest.raises(InputError, match="part must be"):
        pop.store.images([0], "public")
    with pytest.raises(InputError, match="out of range"):
        pop.store.images([0], "test", positions=[np.array([3])])
    with pytest.raises(InputError, match="unknown client"):
        pop.train_chunk([99])


def test_folder_store_decodes_each_file_once(tmp_path: Path) -> None:
    root = write_image_folder(SynthFaces(seed=2, image_size=32), tmp_path / "f", range(5), 6)
    ds = ImageFolderDataset(root, 32, cache_bytes=0)
    pop = Population(ds, make_splits(ds, 0, 4, 1, 4, 2, seed=0))
    ref = [pop.train_images(c) for c in range(4)]
    assert ds.decoded == 16
    ds.decoded = 0
    pop.use_image_store(_plan("host"))
    for _ in range(3):                                   # three "rounds" and an evaluation
        chunk = pop.train_chunk([0, 1, 2, 3])
    for c in range(4):
        assert torch.equal(pop.train_images(c), ref[c])
        pop.test_images(c)
    assert ds.decoded == 16 + 8                          # each train and test file once
    assert all(torch.equal((x.float() - 127.5) / 127.5, r) for x, r in zip(chunk, ref))


# ---- --data-cache: the plan -----------------------------------------------------------------------

def test_plan_auto_device_then_host_then_none() -> None:
    full = 10_000 * 67 * 3 * 112 * 112                   # the FedFS setting: 25.2 GB
    assert round(full / GB, 1) == 25.2
    on_gpu = plan_data_cache("auto", full, "cuda", free_device=110 * GB, free_host=100 * GB)
    assert on_gpu.location == "device" and "kept on cuda" in on_gpu.reason
    assert full <= DEVICE_SHARE * 110 * GB
    host = plan_data_cache("auto", full, "cuda", free_device=79 * GB, free_host=120 * GB)
    assert host.location == "host" and host.pinned and "25.21 GB" in host.reason and "79.00 GB" in host.reason
    none = plan_data_cache("auto", full, "cuda", free_device=79 * GB, free_host=24 * GB)
    assert none.location == "none" and "--data-cache none" in none.reason and "24.00 GB" in none.reason
    cpu = plan_data_cache("device", 10 ** 9, "cpu", free_host=24 * GB)      # on a CPU, 'device' is the RAM
    assert cpu.location == "host" and not cpu.pinned


def test_plan_refuses_an_explicit_store_that_does_not_fit() -> None:
    full = 25 * GB
    with pytest.raises(InputError, match=r"--data-cache device: .* more than 90% of the GPU's free 20.00 GB; "
                                         r"use --data-cache host"):
        plan_data_cache("device", full, "cuda", free_device=20 * GB)
    with pytest.raises(InputError, match=r"--data-cache host: .*available RAM \(24.00 GB\); use --data-cache none"):
        plan_data_cache("host", full, "cpu", free_host=24 * GB)
    with pytest.raises(InputError, match="must be one of auto, device, host, none"):
        plan_data_cache("gpu", full, "cpu")
    assert plan_data_cache("none", full, "cpu").location == "none"


def test_cli_data_cache_flag(capsys) -> None:
    from fedfs_sdk.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["simulate", "--data-cache", "somewhere"])
    assert e.value.code == 2 and "argument --data-cache: invalid choice: 'somewhere'" in capsys.readouterr().err


# ---- the chunk feed and prefetching ---------------------------------------------------------

class _Counting:
    """Float per-client data (no train_chunk) that records which thread prepared each client."""

    def __init__(self, n: int) -> None:
        self.num_clients, self.calls, self.threads = n, [], set()

    def train_images(self, c: int, device=None) -> torch.Tensor:
        self.calls.append(c)
        self.threads.add(threading.current_thread().name)
        return torch.full((2, 3, 4, 4), float(c))


@pytest.mark.parametrize("prefetch", [False, True])
def test_feed_cuts_once_and_follows_a_shrinking_chunk_size(prefetch: bool) -> None:
    """The chunk size reads 8, 8, 8, then 3: chunk 2 was cut at 8 and is handed out in pieces
    of 3 (and a rest) without preparing any client twice."""
    data, sizes = _Counting(20), iter([8, 8, 8])
    got = [(c.tolist(), [int(x[0, 0, 0, 0]) for x in imgs]) for c, imgs in
           ChunkFeed(data, np.arange(20), lambda: next(sizes, 3), "cpu", prefetch)]
    assert [c for c, _ in got] == [list(range(0, 8)), [8, 9, 10], [11, 12, 13], [14, 15], [16, 17, 18], [19]]
    assert all(c == i for c, i in got)                   # each client with its own images
    assert sorted(data.calls) == list(range(20))         # each prepared once
    assert ("fedfs-prefetch" in " ".join(data.threads)) == prefetch


def test_feed_partition_is_the_same_with_and_without_prefetch() -> None:
    def run(prefetch: bool) -> list[list[int]]:
        seq = iter([5, 5, 2, 4, 4, 1, 7, 7, 7, 7, 7, 7, 7, 7])
        return [c.tolist() for c, _ in ChunkFeed(_Counting(30), np.arange(30), lambda: next(seq, 3), "cpu", prefetch)]

    assert run(True) == run(False)


def _federation(pop, xi, prefetch: str, executor: str = "sequential", chunk: int = 0) -> Federation:
    cfg = FederationConfig(rounds=2, participation=0.7, seed=3, executor=executor, chunk_size=chunk, prefetch=prefetch,
                           local=LocalConfig(batch_size=3))
    f = Federation(parse_method("fedfs"), pop, xi, cfg)
    f.run()
    return f


def _same(a: Federation, b: Federation) -> None:
    for k, v in a.global_weights.items():
        assert torch.equal(v, b.global_weights[k]), k
    for c in a.store.touched().tolist():
        pa, pb = a.private_weights(c), b.private_weights(c)
        assert all(torch.equal(pa[g][k], pb[g][k]) for g in pa for k in pa[g]), c
    assert [h.metrics for h in a.history] == [h.metrics for h in b.history]


def test_store_and_prefetch_change_no_federation_result(xi) -> None:
    """No store, a host store, no store kept ('none'), prefetch on (a CPU thread) or off,
    batched chunks of 2: the same weights, bit for bit."""
    ref = _federation(_pop(num_clients=5), xi, "off")
    _same(ref, _federation(_with_store("host", num_clients=5), xi, "off"))
    _same(ref, _federation(_with_store("none", num_clients=5), xi, "on"))
    pop = _with_store("host", num_clients=5)
    _same(ref, _federation(pop, xi, "on"))
    assert pop.store.produced == pop.store.stats()["images_kept"]             # nothing rendered twice
    batched = _federation(_pop(num_clients=5), xi, "off", executor="batched", chunk=2)
    _same(batched, _federation(_with_store("host", num_clients=5), xi, "on", executor="batched", chunk=2))


def test_evaluation_reads_through_the_store(xi) -> None:
    from device_sim.evaluate import EvalConfig, evaluate

    ref, pop = _pop(num_clients=4), _with_store("host", num_clients=4)
    fa, fb = _federation(ref, xi, "off"), _federation(pop, xi, "off")
    cfg = EvalConfig(batch_size=64, impostor_pool=8)
    ra = evaluate(fa.method, fa.global_weights, fa.private_weights, ref, cfg)
    before = pop.store.produced
    rb = evaluate(fb.method, fb.global_weights, fb.private_weights, pop, cfg)
    assert json.dumps(ra, sort_keys=True) == json.dumps(rb, sort_keys=True)      # NaN cells included
    assert pop.store.produced > before                   # test / warm-up images came through the store
    evaluate(fb.method, fb.global_weights, fb.private_weights, pop, cfg)
    new = pop.splits.new_users[0]                         # not clients: rendered per evaluation, not kept
    assert pop.dataset.rendered == pop.store.produced + 2 * (new.train.size + new.test.size)


def test_prefetch_modes() -> None:
    assert prefetch_enabled("auto", "cuda") and not prefetch_enabled("auto", "cpu")
    assert prefetch_enabled("on", "cpu") and not prefetch_enabled("off", "cuda")
    with pytest.raises(InputError, match="prefetch must be one of"):
        FederationConfig(prefetch="sometimes")


# ---- rendering in large batches ---------------------------------------------------------------

def test_large_batch_render_equals_one_at_a_time() -> None:
    faces = SynthFaces(seed=6, image_size=32, num_threads=1)
    ids, idx = np.arange(150) % 17, np.arange(150)
    big = SynthFaces(seed=6, image_size=32, num_threads=1, chunk_size=150).render_u8(ids, idx)
    assert torch.equal(big, faces.render_u8(ids, idx))                    # default chunks (128 at 32 px)
    for j in (0, 77, 149):
        assert torch.equal(faces.render_u8(int(ids[j]), int(idx[j]))[0], big[j])


def test_cuda_render_chunk_fits_its_budget() -> None:
    from device_sim.synthfaces.generator import CUDA_RENDER_BUDGET_BYTES, RENDER_BYTES_PER_PIXEL

    f = SynthFaces(image_size=112)
    n = f.chunk_images("cuda")
    assert n * RENDER_BYTES_PER_PIXEL * 112 * 112 <= CUDA_RENDER_BUDGET_BYTES < (n + 1) * RENDER_BYTES_PER_PIXEL * 112 * 112
    assert f.chunk_images("cpu") == (1 << 17) // (112 * 112) and SynthFaces(chunk_size=9).chunk_images("cuda") == 9


# ---- CUDA ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("location", ["device", "host"])
def test_cuda_store_matches_cpu_render_and_is_where_asked(location: str) -> None:
    ref = _pop(size=112)
    pop = _pop(size=112)
    plan = CachePlan(location, "cuda", location == "host", pop.image_store_bytes(), None, "test")
    pop.use_image_store(plan)
    chunk = pop.train_chunk([0, 2, 4], "cuda")
    assert all(x.is_cuda and x.dtype == torch.uint8 for x in chunk)
    page = pop.store.pages[0]
    assert page.is_cuda if location == "device" else (page.is_pinned() and not page.is_cuda)
    for c, x in zip([0, 2, 4], chunk):
        diff = (x.cpu().float() - (ref.train_images(c) * 127.5 + 127.5)).abs()
        # CUDA's float rounding in the renderer (transcendentals, fused multiply-adds) moves a few pixel
        # levels near soft edges: measured up to 5 levels at 112 px on an H200 (2026-11-26; 2 at 32 px)
        assert float(diff.max()) <= 6.01 and float((diff > 0.5).float().mean()) < 0.01
    again = pop.train_chunk([4, 0], "cuda")
    assert torch.equal(again[0], chunk[2]) and torch.equal(again[1], chunk[0])


@pytest.mark.gpu
def test_cuda_prefetch_on_a_side_stream_changes_no_result(xi) -> None:
    """What prefetching controls — the images each chunk trains on — is bit-equal; the weights
    agree to float tolerance (on CUDA two runs of the same training are not bit-equal: the
    convolution backward kernels reduce with atomics; measured on an H200, 2026-11-26)."""
    def run(prefetch: str) -> tuple[Federation, list[bytes]]:
        pop = _pop(num_clients=5)
        pop.use_image_store(CachePlan("host", "cuda", True, pop.image_store_bytes(), None, "test"))
        cfg = FederationConfig(rounds=2, participation=0.7, seed=3, device="cuda", executor="batched", chunk_size=2,
                               prefetch=prefetch, local=LocalConfig(batch_size=3))
        f = Federation(parse_method("fedfs"), pop, xi, cfg)
        seen: list[bytes] = []
        train = f.executor.train

        def recording(method, plan, tasks, local, max_steps=None):
            seen.extend(t.images.cpu().numpy().tobytes() for t in tasks)
            return train(method, plan, tasks, local, max_steps)
        f.executor.train = recording
        f.run()
        return f, seen

    (a, seen_a), (b, seen_b) = run("off"), run("on")
    assert seen_a == seen_b and len(seen_a) >= 7
    for k, v in a.global_weights.items():
        torch.testing.assert_close(v, b.global_weights[k], rtol=1e-4, atol=1e-5)
    for c in a.store.touched().tolist():
        pa, pb = a.private_weights(c), b.private_weights(c)
        for g in pa:
            for k in pa[g]:
                torch.testing.assert_close(pa[g][k].float(), pb[g][k].float(), rtol=1e-4, atol=1e-4)
