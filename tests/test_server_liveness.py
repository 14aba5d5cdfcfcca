"""Deployment bug 2 (docs/personalization.md): a device registered ahead of its first run
(``fedfs ca request --server``) that then never runs must not be sampled — a secure round would
wait for it until the phase deadline. The server samples only devices that polled within the
liveness window. A real ``fedfs serve`` process on 127.0.0.1 with secure aggregation."""
from __future__ import annotations

import sqlite3

import httpx
import pytest

from conftest_server import start_server

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
