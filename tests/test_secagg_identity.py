"""fedfs-secagg/2 in-process: certificates, what signatures bind, the consistency check, the
device floors, and the server's state across restarts (``fedfs_sdk.federation.secagg``)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import (CaPublicKey, Certificate, CertificateAuthority, DeviceIdentity,
                                         DevicePolicy, IdentityError, RefusedError, ReplayError, SecAggDevice,
                                         SecAggParams, SecAggServer, from_json, restore, snapshot, to_json)
from fedfs_sdk.federation.secagg import auth
from fedfs_sdk.federation.secagg import messages as M
from secagg_adversary import key_exchange

DIM = 20


def _fleet(n: int, count: int | None = None, **params):
    """A CA, the round's params (n invited) and ``count`` (default n) certified devices."""
    ca = CertificateAuthority.generate()
    p = SecAggParams(round_id=4, dim=DIM, participants=n, authenticated=True, **params)
    ids = {u: DeviceIdentity.generate() for u in range(1, (count or n) + 1)}
    ids = {u: i.with_certificate(ca.issue(f"d{u}", i.public_key)) for u, i in ids.items()}
    policy = DevicePolicy(ca=ca.public)
    return ca, p, {u: SecAggDevice(p, u, identity=ids[u], policy=policy) for u in ids}


# ---- certificates -----------------------------------------------------------------------------

def test_certificate_verifies_only_under_its_ca_and_only_untampered():
    ca, other = CertificateAuthority.generate(), CertificateAuthority.generate()
    ident = DeviceIdentity.generate()
    cert = ca.sign_request(ident.request("alice"))
    cert.verify(ca.public)
    with pytest.raises(IdentityError, match="not by the pinned CA"):
        cert.verify(other.public)
    for field, value in (("subject", "mallory"), ("public_key", DeviceIdentity.generate().public_key),
                         ("not_after", cert.not_after + 10**6)):
        with pytest.raises(IdentityError, match="does not verify"):
            dataclasses.replace(cert, **{field: value}).verify(ca.public)
    assert Certificate.from_json(from_json(to_json({"c": cert.to_json()}))["c"]) == cert    # survives the wire
    with pytest.raises(IdentityError, match="not valid now"):
        ca.issue("old", ident.public_key, valid_days=1, now=time.time() - 3 * 86400).verify(ca.public)
    with pytest.raises(IdentityError, match="another key"):
        DeviceIdentity.generate().with_certificate(cert)
    forged = dict(ident.request("alice"), public_key=cert.to_json()["public_key"][:-4] + "AAA=")
    with pytest.raises(InputError, match="proof of possession"):
        ca.sign_request(forged)
    assert CaPublicKey.from_json(ca.public.to_json()) == ca.public


def test_advertisement_signature_binds_round_device_context_and_keys():
    ca, p, devs = _fleet(5)
    adv = devs[1].advertise()
    ctx = devs[1].context
    assert auth.check_advertisement(adv, 4, ctx, ca.public, "t") == devs[1].identity.public_key
    for bad, ctx2, rid in (({**adv, "device": 2}, ctx, 4), ({**adv, "c_pk": devs[2].advertise()["c_pk"]}, ctx, 4),
                           (adv, ctx, 5),
                           (adv, auth.context_digest(dataclasses.replace(p, participants=3)), 4),
                           (adv, auth.context_digest(p, b"another model"), 4)):
        with pytest.raises(RefusedError, match="not signed by its identity key"):
            auth.check_advertisement(bad, rid, ctx2, ca.public, "t")


# ---- a full round, the consistency check --------------------------------------------------------

def _to_consistency(n=5, drop_mask=()):
    ca, p, devs = _fleet(n)
    srv = SecAggServer(p, ca=ca.public)
    roster, inboxes = key_exchange(srv, devs)
    w = {u: (np.full(DIM, 0.01 * u, np.float32), u) for u in devs}
    for u, d in devs.items():
        if u not in drop_mask:
            srv.receive(d.masked_input(inboxes[u], *w[u]))
    return ca, p, devs, srv, w, srv.close_masked()


