"""ξ's trunk features of a device's own photos, computed once per (ξ, photos) on that device.

Under ``scope="top"`` a device would run ξ's frozen trunk on its photos at every local step of every
round, for ξ's moments in the statistics round (:func:`~fedfs_sdk.federation.device_stats.xi_moments`),
and in the do-no-harm check for every candidate whose trunk *is* ξ's, weight for weight
(:func:`~fedfs_sdk.federation.device_stats.in_domain_check`). With this it runs once per (ξ, photos):
local training (:meth:`~fedfs_sdk.federation.device_runtime.TorchRuntime.train`) and the moments share
one entry (:data:`STATS_CHUNK`), as the simulator's clients train the top on ξ's cached features.
The features are kept on the agent (the device's own object — never in a cache another device
reads), keyed by ξ's sha256, the photos' content and the chunking, so a changed photo or ξ is
computed again.

Exact, not approximate, for the check: the embedding is ``EmbeddingTop(trunk features)``, the
backbone's own modules in the backbone's own order, on chunks of the size the full forward uses —
bit-equal to it (tests/test_device_features.py), for a verifier and for the dual verifier
(``verify=both``: θ_c's and w's backbones, both on ξ's trunk under ``scope="top"``). Local
training's batches are smaller than the chunk: there the features equal a per-batch trunk pass
within float rounding (every backbone normalizes each sample by itself). A candidate whose trunk
is not ξ's bit for bit (the global model of rounds whose tasks name no scope: the secure sum's
fixed-point rounding moves it by ≤ 4·10⁻⁹) runs its own full forward.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

CACHE_ATTR = "_xi_trunk_features"
MAX_ENTRIES = 4
STATS_CHUNK = 64
"""The chunk of ξ's moments in a statistics round (:func:`~fedfs_sdk.federation.device_stats._embed_xi`),
which local training takes too: one entry serves both."""


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


def training_features(task: Any, train_cfg: Any, xi: Any, images: np.ndarray, agent: Any):
    """ξ's trunk features ``[n, F]`` of the device's training photos for a round's local training
    (:meth:`~fedfs_sdk.federation.device_runtime.TorchRuntime.train`) under ``scope="top"``: the
    agent's entry, which ξ's statistics round fills too, so no round runs the frozen trunk again;
    None where the trunk trains or there is no ξ (``LocalTrainer`` itself ignores them unless the
    three trunks are equal, and checks a row)."""
    import torch

    if xi is None or train_cfg.effective_scope != "top" or not task.get("xi_sha256") or not hasattr(agent, "__dict__"):
        return None
    return torch.cat(xi_trunk_features(agent, str(task["xi_sha256"]), xi, images, STATS_CHUNK))


def has_xi_trunk(net, xi_backbone) -> bool:
    """Whether every backbone of ``net`` — a verifier, or the dual verifier's θ_c and w — has ξ's
    trunk weights bit for bit (so its embeddings can come from ξ's trunk features)."""
    import torch

    from ..nn.model import DualVerifierNet, VerifierNet
    from ..training.scope import is_top_key

    if type(net) is VerifierNet:
        backbones = [net.backbone]
    elif type(net) is DualVerifierNet:
        backbones = [net.backbone, net.global_backbone]
    else:
        return False
    ref = xi_backbone.state_dict()
    trunk = [k for k in ref if not is_top_key(k)]
    for bb in backbones:
        mine = bb.state_dict()
        if not (type(bb) is type(xi_backbone) and set(mine) == set(ref)
                and all(mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]) for k in trunk)):
            return False
    return True


def embeddings_on_xi_trunk(agent: Any, net, xi_sha: str, xi_net, x: np.ndarray, chunk: int) -> np.ndarray:
    """``net``'s ``embedding`` output of ``x`` from ξ's cached trunk features (``net`` must pass
    :func:`has_xi_trunk`): what ``TorchBackend(net).run(x)["embedding"]`` returns, chunk for chunk."""
    import torch

    from ..stats.in_domain import top_verifier

    top = top_verifier(net).eval()
    with torch.inference_mode():
        outs = [top(f)[0].float().cpu().numpy() for f in xi_trunk_features(agent, xi_sha, xi_net, x, chunk)]
    return np.concatenate(outs)


__all__ = ["STATS_CHUNK", "training_features", "xi_trunk_features", "has_xi_trunk", "embeddings_on_xi_trunk", "CACHE_ATTR"]
