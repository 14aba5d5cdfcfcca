"""Issue 30: the operator's signed revocation list (fedfs_sdk/federation/secagg/revocation.py).

A revoked device (a stolen key) is refused in every roster; the server can neither forge the
list (the devices check the CA's signature), roll it back (a device remembers the highest
number it accepted, across restarts), nor withhold it silently (a device with
``max_revocation_age_s`` refuses a round without a fresh list). Before issue 30 no revocation
existed: a stolen certified key stayed valid until ``not_after``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest_server import ROOT, subprocess_env
from secagg_adversary import Fleet
from fedfs_sdk.federation.secagg import CertificateAuthority, DevicePolicy, RefusedError, SecAggServer
from fedfs_sdk.federation.secagg.revocation import RevocationList, check_task_list, issue
from fedfs_sdk.federation.secagg.round_log import RoundLog


def test_a_roster_with_a_revoked_device_is_refused_and_the_server_drops_its_advert():
    f = Fleet(5, "v2")
    stolen = f.identity[5].certificate.serial
    devs = {u: f.device(u) for u in f.ids}
    for u in (1, 2):
        devs[u].revoked = frozenset({stolen})
    srv = SecAggServer(f.params, ca=f.ca.public)          # a server that ignores the list
    for d in devs.values():
        srv.receive(d.advertise())
    roster = srv.close_advertise()
    with pytest.raises(RefusedError, match=r"devices \[5\] present certificates the operator revoked"):
        devs[1].share_keys(roster)
    devs[3].share_keys(roster)                            # a device without the list does not know
    honest = SecAggServer(f.params, ca=f.ca.public)
    honest.revoked = frozenset({stolen})
    fresh = Fleet(5, "v2", seed=1)
    fresh.identity = f.identity
    d5 = fresh.device(5)
    with pytest.raises(RefusedError, match="revoked by the operator"):
        honest.receive(d5.advertise())


def test_the_device_checks_signature_age_presence_and_rollback(tmp_path):
    ca, rogue = CertificateAuthority.generate(), CertificateAuthority.generate()
    l1 = issue(ca, None, ["aa"], now=1000)
    l2 = issue(ca, l1, ["bb"], now=2000)
    assert (l2.number, l2.revoked) == (2, ("aa", "bb"))
    assert check_task_list(l2.to_json(), ca.public, 3600, 0, "t", now=2500).revoked == ("aa", "bb")
    with pytest.raises(RefusedError, match="not signed by the pinned CA"):          # forged by the server
        check_task_list(issue(rogue, None, [], now=2000).to_json(), ca.public, None, 0, "t", now=2000)
    tampered = {**l2.to_json(), "revoked": ["aa"]}                                   # a serial dropped
    with pytest.raises(RefusedError, match="not signed by the pinned CA"):
        check_task_list(tampered, ca.public, None, 0, "t", now=2000)
    with pytest.raises(RefusedError, match="issued 5000 s ago"):                    # stale
        check_task_list(l2.to_json(), ca.public, 3600, 0, "t", now=7000)
    with pytest.raises(RefusedError, match="carries no revocation list"):           # withheld
        check_task_list(None, ca.public, 3600, 0, "t")
    assert check_task_list(None, ca.public, None, 0, "t") is None                  # not required: none is fine
    log = RoundLog(tmp_path / "rounds.json")
    log.note_revocation(ca.public.key_id, 2)
    again = RoundLog(tmp_path / "rounds.json")                                      # a restart
    with pytest.raises(RefusedError, match="already saw number 2"):                # rolled back
        check_task_list(l1.to_json(), ca.public, None, again.last_revocation(ca.public.key_id), "t", now=1000)
    with pytest.raises(RefusedError, match="the server withholds it"):             # dropped once seen
        check_task_list(None, ca.public, None, again.last_revocation(ca.public.key_id), "t")


def test_session_requires_the_list_with_max_age(tmp_path):
    """Over the task: a device with ``max_revocation_age_s`` refuses a round whose task has no
    list (before any key is sent), accepts one with a fresh list, and records its number."""
    from fedfs_sdk.federation.secagg.http_device import SecAggRoundLost, SecAggSession
    from fedfs_sdk.federation.secagg import DeviceIdentity

    ca = CertificateAuthority.generate()
    ident = DeviceIdentity.generate()
    ident = ident.with_certificate(ca.issue("d1", ident.public_key))
    fields = {"dim": 4, "threshold": None, "neighbours": None, "clip": 1.0, "scale_bits": 24, "max_devices": 5,
              "max_samples": 10, "min_devices": 3, "layout_sha256": "0" * 64, "device": 1,
              "protocol": "fedfs-secagg/2", "participants": 5}
    policy = DevicePolicy(ca=ca.public, max_revocation_age_s=3600)
    log = RoundLog(tmp_path / "log.json")
    with pytest.raises(SecAggRoundLost, match="carries no revocation list"):
        SecAggSession(None, {"round_id": 1, "secagg": fields}, identity=ident, policy=policy, round_log=log)
    crl = issue(ca, issue(ca, None, ["x"]), ["y"])
    s = SecAggSession(None, {"round_id": 2, "secagg": {**fields, "revocations": crl.to_json()}}, identity=ident,
                      policy=policy, round_log=log)
    assert s.device.revoked == {"x", "y"} and RoundLog(tmp_path / "log.json").last_revocation(ca.public.key_id) == 2


def test_cli_revoke_signs_a_growing_list(tmp_path):
    from fedfs_sdk.federation.secagg import CaPublicKey

    def fedfs(*a: str) -> str:
        r = subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", *a], cwd=ROOT, env=subprocess_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    fedfs("ca", "init", "--dir", str(tmp_path / "ca"))
    assert "number 1: 1 certificate(s)" in fedfs("ca", "revoke", "--ca", str(tmp_path / "ca"), "--serial", "abc")
    out = fedfs("ca", "revoke", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "srv.json"))
    assert "number 2: 1 certificate(s)" in out
    crl = RevocationList.load(tmp_path / "srv.json")
    crl.verify(CaPublicKey.load(tmp_path / "ca" / "ca.pub"))
    assert crl.revoked == ("abc",) and json.loads((tmp_path / "ca" / "revocations.json").read_text())["number"] == 2


def test_server_refuses_a_round_every_default_device_would_refuse(tmp_path):
    """``--secagg-ca`` with ``--secagg-neighbours 4`` and 12 devices: a device with the default
    floors refuses the task (t = 4 of 5 holders is not above s* = 2·9 − 12 − 1 = 5), so the
    server says so when it opens the round (409 secagg_params) instead of running it to a
    failure; the full graph opens. The revocation list in the server's state goes into the task."""
    from server_agg.errors import Conflict
    from server_agg.rounds import Coordinator
    from server_agg.store import Layout
    from fedfs_sdk.federation.secagg.revocation import SERVER_FILENAME
    from test_server_coordinator import checkpoint_bytes

    ca = CertificateAuthority.generate()
    c = Coordinator(Layout(tmp_path / "state"), policy_overrides={
        "min_participants": 12, "secure_aggregation": True, "secagg_neighbours": 4, "secagg_ca": ca.public.to_json()})
    c.install_model(checkpoint_bytes(code_length=127))
    for _ in range(12):
        c.authenticate(c.register()["token"])            # registered and polled: eligible
    with pytest.raises(Conflict, match="default floors refuse it: .*not above 5") as e:
        c.open_round()
    assert e.value.code == "secagg_params"
    issue(ca, None, ["abc"]).save(tmp_path / "state" / SERVER_FILENAME)
    c.set_policy({"secagg_neighbours": None})
    c.open_round()
    task = json.loads(c.db.scalar("SELECT task FROM rounds ORDER BY id DESC LIMIT 1"))
    assert task["secagg"]["revocations"]["revoked"] == ["abc"] and task["secagg"]["protocol"] == "fedfs-secagg/2"
