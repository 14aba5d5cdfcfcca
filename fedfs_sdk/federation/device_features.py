"""ξ's trunk features of a device's own photos, computed once per (ξ, photos) on that device.

Under ``scope="top"`` a device runs ξ's trunk on its photos three times without this: for ξ's
moments in the statistics round (:func:`~fedfs_sdk.federation.device_stats.xi_moments`), and in the
do-no-harm check for the ``xi`` and ``norm-adapt`` candidates, whose trunks *are* ξ's, weight for
weight (:func:`~fedfs_sdk.federation.device_stats.in_domain_check`). The features are kept on the
agent (the device's own object — never in a cache another device reads), keyed by ξ's sha256, the
photos' content and the chunking, so a changed photo or ξ is computed again.

Exact, not approximate: the embedding is ``EmbeddingTop(trunk features)``, the backbone's own modules
in the backbone's own order, on chunks of the size the full forward uses — bit-equal to it
(tests/test_device_features.py). A candidate whose trunk is not ξ's bit for bit (the global model:
the secure sum's fixed-point rounding moves it by ≤ 4·10⁻⁹; the personalized dual verifier) runs
its own full forward, as before.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

CACHE_ATTR = "_xi_trunk_features"
MAX_ENTRIES = 4


def _key(xi_sha: str, x: np.ndarray, chunk: int) -> tuple:
    x = np.ascontiguousarray(x)
    digest = hashlib.sha256(x.tobytes()).hexdigest()
    # chunks that cover the same photos the same way are the same computation
    return str(xi_sha), digest, tuple(x.shape), str(x.dtype), int(min(chunk, max(x.shape[0], 1)))


def xi_trunk_features(agent: Any, xi_sha: str, xi_net, x: np.ndarray, chunk: int) -> list:
    """ξ's trunk features ``[n_chunk, F]`` (float32 tensors) of ``x``, one per chunk of ``chunk`` photos,
    computed once per (ξ, photos, chunking) and kept on ``agent``."""
    import torch

    from ..training.scope import Trunk

    cache: dict = agent.__dict__.setdefault(CACHE_ATTR, {})
    key = _key(xi_sha, x, chunk)
    if key not in cache:
        trunk = Trunk(xi_net.backbone)
        with torch.inference_mode():
            cache[key] = [trunk(torch.from_numpy(np.ascontiguousarray(x[a:a + chunk])))
                          for a in range(0, x.shape[0], chunk)]
        while len(cache) > MAX_ENTRIES:
            cache.pop(next(iter(cache)))
    return cache[key]


def has_xi_trunk(net, xi_backbone) -> bool:
    """Whether ``net`` is a single-backbone verifier whose trunk weights equal ξ's bit for bit."""
    import torch

    from ..nn.model import VerifierNet
    from ..training.scope import is_top_key

    if type(net) is not VerifierNet:
        return False
    mine, ref = net.backbone.state_dict(), xi_backbone.state_dict()
    trunk = [k for k in ref if not is_top_key(k)]
    return (type(net.backbone) is type(xi_backbone) and set(mine) == set(ref)
            and all(mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]) for k in trunk))


def embeddings_on_xi_trunk(agent: Any, net, xi_sha: str, xi_net, x: np.ndarray, chunk: int) -> np.ndarray:
    """``net``'s ``embedding`` output of ``x`` from ξ's cached trunk features (``net`` must pass
    :func:`has_xi_trunk`): what ``TorchBackend(net).run(x)["embedding"]`` returns, chunk for chunk."""
    import torch

    from ..stats.in_domain import top_verifier

    top = top_verifier(net).eval()
    with torch.inference_mode():
        outs = [top(f)[0].float().cpu().numpy() for f in xi_trunk_features(agent, xi_sha, xi_net, x, chunk)]
    return np.concatenate(outs)


__all__ = ["xi_trunk_features", "has_xi_trunk", "embeddings_on_xi_trunk", "CACHE_ATTR"]
