"""Client store: persistence of θ_c, half-precision delta encoding, memory estimates."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_sim.client_store import ClientStore, estimate_memory, touched_clients
from fedfs_sdk.errors import InputError


def template() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"personal": {"a": torch.randn(3, 4, generator=g) * 5, "b": torch.randn(7, generator=g)}}


def stacked(k: int, seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = template()["personal"]
    return {"personal": {n: v.unsqueeze(0) + scale * torch.randn((k,) + v.shape, generator=g) for n, v in t.items()}}


def test_roundtrip_fp32_and_untouched_clients_get_the_template() -> None:
    s = ClientStore(100, template())
    assert s.params_per_client == 19 and s.nbytes == 0 and s.touched().size == 0
    w = stacked(3, 1)
    s.put([5, 17, 99], w)
    got = s.get([17, 5, 0, 99])
    assert torch.equal(got["personal"]["a"][0], w["personal"]["a"][1])
    assert torch.equal(got["personal"]["b"][3], w["personal"]["b"][2])
    assert torch.equal(got["personal"]["a"][2], template()["personal"]["a"])     # never trained → θ_0
    assert s.get_one(0) is None and s.has(5) and s.touched().tolist() == [5, 17, 99]
    s.put([5], stacked(1, 2))                                                      # overwrite in place
    assert s.used == 3


def test_shared_tensors_are_kept_once_and_given_to_every_client() -> None:
    """A tensor no client's training moves (scope=top's trunk) has no column in the rows: every
    client gets θ_0's value (a view), rows hold the rest, and a put ignores the frozen entries."""
    s = ClientStore(100, template(), dtype="fp16", shared=[("personal", "a")])
    assert s.params_per_client == 7 and s.keys == [("personal", "b")]
    assert s.estimate().gib == estimate_memory(100, 7, "fp16").gib
    w = stacked(2, 1)
    s.put([3, 8], w)                                  # "a" moved in w: ignored, it is frozen by contract
    got = s.get([8, 3, 50])
    assert list(got["personal"]) == ["a", "b"]        # the template's order
    for i in range(3):
        assert torch.equal(got["personal"]["a"][i], template()["personal"]["a"])
    assert torch.allclose(got["personal"]["b"][0], w["personal"]["b"][1], atol=1e-2)
    assert torch.equal(got["personal"]["b"][2], template()["personal"]["b"])
    assert s.get_one(3)["personal"]["a"].shape == (3, 4)
    with pytest.raises(InputError, match="not in the template"):
        ClientStore(10, template(), shared=[("personal", "z")])


def test_fp16_delta_keeps_small_updates_that_absolute_fp16_drops() -> None:
    w = stacked(2, 3, scale=1e-3)                      # updates tiny relative to the weights (|θ_0| ~ 5)
    exact = {k: v.clone() for k, v in w["personal"].items()}
    errs = {}
    for enc in ("delta", "absolute"):
        s = ClientStore(4, template(), dtype="fp16", encoding=enc)
        s.put([0, 1], w)
        got = s.get([0, 1])["personal"]
        errs[enc] = max(float((got[k] - exact[k]).abs().max()) for k in exact)
    assert errs["delta"] < 1e-6 < errs["absolute"]
    assert ClientStore(4, template(), dtype="fp16").encoding == "delta"


def test_state_roundtrip_and_disk_location(tmp_path) -> None:
    s = ClientStore(10, template(), dtype="fp16", location="disk", path=tmp_path / "theta.mmap")
    s.put([2, 7], stacked(2, 4))
    state = s.state_tensors()
    t = ClientStore(10, template(), dtype="fp16")
    t.load_state_tensors(state)
    assert torch.equal(t.get([2, 7, 3])["personal"]["a"], s.get([2, 7, 3])["personal"]["a"])
    with pytest.raises(InputError, match="does not match"):
        ClientStore(11, template(), dtype="fp16").load_state_tensors(state)


def test_errors() -> None:
    s = ClientStore(4, template())
    with pytest.raises(InputError, match="unknown client 4"):
        s.get([4])
    with pytest.raises(InputError, match="duplicate"):
        s.put([1, 1], stacked(2, 0))
    with pytest.raises(InputError, match="shape"):
        s.put([1], {"personal": {"a": torch.zeros(1, 3, 3), "b": torch.zeros(1, 7)}})
    with pytest.raises(InputError, match="location"):
        ClientStore(4, template(), location="ssd")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA"):
            ClientStore(4, template(), location="pinned")


def test_memory_estimate_numbers() -> None:
    # MobileFaceNet personalized model (backbone + FedFS projection 128→64): 1,011,328 params
    e = estimate_memory(10_000, 1_011_328, "fp16")
    assert e.bytes == 10_000 * 1_011_328 * 2 and 18.8 < e.gib < 18.9
    assert estimate_memory(10_000, 1_011_328, "fp32").bytes == 2 * e.bytes
    assert touched_clients(10_000, 0.01, 100) == int(np.ceil(10_000 * (1 - 0.99 ** 100)))
    assert estimate_memory(10_000, 100, "fp32", participation=0.01, rounds=100).touched_clients == 6340
    assert "GiB" in e.describe()
