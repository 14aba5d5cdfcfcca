"""The federation's frozen-stem features and evaluation share one cache of ξ's trunk (issue 31)."""
from __future__ import annotations

import torch

from device_sim.executors import ClientTask
from device_sim.trunk_cache import cache_of, trunk_cache
from device_sim.xi_cache import FeatureCache
from fedfs_sdk.nn.model import FaceNet, ModelConfig


def test_stem_features_fill_the_run_trunk_cache_that_evaluation_reads():
    torch.manual_seed(0)
    xi = FaceNet(ModelConfig("tiny")).eval()
    cache = trunk_cache(xi.backbone)
    assert cache_of(cache.trunk) is cache and cache_of(xi.backbone) is None
    u8 = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    tasks = [ClientTask(0, u8[:3], {}), ClientTask(1, u8[3:], {})]
    FeatureCache(cache.trunk, "cpu", attr="stem_features").fill(tasks)
    assert cache.misses == 5 and cache.hits == 0
    x = (u8.float() - 127.5) / 127.5                     # what evaluation hands the trunk: the same images
    with torch.no_grad():
        ref = cache.trunk(x)
    again = cache(x)
    assert cache.misses == 5 and cache.hits == 5          # evaluation runs the trunk on none of them
    assert torch.allclose(again, ref, atol=1e-5)
    assert torch.allclose(torch.cat([t.stem_features for t in tasks]), ref, atol=1e-5)


def test_trunk_features_kept_between_runs_bit_for_bit_and_a_torn_file_is_rebuilt(tmp_path):
    from device_sim.trunk_cache import TrunkCache

    torch.manual_seed(1)
    xi = FaceNet(ModelConfig("tiny")).eval()
    x = torch.rand(6, 3, 32, 32) * 2 - 1
    first = TrunkCache(xi.backbone)
    path = first.persist(tmp_path)
    assert first.loaded == 0 and not path.exists()
    ref = first(x)
    assert first.misses == 6 and first.flush() == 6 and path.is_file()

    second = TrunkCache(xi.backbone)                 # the next run: a new cache of the same ξ
    assert second.persist(tmp_path) == path and second.loaded == 6
    calls = []
    second.trunk.register_forward_hook(lambda *a: calls.append(1))
    assert torch.equal(second(x), ref) and not calls and second.hits == 6      # the trunk ran on none
    assert second.flush() == 0                                                   # nothing new to write

    other = FaceNet(ModelConfig("tiny")).eval()      # other weights: another file, nothing read
    assert TrunkCache(other.backbone).persist(tmp_path) != path

    path.write_bytes(path.read_bytes()[:-40])        # a torn write
    third = TrunkCache(xi.backbone)
    third.persist(tmp_path)
    assert third.loaded == 0
    assert torch.equal(third(x), ref) and third.misses == 6 and third.flush() == 6
    assert TrunkCache(xi.backbone).persist(tmp_path) == path and third.file == path


def test_trunk_cache_runs_missing_images_in_cpu_sized_batches(monkeypatch):
    # issue 32: on CPU the cache cuts its misses into device_sim.memory.forward_batch batches
    # (a GPU-sized batch of 64 ran MobileFaceNet's trunk ~2× slower per image); same features
    from device_sim import memory
    from device_sim.trunk_cache import TrunkCache

    torch.manual_seed(0)
    xi = FaceNet(ModelConfig("tiny")).eval()
    cache = TrunkCache(xi.backbone)
    largest = memory.per_image_bytes(cache.trunk, 32)[1]
    monkeypatch.setattr(memory, "CPU_FORWARD_BYTES", largest * 3)
    sizes: list[int] = []
    cache.trunk.register_forward_pre_hook(lambda _m, args: sizes.append(int(args[0].shape[0])))
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        ref = cache.trunk(x)
    sizes.clear()
    got = cache(x)
    assert sizes == [3, 3, 2] and cache.misses == 8
    assert torch.allclose(got, ref, atol=1e-5)
