"""The device agents in secure-aggregation rounds over real HTTP: ``fedfs serve
--secure-aggregation`` in a subprocess and three device processes running
:class:`~fedfs_sdk.federation.agent.DeviceAgent` — with the torch runtime, and with the ORT training
artifacts in processes that cannot import torch.

Each device process also writes the plain update its runtime produced to a test folder (a
subclass of the real runtime; the agent's code is unchanged), so the test can check that the
published model is the FedAvg of those updates to the fixed-point bound of docs/privacy.md,
and that none of them left the device: the audit copy of every request body holds no plain
update, and no request went to the plain upload endpoint.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest_server import ROOT, read_safetensors, start_server, subprocess_env, write_images
from fedfs_sdk.federation.secagg.http_device import flatten_update
from no_torch import NO_TORCH

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCALE = 2.0 ** -24
ATOL, RTOL = 0.5 * SCALE * 1.01, SCALE * 1.01
TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 4}
COUNTS = (5, 7, 9)

DEVICE = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.device_runtime import TorchRuntime
from fedfs_sdk.federation.ort_runtime import OrtRuntime
from fedfs_sdk.federation.server_client import ServerClient
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.runtime.preprocess import list_images

art = {artifacts!r}
Base = OrtRuntime if art else TorchRuntime

class Recording(Base):
    # the real runtime; the test keeps a copy of each plain update to check the sum against
    def train(self, task, model, agent):
        u = super().train(task, model, agent)
        Path({record!r}, f"r{{task['round_id']}}.safetensors").write_bytes(u.body)
        return u

from fedfs_sdk.federation.secagg import DevicePolicy
cfg = DeviceConfig(rounds={rounds}, wait_timeout_s=120, artifacts=Path(art) if art else None,
                   secagg=DevicePolicy.honest_but_curious())   # the server runs fedfs-secagg/1 (no --secagg-ca)
events = []
agent = DeviceAgent(ServerClient({url!r}, audit_dir={audit!r}), DeviceState({state!r}),
                    list_images(Path({images!r})), cfg, runtime=Recording(art) if art else Recording("cpu"),
                    on_event=lambda n, f: events.append(n))
report = agent.run()
print("ROUNDS", len(report.rounds), "LOST", report.lost_rounds, "EVENTS", events)
if art:
    assert "torch" not in sys.modules, "torch was imported on the ORT device path"
"""


def run_devices(tmp_path: Path, url: str, rounds: int, artifacts: str | None = None) -> list[str]:
    procs = []
    for d, n in enumerate(COUNTS):
        write_images(tmp_path / f"img{d}", n, seed=70 + d)
        (tmp_path / f"rec{d}").mkdir()
        code = (NO_TORCH if artifacts else "") + DEVICE.format(
            root=str(ROOT), artifacts=artifacts, record=str(tmp_path / f"rec{d}"), rounds=rounds, url=url,
            audit=str(tmp_path / f"audit{d}"), state=str(tmp_path / f"dev{d}"), images=str(tmp_path / f"img{d}"))
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=280)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert f"ROUNDS {rounds} LOST []" in out, out
        assert "secure_round_done" in out
    return outs


def check_rounds(tmp_path: Path, srv, rounds: int, frozen_trunk: bool = False) -> None:
    from fedfs_sdk.training.scope import is_top_key

    with srv.admin() as c:
        for rnd in range(1, rounds + 1):
            info = c.get(f"/v1/rounds/{rnd}").json()
            if frozen_trunk:
                # train.scope = "top": the published trunk is the previous version's bit for bit — not
                # its fixed-point round trip (server_agg/frozen_trunk.py) — and only the top moved
                pub = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)[0]
                prev = read_safetensors(c.get(f"/v1/models/{info['result_version'] - 1}").content)[0]
                trunk = [k for k in pub if not is_top_key(k)]
                assert trunk and all(np.array_equal(pub[k], prev[k]) for k in trunk)
                assert any(not np.array_equal(pub[k], prev[k]) for k in pub if is_top_key(k))
            assert info["state"] == "closed" and info["secure_aggregation"]["survivors"] == 3, info
            ups = [flatten_update((tmp_path / f"rec{d}" / f"r{rnd}.safetensors").read_bytes()) for d in range(3)]
            assert [n for _, n in ups] == list(COUNTS) and info["total_samples"] == sum(COUNTS)
            exact = sum(w * n for w, n in ups) / sum(COUNTS)
            pub = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)[0]
            got = np.concatenate([pub[k].astype(np.float64).ravel() for k in sorted(pub)])
            np.testing.assert_allclose(got, exact, rtol=RTOL, atol=ATOL)
            assert np.abs(got - np.mean([w for w, _ in ups], axis=0)).max() > 1e-6   # weighted, not plain mean
    # nothing a device sent holds its plain update; nothing went to the plain upload endpoint
    for d in range(3):
        index = [json.loads(x) for x in (tmp_path / f"audit{d}" / "index.jsonl").read_text().splitlines()]
        assert not any(e["path"].endswith("/update") for e in index)
        masked = [e for e in index if e["path"].endswith("/secagg/masked-input")]
        assert len(masked) == rounds
        if frozen_trunk:   # only the top's tensors were masked and sent: 8-byte words, the weight word last
            top = sum(a.size for k, a in read_safetensors((tmp_path / f"rec{d}" / "r1.safetensors").read_bytes())[0]
                      .items() if is_top_key(k))
            assert [len((tmp_path / f"audit{d}" / e["file"]).read_bytes()) for e in masked] == [8 * (top + 1)] * rounds
        sent = [(tmp_path / f"audit{d}" / e["file"]).read_bytes() for e in index if e["file"]]
        for rnd in range(1, rounds + 1):
            body = (tmp_path / f"rec{d}" / f"r{rnd}.safetensors").read_bytes()
            w32 = flatten_update(body)[0].astype(np.float32).tobytes()
            for needle in (body[-64:], w32[1000:1064]):
                assert not any(needle in s for s in sent)
        state_files = [p for p in (tmp_path / f"dev{d}").rglob("*") if p.is_file()]
        assert not any(p.name.startswith("pending") for p in state_files)   # settled, not left to resend


