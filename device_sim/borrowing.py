"""Borrowed ``θ_c``: a distributed round's trainer rank holds a client whose home shard is elsewhere.

Client ``c``'s private weights stay in its home rank's client-store shard (``c mod W``);
when the round's assignment (:mod:`device_sim.rank_split`) gives ``c`` to another rank,

1. :func:`lend_rows` — before training, each home rank sends the stored rows of its
   clients trained elsewhere to their trainers (only clients that have a row: every rank
   keeps the same mask of who has one, so the trainer knows the others start from the
   fresh weights, as on their home rank);
2. the trainer reads them through ``ClientStore.get(…, borrowed=…)``, decoded exactly as
   the home store decodes its own rows, and :func:`store_chunk` keeps their trained rows —
   encoded as the home store would (``ClientStore.encode_rows``) — in a per-round buffer,
   never in its own shard (memory stays O(home clients) per rank);
3. :func:`return_rows` — after training, the trainers send those rows home, where
   ``import_rows`` stores them: the same bits the home rank's own ``put`` would have stored.

Both transfers are ``distributed.exchange_rows`` (point to point, pre-allocated buffers:
every rank computes every count from the assignment and the row mask).
"""
from __future__ import annotations

import numpy as np
import torch

from .client_store import DTYPES, ClientStore
from .distributed import DistContext, exchange_rows
from .methods.base import Params

Borrowed = dict[int, "torch.Tensor | None"]


def lend_rows(store: ClientStore, has_row: np.ndarray, participants: np.ndarray, trainer: np.ndarray,
              ctx: DistContext) -> Borrowed:
    """Step 1 (every rank calls it): returns this rank's borrowed clients → their row as
    stored, or None for a client without a row (it starts from the fresh weights)."""
    me, w = ctx.rank, ctx.world_size
    home, has = participants % w, has_row[participants]
    lent_out = (home == me) & (trainer != me)
    rowless = participants[lent_out & ~has]
    stray = rowless[store.rows[rowless] >= 0]
    if stray.size:     # the shared row mask and this shard disagree: a bug, not bad input
        raise RuntimeError(f"rank {me}'s client store holds a row of client {int(stray[0])} "
                           f"that the federation's row mask says it lacks")
    sends = {t: store.export_rows(participants[lent_out & has & (trainer == t)]) for t in range(w) if t != me}
    mine_in = (trainer == me) & (home != me)
    counts = {h: int((mine_in & has & (home == h)).sum()) for h in range(w) if h != me}
    got = exchange_rows(sends, counts, store.params_per_client, DTYPES[store.dtype], ctx)
    borrowed: Borrowed = {int(c): None for c in participants[mine_in]}
    for h, raw in got.items():
        for i, c in enumerate(participants[mine_in & has & (home == h)].tolist()):
            borrowed[int(c)] = raw[i]
    return borrowed


def store_chunk(store: ClientStore, clients: list[int], private: Params, borrowed: Borrowed,
                returned: dict[int, torch.Tensor]) -> None:
    """Step 2: a trained chunk's ``θ_c`` — home clients into ``store``, borrowed ones
    encoded for their home store into ``returned`` (the round's buffer)."""
    lent = [i for i, c in enumerate(clients) if int(c) in borrowed]
    if not lent:
        store.put(clients, private)
        return
    own = [i for i in range(len(clients)) if int(clients[i]) not in borrowed]

    def pick(idx: list[int]) -> Params:
        return {g: {k: v[torch.tensor(idx, device=v.device)] for k, v in p.items()} for g, p in private.items()}

    if own:
        store.put([clients[i] for i in own], pick(own))
    for c, row in zip((clients[i] for i in lent), store.encode_rows(pick(lent), len(lent))):
        returned[int(c)] = row


def return_rows(store: ClientStore, participants: np.ndarray, trainer: np.ndarray,
                returned: dict[int, torch.Tensor], ctx: DistContext) -> None:
    """Step 3 (every rank calls it): trainers send the borrowed clients' trained rows to
    their home ranks, which store them."""
    me, w = ctx.rank, ctx.world_size
    home = participants % w
    width, dtype = store.params_per_client, DTYPES[store.dtype]
    sends = {}
    for h in range(w):
        if h != me:
            ids = participants[(trainer == me) & (home == h)].tolist()
            sends[h] = torch.stack([returned[int(c)] for c in ids]) if ids else torch.empty((0, width), dtype=dtype)
    back = (home == me) & (trainer != me)
    counts = {t: int((back & (trainer == t)).sum()) for t in range(w) if t != me}
    for t, raw in exchange_rows(sends, counts, width, dtype, ctx).items():
        store.import_rows(participants[back & (trainer == t)], raw)


__all__ = ["lend_rows", "store_chunk", "return_rows", "Borrowed"]
