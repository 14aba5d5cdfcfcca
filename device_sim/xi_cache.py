"""ξ's outputs for each client's training images, computed once per run.

ξ is frozen (FedFS §3: only ``w_c`` and ``θ_c`` train), and a client's training images are the
same in every round, so ``v = ξ(x)`` (Eq. 2) of every image is the same at every local step of
every round. The federation computes it the first time a client takes part — for the whole
chunk's new clients in large batches, outside the per-client step — and hands it to the
executor with the task. The executor would otherwise compute it once per chunk itself.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .executors import ClientTask, xi_features


class XiCache:
    """``{client: ξ(train images) [n_c, D]}`` on ``device``, up to ``max_bytes``.

    Beyond the budget new clients are not stored (the executor then computes their features for
    the chunk). 10,000 clients × 57 images × 128 dims in float32 take 0.29 GB.
    """

    def __init__(self, xi: torch.nn.Module, device: str | torch.device, amp: str = "off",
                 max_bytes: int = 4 << 30) -> None:
        self.xi, self.device, self.amp = xi, torch.device(device), amp
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._v: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._v)

    def fill(self, tasks: Sequence[ClientTask]) -> None:
        """Set ``xi_features`` of every task: from the cache, or computed now for the clients
        seen for the first time (one batched ξ pass over all their images)."""
        new = [t for t in tasks if t.client not in self._v]
        if new:
            sizes = [t.num_samples for t in new]
            images = torch.cat([t.images.to(self.device) for t in new])
            feats = torch.split(xi_features(self.xi, images, self.device, self.amp), sizes)
            for t, v in zip(new, feats):
                t.xi_features = v
                size = v.numel() * v.element_size()
                if self.nbytes + size <= self.max_bytes:
                    self._v[t.client] = v
                    self.nbytes += size
        for t in tasks:
            if t.xi_features is None:
                t.xi_features = self._v[t.client]
