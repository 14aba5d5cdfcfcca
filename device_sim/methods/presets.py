"""Named configurations of the project's methods (``fedfs:paper``, the measured defaults) and the
simulated FedUV base vectors ``b_u``."""
from __future__ import annotations

from typing import Any

import numpy as np

from fedfs_sdk.errors import InputError
from fedfs_sdk.training.methods import (DEFAULT_LR, DEFAULT_NORM_INIT, DEFAULT_SCOPE, DEFAULT_VERIFICATION, PAPER_LR,
                                        PAPER_SCOPE)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "fedfs": {"paper": {"lr": PAPER_LR["fedfs"], "scope": PAPER_SCOPE},
              "default": {"lr": DEFAULT_LR["fedfs"], "scope": DEFAULT_SCOPE["fedfs"], "select": "auto"}},
    "feduv": {"paper": {"lr": PAPER_LR["feduv"], "scope": PAPER_SCOPE},
              # do no harm by default, as fedfs and fedfs+feduv (issue 29): on real faces FedUV alone
              # fell far below ξ (LFW −0.18 template AUROC); ``feduv:paper`` keeps the paper's behaviour
              "default": {"lr": DEFAULT_LR["feduv"], "scope": DEFAULT_SCOPE["feduv"], "select": "auto"}},
    "fedfs+feduv": {
        "paper": {"lr": PAPER_LR["fedfs+feduv"], "scope": PAPER_SCOPE},
        "default": {"lr": DEFAULT_LR["fedfs+feduv"], "norm_init": DEFAULT_NORM_INIT["fedfs+feduv"],
                    "scope": DEFAULT_SCOPE["fedfs+feduv"],
                    "select": "auto", **dict(zip(("score", "verify"), DEFAULT_VERIFICATION["fedfs+feduv"]))}},
}
"""Named configurations of each method. ``paper``: the papers' values as printed (FedFS lr
5e-3, 2 epochs, Eq. 5 dot-product soft scores; FedUV lr 0.1, codeword scoring). ``default``:
the best configuration measured on the cross-domain benchmark (docs/personalization.md
gives the search and its commands); its lr and verification are the device's defaults
(:mod:`fedfs_sdk.training.methods`), so the simulator and a phone run the same thing. Keys: ``score``,
``verify``, ``lr``, ``epochs``, ``uv_weight``, ``norm_init`` and ``loss`` (FedFS loss fields)."""


def base_vector(seed: int, client: int) -> int:
    """A unique 32-bit FedUV base vector ``b_u`` for simulated client ``client``.

    The server draws ``b_u`` at random (``server_agg.rounds``); the simulator must too. With
    ``b_u`` = the client index, the high bits of every ``b_u`` are 0, so with a systematic BCH
    code 25 of 127 codeword positions were the same for every client (mean pairwise codeword
    cosine 0.20 instead of ≈ 0): every client's target shared one direction. Here ``b_u`` is
    a bijection of the 32-bit index (xor with a seed key, then the murmur3 finalizer, itself
    a bijection), so distinct clients still get distinct ``b_u``."""
    if not 0 <= client < 1 << 32:
        raise InputError(f"client index {client} does not fit a 32-bit base vector")
    key = int(np.random.SeedSequence([seed, 0xBA5E]).generate_state(1, np.uint32)[0])
    x = (client ^ key) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x


__all__ = ["PRESETS", "base_vector"]
