"""FedUV secret codewords from BCH codes (FedUV §4, Alg. 2 "Codeword Selection").

The server assigns each user a unique base vector ``b_u`` (``l_b = 32`` bits); the device
draws ``r_u`` (the remaining ``k − 32`` message bits) at random and computes
``v_u = C(b_u ‖ r_u)`` mapped to ``{−1, +1}^c``. Distinct ``b_u`` give distinct messages,
and a linear code maps distinct messages to codewords at Hamming distance ≥ ``d_min``.

The codes of FedUV Table 1 — (127, 64) d_min 21, (255, 71) d_min 59, (511, 67) d_min 175 —
were built with :mod:`galois` (``galois.BCH(n, k).G``, the systematic generator). They are
constants, so they ship as package data (``fedfs_sdk/data/bch_generators.npz``: each
``k × n`` 0/1 matrix bit-packed along rows, 8 KB for all three) and are checked against
:data:`GENERATOR_SHA256` when loaded: a phone never imports galois nor spends the ~20 s a
cold build takes. Encoding is one GF(2) matrix product in numpy. ``tools/regenerate_bch_data.py``
rebuilds the file with galois and checks the pins; ``tests/test_core_codes.py`` does too.
"""
from __future__ import annotations

import functools
import hashlib
import secrets
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import CodeError, InputError

BASE_BITS = 32
"""``l_b``: length of the server-assigned base vector (FedUV §6, "we set l_b = 32")."""

KNOWN_CODES: dict[int, int] = {127: 64, 255: 71, 511: 67}
"""Code length ``c`` → message length ``k`` (FedUV Table 1: smallest BCH k ≥ 64)."""

DESIGN_DISTANCE: dict[int, int] = {127: 21, 255: 59, 511: 175}
"""Minimum distance ``d_min`` of each code in FedUV Table 1."""

GENERATOR_SHA256: dict[int, str] = {
    127: "db2a329a274e57e92825c49220596e23bc2cfc5070c0a00342fb185a9c872322",
    255: "e3e9b72557702c2a9120fe5a74f52c414b493182b250b86b701be2a3c1f6a36d",
    511: "3ce074a54b28a409b89933569935e27fa4f0e965aef15222f25af5d1811a153d",
}
"""sha256 of each systematic generator matrix ``G`` as ``k × n`` uint8 0/1 bytes in C order
(computed from ``galois.BCH(n, k).G``, galois 0.4). The shipped ``G`` is used only if it
hashes to this; a galois build that does not is refused (:class:`CodeError`)."""

DATA_FILE = "bch_generators.npz"
"""Package data (``fedfs_sdk/data/``): ``G<n>`` = ``np.packbits(G, axis=1)`` (uint8
``[k, ⌈n/8⌉]``) and ``d<n>`` = ``d_min`` for each ``n`` of :data:`KNOWN_CODES`."""


def generator_sha256(g: np.ndarray) -> str:
    """The :data:`GENERATOR_SHA256` digest of a generator matrix."""
    return hashlib.sha256(np.ascontiguousarray(g, dtype=np.uint8).tobytes()).hexdigest()


def data_path() -> Path:
    """Where the shipped generator matrices are (inside the installed package)."""
    return Path(str(resources.files("fedfs_sdk") / "data" / DATA_FILE))


@dataclass(frozen=True)
class BCHCode:
    """A binary BCH code with its systematic generator matrix ``G`` (k × n, uint8)."""

    n: int
    k: int
    d_min: int
    generator: np.ndarray

    def encode(self, message: np.ndarray) -> np.ndarray:
        """Encode ``message`` bits (``[k]`` or ``[B, k]``, 0/1) to codeword bits (0/1)."""
        m = np.asarray(message)
        if m.shape[-1] != self.k:
            raise InputError(f"message must have {self.k} bits for BCH({self.n},{self.k}), got shape {m.shape}")
        if not np.isin(m, (0, 1)).all():
            raise InputError("message bits must be 0 or 1")
        return (m.astype(np.int64) @ self.generator.astype(np.int64)) % 2


def build_with_galois(n: int) -> tuple[np.ndarray, int]:
    """``(G, d_min)`` of BCH(n, k) built by galois — maintenance and tests only (slow: a cold
    build takes seconds to tens of seconds; the SDK loads :data:`DATA_FILE` instead)."""
    import galois

    code = galois.BCH(n, KNOWN_CODES[n])
    return np.asarray(code.G, dtype=np.uint8), int(code.d)


def pack_generators(generators: dict[int, tuple[np.ndarray, int]]) -> dict[str, np.ndarray]:
    """The arrays of :data:`DATA_FILE` for ``{n: (G, d_min)}``; every ``G`` must match its pin."""
    out: dict[str, np.ndarray] = {}
    for n, (g, d) in sorted(generators.items()):
        if not _valid(g, d, n, KNOWN_CODES[n]):
            raise CodeError(f"BCH({n},{KNOWN_CODES[n]}) generator (d_min {d}, sha256 {generator_sha256(g)[:16]}…) "
                            f"is not the pinned one (d_min {DESIGN_DISTANCE[n]}, sha256 {GENERATOR_SHA256[n][:16]}…); "
                            "codewords would not match other devices' — check the galois version")
        out[f"G{n}"] = np.packbits(np.asarray(g, dtype=np.uint8), axis=1)
        out[f"d{n}"] = np.array(d, dtype=np.int64)
    return out