def test_consistency_signatures_gate_unmasking():
    ca, p, devs, srv, w, check = _to_consistency()
    assert check["type"] == M.CONSISTENCY_REQUEST and check["survivors"] == [1, 2, 3, 4, 5]
    sigs = {u: devs[u].consistency(check) for u in (1, 2, 3, 4)}
    with pytest.raises(ReplayError, match="already signed"):
        devs[1].consistency(check)
    for m in sigs.values():
        srv.receive(m)
    request = srv.close_consistency()
    assert [s["device"] for s in request["signatures"]] == [1, 2, 3, 4] and srv.u4 == [1, 2, 3, 4]
    with pytest.raises(RefusedError, match="no consistency check was run"):
        devs[5].unmask(request)
    with pytest.raises(RefusedError, match="only 3 valid consistency signatures"):   # quorum ⌊2·5/3⌋ + 1 = 4
        devs[1].unmask({**request, "signatures": request["signatures"][:3]})
    forged = [{**s, "sig": request["signatures"][0]["sig"]} for s in request["signatures"]]   # one signature, 4×
    with pytest.raises(RefusedError, match="only 1 valid"):
        devs[1].unmask({**request, "signatures": forged})
    with pytest.raises(RefusedError, match="differ from the set this device signed"):
        devs[1].unmask({**request, "survivors": [1, 2, 3, 4], "dropped": [5]})
    for u in (1, 2, 3, 4):
        srv.receive(devs[u].unmask(request))
    res = srv.finalize()
    exact = sum(0.01 * u * u for u in devs) / sum(devs)
    assert np.allclose(res.mean, exact, atol=1e-6) and res.dropped["consistency"] == [5]


def test_too_few_signers_fail_the_round():
    from fedfs_sdk.federation.secagg import RoundFailedError

    _, _, devs, srv, _, check = _to_consistency()
    for u in (1, 2, 3):
        srv.receive(devs[u].consistency(check))
    with pytest.raises(RoundFailedError, match="consistency check needs 4 of the 5 invited"):
        srv.close_consistency()


def test_server_restart_after_every_message_of_an_authenticated_round():
    ca, p, devs = _fleet(5)

    def reborn(s):
        return restore(p, from_json(to_json(snapshot(s))), ca=ca.public)

    srv = SecAggServer(p, ca=ca.public)
    for d in devs.values():
        srv = reborn(srv)
        srv.receive(d.advertise())
    srv = reborn(srv)
    roster = srv.close_advertise()
    srv = reborn(srv)
    assert to_json(srv.roster()) == to_json(roster)                # certificates and signatures kept
    for d in devs.values():
        srv.receive(d.share_keys(roster))
        srv = reborn(srv)
    srv.close_share_keys()
    w = {u: (np.full(DIM, 0.02 * u, np.float32), 2 * u) for u in devs}
    for u, d in devs.items():
        srv = reborn(srv)
        srv.receive(d.masked_input(srv.inbox(u), *w[u]))
    check = srv.close_masked()
    for u, d in devs.items():
        srv = reborn(srv)
        srv.receive(d.consistency(check))
    srv = reborn(srv)
    with pytest.raises(ReplayError, match="device 5 already sent"):    # the restored server remembers
        srv.receive({"type": M.CONSISTENCY, "round": 4, "device": 5, "sig": srv.csigs[5]})
    request = srv.close_consistency()
    for u in (1, 2, 4, 5):
        srv = reborn(srv)
        srv.receive(devs[u].unmask(request))
    res = reborn(srv).finalize()
    assert np.allclose(res.mean, sum(0.02 * u * 2 * u for u in devs) / sum(2 * u for u in devs), atol=1e-6)


# ---- device floors ------------------------------------------------------------------------------

