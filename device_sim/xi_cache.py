"""ξ's outputs — and a frozen stem's — for each client's training images, computed once per run.

ξ is frozen (FedFS §3: only ``w_c`` and ``θ_c`` train), and a client's training images are the
same in every round, so ``v = ξ(x)`` (Eq. 2) of every image is the same at every local step of
every round. The federation computes it the first time a client takes part — for the whole
chunk's new clients in large batches, outside the per-client step — and hands it to the
executor with the task. The executor would otherwise compute it once per chunk itself.

The same holds for a method's frozen stem (``scope="top"``: ξ's trunk, which ξ, the global and
the personalized model share, :meth:`~device_sim.methods.base.FederatedMethod.frozen_stem`): its
outputs are cached the same way, and ξ's features are then computed from them by ξ's layers
after the stem (:meth:`~device_sim.methods.base.FederatedMethod.xi_after_stem`) instead of
running ξ's trunk a second time.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .executors import ClientTask, normalized, xi_features
from .trunk_cache import cache_of


class FeatureCache:
    """``{client: model(source) [n_c, …]}`` on ``device``, up to ``max_bytes``; set on each task
    as ``attr`` (``xi_features``, ``stem_features``). ``source`` is the task attribute the model
    reads: ``images``, or ``stem_features`` (filled first by the stem's cache).

    Beyond the budget new clients are not stored (the executor then computes their features for
    the chunk). 10,000 clients × 57 images × 128 dims in float32 take 0.29 GB; MobileFaceNet's
    512-d trunk output, 1.17 GB.
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device, amp: str = "off",
                 max_bytes: int = 4 << 30, attr: str = "xi_features", source: str = "images") -> None:
        self.model, self.device, self.amp = model, torch.device(device), amp
        self.max_bytes = int(max_bytes)
        self.attr, self.source = attr, source
        self.nbytes = 0
        self._v: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._v)

    def fill(self, tasks: Sequence[ClientTask]) -> None:
        """Set ``attr`` of every task: from the cache, or computed now for the clients seen for
        the first time (one batched pass over all their inputs)."""
        new = [t for t in tasks if t.client not in self._v]
        if new:
            sizes = [t.num_samples for t in new]
            inputs = torch.cat([getattr(t, self.source).to(self.device) for t in new])
            shared = cache_of(self.model) if self.source == "images" and self.amp == "off" else None
            if shared is not None:      # a frozen trunk with a run-wide cache: computed once for every use
                out = shared(normalized(inputs)).float()
            else:
                out = xi_features(self.model, inputs, self.device, self.amp)
            feats = torch.split(out, sizes)
            for t, v in zip(new, feats):
                setattr(t, self.attr, v)
                size = v.numel() * v.element_size()
                if self.nbytes + size <= self.max_bytes:
                    self._v[t.client] = v
                    self.nbytes += size
        for t in tasks:
            if getattr(t, self.attr) is None:
                setattr(t, self.attr, self._v[t.client])


class XiCache(FeatureCache):
    """``{client: ξ(train images) [n_c, D]}`` (:class:`FeatureCache` of ξ on the images)."""

    def __init__(self, xi: torch.nn.Module, device: str | torch.device, amp: str = "off",
                 max_bytes: int = 4 << 30) -> None:
        super().__init__(xi, device, amp, max_bytes)
        self.xi = xi


def feature_caches(method, device: str | torch.device, amp: str) -> list[FeatureCache]:
    """The run's caches for ``method`` (a :class:`~device_sim.methods.base.FederatedMethod`), in
    fill order: its frozen stem's outputs, then ξ's features (from the stem's outputs where ξ
    shares the stem, else from the images)."""
    caches: list[FeatureCache] = []
    stem, xi = method.frozen_stem(), method.xi_model()
    if stem is not None:
        caches.append(FeatureCache(stem, device, amp, attr="stem_features"))
    if xi is not None:
        after = method.xi_after_stem() if stem is not None else None
        caches.append(FeatureCache(after, device, amp, source="stem_features") if after is not None
                      else XiCache(xi, device, amp))
    return caches
