"""The authenticated protocol ``fedfs-secagg/2``: what is signed and how it is checked.

Bonawitz et al. 2017, §4 (active adversary): each device signs its advertised keys with its
long-lived identity key, and in the ConsistencyCheck round signs the survivor set ``U3``; a
device reveals shares only after at least a quorum of roster devices signed the same ``U3``.

* advertisement: ``Ed25519(fedfs-secagg/2|advertise | round | device | context | c_pk | s_pk)``,
  the identity key certified by the pinned CA (:mod:`.identity`);
* consistency: ``Ed25519(fedfs-secagg/2|consistency | round | context | run | U3)``, where
  ``run`` (:func:`run_digest`) hashes this run's roster — every device index with its fresh
  X25519 keys. A signature collected in one run of a round id therefore verifies in no other
  run (the keys are new each time): a server that re-runs a round id cannot gather a quorum
  over a survivor set of its choice from several runs (issue 30, attack 1). The same digest
  seeds the SecAgg+ graph of an authenticated round (:func:`~.params.neighbours`).

``context`` is a digest of every parameter the round agreed on (:meth:`SecAggParams.digest`
and the transport's task): devices told different parameters — a different number of invited
devices, threshold, model — never accept one another's advertisements. Byte layouts are
fixed-width (8-byte round, 4-byte ids, 32-byte digests and keys), so no two messages encode
the same bytes.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

from . import messages as M
from .errors import BadMessageError, RefusedError
from .identity import CaPublicKey, Certificate, IdentityError, verify
from .params import PROTOCOL_V2, SecAggParams

_TAG = PROTOCOL_V2.encode()


def context_digest(params: SecAggParams, extra: bytes = b"") -> bytes:
    """The 32 bytes every signature of the round binds: the parameters and the transport's
    own context (the HTTP task's digest)."""
    return hashlib.sha256(_TAG + b"|context|" + params.digest() + hashlib.sha256(extra).digest()).digest()


def advertisement_payload(round_id: int, device: int, context: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    return (_TAG + b"|advertise|" + int(round_id).to_bytes(8, "big") + int(device).to_bytes(4, "big")
            + context + c_pk + s_pk)


def run_digest(round_id: int, context: bytes, pks: Mapping[int, tuple[bytes, bytes]]) -> bytes:
    """32 bytes naming this run of the round: the round, context and every roster entry's
    device index and fresh ``(c_pk, s_pk)`` (each signed by its certified identity, so the
    identities are bound too). Two devices shown different rosters get different digests."""
    h = hashlib.sha256(_TAG + b"|run|" + int(round_id).to_bytes(8, "big") + context
                       + len(pks).to_bytes(4, "big"))
    for u in sorted(pks):
        c_pk, s_pk = pks[u]
        h.update(int(u).to_bytes(4, "big") + c_pk + s_pk)
    return h.digest()


def consistency_payload(round_id: int, context: bytes, survivors: Iterable[int], run: bytes) -> bytes:
    """What a ConsistencyCheck signature covers: the survivor set U3 of *this run* (``run``:
    :func:`run_digest` of the roster the signer accepted)."""
    if not isinstance(run, bytes) or len(run) != 32:
        raise ValueError("run must be the 32-byte run_digest of the roster")
    ids = sorted(int(u) for u in survivors)
    return (_TAG + b"|consistency|" + int(round_id).to_bytes(8, "big") + context + run
            + len(ids).to_bytes(4, "big") + b"".join(u.to_bytes(4, "big") for u in ids))


def certificate_of(entry: Mapping[str, Any], where: str) -> Certificate:
    try:
        return Certificate.from_json(entry.get("cert"))
    except IdentityError as e:
        raise RefusedError(f"{where}: {e}") from None


def check_advertisement(entry: Mapping[str, Any], round_id: int, context: bytes, ca: CaPublicKey | None,
                        where: str) -> bytes:
    """The identity key of a signed advertisement (or roster entry) ``{device, c_pk, s_pk,
    cert, sig}``: its certificate must verify under ``ca`` (when given) and its signature bind
    this round, device index, context and both keys — else :class:`RefusedError`."""
    v = M.get_id(entry, "device", where)
    c_pk, s_pk = M.get_bytes(entry, "c_pk", where, 32), M.get_bytes(entry, "s_pk", where, 32)
    cert = certificate_of(entry, f"{where}, device {v}")
    if ca is not None:
        try:
            cert.verify(ca)
        except IdentityError as e:
            raise RefusedError(f"{where}: device {v} is not a certified device: {e}") from None
    sig = entry.get("sig")
    if not verify(cert.public_key, sig, advertisement_payload(round_id, v, context, c_pk, s_pk)):   # type: ignore[arg-type]
        raise RefusedError(f"{where}: the keys advertised for device {v} are not signed by its identity key "
                           f"({cert.subject!r}): substituted or replayed")
    return cert.public_key


def check_roster_identities(entries: Sequence[Mapping[str, Any]], round_id: int, context: bytes,
                            ca: CaPublicKey, where: str) -> dict[int, bytes]:
    """``{device: identity key}`` of a roster whose every entry verifies; two entries with one
    identity key (one device listed twice) are refused."""
    out: dict[int, bytes] = {}
    for e in entries:
        out[M.get_id(e, "device", where)] = check_advertisement(e, round_id, context, ca, where)
    if len(set(out.values())) != len(out):
        raise RefusedError(f"{where}: two roster entries carry the same identity key")
    return out


def check_signatures(signatures: Any, survivors: set[int], identities: Mapping[int, bytes], round_id: int,
                     context: bytes, quorum: int, where: str, run: bytes) -> list[int]:
    """The devices whose ConsistencyCheck signature over ``survivors`` verifies (each a
    survivor with a verified identity, counted once); :class:`RefusedError` if fewer than
    ``quorum``."""
    if not isinstance(signatures, list):
        raise BadMessageError(f"{where}: 'signatures' must be a list")
    payload = consistency_payload(round_id, context, survivors, run)
    good: set[int] = set()
    for e in signatures:
        if not isinstance(e, dict):
            raise BadMessageError(f"{where}: signature entries must be dicts")
        v = M.get_id(e, "device", where)
        if v in survivors and v in identities and verify(identities[v], e.get("sig"), payload):
            good.add(v)
    if len(good) < quorum:
        raise RefusedError(f"{where}: only {len(good)} valid consistency signatures over this survivor set in this "
                           f"run, this device needs {quorum}: the server may be showing devices different survivor "
                           "sets or rosters, or replaying signatures of another run")
    return sorted(good)


def connected(graph: Mapping[int, Sequence[int]], nodes: Iterable[int]) -> bool:
    """Whether ``nodes`` induce a connected subgraph of ``graph`` (breadth-first search)."""
    alive = set(nodes)
    if not alive:
        return True
    start = min(alive)
    seen, queue = {start}, deque([start])
    while queue:
        for w in graph[queue.popleft()]:
            if w in alive and w not in seen:
                seen.add(w)
                queue.append(w)
    return seen == alive


__all__ = ["context_digest", "advertisement_payload", "consistency_payload", "run_digest", "check_advertisement",
           "check_roster_identities", "check_signatures", "connected", "certificate_of"]