def test_device_floors_refuse_before_any_key_is_sent():
    ca = CertificateAuthority.generate()
    ident = DeviceIdentity.generate()
    ident = ident.with_certificate(ca.issue("d1", ident.public_key))
    strict = DevicePolicy(ca=ca.public)
    cases = [
        (dict(participants=5, threshold=3), "threshold 3 is below this device's floor 4"),
        (dict(participants=2), "fewer than this device's minimum roster 3"),
        (dict(participants=12, neighbours=2), "degree k = 2 is below this device's minimum 4"),
    ]
    for kw, why in cases:
        with pytest.raises(RefusedError, match=why):
            SecAggDevice(SecAggParams(round_id=1, dim=4, authenticated=True, **kw), 1, identity=ident, policy=strict)
    with pytest.raises(RefusedError, match="takes part only in fedfs-secagg/2"):
        SecAggDevice(SecAggParams(round_id=1, dim=4), 1, policy=strict)
    with pytest.raises(RefusedError, match="pins no identity CA"):
        SecAggDevice(SecAggParams(round_id=1, dim=4, participants=5, authenticated=True), 1)
    with pytest.raises(RefusedError, match="needs this device's identity certificate"):
        SecAggDevice(SecAggParams(round_id=1, dim=4, participants=5, authenticated=True), 1, policy=strict)
    # a full graph is fine whatever k; the majority rule accepts t = 3 of 5
    SecAggDevice(SecAggParams(round_id=1, dim=4, participants=3, neighbours=2, authenticated=True), 1,
                 identity=ident, policy=strict)
    SecAggDevice(SecAggParams(round_id=1, dim=4, threshold=3), 1,
                 policy=DevicePolicy(threshold_rule="majority", allow_unauthenticated=True))
    with pytest.raises(RefusedError, match="opt in with --allow-unauthenticated-secagg"):   # issue 30: no silent /1
        SecAggDevice(SecAggParams(round_id=1, dim=4, threshold=3), 1, policy=DevicePolicy(threshold_rule="majority"))
    with pytest.raises(RefusedError, match="σ = 0.5 is below this device's minimum 1"):
        DevicePolicy(min_noise_multiplier=1.0).check_dp_noise(0.5, 3, 4, "t")
    with pytest.raises(RefusedError, match="would hold only 4/5 of σ²C²"):
        DevicePolicy().check_dp_noise(1.0, 5, 4, "t")
    for bad in (dict(min_roster=2), dict(threshold_rule="third"), dict(min_neighbours=1),
                dict(min_noise_multiplier=-1.0)):
        with pytest.raises(InputError):
            DevicePolicy(**bad)


def test_roster_larger_than_the_invited_n_is_refused():
    """Five certified devices signed for a round that invited four: the roster is refused."""
    ca, p, devs = _fleet(4, count=5)
    srv = SecAggServer(p)
    for d in devs.values():
        srv.receive(d.advertise())
    with pytest.raises(RefusedError, match="roster lists 5 devices, the round invited 4"):
        devs[1].share_keys(srv.close_advertise())


def test_previous_snapshot_format_still_restores():
    p = SecAggParams(round_id=3, dim=DIM)
    srv = SecAggServer(p)
    for u in range(1, 4):
        srv.receive(SecAggDevice(p, u, policy=DevicePolicy.honest_but_curious()).advertise())
    snap = snapshot(srv)
    old = {k: v for k, v in snap.items() if k not in ("adverts", "u4", "csigs")}
    old["format"] = "fedfs-secagg-server/1"
    assert sorted(restore(p, old).pks) == [1, 2, 3]


def test_serve_tls_flags_are_checked_before_the_port_is_bound(tmp_path):
    """``fedfs serve --tls-cert/--tls-key``: both or neither, existing files, a key that belongs
    to the certificate — else one clear error before anything is bound or written."""
    from conftest_server import self_signed_cert
    from server_agg.transport import tls_files

    cert, key = self_signed_cert(tmp_path / "a")
    _, other_key = self_signed_cert(tmp_path / "b")
    assert tls_files(None, None) is None
    assert tls_files(cert, key) == (str(cert), str(key))
    with pytest.raises(InputError, match="give both --tls-cert and --tls-key"):
        tls_files(cert, None)
    with pytest.raises(InputError, match="no such file"):
        tls_files(cert, tmp_path / "missing.pem")
    with pytest.raises(InputError, match="cannot be used"):
        tls_files(cert, other_key)
