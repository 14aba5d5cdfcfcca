"""ξ's trunk features, computed once per image for every ``scope="top"`` method of a run.

With ``scope="top"`` (:mod:`fedfs_sdk.training.scope`) the trunk is ξ's for ξ, the global and
every personalized model, so an image's trunk features never change during a simulation:
they are cached here, keyed by the image's bytes (a BLAKE2 digest of the float32 tensor —
identical images share an entry, different ones do not), and shared by every method that
runs on the same ξ (one cache per trunk module). A pure speed-up: the same tensors the trunk
would return (tested). Under ``vmap`` (the batched executor) images are not concrete tensors
and the trunk simply runs.
"""
from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

import torch

from fedfs_sdk.training.scope import Trunk

_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, TrunkCache]" = weakref.WeakKeyDictionary()


def _is_concrete(x: torch.Tensor) -> bool:
    try:        # any functorch wrapper (vmap's BatchedTensor, grad's GradTrackingTensor around it …)
        from torch._C._functorch import is_functorch_wrapped_tensor

        return not is_functorch_wrapped_tensor(x)
    except ImportError:     # pragma: no cover — older torch: never cache
        return False


class TrunkCache:
    """Trunk features of images by content (LRU of at most ``max_entries`` images)."""

    def __init__(self, backbone: torch.nn.Module, max_entries: int = 200_000, batch_size: int = 64) -> None:
        self.trunk = Trunk(backbone).eval().requires_grad_(False)
        self.max_entries, self.batch_size = int(max_entries), int(batch_size)
        self._d: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Trunk features of ``x`` ``[N, 3, S, S]`` (on ``x``'s device)."""
        if not _is_concrete(x):
            # inside vmap/grad: the trunk's weights need no gradient, no graph is built. Never move the
            # module here (Module.to under a functorch transform would leave wrapped tensors in it)
            return self.trunk(x)
        with torch.no_grad():
            return self._cached(x)

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        dev = next(self.trunk.parameters()).device      # where ξ lives (the method moved it)
        if x.shape[0] == 0:
            return self.trunk(x.to(dev)).to(x.device)
        cpu = x.detach().to("cpu", torch.float32).contiguous()
        keys = [hashlib.blake2b(cpu[i].numpy().tobytes(), digest_size=16).digest() for i in range(cpu.shape[0])]
        missing = [i for i, k in enumerate(keys) if k not in self._d]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        for a in range(0, len(missing), self.batch_size):
            part = missing[a:a + self.batch_size]
            feats = self.trunk(cpu[part].to(dev)).to("cpu")
            for i, f in zip(part, feats):
                self._d[keys[i]] = f.clone()
        out = torch.stack([self._d[k] for k in keys])
        for k in keys:
            self._d.move_to_end(k)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
        return out.to(x.device)


_BY_TRUNK: "weakref.WeakKeyDictionary[torch.nn.Module, TrunkCache]" = weakref.WeakKeyDictionary()


def trunk_cache(backbone: torch.nn.Module) -> TrunkCache:
    """The cache of ``backbone``'s trunk (ξ's), shared by every method holding that module."""
    cache = _CACHES.get(backbone)
    if cache is None:
        cache = _CACHES[backbone] = TrunkCache(backbone)
        _BY_TRUNK[cache.trunk] = cache
    return cache


def cache_of(module: torch.nn.Module | None) -> TrunkCache | None:
    """The :class:`TrunkCache` whose ``trunk`` is ``module`` (a method's
    :meth:`~device_sim.methods.base.FederatedMethod.frozen_stem`), or None: the federation's
    stem outputs then come from — and go into — the run's one cache of that trunk, so evaluation
    and the do-no-harm checks do not run the trunk again on the training images (issue 31)."""
    return _BY_TRUNK.get(module) if module is not None else None


__all__ = ["TrunkCache", "trunk_cache", "cache_of"]
