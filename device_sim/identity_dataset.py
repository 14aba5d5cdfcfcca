"""The contract every simulator dataset meets (:class:`IdentityDataset`): images grouped by
identity ``0 … num_identities − 1``, each with a count, normalized float32 batches
``[n, 3, S, S]`` (``(x − 127.5)/127.5``, RGB), stable identity names and a fingerprint; and
:data:`IndexLike`, what an identity or image index may be given as. Implementations:
:mod:`device_sim.datasets` (synthetic) and :mod:`device_sim.image_folder` (photos on disk).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

IndexLike = int | Sequence[int] | np.ndarray | torch.Tensor


@runtime_checkable
class IdentityDataset(Protocol):
    """Images grouped by identity; identities are ``0 … num_identities − 1``."""

    num_identities: int
    image_size: int

    def count(self, identity: int) -> int:
        """Number of images of ``identity``."""
        ...

    def images(self, identity: int, indices: IndexLike) -> torch.Tensor:
        """``[len(indices), 3, S, S]`` float32 normalized images of one identity."""
        ...

    # Optionally ``batch_uint8(identities, indices, device=None, cache=True)``: the same images
    # as uint8 levels on ``device`` (the image store uses it; without it, ``batch`` is quantized).

    def batch(self, identities: IndexLike, indices: IndexLike) -> torch.Tensor:
        """``[N, 3, S, S]`` for pairs ``(identities[i], indices[i])`` (scalars broadcast)."""
        ...

    def identity_names(self, identities: IndexLike) -> list[str]:
        """Stable names of ``identities`` (folder names, ``synthfaces-<seed>/<index>``)."""
        ...

    def fingerprint(self) -> str:
        """sha256 of what determines the images (checkpoints record it)."""
        ...


__all__ = ["IdentityDataset", "IndexLike"]
