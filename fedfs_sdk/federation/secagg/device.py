"""The device side of secure aggregation as a message-in / message-out state machine.

Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
§4, one object per device and round::

    dev = SecAggDevice(params, device_id, identity=…, policy=…, context=…)
    m0 = dev.advertise()                       # → server (signed in an authenticated round)
    m1 = dev.share_keys(roster)                # roster from server → m1 to server
    m2 = dev.masked_input(inbox, w, n)         # inbox from server → y_u to server
    mc = dev.consistency(request)              # fedfs-secagg/2 only: its signature over U3
    m3 = dev.unmask(unmask_request)            # → shares to server; secrets are then erased

``fedfs-secagg/1`` (``params.authenticated`` false) defends against an honest-but-curious
server; ``/2`` against an active one: every roster entry's certificate (pinned CA) and
signature are checked, and shares are revealed only after a quorum of devices signed the same
survivor set. The device's :class:`~.policy.DevicePolicy` — not the server — sets the floors
(threshold, roster size, SecAgg+ degree, DP noise).

Every method validates what it receives and raises a :mod:`~fedfs_sdk.federation.secagg.errors` error
naming the problem. The safety check: a device answers one unmask request per round, and
refuses one that calls a device both survivor and dropped — so the server never gets both
the self-mask seed b_v and the mask key s_sk of any device v from it.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import auth, keys, shamir
from . import messages as M
from .errors import BadMessageError, RefusedError, ReplayError, UnknownDeviceError
from .identity import DeviceIdentity
from .params import SecAggParams, neighbours
from .policy import DevicePolicy
from .prg import add_mask
from .round_log import RoundLog

SECRET_BYTES = 32
SHARE_BYTES = shamir.share_length(SECRET_BYTES)
PLAINTEXT_BYTES = 2 * SHARE_BYTES                          # s_sk share ‖ b share
CIPHERTEXT_BYTES = keys.NONCE_BYTES + PLAINTEXT_BYTES + 16  # + GCM tag


class SecAggDevice:
    """One device's part in one round. Holds its key pairs, its self-mask seed b_u and the
    shares others sent it; ``n_clipped`` says how many coordinates the encoding clipped.

    ``identity``: the device's certified signing key (needed in an authenticated round);
    ``policy``: its floors (default :class:`DevicePolicy`); ``context``: the transport's digest
    of what else the round agreed on, bound into every signature. A round below the policy is
    refused here, before any key is sent (:class:`RefusedError`). ``round_log``: the round ids
    this device already took part in (:class:`~.round_log.RoundLog`, persisted in its state);
    a round id in it is refused (:class:`ReplayError`), and :meth:`advertise` records this one
    before the keys leave."""

    def __init__(self, params: SecAggParams, device_id: int, *, identity: DeviceIdentity | None = None,
                 policy: DevicePolicy | None = None, context: bytes = b"", round_log: RoundLog | None = None,
                 revoked: frozenset[str] = frozenset()):
        self.params = params
        self.id = M.get_id({"device": device_id}, "device", "SecAggDevice")
        self.policy = policy if policy is not None else DevicePolicy()
        self.policy.check_params(params, self._where("task"))
        self.round_log = round_log
        self.revoked = frozenset(revoked)        # certificate serials of the operator's revocation list
        self._scope = self.policy.ca.key_id if self.policy.ca is not None else ""
        if round_log is not None:
            round_log.check(params.round_id, self._scope, self._where("task"))
        if params.authenticated and (identity is None or identity.certificate is None):
            raise RefusedError(f"{self._where('task')}: an authenticated round needs this device's identity "
                               "certificate (fedfs ca request / fedfs ca sign)")
        self.identity = identity if params.authenticated else None
        self.context = auth.context_digest(params, context)
        self._ids: dict[int, bytes] = {}                    # authenticated: device → verified identity key
        self._run: bytes | None = None                      # authenticated: auth.run_digest of the roster
        self._u3: list[int] | None = None                   # the survivor set this device signed
        self._c_sk = keys.new_private_key()
        self._s_sk = keys.new_private_key()
        self._b: bytes | None = None
        self._step = "new"
        self._pks: dict[int, tuple[bytes, bytes]] = {}
        self._graph: dict[int, list[int]] = {}
        self._t = 0
        self._u2: list[int] = []
        self._own: tuple[bytes, bytes] | None = None
        self._held: dict[int, tuple[bytes, bytes]] = {}   # sender → (s_sk share, b share)
        self._enc: dict[int, bytes] = {}                   # neighbour → AES-GCM key (both directions)
        self.n_clipped = 0

    def _expect(self, step: str, what: str) -> None:
        if self._step != step:
            raise ReplayError(f"device {self.id}: {what} arrived at step {self._step!r} (expected at {step!r})")

    def _where(self, step: str) -> str:
        return f"device {self.id}, round {self.params.round_id}, {step}"

    # -- round 0: AdvertiseKeys -------------------------------------------------------------
    def advertise(self) -> dict[str, Any]:
        self._expect("new", "advertise")
        if self.round_log is not None:      # persisted before any key leaves: a restart cannot forget it
            self.round_log.record(self.params.round_id, self._scope, self._where("advertise"))
        self._step = "advertised"
        msg: dict[str, Any] = {"type": M.ADVERTISE, "round": self.params.round_id, "device": self.id,
                               "c_pk": keys.public_bytes(self._c_sk), "s_pk": keys.public_bytes(self._s_sk)}
        if self.identity is not None:
            assert self.identity.certificate is not None
            msg["cert"] = self.identity.certificate.to_json()
            msg["sig"] = self.identity.sign(auth.advertisement_payload(
                self.params.round_id, self.id, self.context, msg["c_pk"], msg["s_pk"]))
        return msg

    # -- round 1: ShareKeys -----------------------------------------------------------------
    def share_keys(self, roster: dict[str, Any]) -> dict[str, Any]:
        """Check the roster U1, draw b_u, Shamir-share s_sk and b_u among the share holders
        and seal each holder's pair of shares with AES-GCM under the c-key agreement."""
        M.check_header(roster, M.ROSTER, self.params.round_id)
        self._expect("advertised", "roster")
        where = self._where("roster")
        pks: dict[int, tuple[bytes, bytes]] = {}
        entries = M.get_list(roster, "devices", where)
        for e in entries:
            if not isinstance(e, dict):
                raise BadMessageError(f"{where}: roster entries must be dicts")
            v = M.get_id(e, "device", where)
            if v in pks:
                raise BadMessageError(f"{where}: device {v} appears twice in the roster")
            pks[v] = (M.get_bytes(e, "c_pk", where, 32), M.get_bytes(e, "s_pk", where, 32))
        if pks.get(self.id) != (keys.public_bytes(self._c_sk), keys.public_bytes(self._s_sk)):
            raise RefusedError(f"{where}: the roster does not carry this device's own public keys")
        if len({p[1] for p in pks.values()}) != len(pks) or len({p[0] for p in pks.values()}) != len(pks):
            raise RefusedError(f"{where}: two devices in the roster share a public key")
        if self.identity is not None:        # every entry certified by the pinned CA and signed for this round
            assert self.policy.ca is not None
            ids = auth.check_roster_identities(entries, self.params.round_id, self.context, self.policy.ca, where)
            if ids.get(self.id) != self.identity.public_key:
                raise RefusedError(f"{where}: the roster does not carry this device's own identity")
            bad = sorted(e["device"] for e in entries if auth.certificate_of(e, where).serial in self.revoked)
            if bad:
                raise RefusedError(f"{where}: devices {bad[:10]} present certificates the operator revoked")
            self._ids = ids
        try:
            t = self.params.threshold_for(len(pks))
        except ValueError as e:
            raise RefusedError(f"{where}: {e}") from None
        self.policy.check_roster(self.params, len(pks), t, where)
        if roster.get("threshold") != t:
            raise RefusedError(f"{where}: roster threshold {roster.get('threshold')!r} ≠ agreed {t}")
        if roster.get("neighbours") != self.params.neighbours:
            raise RefusedError(f"{where}: roster graph degree {roster.get('neighbours')!r} ≠ agreed "
                               f"{self.params.neighbours!r}")
        self._pks, self._t = pks, t
        if self.params.authenticated:        # this run: what every signature binds and what seeds the graph
            self._run = auth.run_digest(self.params.round_id, self.context, pks)
        self._graph = neighbours(self.params, list(pks), self._run)
        self._check_holders(len(pks), t, where)
        holders = self._graph[self.id] + [self.id]
        self._b = os.urandom(SECRET_BYTES)
        shares = shamir.split([keys.private_bytes(self._s_sk), self._b], holders, t)
        out = []
        for v in self._graph[self.id]:
            key = self._enc[v] = keys.pair_key(self._c_sk, pks[v][0], b"enc", self.params.round_id, self.id, v)
            ct = keys.seal(key, self.params.round_id, self.id, v, shares[v][0] + shares[v][1])
            out.append({"to": v, "ct": ct})
        self._own = (shares[self.id][0], shares[self.id][1])
        self._step = "shared"
        return {"type": M.SHARE_KEYS, "round": self.params.round_id, "device": self.id, "ciphertexts": out}

    def _check_holders(self, n_roster: int, t: int, where: str) -> None:
        """Who will hold this device's shares: ``min(k, roster − 1)`` distinct roster devices
        other than itself, at least ``t − 1`` of them (its own share is the t-th)."""
        mine = self._graph.get(self.id, [])
        k = self.params.neighbours
        want = n_roster - 1 if k is None else min(k, n_roster - 1)
        if len(set(mine)) != want or self.id in mine or not set(mine) <= set(self._pks) or len(mine) + 1 < t:
            raise RefusedError(f"{where}: this device's share holders {sorted(mine)[:10]} are not {want} distinct "
                               f"other roster devices (threshold {t})")

    # -- round 2: MaskedInputCollection -----------------------------------------------------
    def masked_input(self, inbox: dict[str, Any], update: np.ndarray, n_samples: int) -> dict[str, Any]:
        """Decrypt the shares addressed to this device, then send
        ``y_u = enc(n·w, n) + PRG(b_u) + Σ_{v∈U2∩N(u)} ±PRG(s_uv)`` (+ if u < v)."""
        M.check_header(inbox, M.SHARES_INBOX, self.params.round_id)
        self._expect("shared", "shares inbox")
        where = self._where("shares inbox")
        if inbox.get("device") != self.id:
            raise BadMessageError(f"{where}: inbox is addressed to device {inbox.get('device')!r}")
        u2 = M.get_id_list(inbox, "senders", where)
        unknown = sorted(set(u2) - set(self._pks))
        if unknown:
            raise UnknownDeviceError(f"{where}: senders {unknown} are not in the roster")
        if self.id not in u2:
            raise RefusedError(f"{where}: this device is missing from the senders U2")
        mine = set(self._graph[self.id]) & set(u2)
        if len(mine) + 1 < self._t:
            raise RefusedError(f"{where}: only {len(mine) + 1} of this device's share holders are left, "
                               f"threshold is {self._t}; its mask could not be removed")
        held: dict[int, tuple[bytes, bytes]] = {}
        for e in M.get_list(inbox, "ciphertexts", where):
            if not isinstance(e, dict):
                raise BadMessageError(f"{where}: ciphertext entries must be dicts")
            v = M.get_id(e, "from", where)
            if v not in mine:
                raise UnknownDeviceError(f"{where}: a share from device {v}, which is not a neighbour in U2")
            if v in held:
                raise ReplayError(f"{where}: two shares from device {v}")
            ct = M.get_bytes(e, "ct", where, CIPHERTEXT_BYTES)
            pt = keys.open_sealed(self._enc[v], self.params.round_id, v, self.id, ct)
            held[v] = (pt[:SHARE_BYTES], pt[SHARE_BYTES:])
        if set(held) != mine:
            raise BadMessageError(f"{where}: shares missing from devices {sorted(mine - set(held))}")
        update = np.asarray(update)
        if update.shape != (self.params.dim,):
            raise BadMessageError(f"{where}: update has shape {update.shape}, expected ({self.params.dim},)")
        y, self.n_clipped = self.params.fixed_point.encode(update, n_samples)
        assert self._b is not None
        add_mask(y, self._b, +1)
        for v in sorted(mine):
            seed = keys.pair_key(self._s_sk, self._pks[v][1], b"mask", self.params.round_id, self.id, v)
            add_mask(y, seed, +1 if self.id < v else -1)
        self._held, self._u2 = held, sorted(u2)
        self._step = "masked"
        return {"type": M.MASKED_INPUT, "round": self.params.round_id, "device": self.id,
                "y": y.astype("<u8", copy=False).tobytes()}

    # -- fedfs-secagg/2: ConsistencyCheck ----------------------------------------------------
    def consistency(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sign the survivor set U3 (once per round): the server must show it to a quorum of
        devices before any of them reveals a share (Bonawitz et al. 2017, round 3 of §4)."""
        M.check_header(request, M.CONSISTENCY_REQUEST, self.params.round_id)
        if not self.params.authenticated:
            raise ReplayError(f"{self._where('consistency')}: this round has no consistency check")
        if self._u3 is not None:
            raise ReplayError(f"{self._where('consistency')}: already signed a survivor set this round")
        self._expect("masked", "consistency request")
        where = self._where("consistency")
        u3 = set(M.get_id_list(request, "survivors", where))
        self._check_survivors(u3, where)
        assert self.identity is not None
        assert self._run is not None
        sig = self.identity.sign(auth.consistency_payload(self.params.round_id, self.context, u3, self._run))
        self._u3 = sorted(u3)
        return {"type": M.CONSISTENCY, "round": self.params.round_id, "device": self.id, "sig": sig}

    def _check_survivors(self, u3: set[int], where: str) -> None:
        """U3 ⊆ U2, this device in it, at least the threshold (the quorum when authenticated),
        and — SecAgg+ — connected in the graph, so only the total can be unmasked."""
        outside = sorted(u3 - set(self._u2))
        if outside:
            raise UnknownDeviceError(f"{where}: survivors {outside[:10]} did not share keys (not in U2)")
        if self.id not in u3:
            raise RefusedError(f"{where}: this device is listed as dropped")
        need = self.policy.quorum(self.params, self._t) if self.params.authenticated else self._t
        if len(u3) < need:
            raise RefusedError(f"{where}: only {len(u3)} survivors, threshold is {need}")
        if self.policy.require_connected and not auth.connected(self._graph, u3):
            raise RefusedError(f"{where}: the survivors do not form one connected group in the SecAgg+ graph; "
                               "unmasking would reveal the sum of each group, not only the total")

    # -- round 3: Unmasking -----------------------------------------------------------------
    def unmask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Reveal b-shares of survivors and s_sk-shares of dropped devices — never both for one
        device, and only once per round. Authenticated: only for the survivor set this device
        signed, and only with a quorum of valid signatures over it."""
        M.check_header(request, M.UNMASK_REQUEST, self.params.round_id)
        if self._step == "done":
            raise ReplayError(f"{self._where('unmask')}: already answered an unmask request this round")
        self._expect("masked", "unmask request")
        where = self._where("unmask")
        u3 = set(M.get_id_list(request, "survivors", where))
        dropped = set(M.get_id_list(request, "dropped", where))
        both = sorted(u3 & dropped)
        if both:
            raise RefusedError(f"{where}: devices {both} are listed both as survivors and as dropped; "
                               "revealing both their shares would unmask their input")
        if u3 | dropped != set(self._u2):
            raise UnknownDeviceError(f"{where}: survivors ∪ dropped must be U2 of this round; "
                                     f"differs by {sorted((u3 | dropped) ^ set(self._u2))}")
        self._check_survivors(u3, where)
        if self.params.authenticated:
            if self._u3 is None:
                raise RefusedError(f"{where}: no consistency check was run; this device reveals nothing before it")
            if sorted(u3) != self._u3:
                raise RefusedError(f"{where}: the survivors differ from the set this device signed in the "
                                   "consistency check")
            assert self._run is not None
            auth.check_signatures(request.get("signatures"), u3, self._ids, self.params.round_id, self.context,
                                  self.policy.quorum(self.params, self._t), where, self._run)
        held = dict(self._held)
        assert self._own is not None
        held[self.id] = self._own
        b_out = [{"of": v, "share": held[v][1]} for v in sorted(held) if v in u3]
        s_out = [{"of": v, "share": held[v][0]} for v in sorted(held) if v in dropped]
        # erase secrets: nothing more is revealed this round, whatever is asked
        self._held, self._own, self._b, self._enc = {}, None, None, {}
        self._step = "done"
        return {"type": M.UNMASK_SHARES, "round": self.params.round_id, "device": self.id,
                "b_shares": b_out, "s_shares": s_out}
