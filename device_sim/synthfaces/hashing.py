"""SynthFaces' counter-based randomness and image keys.

Every random number of the renderer comes from SplitMix64 hashes of integer keys
``(seed, domain, identity, look | index, parameter)`` computed in float64 numpy, so an
image's parameters depend only on its own key — never on the other images of its batch,
the chunking or the device.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from fedfs_sdk.errors import InputError

__all__ = ["hash_uniforms", "ParamStream", "index_array", "broadcast_pairs"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
DOMAIN_IDENTITY, DOMAIN_LOOK, DOMAIN_IMAGE, DOMAIN_NOISE = 1, 2, 3, 4
DOMAIN_STYLE = 5        # per-image numbers of a SynthDomain (mask, texture phase)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """One SplitMix64 step on a uint64 array (wrapping arithmetic, vectorized)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_uniforms(keys: Sequence[np.ndarray | int], count: int) -> np.ndarray:
    """``[N, count]`` float64 uniforms in [0, 1) from a hash of the integer ``keys``.

    Each row depends only on its own keys (broadcast to a common length ``N``), so results
    are independent of batch composition; column ``k`` is stream ``k`` of that row.
    """
    arrays = [np.asarray(k, dtype=np.int64).astype(np.uint64) for k in keys]
    shape = np.broadcast_shapes(*[a.shape for a in arrays])
    if len(shape) > 1:
        raise InputError(f"hash keys must be scalars or 1-D, got shape {shape}")
    n = int(shape[0]) if shape else 1
    with np.errstate(over="ignore"):
        z = np.zeros(n, dtype=np.uint64)
        for a in arrays:
            z = _splitmix64(z ^ np.broadcast_to(a, (n,)))
        streams = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        out = _splitmix64(_splitmix64(z[:, None] ^ streams[None, :]))
    return (out >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class ParamStream:
    """Hands out named parameters from a ``[N, K]`` matrix of uniforms, column by column."""

    def __init__(self, u: np.ndarray) -> None:
        self.u = u
        self.k = 0

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        col = self.u[:, self.k]
        self.k += 1
        return lo + (hi - lo) * col

    def normal(self, sigma: float = 1.0, clip: float = 2.5) -> np.ndarray:
        """Gaussian (Box–Muller) with standard deviation ``sigma``, clipped at ``clip`` σ."""
        u1 = np.maximum(self.uniform(), 1e-12)
        u2 = self.uniform()
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * math.pi * u2)
        return sigma * np.clip(z, -clip, clip)

    def bernoulli(self, p: float | np.ndarray) -> np.ndarray:
        return (self.uniform() < p).astype(np.float64)

    def choice(self, k: int) -> np.ndarray:
        return np.minimum((self.uniform() * k).astype(np.int64), k - 1)



def index_array(x: object, what: str) -> np.ndarray:
    """``x`` (int, sequence, ndarray or tensor of whole numbers ≥ 0) as a 1-D int64 array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim > 1:
        raise InputError(f"{what} must be an int or a 1-D sequence, got shape {list(a.shape)}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if not np.issubdtype(a.dtype, np.number) or not np.all(np.equal(np.mod(a, 1), 0)):
            raise InputError(f"{what} must be integers, got dtype {a.dtype}")
    a = a.astype(np.int64).reshape(-1)
    if a.size and a.min() < 0:
        raise InputError(f"{what} must be ≥ 0, got {int(a.min())}")
    return a


def broadcast_pairs(identities: object, indices: object) -> tuple[np.ndarray, np.ndarray]:
    """``(identities[i], indices[i])`` pairs as two equal-length int64 arrays; a single value
    on either side is repeated to the other's length."""
    ids, idx = index_array(identities, "identities"), index_array(indices, "indices")
    if ids.size != idx.size:
        if ids.size == 1:
            ids = np.repeat(ids, idx.size)
        elif idx.size == 1:
            idx = np.repeat(idx, ids.size)
        else:
            raise InputError(f"identities ({ids.size}) and indices ({idx.size}) must have the same "
                             "length, or one of them must be a single value")
    return ids, idx
