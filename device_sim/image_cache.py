"""uint8 images and their normalization; a byte-bounded LRU of recently used images.

Every fedfs input is ``(level − 127.5)/127.5`` for an integer level 0…255 (the contract of
:func:`fedfs_sdk.runtime.preprocess.preprocess`), so keeping images as uint8 levels is exact
and 4× smaller than float32: :func:`normalize` gives the float32 input wherever it is
needed (on the training device, for a chunk gathered as uint8).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

__all__ = ["LRUImageCache", "normalize"]


def normalize(u8: torch.Tensor) -> torch.Tensor:
    """uint8 levels → float32 ``(x − 127.5)/127.5`` on the tensor's device; a floating-point
    tensor (already normalized) is returned unchanged."""
    if u8.is_floating_point():
        return u8
    return (u8.to(torch.float32) - 127.5) / 127.5


class LRUImageCache:
    """Byte-bounded LRU of uint8 ``[3, S, S]`` images keyed by ``(identity, index)``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._d: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        t = self._d.get(key)
        if t is None:
            self.misses += 1
            return None
        self._d.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: tuple[int, int], value: torch.Tensor) -> None:
        if self.max_bytes <= 0:
            return
        size = value.numel() * value.element_size()
        if key in self._d:
            return
        self._d[key] = value
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._d:
            _, old = self._d.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._d.clear()
        self.nbytes = 0

    def fetch_into(self, ids: np.ndarray, idx: np.ndarray, out: torch.Tensor) -> list[int]:
        """Copy each cached image of the pairs ``(ids[i], idx[i])`` into ``out[i]``; return
        the positions ``i`` that were not cached."""
        missing = []
        for i, key in enumerate(zip(ids.tolist(), idx.tolist())):
            t = self.get(key)
            if t is None:
                missing.append(i)
            else:
                out[i] = t
        return missing

    def take_into(self, ids: np.ndarray, idx: np.ndarray, out: torch.Tensor) -> list[int]:
        """:meth:`fetch_into`, removing what it copies (a hand-over to a caller that keeps the
        images itself); returns the positions that were not cached."""
        missing = []
        for i, key in enumerate(zip(ids.tolist(), idx.tolist())):
            t = self._d.pop(key, None)
            if t is None:
                missing.append(i)
            else:
                self.nbytes -= t.numel() * t.element_size()
                out[i] = t
        return missing

    def put_many(self, ids: np.ndarray, idx: np.ndarray, positions: list[int], images: torch.Tensor) -> None:
        """Cache ``images[j]`` as the pair at ``positions[j]``."""
        for j, i in enumerate(positions):
            self.put((int(ids[i]), int(idx[i])), images[j].clone())

