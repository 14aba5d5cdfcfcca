"""A malicious server against the real device code (issue 24's security review, replayed).

Each attack runs twice against real :class:`SecAggDevice` objects (``tests/secagg_adversary.py``
plays the server from the messages alone):

* on the **previous protocol** — ``fedfs-secagg/1`` with :meth:`DevicePolicy.legacy`, the
  acceptance rules the devices had before identities, the consistency check and device floors.
  This is the regression case: there the attack **recovers the victim's update exactly** (its
  fixed-point words ``enc(n·w, n)``), so the test can fail;
* on **fedfs-secagg/2** with the default :class:`DevicePolicy`: the attack is refused — the
  device says why — and what the attacker collected does not rebuild the update.

Attacks: key substitution by the server (every device's keys); split survivor views with a
roster lie (m = 5, t = 3); a roster lie at the default threshold (m = 10); fake devices; SecAgg+
group sums at k = 2, t = 2 (an honest-but-curious server with natural dropouts) and a
disconnected survivor set at k = 4. The on-path attacker and a plain round offered to a device
that requires secure ones run over real HTTP: ``tests/test_secagg_identity_http.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pytest

from secagg_adversary import DIM, Fleet, KeySwap, Plan, attempt, execute, key_exchange, recover, roster_of
from fedfs_sdk.federation.secagg import (CertificateAuthority, DevicePolicy, RefusedError, SecAggDevice,
                                         SecAggParams, SecAggServer, shamir)
from fedfs_sdk.federation.secagg import keys
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.device import SECRET_BYTES
from fedfs_sdk.federation.secagg.params import neighbours
from fedfs_sdk.federation.secagg.prg import add_mask


@dataclass(frozen=True)
class _NoSybilFloor(DevicePolicy):
    """The default policy without the issue-30 floor ``t > s* = 2q(n) − n − 1``: to show that the other
    checks (here: connectivity) hold on their own."""

    def check_sybil_floor(self, params, t, m, where):
        return None


def _without_sybil_floor(p: DevicePolicy) -> DevicePolicy:
    return _NoSybilFloor(**{f.name: getattr(p, f.name) for f in fields(p)})


def _inboxes(share_msgs: dict[int, dict], ids: list[int], rid: int) -> dict[int, dict]:
    return {v: {"type": M.SHARES_INBOX, "round": rid, "device": v, "senders": sorted(ids),
                "ciphertexts": [{"from": u, "ct": next(e["ct"] for e in m["ciphertexts"] if e["to"] == v)}
                                for u, m in share_msgs.items() if u != v]} for v in ids}


# ---- key substitution -------------------------------------------------------------------------

def test_key_substitution_recovers_every_update_on_the_previous_protocol_undetected():
    """The server shows each device its own keys in place of the others', re-seals the shares it
    reads, strips every mask: all 6 updates, and the round still completes (devices answer the
    unmask request) with the right mean — nothing a device checks notices."""
    f = Fleet(6, "previous")
    devs = {u: f.device(u) for u in f.ids}
    adverts = [d.advertise() for d in devs.values()]
    t = f.params.threshold_for(6)
    real = roster_of(f.params, adverts, t)
    fakes: dict = {}
    swaps = {u: KeySwap(u, f.params.round_id, fakes) for u in f.ids}
    for a in adverts:
        for sw in swaps.values():
            sw.real[a["device"]] = (a["c_pk"], a["s_pk"])
    shares = {u: swaps[u].share_keys(devs[u].share_keys(swaps[u].roster(real))) for u in f.ids}
    inboxes = _inboxes(shares, f.ids, f.params.round_id)
    for u in f.ids:
        swaps[u].u2 = f.ids
        swaps[u].masked(devs[u].masked_input(inboxes[u], *f.updates[u])["y"], t, remask=False)
        assert recover(swaps[u].recovered, f, u), f"update of device {u} not recovered"
    req = {"type": M.UNMASK_REQUEST, "round": f.params.round_id, "survivors": f.ids, "dropped": []}
    for d in devs.values():
        d.unmask(req)                           # nothing looked wrong to any device
    total = sum(swaps[u].recovered for u in f.ids)
    mean, _ = f.params.fixed_point.decode_sum(total, 6)
    exact = sum(f.updates[u][0].astype(np.float64) * f.updates[u][1] for u in f.ids) / sum(
        f.updates[u][1] for u in f.ids)
    assert np.abs(mean - exact).max() <= 1e-7                     # the published mean is right


@pytest.mark.parametrize("rogue_ca", [False, True])
def test_key_substitution_is_refused_on_v2(rogue_ca):
    """The same substitution against fedfs-secagg/2: the swapped keys are not covered by the
    device's signature (or, signed by a key of the attacker's own CA, not by a certified
    identity); every device refuses the roster and seals no share to anyone."""
    f = Fleet(6, "v2")
    devs = {u: f.device(u) for u in f.ids}
    adverts = [d.advertise() for d in devs.values()]
    t = f.params.threshold_for(6)
    fakes: dict = {}
    swaps = {u: KeySwap(u, f.params.round_id, fakes) for u in f.ids}
    rogue = CertificateAuthority.generate()
    for a in adverts:
        for sw in swaps.values():
            sw.real[a["device"]] = (a["c_pk"], a["s_pk"])
    for u, d in devs.items():
        r = swaps[u].roster(roster_of(f.params, adverts, t))
        if rogue_ca:     # the attacker signs its keys with identities of its own CA
            from fedfs_sdk.federation.secagg import auth

            for e in r["devices"]:
                if e["device"] != u:
                    ident = f.certified(f"phone-{e['device']}", rogue)
                    e["cert"] = ident.certificate.to_json()
                    e["sig"] = ident.sign(auth.advertisement_payload(f.params.round_id, e["device"], d.context,
                                                                     e["c_pk"], e["s_pk"]))
        match = "not a certified device" if rogue_ca else "not signed by its identity key"
        with pytest.raises(RefusedError, match=match):
            d.share_keys(r)
        assert swaps[u].shares == {}                              # nothing was sealed to the attacker


# ---- split views and roster lies ---------------------------------------------------------------

# victim 1 sees itself and t − 1 = 2 partners (2, 3); devices 4 and 5 see 1 under the attacker's
# keys (it never shared with them) and are told that 2 and 3 dropped; 2 and 3 that 5 and 3 / 2 did.
SPLIT = Plan(rosters={1: [1, 2, 3], 2: [1, 2, 3, 4, 5], 3: [1, 2, 3, 4, 5], 4: [1, 2, 3, 4, 5], 5: [1, 2, 3, 4, 5]},
             fake={4: {1}, 5: {1}},
             u3={1: {1, 2, 3}, 2: {1, 2, 4}, 3: {1, 3, 4}, 4: {1, 4, 5}, 5: {1, 4, 5}})


def test_split_views_recover_the_victim_on_the_previous_protocol():
    f = Fleet(5, "previous", threshold=3)                         # a strict majority: what devices accepted
    out = execute(f, SPLIT)
    assert out.refused == {}
    assert recover(attempt(f, SPLIT, out, 1), f, 1)


def test_split_views_are_refused_on_v2():
    """At the same threshold the device refuses the task (below two thirds of 5). At the threshold
    it accepts (4), the victim refuses its 3-device roster; with full rosters and split survivor
    sets no group gathers 4 signatures over its set, and every device refuses to unmask."""
    with pytest.raises(RefusedError, match="threshold 3 is below this device's floor 4"):
        Fleet(5, "v2", threshold=3).device(1)
    f = Fleet(5, "v2")
    out = execute(f, SPLIT)
    assert "roster has 3 devices, fewer than min_devices=4" in out.refused[1]
    assert attempt(f, SPLIT, out, 1) is None
    full = Plan(rosters={u: [1, 2, 3, 4, 5] for u in range(1, 6)},
                u3={1: {1, 2, 3, 4}, 2: {1, 2, 3, 4}, 3: {1, 2, 3, 4}, 4: {1, 2, 4, 5}, 5: {1, 2, 4, 5}})
    f = Fleet(5, "v2", seed=1)
    out = execute(f, full)
    assert sorted(out.refused) == [1, 2, 3, 4, 5]
    assert all("valid consistency signatures" in why for why in out.refused.values()), out.refused
    assert out.b == {} and out.s == {}                            # no device revealed a share
    assert attempt(f, full, out, 1) is None


def _roster_lie(n: int) -> Plan:
    """Victim 1 sees itself + 2 and 3; 2 and 3 (full roster) are told 8…n dropped; 4…n are told
    2 and 3 dropped — they reveal s_sk of 2 and 3, 1/2/3 reveal b_1."""
    everyone = list(range(1, n + 1))
    u3 = {1: {1, 2, 3}, 2: set(range(1, 8)), 3: set(range(1, 8))}
    u3.update({u: set(range(4, n + 1)) for u in range(4, n + 1)})
    return Plan(rosters={1: [1, 2, 3], **{u: everyone for u in range(2, n + 1)}}, u3=u3)


def test_roster_lie_at_the_default_threshold_recovers_the_victim_on_the_previous_protocol():
    f = Fleet(10, "previous")                                     # default threshold: 7 of 10, 3 of 3
    plan = _roster_lie(10)
    out = execute(f, plan)
    assert out.refused == {} and out.thresholds[1] == 3 and out.thresholds[4] == 7
    assert recover(attempt(f, plan, out, 1), f, 1)


def test_roster_lie_is_refused_on_v2():
    """v2 fixes t against the invited n = 10: a 3-device roster is below it. Telling the victim
    alone that the round invites 3 changes what its signatures bind: the real devices' signed
    keys no longer verify in its roster."""
    f = Fleet(10, "v2")
    plan = _roster_lie(10)
    out = execute(f, plan)
    assert "roster has 3 devices, fewer than min_devices=7" in out.refused[1]
    assert attempt(f, plan, out, 1) is None
    lie = Plan(rosters=plan.rosters, u3=plan.u3, participants={1: 3})
    f = Fleet(10, "v2", seed=2)
    out = execute(f, lie)
    assert "not signed by its identity key" in out.refused[1]
    assert attempt(f, lie, out, 1) is None


# ---- fake devices ---------------------------------------------------------------------------

FAKES = Plan(rosters={1: [1, 100, 101]}, fake={1: {100, 101}}, u3={1: {1, 100, 101}})


def test_fake_devices_recover_the_victim_on_the_previous_protocol():
    """A roster of the victim and two devices the server made passes min_devices = 3: the server
    reads the victim's shares sealed to its own keys and knows every pairwise mask."""
    f = Fleet(3, "previous")
    out = execute(f, FAKES)
    assert out.refused == {}
    assert recover(attempt(f, FAKES, out, 1), f, 1)


