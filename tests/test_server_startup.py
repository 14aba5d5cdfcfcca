"""``fedfs serve`` start-up: one server per state (lock), a busy port or a method the model
cannot run is refused before the state is written, the admin endpoints refuse such a
combination too, and only devices seen recently are sampled. Real server subprocesses (refusals
before the bind: ``fedfs serve``'s main in this process, on a port the test holds)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from conftest_server import ADMIN, ROOT, free_port, refused_serve, start_server, subprocess_env
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.federation.wire import MODEL_FORMAT, encode_weights

pytestmark = pytest.mark.timeout(120)


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``fedfs serve`` expected to refuse to start (returns once it exits), in a process of its own:
    for refusals that come after the bind (a state another server holds, a stored model). Those
    before it run in this process (:func:`refused_serve`: a subprocess import costs seconds)."""
    cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "serve", "--admin-token", ADMIN, *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def checkpoint_bytes(**cfg) -> bytes:
    config = ModelConfig(backbone="tiny", **cfg).resolved()
    torch.manual_seed(0)
    return encode_weights(FaceNet(config).state_dict(), {"format": MODEL_FORMAT, "model_config": config.to_json(),
                                                         "meta": "{}"})


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("startup") / "server", "--init-backbone", "tiny", "--code-length", "127")
    try:
        yield s
    finally:
        s.stop()


def test_a_second_server_on_the_same_state_is_refused(srv):
    before = sorted(p.name for p in srv.state.rglob("*"))
    r = serve("--state", str(srv.state), "--port", str(free_port()), "--init-backbone", "tiny", "--code-length", "127")
    assert r.returncode == 2, r.stderr
    assert f"state {srv.state} is in use by another fedfs serve (pid {srv.proc.pid})" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in srv.state.rglob("*")) == before
    assert srv.proc.poll() is None and srv.status()["model_version"] == 1      # the first one serves on


