"""The mask PRG (fedfs_sdk.federation.secagg.prg) is the AES-256-CTR keystream of the seed, and masks cancel."""
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg.prg import add_mask, expand


def test_known_answer_against_the_cipher():
    seed = bytes(range(32))
    ref = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * 37))
    assert expand(seed, 37).tobytes() == ref
    assert expand(seed, 5).tobytes() == ref[:40]           # a prefix: the buffer reuse leaks nothing
    assert not np.array_equal(expand(bytes(32), 37), expand(seed, 37))


def test_masks_cancel_and_wrap():
    acc = np.arange(1000, dtype=np.uint64)
    add_mask(acc, b"\x01" * 32, +1)
    big = np.zeros(50_000, np.uint64)
    add_mask(big, b"\x02" * 32, +1)                        # another size in between
    add_mask(acc, b"\x01" * 32, -1)
    assert np.array_equal(acc, np.arange(1000, dtype=np.uint64))


def test_bad_seed():
    with pytest.raises(InputError, match="32 bytes"):
        expand(b"short", 4)
