"""The pseudorandom generator that expands a 32-byte seed into a mask of uint64 words.

AES-256 in counter mode (``cryptography``, AES-NI) over a zero buffer, read as little-endian
uint64: the standard PRG construction; ~4 ms for a 1M-word mask on one core. Seeds are
fresh per round (self-mask ``b_u``) or derived per round and pair (``s_uv``), so the fixed
zero nonce never repeats a keystream.
"""
from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ..errors import InputError

_ZERO_NONCE = bytes(16)


def expand(seed: bytes, n_words: int) -> np.ndarray:
    """``n_words`` pseudorandom uint64 words from a 32-byte ``seed`` (a read-only array)."""
    if len(seed) != 32:
        raise InputError(f"PRG seed must be 32 bytes, got {len(seed)}")
    if n_words < 0:
        raise InputError(f"n_words must be ≥ 0, got {n_words}")
    enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_NONCE)).encryptor()
    data = enc.update(bytes(8 * n_words)) + enc.finalize()
    return np.frombuffer(data, dtype="<u8")


def add_mask(acc: np.ndarray, seed: bytes, sign: int) -> None:
    """``acc += sign·PRG(seed)`` modulo 2^64, in place (``sign`` is +1 or -1)."""
    mask = expand(seed, acc.size)
    if sign > 0:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)
