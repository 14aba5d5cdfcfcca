"""Save and restore the server's round state between steps, so a restarted server finishes
the round (or fails it cleanly) instead of losing it.

The snapshot is a JSON-able dict (bytes → base64 with :func:`~.messages.to_json`); the
running sum of masked vectors is stored as raw little-endian words. It holds what the server
holds anyway — public keys, routed ciphertexts, the masked sum, unmask shares — so it needs
no more protection than the server's memory. Write it atomically after each accepted
message or step close.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .auth import certificate_of
from .errors import BadMessageError
from .identity import CaPublicKey
from .params import SecAggParams
from .server import SecAggServer

FORMAT = "fedfs-secagg-server/2"
READS = ("fedfs-secagg-server/1", FORMAT)
"""/1 snapshots (before authenticated rounds) restore as unauthenticated rounds."""


def _int_keys(d: dict[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def snapshot(srv: SecAggServer) -> dict[str, Any]:
    return {
        "format": FORMAT, "round": srv.params.round_id, "dim": srv.params.dim, "step": srv.step,
        "threshold": srv.threshold,
        "pks": [[u, c, s] for u, (c, s) in sorted(srv.pks.items())],
        "cts": [[u, v, ct] for u, row in sorted(srv.cts.items()) for v, ct in sorted(row.items())],
        "u2": srv.u2, "u3": srv.u3, "dropped": srv.dropped,
        "sum": None if srv._sum is None else srv._sum.astype("<u8").tobytes(),
        "masked_from": sorted(srv._masked_from), "unmasked_from": sorted(srv._unmasked_from),
        "b_shares": [[v, h, s] for v, row in sorted(srv.b_shares.items()) for h, s in sorted(row.items())],
        "s_shares": [[v, h, s] for v, row in sorted(srv.s_shares.items()) for h, s in sorted(row.items())],
        "adverts": [[u, cert, sig] for u, (cert, sig) in sorted(srv.adverts.items())],
        "u4": srv.u4, "csigs": [[u, s] for u, s in sorted(srv.csigs.items())],
    }


def restore(params: SecAggParams, snap: dict[str, Any], *, context: bytes = b"",
            ca: CaPublicKey | None = None) -> SecAggServer:
    """A server in the state ``snap`` was taken in; the params (and context, CA) must be the round's."""
    if not isinstance(snap, dict) or snap.get("format") not in READS:
        raise BadMessageError(f"not a {FORMAT} snapshot")
    if (snap.get("round"), snap.get("dim")) != (params.round_id, params.dim):
        raise BadMessageError(f"snapshot is of round {snap.get('round')} dim {snap.get('dim')}, "
                              f"params say round {params.round_id} dim {params.dim}")
    srv = SecAggServer(params, context=context, ca=ca)
    srv.step = snap["step"]
    srv.threshold = int(snap["threshold"])
    srv.pks = {int(u): (bytes(c), bytes(s)) for u, c, s in snap["pks"]}
    if srv.step != "advertise" and srv.pks:
        srv.set_graph()
    for u, v, ct in snap["cts"]:
        srv.cts.setdefault(int(u), {})[int(v)] = bytes(ct)
    srv.u2, srv.u3 = [int(u) for u in snap["u2"]], [int(u) for u in snap["u3"]]
    srv.dropped = {k: [int(u) for u in v] for k, v in snap["dropped"].items()}
    if snap["sum"] is not None:
        srv._sum = np.frombuffer(bytes(snap["sum"]), dtype="<u8").astype(np.uint64)
    srv._masked_from = {int(u) for u in snap["masked_from"]}
    srv._unmasked_from = {int(u) for u in snap["unmasked_from"]}
    for key, store in (("b_shares", srv.b_shares), ("s_shares", srv.s_shares)):
        for v, h, s in snap[key]:
            store.setdefault(int(v), {})[int(h)] = bytes(s)
    for u, cert, sig in snap.get("adverts", []):
        srv.adverts[int(u)] = (dict(cert), bytes(sig))
        srv.ids[int(u)] = certificate_of({"cert": cert}, "snapshot").public_key
    srv.csigs = {int(u): bytes(s) for u, s in snap.get("csigs", [])}
    # a /1 snapshot at the unmask step: the devices asked to unmask are the survivors
    srv.u4 = [int(u) for u in snap["u4"]] if "u4" in snap else (list(srv.u3) if srv.step == "unmask" else [])
    return srv
