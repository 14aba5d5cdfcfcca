"""Shamir sharing over GF(2^31 − 1) (fedfs_sdk.federation.secagg.shamir): t shares reconstruct, t − 1 do not."""
import itertools
import os
import random

import numpy as np
import pytest

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import shamir


def _pack(*vals):
    return np.array(vals, dtype="<u4").tobytes()


def test_hand_computed_line():
    # secret chunk 5 (bytes 05 00 00), f(x) = 5 + 3x: f(1) = 8, f(2) = 11
    assert shamir.interpolate({1: _pack(8), 2: _pack(11)}, 3) == b"\x05\x00\x00"
    # same line seen from x = 3 and 7: f(3) = 14, f(7) = 26
    assert shamir.interpolate({3: _pack(14), 7: _pack(26)}, 3) == b"\x05\x00\x00"
    # f(x) = 5 − x mod p: f(10) = p − 5, f(1) = 4
    assert shamir.interpolate({10: _pack(shamir.P - 5), 1: _pack(4)}, 3) == b"\x05\x00\x00"


@pytest.mark.parametrize("n,t", [(5, 3), (9, 7), (30, 21)])
def test_any_t_shares_reconstruct_and_t_minus_1_do_not(n, t):
    secrets = [os.urandom(32), os.urandom(32)]
    xs = random.Random(n).sample(range(1, 10_000), n)
    shares = shamir.split(secrets, xs, t)
    assert set(shares) == set(xs) and all(len(s) == shamir.share_length(32) for v in shares.values() for s in v)
    rng = random.Random(t)
    subsets = list(itertools.islice(itertools.combinations(xs, t), 20)) + [tuple(rng.sample(xs, t)) for _ in range(20)]
    for sub in subsets:
        for j in range(2):
            assert shamir.reconstruct({x: shares[x][j] for x in sub}, t, 32) == secrets[j]
    for _ in range(20):
        sub = rng.sample(xs, t - 1)
        with pytest.raises(InputError, match="needed"):
            shamir.reconstruct({x: shares[x][0] for x in sub}, t, 32)
        try:   # interpolating t − 1 points gives another polynomial's constant term
            got = shamir.interpolate({x: shares[x][0] for x in sub}, 32)
        except InputError:
            continue   # not even a valid 24-bit chunk: also not the secret
        assert got != secrets[0]


def test_more_than_t_shares_and_wrong_share_detected():
    s = os.urandom(32)
    shares = {x: v[0] for x, v in shamir.split([s], range(1, 8), 4).items()}
    assert shamir.reconstruct(shares, 4, 32) == s
    bad = dict(shares)
    bad[1] = _pack(*([7] * 11))
    try:
        assert shamir.reconstruct(bad, 4, 32) != s
    except InputError:
        pass


def test_t_minus_1_shares_do_not_depend_on_the_secret():
    # threshold 2: one share is a uniform field element whatever the secret — its mean over
    # many splits is ≈ p/2 for secret 0 and for secret 0xFFFFFF alike
    for secret in (bytes(3), b"\xff\xff\xff"):
        vals = [int(np.frombuffer(shamir.split([secret], [1, 2], 2)[1][0], "<u4")[0]) for _ in range(2000)]
        assert abs(np.mean(vals) / shamir.P - 0.5) < 0.03


@pytest.mark.parametrize("xs,t,msg", [([0, 1, 2], 2, "ids must be in"), ([1, 1, 2], 2, "distinct"),
                                      ([1, 2, 3], 4, "threshold"), ([1, 2, 3], 0, "threshold")])
def test_bad_holders(xs, t, msg):
    with pytest.raises(InputError, match=msg):
        shamir.split([b"abc"], xs, t)


def test_bad_share_length():
    with pytest.raises(InputError, match="bytes, expected"):
        shamir.interpolate({1: b"\x00" * 5, 2: b"\x00" * 4}, 3)
