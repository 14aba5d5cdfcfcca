"""A malicious aggregation server (and an on-path attacker) played against the real device code.

Helpers for tests/test_secagg_attacks.py and test_secagg_identity_http.py (not a test module).
Every device here is a real :class:`~fedfs_sdk.federation.secagg.device.SecAggDevice`; only the
server side is the attacker's, written from the messages alone. Two protocols:

* ``previous``: ``fedfs-secagg/1`` with :meth:`DevicePolicy.legacy` — the device code as it
  accepted rounds before device floors, identities and the consistency check (the regression
  case: the attacks must work there, or the tests prove nothing);
* ``v2``: ``fedfs-secagg/2`` with certified identities and the default floors.

An attack returns the victim's recovered input as fixed-point words (``enc(n·w, n)``), or
raises the device's refusal. :func:`recover` checks a recovery exactly against the encoding.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfs_sdk.federation.secagg import (CertificateAuthority, DeviceIdentity, DevicePolicy, SecAggDevice,
                                         SecAggParams, shamir)
from fedfs_sdk.federation.secagg import keys
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.device import SECRET_BYTES, SHARE_BYTES
from fedfs_sdk.federation.secagg.prg import add_mask

DIM = 64
MODES = ("previous", "v2")


@dataclass
class Fleet:
    """``n`` real devices of one round, their updates and (v2) certified identities."""

    n: int
    mode: str
    threshold: int | None = None
    neighbours: int | None = None
    round_id: int = 7
    seed: int = 0
    ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        v2 = self.mode == "v2"
        self.params = SecAggParams(round_id=self.round_id, dim=DIM, threshold=self.threshold,
                                   neighbours=self.neighbours, participants=self.n if v2 else None, authenticated=v2)
        self.ca = CertificateAuthority.generate()
        self.ids = self.ids or list(range(1, self.n + 1))
        self.identity = {u: self.certified(f"phone-{u}") for u in self.ids}
        self.policy = DevicePolicy(ca=self.ca.public) if v2 else DevicePolicy.legacy()
        rng = np.random.default_rng(self.seed)
        self.updates = {u: (rng.normal(0, 0.05, DIM).astype(np.float32), int(rng.integers(1, 50))) for u in self.ids}
        self.devs: dict[int, SecAggDevice] = {}

    def certified(self, subject: str, ca: CertificateAuthority | None = None) -> DeviceIdentity:
        ident = DeviceIdentity.generate()
        return ident.with_certificate((ca or self.ca).issue(subject, ident.public_key))

    def device(self, u: int, params: SecAggParams | None = None) -> SecAggDevice:
        """Device ``u`` (a refusal of the task itself raises here, before it sends anything)."""
        d = SecAggDevice(params or self.params, u, identity=self.identity[u], policy=self.policy)
        self.devs[u] = d
        return d

    def encoded(self, u: int) -> np.ndarray:
        w, n = self.updates[u]
        return self.params.fixed_point.encode(w, n)[0]


def key_exchange(srv: Any, devs: dict[int, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    """Rounds 0 and 1 run honestly by ``srv``: every device advertises its keys, then shares its
    seeds with the roster. Returns (roster, each device's inbox of shares)."""
    for d in devs.values():
        srv.receive(d.advertise())
    roster = srv.close_advertise()
    for d in devs.values():
        srv.receive(d.share_keys(roster))
    return roster, srv.close_share_keys()


def roster_of(params: SecAggParams, adverts: list[dict[str, Any]], threshold: int) -> dict[str, Any]:
    """A roster as the honest server builds it, from the given advertisement messages."""
    entries = []
    for a in sorted(adverts, key=lambda m: m["device"]):
        e = {"device": a["device"], "c_pk": a["c_pk"], "s_pk": a["s_pk"]}
        if "cert" in a:
            e["cert"], e["sig"] = a["cert"], a["sig"]
        entries.append(e)
    return {"type": M.ROSTER, "round": params.round_id, "threshold": threshold, "neighbours": params.neighbours,
            "devices": entries}


def open_shares(ct_key: bytes, round_id: int, sender: int, recipient: int, ct: bytes) -> tuple[bytes, bytes]:
    pt = keys.open_sealed(ct_key, round_id, sender, recipient, ct)
    return pt[:SHARE_BYTES], pt[SHARE_BYTES:]


def strip(y: bytes | np.ndarray, b: bytes, pair_seeds: list[tuple[bytes, int]]) -> np.ndarray:
    """``y − PRG(b) − Σ sign·PRG(seed)``: what is left once the attacker knows every mask."""
    z = np.frombuffer(y, dtype="<u8").astype(np.uint64) if isinstance(y, (bytes, bytearray)) else y.copy()
    add_mask(z, b, -1)
    for seed, sign in pair_seeds:
        add_mask(z, seed, -sign)
    return z


def recover(words: np.ndarray | None, fleet: Fleet, victim: int) -> bool:
    """Whether ``words`` is exactly the victim's encoded input ``enc(n·w, n)``."""
    return words is not None and np.array_equal(np.asarray(words, dtype=np.uint64), fleet.encoded(victim))


def reconstruct(shares: dict[int, bytes], t: int) -> bytes | None:
    """The secret if at least ``t`` shares are at hand (None otherwise: it stays hidden)."""
    if len(shares) < t:
        return None
    return shamir.reconstruct(dict(list(shares.items())[:t]), t, SECRET_BYTES)


class KeySwap:
    """An attacker between one device ``u`` and everyone else (the server itself, or someone on
    u's link): it shows ``u`` its own keys in place of every other device's, shows the others its
    keys in place of ``u``'s, and translates everything in between — so the round completes with
    the right sum while it reads ``u``'s shares and strips ``u``'s masks (the attack of the
    security review, issue 24). Works on the protocol's messages (dicts with bytes)."""

    def __init__(self, u: int, round_id: int, fake: dict[int, tuple[Any, Any]] | None = None) -> None:
        self.u, self.round_id = u, round_id
        # device → (c_sk, s_sk) the attacker shows for it; shared between KeySwaps when the server
        # swaps every device's keys at once (then inboxes need no translation)
        self.fake: dict[int, tuple[Any, Any]] = {} if fake is None else fake
        self.real: dict[int, tuple[bytes, bytes]] = {}   # device → its real (c_pk, s_pk)
        self.shares: dict[int, tuple[bytes, bytes]] = {}  # holder → (s-share, b-share) of u's secrets
        self.u2: list[int] = []
        self.recovered: np.ndarray | None = None

    def _fake(self, v: int) -> tuple[Any, Any]:
        if v not in self.fake:
            self.fake[v] = (keys.new_private_key(), keys.new_private_key())
        return self.fake[v]

    def _pk(self, v: int) -> tuple[bytes, bytes]:
        c, s = self._fake(v)
        return keys.public_bytes(c), keys.public_bytes(s)

    def advertise(self, msg: dict[str, Any]) -> dict[str, Any]:
        """u → server: its real keys are kept, the attacker's go on."""
        self.real[self.u] = (msg["c_pk"], msg["s_pk"])
        c, s = self._pk(self.u)
        return {**msg, "c_pk": c, "s_pk": s}       # a signature (v2) no longer covers these keys

    def roster(self, roster: dict[str, Any]) -> dict[str, Any]:
        """server → u: every other device's keys replaced by the attacker's, u's own restored."""
        out = []
        for e in roster["devices"]:
            v = e["device"]
            if v == self.u:
                out.append({**e, "c_pk": self.real[v][0], "s_pk": self.real[v][1]})
            else:
                self.real[v] = (e["c_pk"], e["s_pk"])
                c, s = self._pk(v)
                out.append({**e, "c_pk": c, "s_pk": s})
        return {**roster, "devices": out}

    def share_keys(self, msg: dict[str, Any]) -> dict[str, Any]:
        """u → server: decrypt u's shares (sealed to the attacker's keys), re-seal them to the
        real recipients as the fake u."""
        out = []
        for e in msg["ciphertexts"]:
            v = e["to"]
            k_in = keys.pair_key(self._fake(v)[0], self.real[self.u][0], b"enc", self.round_id, v, self.u)
            s_share, b_share = open_shares(k_in, self.round_id, self.u, v, e["ct"])
            self.shares[v] = (s_share, b_share)
            k_out = keys.pair_key(self._fake(self.u)[0], self.real[v][0], b"enc", self.round_id, self.u, v)
            out.append({"to": v, "ct": keys.seal(k_out, self.round_id, self.u, v, s_share + b_share)})
        return {**msg, "ciphertexts": out}

    def inbox(self, inbox: dict[str, Any]) -> dict[str, Any]:
        """server → u: the others' shares for u (sealed to the fake u) re-sealed as from the fakes."""
        self.u2 = list(inbox["senders"])
        out = []
        for e in inbox["ciphertexts"]:
            v = e["from"]
            k_in = keys.pair_key(self._fake(self.u)[0], self.real[v][0], b"enc", self.round_id, self.u, v)
            pt = keys.open_sealed(k_in, self.round_id, v, self.u, e["ct"])
            k_out = keys.pair_key(self._fake(v)[0], self.real[self.u][0], b"enc", self.round_id, v, self.u)
            out.append({"from": v, "ct": keys.seal(k_out, self.round_id, v, self.u, pt)})
        return {**inbox, "ciphertexts": out}

    def masked(self, y: bytes, t: int, remask: bool = True) -> bytes:
        """u → server: strip u's masks (b_u from its shares, pairwise seeds with the fakes), keep
        ``enc(n·w)`` — then mask it again as the fake u, so the sum still cancels."""
        b = shamir.reconstruct({v: sb for v, (_, sb) in list(self.shares.items())[:t]}, t, SECRET_BYTES)
        others = [v for v in self.u2 if v != self.u and v in self.shares]
        seeds = [(keys.pair_key(self._fake(v)[1], self.real[self.u][1], b"mask", self.round_id, v, self.u),
                  +1 if self.u < v else -1) for v in others]
        x = strip(y, b, seeds)
        self.recovered = x.copy()
        if not remask:
            return y
        z = x.copy()
        add_mask(z, b, +1)
        for v in others:
            seed = keys.pair_key(self._fake(self.u)[1], self.real[v][1], b"mask", self.round_id, self.u, v)
            add_mask(z, seed, +1 if self.u < v else -1)
        return z.astype("<u8").tobytes()


# ---- a server that shows each device its own view -----------------------------------------

@dataclass
class Plan:
    """What the malicious server shows each real device.

    ``rosters``: device → the ids in its roster (other real devices, or the attacker's own
    ``fakes``); ``fake``: device → ids shown to it with the attacker's keys (a fake device, or a
    real one whose keys are swapped — it never gets that device's real shares); ``u3``: device →
    the survivors in its unmask request (its dropped set is the rest of its U2); ``participants``:
    device → the number of invited devices its task states (v2; default the fleet's)."""

    rosters: dict[int, list[int]]
    u3: dict[int, set[int]]
    fake: dict[int, set[int]] = field(default_factory=dict)
    participants: dict[int, int] = field(default_factory=dict)
    rogue: CertificateAuthority | None = None
    """Certifies (and signs for) the fake entries: the attacker's own CA (v2)."""
    sybils: set[int] = field(default_factory=set)
    """Real devices of the fleet, certified by the operator's CA and running the real device
    code, whose private state the server reads (issue 30): every share they hold, their keys."""


@dataclass
class Outcome:
    refused: dict[int, str]                        # device → the refusal that stopped it
    b: dict[int, dict[int, bytes]]                 # of → holder → revealed or stolen b-share
    s: dict[int, dict[int, bytes]]                 # of → holder → revealed or stolen s_sk-share
    y: dict[int, bytes]
    keys: dict[int, tuple[Any, Any]]               # fake id → the attacker's (c_sk, s_sk)
    shown: dict[int, dict[int, tuple[bytes, bytes]]]  # device → id → (c_pk, s_pk) in its roster
    thresholds: dict[int, int]


def execute(fleet: Fleet, plan: Plan) -> Outcome:
    """Run the plan with the fleet's real devices; every refusal is recorded and the device drops
    out (it sends nothing more). Whatever the devices reveal — and whatever they seal to keys
    the attacker holds — is collected for :func:`attempt`."""
    from dataclasses import replace

    from fedfs_sdk.federation.secagg import SecAggError
    from fedfs_sdk.federation.secagg import auth

    rid = fleet.params.round_id
    refused: dict[int, str] = {}
    devs: dict[int, SecAggDevice] = {}
    for u in plan.rosters:
        p = replace(fleet.params, participants=plan.participants.get(u, fleet.params.participants))
        try:
            devs[u] = fleet.device(u, p)
        except SecAggError as e:
            refused[u] = str(e)
    adverts = {u: d.advertise() for u, d in devs.items()}
    fkeys: dict[int, tuple[Any, Any]] = {}
    rogue_ids: dict[int, DeviceIdentity] = {}

    def entry(viewer: int, v: int) -> dict[str, Any]:
        if v not in plan.fake.get(viewer, set()):
            return {k: adverts[v][k] for k in ("device", "c_pk", "s_pk", "cert", "sig") if k in adverts[v]}
        c, s_ = fkeys.setdefault(v, (keys.new_private_key(), keys.new_private_key()))
        e: dict[str, Any] = {"device": v, "c_pk": keys.public_bytes(c), "s_pk": keys.public_bytes(s_)}
        if fleet.params.authenticated:
            if plan.rogue is not None:     # a fake device certified by the attacker's CA, signing its keys
                ident = rogue_ids.setdefault(v, fleet.certified(f"fake-{v}", plan.rogue))
                ctx = devs[viewer].context
                e["cert"] = ident.certificate.to_json()  # type: ignore[union-attr]
                e["sig"] = ident.sign(auth.advertisement_payload(rid, v, ctx, e["c_pk"], e["s_pk"]))
            elif v in adverts:             # a real device's certificate and signature over other keys
                e["cert"], e["sig"] = adverts[v]["cert"], adverts[v]["sig"]
            elif v in fleet.identity:      # a real device's (public) certificate; its key signs nothing here
                e["cert"], e["sig"] = fleet.identity[v].certificate.to_json(), os.urandom(64)  # type: ignore[union-attr]
        return e

    shown: dict[int, dict[int, tuple[bytes, bytes]]] = {}
    thresholds: dict[int, int] = {}
    sent: dict[int, dict[int, bytes]] = {}          # sender → recipient → ct
    b: dict[int, dict[int, bytes]] = {}
    s: dict[int, dict[int, bytes]] = {}
    for u, d in list(devs.items()):
        roster_ids = sorted(set(plan.rosters[u]) | {u})
        t = d.params.threshold_for(len(roster_ids))
        thresholds[u] = t
        r = roster_of(d.params, [entry(u, v) for v in roster_ids], t)
        shown[u] = {e["device"]: (e["c_pk"], e["s_pk"]) for e in r["devices"]}
        try:
            msg = d.share_keys(r)
        except SecAggError as e:
            refused[u] = str(e)
            del devs[u]
            continue
        sent[u] = {e["to"]: e["ct"] for e in msg["ciphertexts"]}
        for v, ct in sent[u].items():             # sealed to a key the attacker holds: read it
            if v in plan.fake.get(u, set()):
                k = keys.pair_key(fkeys[v][0], adverts[u]["c_pk"], b"enc", rid, v, u)
                sv, bv = open_shares(k, rid, u, v, ct)
                s.setdefault(u, {})[v], b.setdefault(u, {})[v] = sv, bv
    if callable(plan.u3):      # survivor sets that depend on the run's graph (seeded by the roster's keys)
        plan.u3 = plan.u3(next(iter(devs.values()))._graph)
    ys: dict[int, bytes] = {}
    for u, d in list(devs.items()):
        cts, senders = [], [u]
        for v in shown[u]:
            if v == u:
                continue
            if v in plan.fake.get(u, set()):      # forged by the attacker (random shares)
                k = keys.pair_key(fkeys[v][0], adverts[u]["c_pk"], b"enc", rid, v, u)
                cts.append({"from": v, "ct": keys.seal(k, rid, v, u, os.urandom(2 * SHARE_BYTES))})
                senders.append(v)
            elif u in sent.get(v, {}):
                cts.append({"from": v, "ct": sent[v][u]})
                senders.append(v)
            elif v in sent and v not in d._graph[u]:   # SecAgg+: shared keys, just not with u
                senders.append(v)
        inbox = {"type": M.SHARES_INBOX, "round": rid, "device": u, "senders": sorted(senders), "ciphertexts": cts}
        try:
            ys[u] = d.masked_input(inbox, *fleet.updates[u])["y"]
        except SecAggError as e:
            refused[u] = str(e)
            del devs[u]
    for w in plan.sybils & set(devs):   # the server reads its own devices' state: every share they hold
        for v, (sv, bv) in devs[w]._held.items():
            s.setdefault(v, {})[w], b.setdefault(v, {})[w] = sv, bv
    sigs = []
    if fleet.params.authenticated and plan.sybils:   # its devices' identity keys sign every survivor set it shows
        for w in sorted(plan.sybils & set(devs)):
            for x in {tuple(sorted(v)) for v in plan.u3.values()}:
                sigs.append({"device": w, "sig": fleet.identity[w].sign(_consistency(devs[w], set(x)))})
    if fleet.params.authenticated:
        for u, d in list(devs.items()):
            if u in plan.sybils:
                continue
            try:
                sigs.append({"device": u, "sig": d.consistency(
                    {"type": M.CONSISTENCY_REQUEST, "round": rid, "survivors": sorted(plan.u3[u])})["sig"]})
            except SecAggError as e:
                refused[u] = str(e)
                del devs[u]
    for u, d in devs.items():
        if u in plan.sybils:                      # its own devices: their shares were read already
            continue
        u2 = set(d._u2)
        req = {"type": M.UNMASK_REQUEST, "round": rid, "survivors": sorted(plan.u3[u]),
               "dropped": sorted(u2 - plan.u3[u]), "signatures": sigs}
        try:
            out = d.unmask(req)
        except SecAggError as e:
            refused[u] = str(e)
            continue
        for e in out["b_shares"]:
            if e["of"] not in plan.fake.get(u, set()):     # a forged share is worth nothing
                b.setdefault(e["of"], {})[u] = e["share"]
        for e in out["s_shares"]:
            if e["of"] not in plan.fake.get(u, set()):
                s.setdefault(e["of"], {})[u] = e["share"]
    return Outcome(refused, b, s, ys, fkeys, shown, thresholds)


def _consistency(d: SecAggDevice, u3: set[int]) -> bytes:
    """What device ``d``'s identity signs over ``u3`` in its run (before issue 30: no run digest)."""
    import inspect

    from fedfs_sdk.federation.secagg import auth

    if "run" in inspect.signature(auth.consistency_payload).parameters:
        return auth.consistency_payload(d.params.round_id, d.context, u3, d._run)
    return auth.consistency_payload(d.params.round_id, d.context, u3)


def attempt(fleet: Fleet, plan: Plan, out: Outcome, victim: int) -> np.ndarray | None:
    """The attacker's best try at the victim's input from what it collected: ``b_v`` and, for each
    partner in the victim's roster, the pairwise mask — from the partner's reconstructed
    ``s_sk`` or the attacker's own key. None when any piece is missing."""
    from fedfs_sdk.federation.secagg.params import neighbours

    if victim not in out.y:
        return None
    rid, t = fleet.params.round_id, out.thresholds[victim]
    bv = reconstruct(out.b.get(victim, {}), t)
    if bv is None:
        return None
    view = out.shown[victim]
    dev = fleet.devs.get(victim)
    graph = dev._graph if dev is not None and dev._graph else neighbours(fleet.params, list(view))
    seeds = []
    own = reconstruct(out.s.get(victim, {}), t)      # the victim's own mask key: every pairwise mask
    for w in graph[victim]:
        if own is not None:
            sk_v = keys.private_from_bytes(own)
            seeds.append((keys.pair_key(sk_v, view[w][1], b"mask", rid, victim, w), +1 if victim < w else -1))
            continue
        if w in plan.fake.get(victim, set()):               # a key the attacker made
            sk = out.keys[w][1]
        elif w in plan.sybils:                              # its own device: it reads the key
            sk = fleet.devs[w]._s_sk
        else:
            raw = reconstruct(out.s.get(w, {}), out.thresholds.get(w, t))
            if raw is None:
                return None
            sk = keys.private_from_bytes(raw)
        seeds.append((keys.pair_key(sk, view[victim][1], b"mask", rid, w, victim), +1 if victim < w else -1))
    return strip(out.y[victim], bv, seeds)
