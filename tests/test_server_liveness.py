"""Deployment bug 2 (docs/personalization.md): a device registered ahead of its first run
(``fedfs ca request --server``) that then never runs must not be sampled — a secure round would
wait for it until the phase deadline. The server samples only devices that polled within the
liveness window, and ``fedfs ca request --images`` runs ``fedfs device``'s own input checks before
it registers. Real ``fedfs serve`` processes on 127.0.0.1."""
from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from conftest_server import start_server, write_images

pytestmark = pytest.mark.timeout(120)


def _participants(state, round_id: int) -> set[str]:
    with sqlite3.connect(f"file:{state / 'server.db'}?mode=ro", uri=True) as c:
        return {r[0] for r in c.execute("SELECT device_id FROM participants WHERE round_id = ?", (round_id,))}


def test_a_secure_round_samples_only_devices_that_polled(tmp_path):
    # the default liveness window (no --device-ttl): what a deployment gets
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127",
                       "--secure-aggregation", "--min-participants", "3", "--round-timeout", "600",
                       "--secagg-phase-timeout", "600")
    try:
        regs = [httpx.post(srv.url + "/v1/devices").json() for _ in range(4)]
        polled, silent = regs[:3], regs[3]          # silent: registered (e.g. by `fedfs ca request`), never ran

        def task(reg: dict) -> dict:
            r = httpx.get(srv.url + "/v1/task", headers={"Authorization": f"Bearer {reg['token']}"})
            assert r.status_code == 200, r.text
            return r.json()

        assert all(task(r)["action"] == "wait" for r in polled)
        with srv.admin() as a:
            opened = a.post("/v1/admin/rounds")
            assert opened.status_code == 201, opened.text
            assert opened.json()["sampled"] == 3
            assert srv.status()["devices"] == 4 and srv.status()["active_devices"] == 3
            assert _participants(srv.state, 1) == {r["device_id"] for r in polled}
            for r in polled:
                t = task(r)
                assert t["action"] == "train" and t["secagg"] is not None
            assert task(silent)["action"] == "wait"    # its first poll: too late for round 1 …
            assert a.post("/v1/admin/rounds/1/close").status_code == 200
            assert a.post("/v1/admin/rounds").json()["sampled"] == 4    # … in time for round 2
            assert _participants(srv.state, 2) == {r["device_id"] for r in regs}
    finally:
        srv.stop()


def test_ca_request_refuses_a_device_that_fedfs_device_would_refuse_before_registering(tmp_path, capsys):
    from fedfs_sdk.cli.main import main

    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127")
    try:
        write_images(tmp_path / "me", 9, seed=1)         # 9 photos: fewer than q = 0.9's warm-up minimum of 10
        state, req = tmp_path / "dev", tmp_path / "req.json"
        request = ["ca", "request", "--state", str(state), "--out", str(req), "--server", srv.url]
        assert main(request + ["--images", str(tmp_path / "me"), "--enroll"]) == 2
        err = capsys.readouterr().err
        assert err == ("fedfs ca: error: --enroll with target TPR q=0.9 needs at least 10 photos of the owner, got 9: "
                       "add photos, or lower --q (q=0.8 needs 5) (nothing registered)\n")
        # the same check, by the same function, as `fedfs device` (which refuses before registering too)
        assert main(["device", "--server", srv.url, "--images", str(tmp_path / "me"), "--state", str(state),
                     "--enroll"]) == 2
        assert capsys.readouterr().err.split("error: ")[1] == err.split("error: ")[1].replace(" (nothing registered)", "")
        assert main(request + ["--images", str(tmp_path / "nowhere")]) == 2
        assert "image folder not found" in capsys.readouterr().err
        assert main(request + ["--enroll"]) == 2                          # --enroll says nothing without the photos
        assert "--images DIR" in capsys.readouterr().err
        assert srv.status()["devices"] == 0                               # the server never saw it
        assert not state.exists() and not req.exists()
        # photos `fedfs device --enroll --q 0.8` accepts: registered, and the request names the device
        assert main(request + ["--images", str(tmp_path / "me"), "--enroll", "--q", "0.8"]) == 0
        assert srv.status()["devices"] == 1
        from fedfs_sdk.federation.device_state import DeviceState
        with DeviceState(state, read_only=True) as st:
            assert json.loads(req.read_text())["subject"] == st.info.device_id
    finally:
        srv.stop()