def _valid(g: np.ndarray, d: int, n: int, k: int) -> bool:
    return g.shape == (k, n) and d == DESIGN_DISTANCE[n] and generator_sha256(g) == GENERATOR_SHA256[n]


@functools.lru_cache(maxsize=None)
def get_code(n: int) -> BCHCode:
    """The BCH code of length ``n`` ∈ {127, 255, 511} from FedUV Table 1.

    Loaded from the package data and checked against :data:`GENERATOR_SHA256`; a missing,
    unreadable or altered file is a :class:`CodeError` (reinstall the package)."""
    if n not in KNOWN_CODES:
        raise CodeError(f"no BCH code of length {n}; FedUV Table 1 provides lengths {sorted(KNOWN_CODES)}")
    k = KNOWN_CODES[n]
    path = data_path()
    try:
        with np.load(path, allow_pickle=False) as data:
            packed, d = data[f"G{n}"], int(data[f"d{n}"])
        if packed.dtype != np.uint8 or packed.shape != (k, (n + 7) // 8):
            raise ValueError(f"G{n} is {packed.dtype} {list(packed.shape)}, expected uint8 {[k, (n + 7) // 8]}")
        g = np.unpackbits(packed, axis=1, count=n)
    except Exception as e:  # noqa: BLE001 - any unreadable file (missing, bad zip, pickle, wrong key) is one error
        raise CodeError(f"cannot read the BCH({n},{k}) generator from {path} ({type(e).__name__}: {e}); "
                        "the fedfs package is damaged: reinstall it") from None
    if not _valid(g, d, n, k):
        raise CodeError(f"the BCH({n},{k}) generator in {path} (d_min {d}, sha256 {generator_sha256(g)[:16]}…) "
                        f"is not the pinned one (d_min {DESIGN_DISTANCE[n]}, sha256 {GENERATOR_SHA256[n][:16]}…); "
                        "the fedfs package is damaged: reinstall it")
    return _code(n, k, d, g)


def _code(n: int, k: int, d: int, g: np.ndarray) -> BCHCode:
    g = np.ascontiguousarray(g, dtype=np.uint8)
    g.setflags(write=False)      # shared by every caller through the lru_cache
    return BCHCode(n, k, d, g)


def bits_from_int(value: int, nbits: int = BASE_BITS) -> np.ndarray:
    """Big-endian bits of a non-negative integer (the server sends ``b_u`` as an int)."""
    if not 0 <= value < (1 << nbits):
        raise InputError(f"base vector {value} does not fit in {nbits} bits")
    return np.array([(value >> (nbits - 1 - i)) & 1 for i in range(nbits)], dtype=np.uint8)


def random_bits(nbits: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """``r_u``: device-random bits. Uses the OS CSPRNG unless a seeded ``rng`` is given
    (simulation only — a real device must keep ``r_u`` unpredictable)."""
    if rng is None:
        raw = secrets.token_bytes((nbits + 7) // 8)
        return np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:nbits].astype(np.uint8)
    return rng.integers(0, 2, size=nbits, dtype=np.uint8)


def to_pm1(bits: np.ndarray) -> np.ndarray:
    """Map codeword bits {0,1} to FedUV's ``v ∈ {−1, +1}^c`` (0 → +1, 1 → −1)."""
    return (1 - 2 * np.asarray(bits, dtype=np.int8)).astype(np.int8)


def make_codeword(base: int | np.ndarray, code_length: int = 127,
                  r_bits: np.ndarray | None = None, rng: np.random.Generator | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``v_u = C(b_u ‖ r_u)`` as ±1 (FedUV Alg. 2). Returns ``(v_u, r_u)``.

    ``base`` is ``b_u`` as an int or 32 bits; ``r_bits`` the device's random bits (drawn
    here when None). Both results are device secrets.
    """
    code = get_code(code_length)
    b = bits_from_int(int(base)) if np.isscalar(base) else np.asarray(base, dtype=np.uint8)
    if b.shape != (BASE_BITS,):
        raise InputError(f"base vector must have {BASE_BITS} bits, got shape {b.shape}")
    nr = code.k - BASE_BITS
    r = random_bits(nr, rng) if r_bits is None else np.asarray(r_bits, dtype=np.uint8)
    if r.shape != (nr,):
        raise InputError(f"r_u must have {nr} bits for BCH({code.n},{code.k}), got shape {r.shape}")
    return to_pm1(code.encode(np.concatenate([b, r]))), r


def random_codewords(count: int, code_length: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` codewords of uniformly random messages (±1, ``[count, c]``)."""
    code = get_code(code_length)
    msgs = rng.integers(0, 2, size=(count, code.k), dtype=np.uint8)
    return to_pm1(code.encode(msgs))