def test_fake_devices_are_refused_on_v2():
    """The server cannot certify its devices: with its own CA they are not certified; with real
    devices' certificates and its own keys the signatures do not verify."""
    f = Fleet(3, "v2")
    rogue = Plan(rosters=FAKES.rosters, fake=FAKES.fake, u3=FAKES.u3, rogue=CertificateAuthority.generate())
    out = execute(f, rogue)
    assert "not a certified device" in out.refused[1]
    assert attempt(f, rogue, out, 1) is None and out.b == {} and out.s == {}
    stolen = Plan(rosters={1: [1, 2, 3]}, fake={1: {2, 3}}, u3={1: {1, 2, 3}})    # real certs, fake keys
    f = Fleet(3, "v2", seed=3)
    out = execute(f, stolen)
    assert "not signed by its identity key" in out.refused[1]
    assert attempt(f, stolen, out, 1) is None


# ---- SecAgg+ group sums -----------------------------------------------------------------------

def _ring(params: SecAggParams, ids: list[int]) -> list[int]:
    """The k = 2 graph is a cycle: its order."""
    g = neighbours(params, ids)
    order = [ids[0]]
    while len(order) < len(ids):
        order.append(next(w for w in g[order[-1]] if w not in order))
    return order


def test_secaggplus_group_sums_leak_to_an_honest_but_curious_server_on_the_previous_protocol():
    """k = 2, t = 2, m = 9, three natural dropouts after ShareKeys at every third place of the
    ring: the honest server finishes the round (every secret keeps t holders), and from what it
    legitimately holds it rebuilds the sum of each surviving pair — not only the total."""
    p = SecAggParams(round_id=5, dim=DIM, threshold=2, neighbours=2)
    f = Fleet(9, "previous", threshold=2, neighbours=2, round_id=5)
    ring = _ring(p, f.ids)
    dropped = {ring[2], ring[5], ring[8]}
    srv = SecAggServer(p, keep_transcript=True)
    devs = {u: f.device(u) for u in f.ids}
    roster, inboxes = key_exchange(srv, devs)
    for u, d in devs.items():
        if u not in dropped:
            srv.receive(d.masked_input(inboxes[u], *f.updates[u]))
    req = srv.close_masked()
    for u in req["survivors"]:
        srv.receive(devs[u].unmask(req))
    srv.finalize()                                                # the round succeeds
    ys = {m["device"]: np.frombuffer(m["y"], "<u8") for m in srv.transcript if m["type"] == M.MASKED_INPUT}
    pks = {e["device"]: e["s_pk"] for e in roster["devices"]}
    for i in (0, 3, 6):                                           # the surviving pairs
        a, b = ring[i], ring[i + 1]
        z = (ys[a] + ys[b]).astype(np.uint64)
        for v in (a, b):
            add_mask(z, shamir.reconstruct(srv.b_shares[v], 2, SECRET_BYTES), -1)
            for w in srv.graph[v]:
                if w in dropped:                                  # its mask key was rebuilt
                    sk = keys.private_from_bytes(shamir.reconstruct(srv.s_shares[w], 2, SECRET_BYTES))
                    add_mask(z, keys.pair_key(sk, pks[v], b"mask", 5, w, v), -1 if v < w else +1)
        assert np.array_equal(z, f.encoded(a) + f.encoded(b)), f"pair {a}, {b} not exposed"


