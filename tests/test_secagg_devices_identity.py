"""Real device processes in authenticated secure rounds over TLS: ``fedfs serve --secure-aggregation
--secagg-ca ca.pub --tls-cert … --tls-key …`` and five :class:`DeviceAgent` processes with
certified identities (``fedfs ca request`` / ``fedfs ca sign``), the CA and the server's
self-signed certificate pinned — with the torch runtime, and with the ORT training artifacts in
processes that cannot import torch. One device drops (n − t = 5 − 4): the torch one right
after its masked input (it never signs the consistency check), the ORT one after signing (it
never unmasks); the round still publishes the FedAvg of all five updates.

Each process writes the plain update its runtime produced to a test folder (a subclass of the
real runtime), so the test checks the published model against them; the audit copies of
every request body show that no plain update and no identity private key left a device.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest_server import ROOT, read_safetensors, self_signed_cert, start_server, subprocess_env, write_images
from fedfs_sdk.cli.main import main as fedfs
from fedfs_sdk.federation.secagg.http_device import flatten_update
from no_torch import NO_TORCH

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCALE = 2.0 ** -24
ATOL, RTOL = 0.5 * SCALE * 1.01, SCALE * 1.01
TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 4}
COUNTS = (5, 7, 9, 6, 8)

DEVICE = """
import os
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.device_runtime import TorchRuntime
from fedfs_sdk.federation.ort_runtime import OrtRuntime
from fedfs_sdk.federation.server_client import ServerClient
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.federation.secagg import CaPublicKey, DevicePolicy
from fedfs_sdk.federation.secagg import http_device
from fedfs_sdk.runtime.preprocess import list_images

art, drop = {artifacts!r}, {drop!r}
Base = OrtRuntime if art else TorchRuntime

class Recording(Base):
    # the real runtime; the test keeps a copy of each plain update to check the sum against
    def train(self, task, model, agent):
        u = super().train(task, model, agent)
        Path({record!r}, f"r{{task['round_id']}}.safetensors").write_bytes(u.body)
        return u

if drop == "consistency":          # this device dies after signing the survivor set
    signed = http_device.SecAggSession.consistency
    def consistency(self):
        out = signed(self)
        if out is not None:
            os._exit(0)
        return out
    http_device.SecAggSession.consistency = consistency

def on_event(name, fields):
    print("EVENT", name, fields, flush=True)
    if drop == "masked" and name == "uploaded":      # dies once its masked input is accepted
        os._exit(0)

cfg = DeviceConfig(rounds=1, wait_timeout_s=120, artifacts=Path(art) if art else None,
                   secagg=DevicePolicy(ca=CaPublicKey.load({ca!r})), identity_certificate=Path({cert!r}))
agent = DeviceAgent(ServerClient({url!r}, audit_dir={audit!r}, tls_ca={tls!r}), DeviceState({state!r}),
                    list_images(Path({images!r})), cfg, runtime=Recording(art) if art else Recording("cpu"),
                    on_event=on_event)
report = agent.run()
print("ROUNDS", len(report.rounds), "LOST", report.lost_rounds)
if art:
    assert "torch" not in sys.modules, "torch was imported on the ORT device path"
