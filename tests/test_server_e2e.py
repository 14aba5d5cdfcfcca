"""End-to-end: `fedfs serve` and three `fedfs device` processes run 2 FedUV rounds (tiny
backbone); every published global version equals the weighted average of the uploads,
recomputed here from the bytes the devices sent (their --audit-dir copies)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest_server import (ROOT, assert_published_fedavg, audited_uploads, read_safetensors, start_server,
                             subprocess_env, write_images)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_three_devices_two_feduv_rounds(tmp_path):
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127",
                       "--method", "feduv", "--rounds", "2", "--min-participants", "3",
                       "--train", json.dumps({"lr": 0.1, "local_epochs": 1, "batch_size": 4}))
    try:
        devices = []
        for d, n_img in enumerate((5, 7, 9)):       # unequal |D_c| so weighting matters
            write_images(tmp_path / f"img{d}", n_img, seed=d)
            cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "device", "--server", srv.url,
                   "--images", str(tmp_path / f"img{d}"), "--state", str(tmp_path / f"dev{d}"),
                   "--rounds", "2", "--audit-dir", str(tmp_path / f"audit{d}"), "--wait-timeout", "120"]
            devices.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=200)[0] for p in devices]
        for p, out in zip(devices, outs):
            assert p.returncode == 0, out
            assert "took part in 2 round(s)" in out

        status = srv.status()
        assert status["rounds_completed"] == 2 and status["model_version"] == 3 and status["devices"] == 3

        # What each device uploaded, per round, from its own record of the bytes it sent.
        uploads: dict[int, list[tuple[dict[str, np.ndarray], int]]] = {1: [], 2: []}
        for d in range(3):
            sent = audited_uploads(tmp_path / f"audit{d}")
            assert [r for r, _, _ in sent] == [1, 2]
            for rnd, w, n in sent:
                assert n == (5, 7, 9)[d]
                uploads[rnd].append((w, n))
        assert_published_fedavg(srv, uploads)

        with srv.admin() as c:
            for rnd, version in ((1, 2), (2, 3)):
                info = c.get(f"/v1/rounds/{rnd}").json()
                assert info["total_samples"] == 21 and info["result_version"] == version
                # ...and it is not the unweighted mean (|D_c| differ), so the weighting was checked.
                published = read_safetensors(c.get(f"/v1/models/{version}").content)[0]
                unweighted = {k: np.mean([w[k] for w, _ in uploads[rnd]], axis=0) for k in published}
                assert max(np.abs(published[k] - unweighted[k]).max() for k in published) > 1e-6

            # Round 2 trained from version 2: the devices downloaded what round 1 published.
            v2 = read_safetensors(c.get("/v1/models/2").content)[0]
            v1 = read_safetensors(c.get("/v1/models/1").content)[0]
            assert any(not np.array_equal(v1[k], v2[k]) for k in v1)

        # Each device got a distinct b_u and kept its secrets to itself (0600, dir 0700).
        bases = {json.loads((tmp_path / f"dev{d}" / "device.json").read_text())["base_vector"] for d in range(3)}
        assert len(bases) == 3
        for d in range(3):
            st = tmp_path / f"dev{d}"
            assert st.stat().st_mode & 0o777 == 0o700
            for f in ("token", "secrets.json", "device.json"):
                assert (st / f).stat().st_mode & 0o777 == 0o600
    finally:
        srv.stop()
