"""Which rank trains which participant of a distributed round (``--rank-split``).

Client ``c``'s private weights ``θ_c`` live on its *home* rank ``c mod W`` for the whole
run (its client-store shard, checkpoints, ``collect_private``). Training every participant
on its home rank (``--rank-split home``, the first design) splits a round unevenly — 10
participants on 2 ranks often split 6 + 4 — and the round waits for the slowest rank.
``--rank-split balanced`` (the default) gives each round's participants to trainer ranks
so that the *work* is balanced, and the trainer borrows ``θ_c`` from the home rank for the
round (:mod:`device_sim.distributed`, :class:`device_sim.federation.Federation`).

The rule (:func:`assign_participants`), computed identically on every rank from the
round's sorted participants and their loads (the number of training images of each
client where the data report it — ``num_train`` — else 1 per client), so no message is
needed to agree on it:

1. every participant starts on its home rank;
2. while the most loaded rank ``hi`` (the lowest rank id among equals) holds a client of
   load ``w`` with ``w < load(hi) − load(lo)``, ``lo`` the least loaded rank (the lowest
   id among equals), move one such client from ``hi`` to ``lo``: the one whose load is
   closest to half the gap (it evens the two ranks best), then one going back to its home
   rank, then the larger load, then the smaller client id.

Each move strictly lowers the sum of squared rank loads, so the loop ends; at its end no
client of the most loaded rank fits in the gap, so ``max load − min load ≤`` the largest
single client's load (balanced within one client). A client moves only when that strictly
narrows the gap between the most and the least loaded rank — equal home shares move
nobody — so the rows that cross ranks are few. Unlike greedy longest-processing-time from
empty ranks, which moves about half the clients even when the home split is already even,
this starts from the home split. Loads are a proxy: a client's training time is close to
proportional to its images (same epochs and batch size for everyone).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fedfs_sdk.errors import InputError

SPLITS = ("balanced", "home")


def home_ranks(clients: np.ndarray, world_size: int) -> np.ndarray:
    """The rank whose store shard holds each client's ``θ_c``: ``c mod W``."""
    return np.asarray(clients, dtype=np.int64) % int(world_size)


def assign_participants(clients: Sequence[int] | np.ndarray, loads: Sequence[float] | np.ndarray | None,
                        world_size: int, split: str = "balanced") -> np.ndarray:
    """The trainer rank of each of ``clients`` (same order), by the rule of the module
    docstring (``split="balanced"``) or the home rank (``split="home"``).

    Args:
        clients: the round's participants (distinct ids).
        loads: each client's work (> 0), e.g. its number of training images; None: 1 each.
        world_size: number of ranks ``W``.
        split: ``balanced`` | ``home``.
    """
    c = np.asarray(clients, dtype=np.int64).reshape(-1)
    if world_size < 1:
        raise InputError(f"world size must be ≥ 1, got {world_size}")
    if split not in SPLITS:
        raise InputError(f"--rank-split must be one of {', '.join(SPLITS)}, got {split!r}")
    if len(np.unique(c)) != c.size:
        raise InputError("a round's participants must be distinct clients")
    home = home_ranks(c, world_size)
    if split == "home" or world_size == 1 or c.size == 0:
        return home
    w = np.ones(c.size) if loads is None else np.asarray(loads, dtype=np.float64).reshape(-1)
    if w.shape != c.shape:
        raise InputError(f"{c.size} participants but {w.size} loads")
    if not np.all(w > 0):
        raise InputError(f"client loads must be > 0 (client {int(c[np.argmin(w)])} has {float(w.min())})")
    rank = home.copy()
    while True:
        load = np.bincount(rank, weights=w, minlength=world_size)   # recomputed: no drift from += / −=
        hi, lo = int(np.argmax(load)), int(np.argmin(load))   # argmax/argmin: lowest id among equals
        gap = load[hi] - load[lo]
        cand = np.flatnonzero((rank == hi) & (w < gap))
        if cand.size == 0:
            return rank
        # lexsort: the last key is the primary one
        pick = cand[np.lexsort((c[cand], -w[cand], home[cand] != lo, np.abs(gap / 2 - w[cand])))[0]]
        rank[pick] = lo


__all__ = ["assign_participants", "home_ranks", "SPLITS"]
