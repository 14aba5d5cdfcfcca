"""The statistics round in the simulator: each client computes its own contribution with the
device's functions (:mod:`fedfs_sdk.stats`), and the federation learns their sum — the one sum
the server computes (:func:`fedfs_sdk.stats.sum_contributions`). No pooled shortcut: what the
simulator folds into ``norm_init`` / ``norm-adapt`` and what its do-no-harm check sees are what a
device gets from the round.

Contributions (per client, from its training photos, ξ's frozen weights):

* ``xi.embedding`` — :func:`~fedfs_sdk.stats.embedding_moments` of ξ's embedding;
* ``xi.features`` — :func:`~fedfs_sdk.stats.feature_moments` of ξ's trunk features (only when
  the backbone splits into trunk + top, ``scope="top"``).

Which clients contribute: every client up to :data:`~.reference.NORM_STATS_CLIENTS`, a seeded
sample beyond (a round opened to a sample of devices).

DP (``dp``: a :class:`StatsRoundDp`): the round's sum gets the server's central Gaussian noise —
the same function (:func:`fedfs_sdk.stats.privacy.add_noise`) — with the round's clip bound and
photo cap; each client's own contribution is kept noise-free (what a device keeps on itself).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from fedfs_sdk.stats import EMBEDDING_BOUND, FEATURE_BOUND, MAX_PHOTOS, StatSum, embedding_moments, \
    feature_moments, feature_length, sum_contributions

from fedfs_sdk.stats.in_domain import EMBEDDING, FEATURES  # noqa: E402 (the statistics' names, as devices send them)


@dataclass(frozen=True)
class StatsRoundDp:
    """The simulated round's DP: noise multiplier ``z`` (0: the clipping only), each photo's L2
    ``bound`` (embedding and feature moments), the ``max_photos`` cap, and the noise's seed."""

    z: float = 0.0
    bound: float | None = None
    max_photos: int = MAX_PHOTOS
    seed: int = 0

    def specs(self, dims: dict[str, int]) -> list:
        """The round's :class:`~fedfs_sdk.stats.transport.StatSpec` (``dims``: name → the vector's
        embedding / feature width)."""
        from fedfs_sdk.stats.transport import StatSpec

        out = []
        if EMBEDDING in dims:
            out.append(StatSpec(EMBEDDING, "embedding", 2 * dims[EMBEDDING] + 1, self.bound or EMBEDDING_BOUND))
        if FEATURES in dims:
            out.append(StatSpec(FEATURES, "features", feature_length(dims[FEATURES]), self.bound or FEATURE_BOUND))
        return out


@dataclass
class FederationStats:
    """The round's published sum, every contributor's own contribution (which only that client
    holds; the simulator keeps them to subtract each client's own), and — for the simulator's
    diagnostics only, never for a decision — each client's trunk features."""

    total: StatSum
    own: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    features: dict[int, np.ndarray] = field(default_factory=dict)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    dp: StatsRoundDp | None = None
    """What the do-no-harm checks derive from this round alone (a client's impostor draws, ξ's
    check): computed by the first method that needs it, reused by the others of the run
    (:class:`~.selection.SimSelection`; issue 31)."""

    def contribution(self, client: int) -> dict[str, np.ndarray] | None:
        """Client ``client``'s own contribution (None: it was not in the round). The feature
        moments are recomputed from its features (kept small: 4·n·F bytes, not F² per client)."""
        mine = self.own.get(client)
        if mine is None:
            return None
        if client in self.features:
            dp = self.dp or StatsRoundDp()
            return {**mine, FEATURES: feature_moments(self.features[client], dp.bound or FEATURE_BOUND, dp.max_photos)}
        return mine

    def others(self, client: int, name: str) -> np.ndarray:
        """The sum over every other contributor (the published sum minus the client's own)."""
        mine = self.contribution(client)
        total = self.total.sums[name]
        return total if mine is None else total - mine[name]


