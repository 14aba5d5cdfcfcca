"""The process cache of public models' outputs on the public impostor set
(fedfs_sdk.runtime.impostor_outputs): the same enrollment as without it, recomputed when the model
or the set changes, never holding a device's own model."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fedfs_sdk.federation.device_enrollment import PUBLIC_CANDIDATES, shared_impostor_outputs
from fedfs_sdk.nn.checkpoint import model_id_of
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.enrollment import enroll
from fedfs_sdk.runtime.impostor_outputs import PublicOutputs
from fedfs_sdk.runtime.impostors import ImpostorSet
from fedfs_sdk.runtime.inference import TorchBackend


def _backend(seed: int) -> TorchBackend:
    torch.manual_seed(seed)
    m = FaceNet(ModelConfig("tiny", code_length=127)).eval()
    net = VerifierNet(m.backbone, m.uv_head).eval()
    return TorchBackend(net, model_id_of(net.state_dict(), "tiny"))


def _set(seed: int, n: int = 70) -> ImpostorSet:
    rng = np.random.default_rng(seed)
    size = _backend(0).input_size
    return ImpostorSet(rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), np.arange(n) // 2,
                       [f"p{i}" for i in range(n // 2)], {"input_size": size})


def _photos(n: int = 12) -> np.ndarray:
    size = _backend(0).input_size
    return np.random.default_rng(7).uniform(-1, 1, (n, 3, size, size)).astype(np.float32)


def test_cached_outputs_give_the_enrollment_computed_without_them():
    b, imp, cache = _backend(0), _set(1), PublicOutputs()
    plain = enroll(b, _photos(), q=0.9, outliers="none", impostors=imp)
    first, again = cache.get(b, imp), cache.get(_backend(0), imp)     # another device's copy of the same model
    assert again is first and (cache.misses, cache.hits) == (1, 1)
    assert len(first) == 2                    # 70 photos in chunks of 64, as enroll scores them
    cached = enroll(b, _photos(), q=0.9, outliers="none", impostors=imp, impostor_outputs=first)
    assert cached.meta["operating_point"] == plain.meta["operating_point"]
    assert cached.threshold == plain.threshold
    assert plain.meta["operating_point"]["n_impostors"] == 70
    with pytest.raises(ValueError):           # shared between devices: read-only
        first[0]["embedding"][0, 0] = 1.0


def test_a_changed_model_or_set_is_computed_again():
    cache, imp = PublicOutputs(), _set(1)
    a = cache.get(_backend(0), imp)
    b = cache.get(_backend(1), imp)           # other weights → other model_id
    c = cache.get(_backend(0), _set(2))       # other photos → other digest
    assert cache.misses == 3 and cache.hits == 0
    assert not np.array_equal(a[0]["embedding"], b[0]["embedding"])
    assert not np.array_equal(a[0]["embedding"], c[0]["embedding"])


def test_devices_asking_at_once_compute_it_once():
    cache, imp, b = PublicOutputs(), _set(1), _backend(0)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(cache.get(b, imp))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.misses == 1 and cache.hits == 3 and all(g is got[0] for g in got)


def test_a_devices_own_model_never_enters_the_cache():
    cache, imp = PublicOutputs(), _set(1)
    assert "personalized" not in PUBLIC_CANDIDATES
    assert shared_impostor_outputs("personalized", _backend(3), imp, cache) is None
    assert shared_impostor_outputs("global", _backend(0), None, cache) is None      # no set, nothing to share
    assert cache.misses == cache.hits == 0
    assert shared_impostor_outputs("norm-adapt", _backend(0), imp, cache) is not None
    assert cache.misses == 1
