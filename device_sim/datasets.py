"""Face datasets indexed by ``(identity, image index)``: synthetic or an ImageFolder on disk.

Both implement :class:`IdentityDataset`, the only thing the simulator needs: how many
identities, how many images each has, and normalized float32 batches ``[n, 3, S, S]``
(``(x − 127.5)/127.5``, RGB — the contract of :func:`fedfs_sdk.runtime.preprocess.preprocess`).

Both also give the images as uint8 ``[n, 3, S, S]`` (``batch_uint8``, on a chosen device):
4× smaller than float32 and exact — every fedfs input is ``(level − 127.5)/127.5`` for an
integer level — which is what :class:`~device_sim.image_store.ClientImageStore` keeps and a
training device normalizes. Recently used images are cached as uint8 in a byte-bounded LRU.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .identity_dataset import IdentityDataset, IndexLike  # noqa: F401 (re-exported: the contract moved down)
from .image_cache import LRUImageCache, normalize
from .image_folder import ImageFolderDataset, SkippedFile, SkippedIdentity  # noqa: F401 (re-exported)
from .synthfaces import SynthFaces, broadcast_pairs

__all__ = ["IdentityDataset", "IndexLike", "SynthDataset", "ImageFolderDataset", "SkippedFile", "SkippedIdentity",
           "LRUImageCache"]


class SynthDataset:
    """:class:`IdentityDataset` over :class:`SynthFaces` identities ``0 … num_identities − 1``.

    Every identity has ``images_per_identity`` images (index ``0 …``), rendered on demand and
    kept in an LRU of ``cache_bytes`` (uint8). ``device`` is where rendering runs; results are
    returned there.
    """

    def __init__(self, faces: SynthFaces, images_per_identity: int = 72, num_identities: int = 10_000,
                 cache_bytes: int = 256 << 20, device: str | torch.device | None = None) -> None:
        if images_per_identity < 1:
            raise InputError(f"images_per_identity must be ≥ 1, got {images_per_identity}")
        if num_identities < 1:
            raise InputError(f"num_identities must be ≥ 1, got {num_identities}")
        self.faces = faces
        self.images_per_identity = int(images_per_identity)
        self.num_identities = int(num_identities)
        self.image_size = faces.image_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cache = LRUImageCache(cache_bytes)
        self.rendered = 0
        """Images rendered so far (cache misses included)."""

    def __repr__(self) -> str:
        return (f"SynthDataset({self.faces!r}, images_per_identity={self.images_per_identity}, "
                f"num_identities={self.num_identities})")

    def identity_names(self, identities: IndexLike) -> list[str]:
        """Stable names of ``identities``: ``synthfaces-<seed>/<index>`` (the same person at any
        image size; another universe seed is another person)."""
        ids = np.asarray(identities, dtype=np.int64).reshape(-1)
        self._check_ids(ids)
        return [f"synthfaces-{self.faces.seed}/{int(i)}" for i in ids]

    def fingerprint(self) -> str:
        """sha256 of what determines every image (the generator's settings and the universe)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()

    def count(self, identity: int) -> int:
        self._check_ids(np.asarray([identity]))
        return self.images_per_identity

    def images(self, identity: int, indices: IndexLike) -> torch.Tensor:
        return self.batch(identity, indices)

    def batch(self, identities: IndexLike, indices: IndexLike) -> torch.Tensor:
        return normalize(self.batch_uint8(identities, indices))

    def batch_uint8(self, identities: IndexLike, indices: IndexLike, device: str | torch.device | None = None,
                    cache: bool = True) -> torch.Tensor:
        """uint8 ``[N, 3, S, S]`` rendered on ``device`` (default: the dataset's), in the
        renderer's large chunks. ``cache=False`` (or another device than the dataset's, or an
        LRU of 0 bytes) bypasses the LRU: the image store keeps the images itself."""
        ids, idx = broadcast_pairs(identities, indices)
        self._check_ids(ids)
        if idx.size and (idx.min() < 0 or idx.max() >= self.images_per_identity):
            raise InputError(f"image index out of range [0, {self.images_per_identity}): "
                             f"{int(idx.min())}..{int(idx.max())}")
        dev = self.device if device is None else torch.device(device)
        if not cache or dev != self.device or self.cache.max_bytes <= 0:
            self.rendered += int(ids.size)
            return self.faces.render_u8(ids, idx, dev)
        S = self.image_size
        out = torch.empty((ids.size, 3, S, S), dtype=torch.uint8, device=dev)
        missing = self.cache.fetch_into(ids, idx, out)
        if missing:
            m = np.asarray(missing)
            levels = self.faces.render_u8(ids[m], idx[m], dev)
            self.rendered += int(m.size)
            out[torch.as_tensor(m, device=dev)] = levels
            self.cache.put_many(ids, idx, missing, levels)
        return out

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_identities):
            raise InputError(f"identity out of range [0, {self.num_identities}): {int(ids.min())}..{int(ids.max())}")

