"""Fixed-point encoding into Z_{2^64} (fedfs_sdk.federation.secagg.encoding): values, clipping, headroom, error."""
import numpy as np
import pytest

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import FixedPoint, RoundFailedError


def test_hand_computed_words():
    fp = FixedPoint(scale_bits=24)
    words, clipped = fp.encode(np.array([1.5, -2.25], np.float32), 4)
    assert clipped == 0
    assert words.dtype == np.uint64
    assert int(words[0]) == 6 * 2**24                 # 4 · 1.5 · 2^24
    assert int(words[1]) == 2**64 - 9 * 2**24         # 4 · −2.25 · 2^24, two's complement
    assert int(words[2]) == 4                         # the sample count word
    mean, n = fp.decode_sum(words, 1)
    assert n == 4 and mean.tolist() == [1.5, -2.25]


def test_weighted_mean_of_two():
    fp = FixedPoint()
    a, _ = fp.encode(np.array([1.0, 0.0]), 1)
    b, _ = fp.encode(np.array([4.0, -3.0]), 2)
    mean, n = fp.decode_sum(a + b, 2)                 # uint64 addition wraps mod 2^64
    assert n == 3 and np.allclose(mean, [3.0, -2.0], atol=fp.error_bound())


def test_clipping_counted():
    fp = FixedPoint(clip=256.0)
    words, clipped = fp.encode(np.array([300.0, -1000.0, 1.0, 256.0]), 1)
    assert clipped == 2
    mean, _ = fp.decode_sum(words, 1)
    assert mean.tolist() == [256.0, -256.0, 1.0, 256.0]


def test_headroom_checked():
    with pytest.raises(InputError, match="63"):
        FixedPoint(clip=256.0, scale_bits=24, max_devices=1 << 16, max_samples=1 << 16)
    assert FixedPoint().headroom_bits() <= 63


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_full_range_sum_does_not_wrap(sign):
    fp = FixedPoint(clip=1.0, scale_bits=20, max_devices=1 << 20, max_samples=1 << 22)
    words, _ = fp.encode(np.array([sign * 1.0, sign * 0.5]), fp.max_samples)
    total = words * np.uint64(fp.max_devices)       # the sum of max_devices extreme inputs, mod 2^64
    mean, n = fp.decode_sum(total, fp.max_devices)
    assert n == fp.max_devices * fp.max_samples
    assert mean.tolist() == [sign * 1.0, sign * 0.5]


def test_error_bound_many_devices():
    fp = FixedPoint(scale_bits=16)
    rng = np.random.default_rng(0)
    ws = rng.normal(0, 3, (50, 1000))
    ns = rng.integers(1, 100, 50)
    total = np.zeros(1001, np.uint64)
    for w, n in zip(ws, ns):
        total += fp.encode(w, int(n))[0]
    mean, _ = fp.decode_sum(total, 50)
    exact = (ws * ns[:, None]).sum(0) / ns.sum()
    err = np.abs(mean.astype(np.float64) - exact)
    assert np.all(err <= fp.error_bound() + np.abs(exact) * 2.0**-24)
    assert err.max() > 0   # quantization is real at 16 bits


def test_garbage_sum_rejected():
    fp = FixedPoint()
    garbage = np.random.default_rng(1).integers(0, 2**63, 100, dtype=np.uint64)
    with pytest.raises(RoundFailedError, match="corrupted"):
        fp.decode_sum(garbage, 10)
    ok, _ = fp.encode(np.zeros(5), 3)
    ok[2] += np.uint64(1 << 60)
    with pytest.raises(RoundFailedError, match="exceed"):
        fp.decode_sum(ok, 1)


@pytest.mark.parametrize("w,n,msg", [([np.nan, 1.0], 1, "NaN"), ([1.0], 0, "n_samples"), ([1.0], 1 << 17, "n_samples"),
                                     ([[1.0]], 1, "1-D"), ([1, 2], 1, "floating")])
def test_bad_input(w, n, msg):
    with pytest.raises(InputError, match=msg):
        FixedPoint().encode(np.array(w), n)
