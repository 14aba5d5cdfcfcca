"""The server side of secure aggregation as a message-in / message-out state machine.

Bonawitz et al. 2017 §4. The transport calls :meth:`SecAggServer.receive` for every device
message, and ``close_*`` when a step's deadline passes (or everyone answered); whoever has
not answered by then has dropped at that step::

    srv = SecAggServer(params)
    for m in advertise_msgs: srv.receive(m)
    roster = srv.close_advertise()            # broadcast
    for m in share_msgs: srv.receive(m)
    inboxes = srv.close_share_keys()          # {device: inbox}
    for m in masked_msgs: srv.receive(m)      # y_u summed on arrival, O(dim) memory
    request = srv.close_masked()              # broadcast to survivors
    # fedfs-secagg/2: request is the consistency request; then
    #   for m in signature_msgs: srv.receive(m); request = srv.close_consistency()
    for m in unmask_msgs: srv.receive(m)
    result = srv.finalize()                   # weighted FedAvg of the survivors

In an authenticated round (``params.authenticated``) the server checks each advertisement's
signature (and, given the CA's public key, its certificate) and each consistency signature,
so that a bad device cannot stall the round — the devices check all of it themselves.

A bad message raises a 4xx :class:`~fedfs_sdk.federation.secagg.errors.SecAggError` and changes
nothing; too few survivors raise :class:`RoundFailedError` (and the round stays failed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import time

import numpy as np

from . import auth, keys, shamir
from . import messages as M
from .device import CIPHERTEXT_BYTES, SECRET_BYTES, SHARE_BYTES
from .errors import BadMessageError, RefusedError, RoundFailedError, ReplayError, SecAggError, UnknownDeviceError
from .identity import CaPublicKey, verify
from .params import SecAggParams, consistency_quorum, neighbours
from .prg import add_mask

_STEPS = {"advertise": M.ADVERTISE, "share_keys": M.SHARE_KEYS, "masked": M.MASKED_INPUT,
          "consistency": M.CONSISTENCY, "unmask": M.UNMASK_SHARES}


@dataclass
class SecAggResult:
    """The round's outcome: ``mean`` = Σ n·w / Σ n over ``survivors`` (float32)."""

    mean: np.ndarray
    total_samples: int
    survivors: list[int]
    dropped: dict[str, list[int]]   # step → devices that did not answer it


