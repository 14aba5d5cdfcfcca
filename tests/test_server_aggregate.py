"""Weighted FedAvg (FedFS Eq. 1) against hand-computed averages."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfs_sdk.errors import InputError
from float_bounds import assert_within_float32_ulps
from server_agg.aggregate import StreamingFedAvg, fedavg, fedavg_stacked


def _w(a: float, b: list[float]) -> dict[str, torch.Tensor]:
    return {"a": torch.tensor([a], dtype=torch.float32), "b.weight": torch.tensor(b, dtype=torch.float32)}


def test_fedavg_matches_hand_computed_weighted_mean():
    # (1*1 + 3*5) / 4 = 4 ; [(1*2 + 3*6)/4, (1*(-4) + 3*0)/4] = [5, -1]
    out = fedavg([(_w(1.0, [2.0, -4.0]), 1), (_w(5.0, [6.0, 0.0]), 3)])
    assert out["a"].dtype == torch.float32
    # bit equality is guaranteed here: every product, sum and quotient is a small dyadic
    # number, exact in float64 and in the final float32 cast
    assert torch.equal(out["a"], torch.tensor([4.0]))
    assert torch.equal(out["b.weight"], torch.tensor([5.0, -1.0]))


def test_fedavg_is_not_the_unweighted_mean():
    out = fedavg([(_w(0.0, [0.0, 0.0]), 9), (_w(10.0, [10.0, 10.0]), 1)])
    assert torch.allclose(out["a"], torch.tensor([1.0]))


def test_streaming_accumulates_in_float64():
    # 1e8 + 1 is not representable in float32; a float32 running sum would lose the ones.
    acc = StreamingFedAvg()
    big = {"x": torch.tensor([1e8], dtype=torch.float32)}
    acc.add(big, 1)
    for _ in range(1000):
        acc.add({"x": torch.tensor([1.0])}, 1)
    expected = (1e8 + 1000.0) / 1001.0
    assert abs(float(acc.result()["x"]) - np.float32(expected)) <= abs(np.spacing(np.float32(expected)))
    assert acc.count == 1001 and acc.total_samples == 1001


def test_random_models_match_numpy_reference():
    g = torch.Generator().manual_seed(0)
    ups = [({"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}, int(n))
           for n in (3, 7, 1, 12)]
    out = fedavg(ups)
    ns = np.array([n for _, n in ups], dtype=np.float64)
    for k in ("w", "b"):
        ref = sum(n * u[k].double().numpy() for u, n in ups) / ns.sum()
        # float64 sums in another order, one float32 cast each: ≤ 1 float32 ulp, not bit equality
        assert_within_float32_ulps(out[k].numpy(), ref.astype(np.float32), 1, k)


def test_integer_and_bool_buffers_are_rounded_back():
    out = fedavg([({"steps": torch.tensor(1), "m": torch.tensor([True, False])}, 1),
                  ({"steps": torch.tensor(4), "m": torch.tensor([True, True])}, 3)])
    assert out["steps"].dtype == torch.int64 and int(out["steps"]) == 3  # 13/4 = 3.25
    assert out["m"].tolist() == [True, True]


@pytest.mark.parametrize("bad, msg", [
    ({"a": torch.zeros(1)}, "missing"),
    ({"a": torch.zeros(1), "b.weight": torch.zeros(2), "c": torch.zeros(1)}, "unexpected"),
    ({"a": torch.zeros(2), "b.weight": torch.zeros(2)}, "shape"),
])
def test_key_and_shape_mismatch_raise_and_leave_state_unchanged(bad, msg):
    acc = StreamingFedAvg(_w(0.0, [0.0, 0.0]))
    acc.add(_w(2.0, [2.0, 2.0]), 2)
    with pytest.raises(InputError, match=msg):
        acc.add(bad, 5)
    assert acc.count == 1 and acc.total_samples == 2
    assert torch.equal(acc.result()["a"], torch.tensor([2.0]))


@pytest.mark.parametrize("n", [0, -3, 1.5, True, "4", None])
def test_num_samples_must_be_positive_int(n):
    with pytest.raises(InputError, match="num_samples"):
        StreamingFedAvg().add(_w(1.0, [1.0, 1.0]), n)


def test_empty_average_raises():
    with pytest.raises(InputError, match="zero updates"):
        StreamingFedAvg().result()
    with pytest.raises(InputError, match="zero updates"):
        fedavg([])


def test_result_casts_to_reference_dtype():
    ref = {"x": torch.zeros(2, dtype=torch.float16)}
    out = fedavg([({"x": torch.tensor([1.0, 2.0])}, 1)], reference=ref)
    assert out["x"].dtype == torch.float16


def test_stacked_equals_streaming():
    g = torch.Generator().manual_seed(1)
    k = 5
    stacked = {"w": torch.randn(k, 3, 2, generator=g), "b": torch.randn(k, 2, generator=g)}
    n = torch.tensor([4, 1, 9, 2, 2])
    out = fedavg_stacked(stacked, n)
    ref = fedavg([({key: t[i] for key, t in stacked.items()}, int(n[i])) for i in range(k)])
    for key in stacked:
        assert out[key].shape == stacked[key].shape[1:]
        assert_within_float32_ulps(out[key], ref[key], 1, key)     # both float64 → one float32 cast


def test_stacked_in_client_slices_matches_one_reduction(monkeypatch):
    g = torch.Generator().manual_seed(3)
    stacked = {"w": torch.randn(7, 5, generator=g)}
    n = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    whole = fedavg_stacked(stacked, n)
    monkeypatch.setattr("server_agg.aggregate._STACK_CHUNK", 10)      # 2 clients per slice
    sliced = fedavg_stacked(stacked, n)
    # slices are summed in float64 and cast once: ≤ 1 float32 ulp from one reduction (design)
    assert_within_float32_ulps(sliced["w"], whole["w"], 1, "sliced vs whole")
    expected = (n.double()[:, None] * stacked["w"].double()).sum(0) / n.sum()
    assert_within_float32_ulps(sliced["w"], expected.float(), 1, "sliced vs float64 reference")


@pytest.mark.parametrize("n, msg", [
    (torch.tensor([1, 0]), "> 0"),
    (torch.tensor([1.5, 2.0]), "integers"),
    (torch.tensor([1, 2, 3]), "stacked tensor"),
    (torch.tensor([[1, 2]]), "1-D"),
])
def test_stacked_rejects_bad_counts(n, msg):
    with pytest.raises(InputError, match=msg):
        fedavg_stacked({"w": torch.zeros(2, 3)}, n)


def test_stacked_checks_reference_layout():
    with pytest.raises(InputError, match="per-client shape"):
        fedavg_stacked({"w": torch.zeros(2, 3)}, torch.tensor([1, 1]), reference={"w": torch.zeros(4)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stacked_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(2)
    stacked = {"w": torch.randn(6, 10, generator=g)}
    n = torch.tensor([1, 2, 3, 4, 5, 6])
    cpu = fedavg_stacked(stacked, n)
    gpu = fedavg_stacked({k: v.cuda() for k, v in stacked.items()}, n.cuda())
    assert gpu["w"].is_cuda
    torch.testing.assert_close(gpu["w"].cpu(), cpu["w"], rtol=0, atol=1e-6)


def test_a_tensor_every_client_shares_averages_to_itself():
    # the simulator hands a frozen trunk to fedavg_stacked as one tensor broadcast over the clients
    # (stride 0 along dim 0): the shortcut must give exactly what the float64 reduction of the
    # materialized stack gives — the value itself, since Σ w = 1 rounds back to it in float32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g) * 7
    n = torch.tensor([3, 1, 9, 2, 5, 4, 8])
    shared = x.unsqueeze(0).expand(7, *x.shape)
    assert shared.stride(0) == 0
    fast = fedavg_stacked({"w": shared, "i": torch.arange(4).unsqueeze(0).expand(7, 4)}, n)
    slow = fedavg_stacked({"w": shared.contiguous(), "i": torch.arange(4).unsqueeze(0).expand(7, 4).contiguous()}, n)
    assert torch.equal(fast["w"], slow["w"]) and torch.equal(fast["w"], x)
    assert torch.equal(fast["i"], slow["i"]) and fast["i"].dtype == slow["i"].dtype
    fast["w"].add_(1)       # a result never aliases the clients' shared tensor
    assert torch.equal(shared[0], x)