def test_secaggplus_group_sums_are_refused_by_the_device_floors():
    """The same round with the devices' default policy: k = 2 and t = 2 of 3 holders are below
    the floors. At k = 4 (the default minimum), an active server that declares two devices at each
    of two places of the ring dropped — so that the 11 survivors of 15 form two groups — is refused
    at the consistency check: the survivors are not connected. (Since issue 30 a device refuses
    k = 4 of 15 invited at once — 4 of 5 share holders is not above the 2·11 − 15 − 1 = 6 certified
    devices a server may hold — so the check runs here with that floor relaxed: the
    connectivity check must hold on its own.)"""
    p = SecAggParams(round_id=5, dim=DIM, threshold=2, neighbours=2)
    dev = SecAggDevice(p, 1, policy=DevicePolicy.honest_but_curious())
    srv = SecAggServer(p)
    others = [SecAggDevice(p, u, policy=DevicePolicy.legacy()) for u in range(2, 10)]
    for d in [dev, *others]:
        srv.receive(d.advertise())
    with pytest.raises(RefusedError, match="SecAgg\\+ degree k = 2 is below this device's minimum 4"):
        dev.share_keys(srv.close_advertise())
    with pytest.raises(RefusedError, match="SecAgg\\+ threshold 4 of 5 share holders is not above 6"):
        Fleet(15, "v2", neighbours=4, round_id=6).device(1)
    f = Fleet(15, "v2", neighbours=4, round_id=6)     # 11 survivors reach the quorum ⌊2·15/3⌋ + 1
    f.policy = _without_sybil_floor(f.policy)

    def split(ring: dict) -> dict:      # the graph is the run's (seeded by the roster's keys): known after it
        order = [1]                                   # walk the ring: the ±1 neighbour not yet seen
        while len(order) < 15:
            order.append(next(w for w in ring[order[-1]] if w not in order and
                              len(set(ring[w]) & set(ring[order[-1]])) == 2))
        alive = set(f.ids) - {order[0], order[1], order[7], order[8]}
        return {u: alive for u in f.ids}

    plan = Plan(rosters={u: f.ids for u in f.ids}, u3=split)
    out = execute(f, plan)
    survivors = plan.u3[2]
    assert sorted(out.refused) == f.ids, out.refused
    assert all("not form one connected group" in out.refused[u] for u in survivors), out.refused
    assert all("listed as dropped" in out.refused[u] for u in set(f.ids) - survivors)
    assert out.b == {} and out.s == {}
