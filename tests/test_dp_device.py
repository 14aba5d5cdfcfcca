"""Device-side DP clipping: in a DP round the device clips ``w_c − w`` to the round's ``C``
before encoding its upload (fedfs_sdk.federation.device_runtime.clip_upload, used by both the torch and
the ONNX Runtime runtimes); checked on what real ``fedfs device`` processes sent to a real
server (their --audit-dir copies of the request bodies)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest_server import ROOT, audited_uploads, read_safetensors, start_server, subprocess_env, write_images
from fedfs_sdk.federation.device_runtime import clip_upload, dp_clip_norm
from fedfs_sdk.errors import InputError

pytestmark = pytest.mark.timeout(300)


def test_clip_upload_by_hand():
    ref = {"a": np.zeros(3, np.float32), "i": np.array([1], np.int64)}
    new = {"a": np.array([2.0, 0.0, 0.0], np.float32), "i": np.array([5], np.int64)}
    task = {"dp": {"clip": 0.5, "noise_multiplier": 1.0, "denominator": 4.0, "weight_cap": 1}}
    metrics: dict[str, float] = {}
    out = clip_upload(new, ref, task, metrics)
    np.testing.assert_allclose(out["a"], [0.5, 0.0, 0.0])
    assert out["i"][0] == 5 and metrics["dp_update_norm"] == pytest.approx(2.0)
    assert clip_upload(new, ref, {}, {}) is new and dp_clip_norm({"round_id": 1}) is None   # not a DP round
    with pytest.raises(InputError, match="DP"):
        dp_clip_norm({"dp": {"clip": -1, "noise_multiplier": 1, "denominator": 1}})


def test_torch_devices_clip_before_uploading(tmp_path):
    clip = 0.02
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--method", "feduv",
                       "--rounds", "1", "--min-participants", "2", "--participation", "1.0",
                       "--max-update-norm", str(clip), "--dp-noise-multiplier", "0.5", "--dp-delta", "1e-5",
                       "--train", json.dumps({"lr": 0.1, "local_epochs": 1, "batch_size": 4}))
    try:
        devices = []
        for d in range(2):
            write_images(tmp_path / f"img{d}", 6, seed=d)
            cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "device", "--server", srv.url,
                   "--images", str(tmp_path / f"img{d}"), "--state", str(tmp_path / f"dev{d}"),
                   "--rounds", "1", "--audit-dir", str(tmp_path / f"audit{d}"), "--wait-timeout", "120"]
            devices.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=240)[0] for p in devices]
        for p, out in zip(devices, outs):
            assert p.returncode == 0, out
        with srv.admin() as a:
            w1, _ = read_safetensors(a.get("/v1/models/1").content)
            assert a.get("/v1/models/latest").json()["dp"]["rounds_charged"] == 1
        for d in range(2):
            [(rnd, sent, _)] = audited_uploads(tmp_path / f"audit{d}")
            delta = np.concatenate([(sent[k].astype(np.float64) - w1[k].astype(np.float64)).ravel()
                                    for k in w1 if np.issubdtype(w1[k].dtype, np.floating)])
            # clipped to C on the device: the norm sits at C (a natural update would not), up
            # to the float32 rounding of w + Δ
            assert np.linalg.norm(delta) == pytest.approx(clip, rel=1e-3), np.linalg.norm(delta)
    finally:
        srv.stop()
