"""BCH codewords (FedUV §4, Table 1, Alg. 2)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import fedfs_sdk.runtime.codes as codes
from fedfs_sdk.runtime.codes import (BASE_BITS, DESIGN_DISTANCE, GENERATOR_SHA256, KNOWN_CODES, bits_from_int, get_code,
                             generator_sha256, make_codeword, random_codewords, to_pm1)
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


def _min_weight_checks(code: codes.BCHCode, rng: np.random.Generator, samples: int = 3000) -> int:
    """Smallest weight among the low-weight candidates: every row of G (a systematic row has
    a single message bit), every sum of two rows, and random nonzero codewords."""
    g = code.generator.astype(np.int64)
    w_rows = g.sum(1)
    pairs = (g[:, None, :] + g[None, :, :]) % 2
    iu = np.triu_indices(code.k, 1)
    w_pairs = pairs.sum(-1)[iu]
    msgs = rng.integers(0, 2, size=(samples, code.k), dtype=np.uint8)
    msgs = msgs[msgs.any(1)]
    w_rand = code.encode(msgs).sum(1)
    return int(min(w_rows.min(), w_pairs.min(), w_rand.min()))


@pytest.mark.parametrize("n", [127, 255, 511])
def test_low_weight_codewords_respect_dmin(n: int) -> None:
    """A linear code's d_min is its minimum nonzero codeword weight: rows of G and sums of two
    rows are the likeliest low-weight words, so a code with a small true d_min fails here."""
    code = get_code(n)
    assert _min_weight_checks(code, np.random.default_rng(n)) >= DESIGN_DISTANCE[n]


def test_low_weight_check_catches_a_weak_code() -> None:
    good = get_code(127)
    g = good.generator.copy()
    g[5] = 0
    g[5, 5] = 1                               # C(e_5) now has weight 1: true d_min = 1
    assert _min_weight_checks(codes.BCHCode(127, 64, 21, g), np.random.default_rng(0)) == 1
    g = good.generator.copy()
    g[7] = g[3].copy()
    g[7, [3, 7]] = g[7, [7, 3]]               # rows 3 and 7 differ in 2 bits: their sum has weight 2
    assert _min_weight_checks(codes.BCHCode(127, 64, 21, g), np.random.default_rng(0)) <= 2


def test_generators_match_the_pinned_hashes() -> None:
    for n in KNOWN_CODES:
        assert generator_sha256(get_code(n).generator) == GENERATOR_SHA256[n]
    assert not get_code(127).generator.flags.writeable      # shared: callers cannot corrupt it


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A copy of the package's generator file that a test may damage; get_code reads it."""
    path = tmp_path / codes.DATA_FILE
    path.write_bytes(codes.data_path().read_bytes())
    monkeypatch.setattr(codes, "data_path", lambda: path)
    get_code.cache_clear()
    yield path
    get_code.cache_clear()


@pytest.mark.parametrize("n", sorted(KNOWN_CODES))
def test_shipped_generators_equal_the_galois_build(n: int) -> None:
    g, d = codes.build_with_galois(n)
    assert generator_sha256(g) == GENERATOR_SHA256[n] and d == DESIGN_DISTANCE[n]
    assert np.array_equal(get_code(n).generator, g) and get_code(n).d_min == d     # 0/1 integers: exact


def test_loading_the_codes_never_imports_galois() -> None:
    """A phone loads the shipped matrices: galois (and its numba JIT) is never imported."""
    import subprocess
    import sys

    code = ("import sys; import fedfs_sdk.runtime.codes as c\n"
            "for n in c.KNOWN_CODES: assert c.generator_sha256(c.get_code(n).generator) == c.GENERATOR_SHA256[n]\n"
            "c.make_codeword(5, 511)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('galois', 'numba')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("damage", ["one_bit", "wrong_d", "pickle", "garbage", "missing_key", "missing_file"])
def test_damaged_package_data_is_a_clear_error(shipped_copy, damage: str) -> None:
    with np.load(shipped_copy) as data:
        arrays = {k: data[k] for k in data.files}
    if damage == "one_bit":
        arrays["G127"][10, 3] ^= 0x10
    elif damage == "wrong_d":
        arrays["d127"] = np.array(3)
    elif damage == "missing_key":
        del arrays["G127"]
    if damage == "pickle":
        np.savez(shipped_copy, **{**arrays, "G127": np.array([object()] * 3)})
    elif damage == "garbage":
        shipped_copy.write_bytes(b"PK\x03\x04 not really a zip")
    elif damage == "missing_file":
        shipped_copy.unlink()
    else:
        np.savez(shipped_copy, **arrays)
    match = "not the pinned one" if damage in ("one_bit", "wrong_d") else "cannot read"
    with pytest.raises(CodeError, match=match + r".*reinstall"):
        get_code(127)
    if damage in ("one_bit", "wrong_d", "missing_key"):       # only the damaged code is refused
        assert generator_sha256(get_code(255).generator) == GENERATOR_SHA256[255]


def test_galois_build_that_differs_from_the_pin_is_refused() -> None:
    g, d = codes.build_with_galois(127)
    g = g.copy()
    g[[0, 1]] = g[[1, 0]]                 # same code, other basis: other codewords per message
    with pytest.raises(CodeError, match=r"not the pinned one.*check the galois version"):
        codes.pack_generators({127: (g, d)})
    packed = codes.pack_generators({127: codes.build_with_galois(127)})
    assert packed["G127"].shape == (64, 16) and int(packed["d127"]) == 21