@torch.no_grad()
def client_statistics(net: torch.nn.Module, weights: dict, data: Any, clients: Sequence[int],
                      device: str | torch.device = "cpu", trunk: Any = None, top: torch.nn.Module | None = None,
                      clients_per_load: int = 64, batch_size: int = 512,
                      dp: StatsRoundDp | None = None) -> FederationStats:
    """Each client's contribution and their sum. ``trunk``/``top``: ξ split at its trunk (then the
    feature moments are contributed too); else ``net`` with ``weights`` gives the embeddings.
    ``dp``: the round's bound, photo cap and central noise (module docstring)."""
    from torch.func import functional_call

    from ..executors import normalized
    from ..memory import forward_batch

    dev = torch.device(device)
    net = net.to(dev).eval()
    w = {k: v.to(dev) for k, v in weights.items()}
    if top is not None:
        names = set(top.state_dict())
        top = top.to(dev).eval()
        tw = {k: v for k, v in w.items() if k in names}
    out = FederationStats(StatSum(), dp=dp)
    bound, cap = (dp.bound or EMBEDDING_BOUND, dp.max_photos) if dp is not None else (EMBEDDING_BOUND, MAX_PHOTOS)
    ids = [int(c) for c in clients]
    chunk_fn = getattr(data, "train_chunk", None)
    for a in range(0, len(ids), clients_per_load):
        group = ids[a:a + clients_per_load]
        xs = chunk_fn(np.asarray(group), dev) if callable(chunk_fn) else [data.train_images(c, dev) for c in group]
        sizes = [int(x.shape[0]) for x in xs]
        x = normalized(torch.cat([t.to(dev) for t in xs]))
        feats, embs = [], []
        # through the trunk cache (which batches for the device itself), or ξ on CPU at a batch that
        # suits the CPU (device_sim.memory.forward_batch: 512 images of MobileFaceNet run ~2× slower per image)
        bs = batch_size if trunk is not None and top is not None else \
            forward_batch(net, int(x.shape[-1]), dev, batch_size)
        for b in range(0, x.shape[0], bs):
            xb = x[b:b + bs]
            if trunk is not None and top is not None:
                f = trunk(xb).to(dev)
                feats.append(f.double().cpu())
                embs.append(functional_call(top, tw, (f,))[0].double().cpu())
            else:
                embs.append(functional_call(net, w, (xb,))[0].double().cpu())
        e_all = torch.cat(embs).numpy()
        f_all = torch.cat(feats).numpy() if feats else None
        start = 0
        for c, n in zip(group, sizes):
            out.own[c] = {EMBEDDING: embedding_moments(e_all[start:start + n], bound, cap)}
            if f_all is not None:
                out.features[c] = f_all[start:start + n]
            start += n
    out.total = sum_contributions(out.contribution(c) for c in out.own)
    if dp is not None and dp.z > 0:
        from fedfs_sdk.stats.privacy import add_noise

        dims = {EMBEDDING: (out.total.sums[EMBEDDING].size - 1) // 2}
        if f_all is not None:
            dims[FEATURES] = int(f_all.shape[1])
        rng = np.random.default_rng([int(dp.seed) & 0xFFFFFFFF, 0xD905])
        out.total = StatSum(add_noise(out.total.sums, dp.specs(dims), dp.max_photos, dp.z, rng), out.total.count)
    return out


_SHARED: list = []      # [(weak refs to the key objects, key values, stats)]: the run's one statistics round


def shared_round(objects: tuple, values: tuple, compute) -> FederationStats:
    """The statistics round of ``compute()``, once per run: every method of a run that asks for
    the same round (the same ξ object, data source, clients and settings: ``objects`` compared by
    identity, ``values`` by equality) gets the same :class:`FederationStats` — the round is a
    function of ξ's frozen weights and the clients' photos only, so each method recomputing it
    (and the checks derived from it, :attr:`FederationStats.memo`) was redundant work (issue 31).
    One round is kept: a run's methods ask one after another. The key's objects are held weakly
    (a finished run's population and ξ are not kept alive by it: the next seed's would sit next to
    them, an image store on the GPU included)."""
    import weakref

    def ref(o):
        return (lambda: None) if o is None else weakref.ref(o)

    if _SHARED:
        refs, vals, stats = _SHARED[0]
        if len(refs) == len(objects) and all(r() is o for r, o in zip(refs, objects)) and vals == values:
            return stats
    stats = compute()
    _SHARED[:] = [(tuple(ref(o) for o in objects), values, stats)]
    return stats


__all__ = ["StatsRoundDp", "FederationStats", "client_statistics", "shared_round", "EMBEDDING", "FEATURES"]