def test_a_busy_port_writes_no_state(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = refused_serve("--state", str(tmp_path / "new"), "--init-backbone", "tiny", "--code-length", "127",
                          port=port)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("flags, missing", [
    (["--method", "fedfs"], "proj_dim"),                              # no FedFS projection
    # (no flag: the default method feduv gets a FedUV head of c = 127 — issue 29 — so it starts)
    (["--method", "fedfs+feduv", "--code-length", "127"], "proj_dim"),
    (["--method", "fedfs", "--proj-dim", "32"], "--xi"),             # FedFS starts the backbone from ξ
])
def test_a_method_the_initial_model_cannot_run_is_refused(tmp_path, flags, missing):
    r = refused_serve("--state", str(tmp_path / "new"), "--init-backbone", "tiny", *flags)
    assert r.returncode == 2 and "fedfs serve: error:" in r.stderr and missing in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()


def test_a_method_the_stored_model_cannot_run_is_refused(tmp_path):
    from server_agg.rounds import Coordinator
    from server_agg.store import Layout

    c = Coordinator(Layout(tmp_path / "state"))
    c.install_model(checkpoint_bytes(code_length=127))
    c.close()
    r = serve("--state", str(tmp_path / "state"), "--port", "0", "--method", "fedfs")
    assert r.returncode == 2 and "the state's model v1 has none" in r.stderr, r.stderr
    c = Coordinator(Layout(tmp_path / "state"))
    assert c.policy.method == "feduv" and c.model.version == 1      # nothing was changed


def test_admin_endpoints_refuse_a_method_the_model_cannot_run(srv):
    with srv.admin() as a:
        r = a.put("/v1/admin/config", json={"method": "fedfs"})
        assert r.status_code == 409 and r.json()["error"] == "model_method_mismatch" and "proj_dim" in r.json()["reason"]
        octet = {"Content-Type": "application/octet-stream"}
        fedfs_only = checkpoint_bytes(proj_dim=32)
        r = a.post("/v1/admin/model", content=fedfs_only, headers=octet)
        assert r.status_code == 409 and r.json()["error"] == "model_method_mismatch", r.text
        assert a.get("/v1/admin/config").json()["method"] == "feduv" and srv.status()["model_version"] == 1
        r = a.post("/v1/admin/model", params={"method": "nope"}, content=fedfs_only, headers=octet)
        assert r.status_code == 422
        both = checkpoint_bytes(proj_dim=32, code_length=127)
        r = a.post("/v1/admin/model", params={"method": "fedfs+feduv"}, content=both, headers=octet)
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        assert a.get("/v1/admin/config").json()["method"] == "fedfs+feduv"
        assert a.put("/v1/admin/config", json={"method": "feduv"}).status_code == 200   # the model has both


def test_only_devices_seen_within_the_ttl_are_sampled(srv):
    http = httpx.Client(base_url=srv.url, timeout=30)
    alive, silent = (http.post("/v1/devices").json()["token"] for _ in range(2))
    auth = {"Authorization": f"Bearer {alive}"}
    with srv.admin() as a:
        assert a.put("/v1/admin/config", json={"device_ttl_s": 0.6, "min_participants": 1}).status_code == 200
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:                            # only `alive` keeps polling
            assert http.get("/v1/task", headers=auth).json()["action"] == "wait"
            time.sleep(0.1)
        assert srv.status()["active_devices"] == 1
        opened = a.post("/v1/admin/rounds").json()
        assert opened["sampled"] == 1, opened
        assert http.get("/v1/task", headers=auth).json()["action"] == "train"
        assert http.get("/v1/task", headers={"Authorization": f"Bearer {silent}"}).json()["action"] == "wait"
        a.post(f"/v1/admin/rounds/{opened['round_id']}/close")
        assert a.put("/v1/admin/config", json={"device_ttl_s": None}).status_code == 200
    http.close()


@pytest.mark.parametrize("method, code", [("fedfs+feduv", ["--code-length", "127"]), ("fedfs", [])])
def test_a_proj_dim_that_xi_cannot_train_is_refused(tmp_path, method, code):
    """Issue 12 item 8: with a 64-d ξ, FedFS (concat) needs proj_dim = 32; a server started
    with --proj-dim 64 used to open round 1 and every device died with ``set proj_dim = 32``."""
    xi = tmp_path / "xi.safetensors"
    xi.write_bytes(checkpoint_bytes(embedding_dim=64))
    r = refused_serve("--state", str(tmp_path / "new"), "--method", method, "--init-backbone", "tiny",
                      "--embedding-dim", "64", "--proj-dim", "64", *code, "--xi", str(xi))
    assert r.returncode == 2, r.stderr
    assert "--proj-dim 64 cannot be trained with this ξ" in r.stderr and "give --proj-dim 32" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "new").exists()
    # combine = sum: z = r + q has ξ's size, so 64 is right and the server starts
    s = start_server(tmp_path / "ok", "--method", method, "--init-backbone", "tiny", "--embedding-dim", "64",
                     "--proj-dim", "64", *code, "--xi", str(xi),
                     "--train", '{"objective": {"fedfs": {"combine": "sum"}}}')
    try:
        with s.admin() as a:                  # the admin cannot switch to a combine ξ does not fit either
            r = a.put("/v1/admin/config", json={"train": {}})
            assert r.status_code == 409 and r.json()["error"] == "proj_dim_mismatch", r.text
            assert "needs proj_dim = 32" in r.json()["reason"]
            r = a.post("/v1/admin/model", content=checkpoint_bytes(embedding_dim=64, proj_dim=48, code_length=127)
                       if code else checkpoint_bytes(embedding_dim=64, proj_dim=48),
                       params={"method": method}, headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 409 and r.json()["error"] == "proj_dim_mismatch", r.text
            assert a.get("/v1/models/latest").json()["version"] == 1
    finally:
        s.stop()
    # a restart of that state with the default combine (concat) is refused, naming the state's model
    r = serve("--state", str(tmp_path / "ok"), "--port", "0", "--train", "{}")
    assert r.returncode == 2 and "the state's model v1" in r.stderr and "proj_dim = 32" in r.stderr, r.stderr