"""


def _run(tmp_path: Path, server_args: tuple[str, ...], artifacts: str | None, drop: str) -> None:
    assert fedfs(["ca", "init", "--dir", str(tmp_path / "ca")]) == 0
    tls = self_signed_cert(tmp_path / "tls")
    srv = start_server(tmp_path / "server", *server_args, "--rounds", "1", "--min-participants", str(len(COUNTS)),
                       "--secure-aggregation", "--secagg-ca", str(tmp_path / "ca" / "ca.pub"),
                       "--secagg-phase-timeout", "12", "--round-timeout", "120", "--train", json.dumps(TRAIN),
                       tls=tls)
    procs = []
    try:
        for d, n in enumerate(COUNTS):
            state, req, cert = tmp_path / f"dev{d}", tmp_path / f"req{d}.json", tmp_path / f"cert{d}.json"
            assert fedfs(["ca", "request", "--state", str(state), "--out", str(req)]) == 0
            assert fedfs(["ca", "sign", "--ca", str(tmp_path / "ca"), "--request", str(req), "--out", str(cert)]) == 0
            write_images(tmp_path / f"img{d}", n, seed=90 + d)
            (tmp_path / f"rec{d}").mkdir()
            code = (NO_TORCH if artifacts else "") + DEVICE.format(
                root=str(ROOT), artifacts=artifacts, drop=drop if d == len(COUNTS) - 1 else None,
                record=str(tmp_path / f"rec{d}"), ca=str(tmp_path / "ca" / "ca.pub"), cert=str(cert),
                url=srv.url, audit=str(tmp_path / f"audit{d}"), tls=str(tls[0]), state=str(state),
                images=str(tmp_path / f"img{d}"))
            with open(tmp_path / f"out{d}.txt", "w") as f:
                procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                                              stdout=f, stderr=subprocess.STDOUT, text=True))
        for p in procs:
            p.wait(timeout=240)
        outs = [(tmp_path / f"out{d}.txt").read_text() for d in range(len(COUNTS))]
        for d, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, out
            if d < len(COUNTS) - 1:
                assert "ROUNDS 1 LOST []" in out and "secure_round_done" in out, out
        with srv.admin() as c:
            info = c.get("/v1/rounds/1").json()
            assert info["state"] == "closed", info
            sa = info["secure_aggregation"]
            assert sa["protocol"] == "fedfs-secagg/2" and sa["threshold"] == 4 and sa["survivors"] == len(COUNTS)
            assert sa["dropped"].get("consistency" if drop == "masked" else "unmask") == 1, sa
            pub = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)[0]
        ups = [flatten_update((tmp_path / f"rec{d}" / "r1.safetensors").read_bytes()) for d in range(len(COUNTS))]
        assert [n for _, n in ups] == list(COUNTS) and info["total_samples"] == sum(COUNTS)
        got = np.concatenate([pub[k].astype(np.float64).ravel() for k in sorted(pub)])
        np.testing.assert_allclose(got, sum(w * n for w, n in ups) / sum(COUNTS), rtol=RTOL, atol=ATOL)
        server_files = [p.read_bytes() for p in (tmp_path / "server").rglob("*") if p.is_file()]
        for d in range(len(COUNTS)):
            key_pem = (tmp_path / f"dev{d}" / "identity.key").read_bytes()
            assert (tmp_path / f"dev{d}" / "identity.key").stat().st_mode & 0o777 == 0o600
            from cryptography.hazmat.primitives import serialization

            raw = serialization.load_pem_private_key(key_pem, None).private_bytes_raw()
            index = [json.loads(x) for x in (tmp_path / f"audit{d}" / "index.jsonl").read_text().splitlines()]
            assert not any(e["path"].endswith("/update") for e in index)
            signed = d < len(COUNTS) - 1 or drop == "consistency"
            assert any(e["path"].endswith("/secagg/consistency") for e in index) == signed
            sent = [(tmp_path / f"audit{d}" / e["file"]).read_bytes() for e in index if e["file"]]
            w32 = ups[d][0].astype(np.float32).tobytes()
            for needle in (w32[1000:1064], raw, base64.b64encode(raw), key_pem[30:90]):
                assert not any(needle in s for s in sent) and not any(needle in s for s in server_files)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        srv.stop()


def test_torch_devices_run_an_authenticated_round_over_tls_with_a_dropout(tmp_path):
    _run(tmp_path, ("--init-backbone", "tiny", "--code-length", "127", "--method", "feduv"), None, "masked")


def test_ort_devices_without_torch_run_an_authenticated_round_over_tls_with_a_dropout(tmp_path):
    from conftest_export import checkpoints
    from export.pipeline import ExportOptions, run_export

    ck = checkpoints()
    out = tmp_path / "export"
    run_export(ck["global"], out, ExportOptions(formats=("onnx", "ort-training"), methods=("feduv",), train=TRAIN))
    _run(tmp_path, ("--init-model", str(ck["global"]), "--method", "feduv"), str(out), "consistency")