class SecAggServer:
    """One round of the server. ``keep_transcript`` keeps every message in and out (tests);
    ``context`` is the transport's digest that devices bind into their signatures, ``ca`` the
    operator CA's key when the server checks certificates too (authenticated rounds)."""

    def __init__(self, params: SecAggParams, keep_transcript: bool = False, *, context: bytes = b"",
                 ca: CaPublicKey | None = None):
        self.params = params
        self.context = auth.context_digest(params, context)
        self.ca = ca
        self.revoked: frozenset[str] = frozenset()                     # serials of the operator's revocation list
        self.decode_dtype: type = np.float32       # of SecAggResult.mean (statistics rounds: float64)
        self.adverts: dict[int, tuple[dict[str, Any], bytes]] = {}   # authenticated: device → (cert, sig)
        self.ids: dict[int, bytes] = {}                                # authenticated: device → identity key
        self.u4: list[int] = []                                        # devices asked to unmask
        self.csigs: dict[int, bytes] = {}                              # consistency signatures over U3
        self.step = "advertise"
        self.transcript: list[dict[str, Any]] | None = [] if keep_transcript else None
        self.pks: dict[int, tuple[bytes, bytes]] = {}
        self.threshold = 0
        self.graph: dict[int, list[int]] = {}
        self.run: bytes | None = None                       # authenticated: auth.run_digest of the roster
        self.cts: dict[int, dict[int, bytes]] = {}          # sender → recipient → ciphertext
        self.u2: list[int] = []
        self._sum: np.ndarray | None = None
        self.u3: list[int] = []
        self.dropped: dict[str, list[int]] = {}
        self.b_shares: dict[int, dict[int, bytes]] = {}     # of → holder → share
        self.s_shares: dict[int, dict[int, bytes]] = {}
        self._unmasked_from: set[int] = set()
        self._masked_from: set[int] = set()
        # cost accounting for benchmarks (thread CPU seconds, PRG expansions of dim + 1 words)
        self.stats: dict[str, float] = {"prg_expansions": 0, "key_agreements": 0,
                                        "self_masks_cpu_s": 0.0, "dropped_masks_cpu_s": 0.0}

    def _log(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.transcript is not None:
            self.transcript.append(msg)
        return msg

    def _fail(self, message: str, survivors: int | None = None) -> RoundFailedError:
        self.step = "failed"
        return RoundFailedError(f"round {self.params.round_id} failed: {message}",
                                survivors=survivors, threshold=self.threshold or None)

    def _holders(self, v: int) -> list[int]:
        return self.graph[v] + [v]

    def _check_recoverable(self, alive: set[int], devices: set[int], step: str) -> None:
        """Every device in ``devices`` must keep ≥ t share holders in ``alive``."""
        for v in sorted(devices):
            have = len(set(self._holders(v)) & alive)
            if have < self.threshold:
                if self.params.neighbours is None or len(self._holders(v)) == len(self.pks):
                    raise self._fail(f"only {len(alive)} devices survived {step}, the threshold is "
                                     f"{self.threshold}", survivors=len(alive))
                raise self._fail(f"device {v} has only {have} share holders left after {step}, the "
                                 f"threshold is {self.threshold}", survivors=have)

    # -- receiving ---------------------------------------------------------------------------
    def receive(self, msg: Any) -> None:
        """Take one device message for the current step; raises a 4xx error if it is bad."""
        if self.step in ("done", "failed", "closed"):
            raise ReplayError(f"round {self.params.round_id} is over ({self.step})")
        if isinstance(msg, dict) and msg.get("type") in _STEPS.values() and msg.get("type") != _STEPS[self.step] \
                and msg.get("round") == self.params.round_id:
            raise ReplayError(f"a {msg.get('type')!r} message arrived while the round collects {_STEPS[self.step]!r}")
        M.check_header(msg, _STEPS[self.step], self.params.round_id)
        getattr(self, "_on_" + self.step)(msg)
        self._log(msg)

    def _sender(self, msg: dict[str, Any], allowed: Any, seen: Any, what: str) -> int:
        u = M.get_id(msg, "device", what)
        if u not in allowed:
            raise UnknownDeviceError(f"{what}: device {u} is not part of this step of round {self.params.round_id}")
        if u in seen:
            raise ReplayError(f"{what}: device {u} already sent its message for this step")
        return u

    def _on_advertise(self, msg: dict[str, Any]) -> None:
        u = M.get_id(msg, "device", "advertise_keys")
        if u in self.pks:
            raise ReplayError(f"advertise_keys: device {u} already advertised keys")
        if len(self.pks) >= self.params.fixed_point.max_devices:
            raise BadMessageError(f"advertise_keys: round is full ({len(self.pks)} devices)")
        c_pk, s_pk = (M.get_bytes(msg, k, "advertise_keys", 32) for k in ("c_pk", "s_pk"))
        keys.load_public(c_pk, f"c_pk of device {u}")
        keys.load_public(s_pk, f"s_pk of device {u}")
        if self.params.authenticated:
            ident = auth.check_advertisement(msg, self.params.round_id, self.context, self.ca, "advertise_keys")
            if auth.certificate_of(msg, "advertise_keys").serial in self.revoked:
                raise RefusedError(f"advertise_keys: device {u}'s certificate is revoked by the operator")
            if ident in self.ids.values():
                raise RefusedError(f"advertise_keys: device {u} presents an identity already in this round")
            self.ids[u] = ident
            self.adverts[u] = (dict(msg["cert"]), bytes(msg["sig"]))
        self.pks[u] = (c_pk, s_pk)

    def _on_share_keys(self, msg: dict[str, Any]) -> None:
        u = self._sender(msg, self.pks, self.cts, "share_keys")
        out: dict[int, bytes] = {}
        for e in M.get_list(msg, "ciphertexts", "share_keys"):
            if not isinstance(e, dict):
                raise BadMessageError("share_keys: ciphertext entries must be dicts")
            v = M.get_id(e, "to", "share_keys")
            if v not in self.graph[u]:
                raise UnknownDeviceError(f"share_keys: device {u} sent a share for device {v}, which "
                                         f"{'never joined' if v not in self.pks else 'is not its neighbour'}")
            if v in out:
                raise BadMessageError(f"share_keys: device {u} sent two shares for device {v}")
            out[v] = M.get_bytes(e, "ct", f"share_keys of device {u} for {v}", CIPHERTEXT_BYTES)
        missing = sorted(set(self.graph[u]) - set(out))
        if missing:
            raise BadMessageError(f"share_keys: device {u} sent no share for devices {missing[:10]}")
        self.cts[u] = out

    def _on_masked(self, msg: dict[str, Any]) -> None:
        u = self._sender(msg, set(self.u2), self._masked_from, "masked_input")
        y = msg.get("y")
        n = self.params.words
        if isinstance(y, (bytes, bytearray)):
            if len(y) != 8 * n:
                raise BadMessageError(f"masked_input of device {u}: {len(y)} bytes, expected 8 × {n} = {8 * n}")
            vec = np.frombuffer(bytes(y), dtype="<u8")
        elif isinstance(y, list):   # JSON fallback: a list of ints in [0, 2^64)
            if len(y) != n:
                raise BadMessageError(f"masked_input of device {u}: {len(y)} words, expected {n}")
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64 for x in y):
                raise BadMessageError(f"masked_input of device {u}: values must be ints in [0, 2^64)")
            vec = np.array(y, dtype=np.uint64)
        else:
            raise BadMessageError(f"masked_input of device {u}: 'y' must be bytes or a list of ints")
        if self._sum is None:
            self._sum = np.zeros(n, dtype=np.uint64)
        np.add(self._sum, vec, out=self._sum)   # wraps mod 2^64, as the masks need
        self._masked_from.add(u)

    def _on_consistency(self, msg: dict[str, Any]) -> None:
        u = self._sender(msg, set(self.u3), self.csigs, "consistency_signature")
        sig = M.get_bytes(msg, "sig", "consistency_signature", 64)
        assert self.run is not None
        if not verify(self.ids[u], sig, auth.consistency_payload(self.params.round_id, self.context, self.u3,
                                                                      self.run)):
            raise RefusedError(f"consistency_signature: device {u}'s signature does not cover this round's survivors")
        self.csigs[u] = sig

    def _on_unmask(self, msg: dict[str, Any]) -> None:
        u = self._sender(msg, set(self.u4), self._unmasked_from, "unmask_shares")
        dropped = set(self.dropped["masked_input"])
        got: dict[str, dict[int, bytes]] = {"b_shares": {}, "s_shares": {}}
        for key, allowed in (("b_shares", set(self.u3)), ("s_shares", dropped)):
            for e in M.get_list(msg, key, "unmask_shares"):
                if not isinstance(e, dict):
                    raise BadMessageError(f"unmask_shares: {key} entries must be dicts")
                v = M.get_id(e, "of", "unmask_shares")
                if v not in allowed or u not in self._holders(v):
                    raise UnknownDeviceError(f"unmask_shares: device {u} sent a {key[0]}-share of device {v}, "
                                             "which it does not hold or which is not asked for")
                if v in got[key]:
                    raise BadMessageError(f"unmask_shares: device {u} sent two {key} for device {v}")
                got[key][v] = M.get_bytes(e, "share", "unmask_shares", SHARE_BYTES)
        for v, s in got["b_shares"].items():
            self.b_shares.setdefault(v, {})[u] = s
        for v, s in got["s_shares"].items():
            self.s_shares.setdefault(v, {})[u] = s
        self._unmasked_from.add(u)

    # -- closing steps -----------------------------------------------------------------------
    def _close(self, step: str) -> None:
        if self.step != step:
            raise ReplayError(f"cannot close {step!r}: round {self.params.round_id} is at {self.step!r}")

    def close_advertise(self) -> dict[str, Any]:
        """End AdvertiseKeys; return the roster U1 to broadcast."""
        self._close("advertise")
        n = len(self.pks)
        if n < self.params.min_devices:
            raise self._fail(f"{n} devices advertised keys, min_devices is {self.params.min_devices}", n)
        try:
            self.threshold = self.params.threshold_for(n)
        except SecAggError:
            raise
        except ValueError as e:
            raise self._fail(str(e), n) from e
        self.set_graph()
        if self.threshold > len(self._holders(min(self.pks))):
            raise self._fail(f"{n} devices advertised keys, the threshold is {self.threshold}", n)
        self.step = "share_keys"
        return self._log(self.roster())

    def set_graph(self) -> None:
        """The run digest (authenticated rounds) and the graph, from the roster's keys."""
        if self.params.authenticated:
            self.run = auth.run_digest(self.params.round_id, self.context, self.pks)
        self.graph = neighbours(self.params, list(self.pks), self.run)

    def roster(self) -> dict[str, Any]:
        """The roster U1 (authenticated: each entry with its certificate and signature)."""
        entries = [{"device": v, "c_pk": c, "s_pk": s} for v, (c, s) in sorted(self.pks.items())]
        for e in entries:
            if e["device"] in self.adverts:
                e["cert"], e["sig"] = self.adverts[e["device"]]
        return {"type": M.ROSTER, "round": self.params.round_id, "threshold": self.threshold,
                "neighbours": self.params.neighbours, "devices": entries}

    def close_share_keys(self) -> dict[int, dict[str, Any]]:
        """End ShareKeys; return each sender's inbox (the ciphertexts addressed to it and U2)."""
        self._close("share_keys")
        self.u2 = sorted(self.cts)
        self.dropped["share_keys"] = sorted(set(self.pks) - set(self.u2))
        self._check_recoverable(set(self.u2), set(self.u2), "share_keys")
        self.step = "masked"
        return {v: self._log(self.inbox(v)) for v in self.u2}

    def inbox(self, device: int) -> dict[str, Any]:
        """The ShareKeys inbox of ``device`` (again, e.g. after a restart), until close_masked."""
        if self.step != "masked":
            raise ReplayError(f"inboxes are served between ShareKeys and MaskedInput; round is at {self.step!r}")
        if device not in self.u2:
            raise UnknownDeviceError(f"device {device} is not in U2 of round {self.params.round_id}")
        cts = [{"from": u, "ct": self.cts[u][device]} for u in self.graph[device] if u in self.cts]
        return {"type": M.SHARES_INBOX, "round": self.params.round_id, "device": device,
                "senders": self.u2, "ciphertexts": cts}

    def close_masked(self) -> dict[str, Any]:
        """End MaskedInputCollection; return the unmask request (survivors U3, dropped) — or,
        authenticated, the consistency request (U3) that precedes it."""
        self._close("masked")
        self.u3 = sorted(self._masked_from)
        self.dropped["masked_input"] = sorted(set(self.u2) - set(self.u3))
        alive = set(self.u3)
        self._check_recoverable(alive, alive | set(self.dropped["masked_input"]), "masked_input")
        self.cts = {}   # delivered; the server keeps no ciphertexts
        if self.params.authenticated:
            self._check_quorum(len(self.u3), "masked_input")
            self.step = "consistency"
            return self._log(self.consistency_request())
        self.u4 = list(self.u3)
        self.step = "unmask"
        return self._log(self.unmask_request())

    def _check_quorum(self, alive: int, step: str) -> None:
        q = consistency_quorum(self.params, self.threshold)
        if alive < q:
            raise self._fail(f"only {alive} devices survived {step}, the consistency check needs {q} of the "
                             f"{self.params.participants} invited", survivors=alive)

    def consistency_request(self) -> dict[str, Any]:
        return {"type": M.CONSISTENCY_REQUEST, "round": self.params.round_id, "survivors": self.u3}

    def close_consistency(self) -> dict[str, Any]:
        """End the ConsistencyCheck (authenticated rounds); return the unmask request for the
        signers U4: U3, the dropped devices and every signature, for each device to check."""
        self._close("consistency")
        self.u4 = sorted(self.csigs)
        self.dropped["consistency"] = sorted(set(self.u3) - set(self.u4))
        self._check_quorum(len(self.u4), "the consistency check")
        self._check_recoverable(set(self.u4), set(self.u3) | set(self.dropped["masked_input"]), "consistency check")
        self.step = "unmask"
        return self._log(self.unmask_request())

    def unmask_request(self) -> dict[str, Any]:
        req: dict[str, Any] = {"type": M.UNMASK_REQUEST, "round": self.params.round_id, "survivors": self.u3,
                               "dropped": self.dropped["masked_input"]}
        if self.params.authenticated:
            req["signatures"] = [{"device": v, "sig": s} for v, s in sorted(self.csigs.items())]
        return req

    def finalize(self) -> SecAggResult:
        """End Unmasking: reconstruct b_v of survivors and s_sk of dropped devices, remove all
        masks and decode the weighted mean. Fails cleanly if any secret lacks t shares."""
        self._close("unmask")
        self.dropped["unmask"] = sorted(set(self.u4) - self._unmasked_from)
        alive = set(self._unmasked_from)
        self._check_recoverable(alive, set(self.u3) | set(self.dropped["masked_input"]), "unmask")
        assert not set(self.b_shares) & set(self.s_shares), "never both shares of one device"
        assert self._sum is not None
        z = self._sum.copy()
        rid, t = self.params.round_id, self.threshold
        t0 = time.thread_time()
        for v in self.u3:
            try:
                b = shamir.reconstruct(self.b_shares.get(v, {}), t, SECRET_BYTES)
            except ValueError as e:
                raise self._fail(f"self-mask seed of device {v} cannot be reconstructed: {e}") from e
            add_mask(z, b, -1)
        t1 = time.thread_time()
        survivors = set(self.u3)
        for v in self.dropped["masked_input"]:
            try:
                sk = keys.private_from_bytes(shamir.reconstruct(self.s_shares.get(v, {}), t, SECRET_BYTES))
            except ValueError as e:
                raise self._fail(f"mask key of dropped device {v} cannot be reconstructed: {e}") from e
            if keys.public_bytes(sk) != self.pks[v][1]:
                raise self._fail(f"reconstructed mask key of device {v} does not match its s_pk: a share is corrupt")
            for w in self.graph[v]:
                if w in survivors:   # y_w carries +PRG(s_wv) if w < v, else −PRG(s_wv)
                    seed = keys.pair_key(sk, self.pks[w][1], b"mask", rid, v, w)
                    add_mask(z, seed, -1 if w < v else +1)
                    self.stats["prg_expansions"] += 1
                    self.stats["key_agreements"] += 1
        self.stats["prg_expansions"] += len(self.u3)
        self.stats["self_masks_cpu_s"] = t1 - t0
        self.stats["dropped_masks_cpu_s"] = time.thread_time() - t1
        try:
            mean, total = self.params.fixed_point.decode_sum(z, len(self.u3), self.decode_dtype)
        except RoundFailedError as e:
            raise self._fail(str(e), len(self.u3)) from e
        self.step = "done"
        self._sum = None
        return SecAggResult(mean=mean, total_samples=total, survivors=list(self.u3), dropped=dict(self.dropped))
