"""BCH codewords (FedUV §4, Table 1, Alg. 2)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedfs_sdk.codes import (BASE_BITS, DESIGN_DISTANCE, KNOWN_CODES, bits_from_int, get_code,
                             make_codeword, random_codewords)
from fedfs_sdk.errors import CodeError, InputError


@pytest.mark.parametrize("n,k,d", [(127, 64, 21), (255, 71, 59), (511, 67, 175)])
def test_table1_parameters(n: int, k: int, d: int) -> None:
    code = get_code(n)
    assert (code.n, code.k, code.d_min) == (n, k, d)
    assert KNOWN_CODES[n] == k and DESIGN_DISTANCE[n] == d
    assert code.generator.shape == (k, n)


@pytest.mark.parametrize("n", [127, 255, 511])
def test_sampled_codewords_respect_dmin(n: int) -> None:
    rng = np.random.default_rng(n)
    words = random_codewords(60, n, rng)                     # ±1
    bits = (words < 0).astype(np.int64)
    dists = [int((a != b).sum()) for a, b in itertools.combinations(bits, 2) if (a != b).any()]
    assert min(dists) >= get_code(n).d_min


def test_encoding_matches_galois() -> None:
    import galois

    ref = galois.BCH(127, 64)
    rng = np.random.default_rng(0)
    msgs = rng.integers(0, 2, size=(5, 64), dtype=np.uint8)
    ours = get_code(127).encode(msgs)
    theirs = np.asarray(ref.encode(galois.GF2(msgs)), dtype=np.int64)
    np.testing.assert_array_equal(ours, theirs)


def test_distinct_base_vectors_give_distinct_codewords_even_with_same_r() -> None:
    r = np.zeros(KNOWN_CODES[127] - BASE_BITS, dtype=np.uint8)
    words = [make_codeword(b, 127, r_bits=r)[0] for b in range(20)]
    for a, b in itertools.combinations(words, 2):
        assert int((a != b).sum()) >= 21


def test_codeword_is_pm1_and_r_is_random_by_default() -> None:
    v1, r1 = make_codeword(7, 255)
    v2, r2 = make_codeword(7, 255)
    assert v1.dtype == np.int8 and set(np.unique(v1)) <= {-1, 1} and v1.shape == (255,)
    assert r1.shape == (71 - 32,)
    assert not np.array_equal(r1, r2)  # OS CSPRNG: 2^-39 chance of a false failure


def test_unknown_code_length_is_a_clear_error() -> None:
    with pytest.raises(CodeError, match="no BCH code of length 100"):
        get_code(100)


def test_bad_base_and_r_bits() -> None:
    with pytest.raises(InputError, match="does not fit in 32 bits"):
        bits_from_int(1 << 32)
    with pytest.raises(InputError, match="r_u must have 32 bits"):
        make_codeword(1, 127, r_bits=np.zeros(5, dtype=np.uint8))