def test_torch_devices_run_secure_rounds(tmp_path):
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--method", "feduv",
                       "--rounds", "2", "--min-participants", "3", "--secure-aggregation",
                       "--secagg-phase-timeout", "60", "--train", json.dumps({**TRAIN, "scope": "top"}))
    try:
        run_devices(tmp_path, srv.url, rounds=2)
        check_rounds(tmp_path, srv, 2, frozen_trunk=True)
    finally:
        srv.stop()


def test_ort_devices_without_torch_run_secure_rounds(tmp_path):
    from conftest_export import checkpoints
    from export.pipeline import ExportOptions, run_export

    ck = checkpoints()
    out = tmp_path / "export"
    run_export(ck["global"], out, ExportOptions(formats=("onnx", "ort-training"), methods=("feduv",), train=TRAIN))
    srv = start_server(tmp_path / "server", "--init-model", str(ck["global"]), "--method", "feduv", "--rounds", "1",
                       "--min-participants", "3", "--secure-aggregation", "--secagg-phase-timeout", "60",
                       "--train", json.dumps(TRAIN))
    try:
        outs = run_devices(tmp_path, srv.url, rounds=1, artifacts=str(out))
        assert all("'trained'" in o for o in outs)
        check_rounds(tmp_path, srv, 1)
    finally:
        srv.stop()


def test_device_requiring_secure_aggregation_refuses_a_plain_round(tmp_path):
    """A server without --secure-aggregation offers a plain round; a device configured with
    ``require_secure_aggregation`` trains nothing and sends no update, and says why."""
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.errors import ProtocolError

    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--rounds", "1",
                       "--min-participants", "1")
    try:
        images = write_images(tmp_path / "img", 3, seed=1)
        events: list[tuple[str, dict]] = []
        agent = DeviceAgent(ServerClient(srv.url, audit_dir=tmp_path / "audit"), DeviceState(tmp_path / "dev"), images,
                            DeviceConfig(rounds=1, wait_timeout_s=3, require_secure_aggregation=True),
                            on_event=lambda n, f: events.append((n, f)), sleep=lambda s: __import__("time").sleep(0.2))
        with pytest.raises(ProtocolError, match="no secure-aggregation round"):
            agent.run()
        refused = [f for n, f in events if n == "round_refused"]
        assert len(refused) == 1 and refused[0]["round_id"] == 1
        assert not [n for n, _ in events if n in ("trained", "uploaded", "round_started")]
        index = [json.loads(x) for x in (tmp_path / "audit" / "index.jsonl").read_text().splitlines()]
        assert {e["method"] for e in index} <= {"POST", "GET"} and not any("/update" in e["path"] for e in index)
        assert srv.status()["round"]["accepted"] == 0
    finally:
        srv.stop()


def test_cli_flag_require_secure_aggregation(tmp_path):
    """``fedfs device --require-secure-aggregation`` against a plain server: refuses the round,
    sends no update, stops at its wait timeout with a message."""
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--rounds", "1",
                       "--min-participants", "1")
    try:
        write_images(tmp_path / "img", 3, seed=2)
        r = subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", "device", "--server", srv.url,
                            "--images", str(tmp_path / "img"), "--state", str(tmp_path / "dev"), "--rounds", "1",
                            "--wait-timeout", "3", "--require-secure-aggregation", "--audit-dir", str(tmp_path / "a")],
                           cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "round_refused round_id=1" in r.stderr, r.stderr[-2000:]
        assert "no secure-aggregation round from the server" in r.stderr
        index = [json.loads(x) for x in (tmp_path / "a" / "index.jsonl").read_text().splitlines()]
        assert not any(e["method"] == "PUT" for e in index)
    finally:
        srv.stop()
