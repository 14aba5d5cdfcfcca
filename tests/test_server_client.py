"""Device side: HTTP retries/back-off (mock transport), the device-state directory, and the
agent's handling of lost rounds."""
from __future__ import annotations

import base64
import json
import os
import time

import httpx
import numpy as np
import pytest

from conftest_server import write_images
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient, ServerError
from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.federation.device_state import DeviceKeyError, DeviceState, DeviceStateError
from fedfs_sdk.errors import CodeError, InputError, ProtocolError
from fedfs_sdk.federation.wire import sha256_hex


def client_with(handler, attempts: int = 4) -> tuple[ServerClient, list[float]]:
    sleeps: list[float] = []
    c = ServerClient("http://server.test", token="d1.x", transport=httpx.MockTransport(handler),
                     retry=RetryPolicy(attempts=attempts, base_delay_s=0.1, max_delay_s=1.0), sleep=sleeps.append)
    return c, sleeps


def test_retries_5xx_and_connection_errors_with_growing_backoff():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"error": "busy", "reason": "try later"})
        if len(calls) == 3:
            return httpx.Response(500, text="oops")
        return httpx.Response(200, json={"action": "wait", "retry_after": 1})

    c, sleeps = client_with(handler)
    assert c.task()["action"] == "wait"
    assert len(calls) == 4 and len(sleeps) == 3
    # base·2^i with jitter in [50 %, 100 %]
    for i, s in enumerate(sleeps):
        assert 0.05 * 2 ** i <= s <= 0.1 * 2 ** i + 1e-9


def test_honours_retry_after_and_gives_up():
    def handler(request):
        return httpx.Response(429, headers={"Retry-After": "0.7"}, json={"error": "slow_down", "reason": "rate"})

    c, sleeps = client_with(handler, attempts=3)
    with pytest.raises(ServerError, match="429 slow_down") as e:
        c.task()
    assert e.value.status == 429 and sleeps == [0.7, 0.7]


def test_never_retries_4xx():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(410, json={"error": "round_closed", "reason": "round 3 is closed"})

    c, sleeps = client_with(handler)
    with pytest.raises(ServerError) as e:
        c.upload(3, b"body")
    assert (e.value.status, e.value.code, e.value.reason) == (410, "round_closed", "round 3 is closed")
    assert calls == [1] and sleeps == []


def test_unreachable_server_is_a_protocol_error():
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    c, sleeps = client_with(handler, attempts=2)
    with pytest.raises(ProtocolError, match="unreachable after 2 tries"):
        c.health()


def test_receipt_and_download_hashes_are_checked():
    def handler(request):
        if request.method == "PUT":
            return httpx.Response(200, json={"sha256": "0" * 64})
        return httpx.Response(200, content=b"model bytes")

    c, _ = client_with(handler)
    with pytest.raises(ProtocolError, match="receipt"):
        c.upload(1, b"body")
    assert c.download_model(1, sha256_hex(b"model bytes")) == b"model bytes"
    with pytest.raises(ProtocolError, match="SHA-256"):
        c.download_model(1, "f" * 64)


def test_upload_sends_bearer_and_octet_stream():
    seen = {}

    def handler(request):
        seen.update(auth=request.headers["authorization"], ctype=request.headers["content-type"],
                    body=request.read())
        return httpx.Response(200, json={"sha256": sha256_hex(b"abc"), "duplicate": False})

    c, _ = client_with(handler)
    c.upload(2, b"abc")
    assert seen == {"auth": "Bearer d1.x", "ctype": "application/octet-stream", "body": b"abc"}


def test_audit_dir_records_every_body(tmp_path):
    def handler(request):
        return httpx.Response(200, json={"sha256": sha256_hex(b"payload")})

    c = ServerClient("http://s.test", token="d.x", transport=httpx.MockTransport(handler), audit_dir=tmp_path)
    c.upload(1, b"payload")
    index = [json.loads(x) for x in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert index[0]["method"] == "PUT" and (tmp_path / index[0]["file"]).read_bytes() == b"payload"
    assert "d.x" not in (tmp_path / "index.jsonl").read_text()      # no headers, no token


# ---- device state ----------------------------------------------------------------------

def test_state_files_are_private_and_atomic(tmp_path):
    with DeviceState(tmp_path / "s") as st:
        st.save_registration("http://h:1", "dabc", "dabc.secret", 123)
        v = st.codeword(127)
        assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
        for f in os.listdir(tmp_path / "s"):
            assert (tmp_path / "s" / f).stat().st_mode & 0o777 == 0o600, f
        assert not [f for f in os.listdir(tmp_path / "s") if f.endswith(".tmp")]
        assert st.token == "dabc.secret" and st.info.base_vector == 123
        r = st.r_bits()
        assert np.array_equal(make_codeword(123, 127, r_bits=r)[0], v)
        assert np.array_equal(st.codeword(127), v)                    # persisted, not redrawn
        with pytest.raises(CodeError, match="cannot change"):
            st.codeword(255)
    with DeviceState(tmp_path / "s") as st:                            # reopened: same secrets
        assert np.array_equal(st.load_codeword(), v)


def test_state_is_locked_and_corruption_is_detected(tmp_path):
    st = DeviceState(tmp_path / "s")
    with pytest.raises(DeviceStateError, match="in use"):
        DeviceState(tmp_path / "s")
    st.save_registration("http://h:1", "dabc", "dabc.secret", 5)
    v = st.codeword(127)
    r = "".join(map(str, st.r_bits()))
    enc = json.loads((tmp_path / "s" / "secrets.json").read_text())
    ct = bytearray(base64.b64decode(enc["ciphertext"]))
    ct[0] ^= 1                                                          # a flipped ciphertext bit
    (tmp_path / "s" / "secrets.json").write_text(json.dumps({**enc, "ciphertext": base64.b64encode(ct).decode()}))
    with pytest.raises(DeviceStateError, match="cannot be decrypted"):
        st.codeword(127)
    # An old plaintext secrets.json whose r_u no longer matches the stored codeword.
    bad_r = ("1" if r[0] == "0" else "0") + r[1:]
    plain = {"code_length": 127, "r_bits": bad_r, "codeword": np.packbits(v < 0).tobytes().hex()}
    (tmp_path / "s" / "secrets.json").write_text(json.dumps(plain))
    with pytest.raises(DeviceStateError, match="corrupt"):
        st.codeword(127)
    st.close()


def test_secrets_are_encrypted_under_the_device_key(tmp_path):
    app_key = os.urandom(32)
    with DeviceState(tmp_path / "s", key=app_key) as st:
        st.save_registration("http://h:1", "dabc", "dabc.secret", 5)
        v = st.codeword(127)
        r = "".join(map(str, st.r_bits()))
    raw = (tmp_path / "s" / "secrets.json").read_text()
    hexcw = np.packbits(v < 0).tobytes().hex()
    assert r not in raw and hexcw not in raw and hexcw.upper() not in raw
    assert json.loads(raw)["format"] == "fedfs-device-secrets/1"
    assert not (tmp_path / "s" / "enrollment.key").exists()           # the app's key was used
    assert (tmp_path / "s" / "secrets.json").stat().st_mode & 0o777 == 0o600
    with DeviceState(tmp_path / "s", key=os.urandom(32)) as st:
        with pytest.raises(DeviceKeyError, match="wrong device key"):
            st.load_codeword()
    with DeviceState(tmp_path / "s") as st:                            # no key: STATE/enrollment.key, not it
        with pytest.raises(DeviceKeyError):
            st.load_codeword()
    with DeviceState(tmp_path / "s", read_only=True, key=app_key) as st:
        assert np.array_equal(st.load_codeword(), v)
    # The ciphertext is bound to the device id: the same file under another device id fails.
    with DeviceState(tmp_path / "s", key=app_key) as st:
        st.save_registration("http://h:1", "dother", "dother.secret", 5)
        with pytest.raises(DeviceKeyError):
            st.load_codeword()

    # An old plaintext secrets.json is encrypted on first read (same codeword, new file).
    with DeviceState(tmp_path / "old") as st:
        st.save_registration("http://h:1", "dold", "dold.secret", 9)
        v, r_bits = make_codeword(9, 127)
        plain = {"code_length": 127, "r_bits": "".join(str(int(b)) for b in r_bits),
                 "codeword": np.packbits(v < 0).tobytes().hex()}
        (tmp_path / "old" / "secrets.json").write_text(json.dumps(plain))
        assert np.array_equal(st.load_codeword(), v)
        raw = (tmp_path / "old" / "secrets.json").read_text()
        assert plain["r_bits"] not in raw and plain["codeword"] not in raw
        assert np.array_equal(st.load_codeword(), v) and np.array_equal(st.r_bits(), r_bits)


def test_state_folder_is_only_created_or_reused_never_taken_over(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir(mode=0o755)
    os.chmod(foreign, 0o755)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DeviceStateError, match="not a fedfs device state"):
        DeviceState(foreign)
    assert foreign.stat().st_mode & 0o777 == 0o755 and sorted(os.listdir(foreign)) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    os.chmod(empty, 0o755)
    with DeviceState(empty):                                           # an empty folder is used as it is
        pass
    assert empty.stat().st_mode & 0o777 == 0o755
    with DeviceState(tmp_path / "new" / "state"):
        pass
    assert (tmp_path / "new" / "state").stat().st_mode & 0o777 == 0o700
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DeviceStateError, match="not a folder"):
        DeviceState(tmp_path / "afile")
    with pytest.raises(DeviceStateError, match="cannot use device state"):
        DeviceState(tmp_path / "afile" / "sub")                        # OSError → DeviceStateError
    with pytest.raises(DeviceStateError, match="no device state"):
        DeviceState(tmp_path / "typo", read_only=True)
    assert not (tmp_path / "typo").exists()
    with pytest.raises(DeviceStateError, match="not a fedfs device state"):
        DeviceState(empty, read_only=True)
    # A registration interrupted after the token (no device.json yet) is still a device state.
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "token").write_text("d.t\n")
    with DeviceState(tmp_path / "half"):
        pass


def test_two_different_draws_of_r_u_differ(tmp_path):
    vs = []
    for i in range(2):
        with DeviceState(tmp_path / f"s{i}") as st:
            st.save_registration("http://h:1", f"d{i}", f"d{i}.t", 77)   # same b_u on purpose
            st.codeword(127)
            vs.append(st.r_bits())
    assert vs[0].shape == (32,) and not np.array_equal(*vs)                                       # r_u from the OS CSPRNG


# ---- agent -----------------------------------------------------------------------------

class _StubClient:
    base_url = "http://stub"

    def __init__(self, tasks):
        self.tasks, self.token = list(tasks), None

    def register(self, _):
        return {"device_id": "dstub", "token": "dstub.t", "base_vector": 9}

    def task(self):
        return self.tasks.pop(0)


def test_agent_waits_skips_lost_rounds_and_stops_when_done(tmp_path, monkeypatch):
    stub = _StubClient([{"action": "wait", "retry_after": 0.25}, {"action": "train", "round_id": 4},
                        {"action": "train", "round_id": 5}, {"action": "done", "model_version": 6}])
    events = []
    images = [str(p) for p in write_images(tmp_path / "img", 2, seed=0)]
    with DeviceState(tmp_path / "s") as st:
        agent = DeviceAgent(stub, st, images, DeviceConfig(rounds=0, require_secure_aggregation=False),
                            on_event=lambda n, f: events.append(n),
                            sleep=lambda s: events.append(f"sleep {s}"))

        def fake_round(task):
            if task["round_id"] == 4:
                raise ServerError(410, "deadline_passed", "late", "PUT", "/x")
            return {"round_id": task["round_id"]}

        monkeypatch.setattr(agent, "run_round", fake_round)
        report = agent.run()
        assert [r["round_id"] for r in report.rounds] == [5]
        assert report.lost_rounds == [{"round_id": 4, "code": "deadline_passed", "reason": "late"}]
        assert report.finished_by_server and stub.token == "dstub.t"
        assert events[:2] == ["registered", "sleep 0.25"]

        stub.tasks = [{"action": "train", "round_id": 6}]
        monkeypatch.setattr(agent, "run_round", lambda t: (_ for _ in ()).throw(
            ServerError(401, "invalid_token", "bad", "PUT", "/x")))
        with pytest.raises(ServerError, match="invalid_token"):          # not a lost round: stop
            agent.run()


def test_agent_refuses_a_state_of_another_server(tmp_path):
    with DeviceState(tmp_path / "s") as st:
        st.save_registration("http://other:1", "dabc", "dabc.t", 1)
        with pytest.raises(DeviceStateError, match="belongs to server"):
            DeviceAgent(_StubClient([]), st, ["x.png"]).ensure_registered()


def test_retry_after_hint_must_be_a_finite_non_negative_number():
    import httpx

    from fedfs_sdk.federation.server_client import _retry_after

    def hint(v):
        return _retry_after(httpx.Response(503, headers={"Retry-After": v}))

    assert hint("2.5") == 2.5 and hint("0") == 0.0
    assert hint("nan") is None and hint("inf") is None and hint("-1") is None and hint("soon") is None


# ---- configuration mistakes fail at once, with a clear error ------------------------------

@pytest.mark.parametrize("url", ["127.0.0.1:8080", "localhost:8080", "ftp://h:21", "http://", "http://h:70000",
                                 "http://h:port", "htp://h:1", "", "http://h:1/?x=1"])
def test_server_url_is_checked_when_the_client_is_made(url):
    with pytest.raises(InputError, match="server URL"):
        ServerClient(url)


def test_good_server_urls_are_accepted():
    for url in ("http://127.0.0.1:8080/", "https://fedfs.example.org", "http://[::1]:9000"):
        with ServerClient(url) as c:
            assert not c.base_url.endswith("/")


def test_a_server_that_is_not_fedfs_fails_at_once_without_retries():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    calls: list[tuple[str, int]] = []

    class NotFedfs(BaseHTTPRequestHandler):                  # POST: http.server's own 501 HTML page
        def do_GET(self):
            self.send_error(404)

        def send_error(self, code, message=None, explain=None):
            calls.append((self.command, code))
            super().send_error(code, message, explain)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFedfs)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sleeps: list[float] = []
    try:
        with ServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", sleep=sleeps.append) as c:
            with pytest.raises(ServerError) as e:
                c.register()
            msg = str(e.value)
            assert e.value.status == 501 and "Unsupported method" in msg and "fedfs server?" in msg
            assert "<" not in msg and calls == [("POST", 501)] and sleeps == []
            c.token = "d1.x"
            with pytest.raises(ServerError) as e:
                c.task()
            assert e.value.status == 404 and "Not Found" in str(e.value) and "fedfs server?" in str(e.value)
            assert "<" not in str(e.value) and sleeps == []
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_505_and_unsupported_protocols_are_not_retried():
    def handler(request):
        return httpx.Response(505, json={"error": "http_version", "reason": "no"})

    c, sleeps = client_with(handler)
    with pytest.raises(ServerError, match="505"):
        c.task()
    assert sleeps == []
    calls = []

    def unsupported(request):
        calls.append(1)
        raise httpx.UnsupportedProtocol("Request URL has an unsupported protocol 'gopher://'", request=request)

    c, sleeps = client_with(unsupported)
    with pytest.raises(InputError, match="unsupported protocol"):
        c.task()
    assert calls == [1] and sleeps == []


def test_registration_is_retried_only_when_the_request_surely_did_not_arrive():
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)       # never reached the server: retried
        if len(calls) == 2:
            return httpx.Response(503, json={"error": "busy", "reason": "starting"})   # refused unprocessed: retried
        raise httpx.ReadTimeout("timed out", request=request)           # may have registered: not retried

    c, sleeps = client_with(handler)
    with pytest.raises(ProtocolError, match="orphan"):
        c.register()
    assert len(calls) == 3 and len(sleeps) == 2

    def handler500(request):
        calls.append(1)
        return httpx.Response(500, json={"error": "internal", "reason": "boom"})

    calls.clear()
    c, sleeps = client_with(handler500)
    with pytest.raises(ServerError, match="500"):
        c.register()
    assert len(calls) == 1 and sleeps == []
    calls.clear()
    with pytest.raises(ServerError, match="500"):                     # other requests still retry 5xx
        c.task()
    assert len(calls) == 4


def test_audit_dir_is_private(tmp_path):
    def handler(request):
        return httpx.Response(200, json={"sha256": sha256_hex(b"payload")})

    old = os.umask(0o022)
    try:
        c = ServerClient("http://s.test", token="d.x", transport=httpx.MockTransport(handler),
                         audit_dir=tmp_path / "audit")
        c.upload(1, b"payload")
        c.upload(1, b"payload")
    finally:
        os.umask(old)
    assert (tmp_path / "audit").stat().st_mode & 0o777 == 0o700
    files = sorted(os.listdir(tmp_path / "audit"))
    assert files == ["00001.bin", "00002.bin", "index.jsonl"]
    for f in files:
        assert (tmp_path / "audit" / f).stat().st_mode & 0o777 == 0o600, f


def test_device_config_is_validated():
    for bad in ({"rounds": -1}, {"rounds": 1.5}, {"wait_timeout_s": 0}, {"wait_timeout_s": float("nan")}, {"q": 1.0},
                {"enrollment_key": b"short"}):
        with pytest.raises(InputError):
            DeviceConfig(**bad)


# ---- the local-training seed -------------------------------------------------------------

def test_local_training_is_seeded_per_round_and_deterministic(tmp_path):
    import torch

    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.federation.device_runtime import TorchRuntime, round_seed
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    assert round_seed(0, 1) == round_seed(0, 1) != round_seed(0, 2) and round_seed(1, 1) != round_seed(0, 1)
    cfg = ModelConfig(backbone="tiny", code_length=127)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "g.safetensors", FaceNet(cfg), cfg)
    model = (tmp_path / "g.safetensors").read_bytes()
    images = [str(p) for p in write_images(tmp_path / "img", 6, seed=3)]

    def task(round_id):
        return {"round_id": round_id, "model_version": 1, "method": "feduv", "neg_codewords": 0,
                "model_config": json.loads(cfg.resolved().to_json()),
                "train": {"lr": 0.1, "local_epochs": 1, "batch_size": 2, "seed": 7}}

    with DeviceState(tmp_path / "s") as st:
        st.save_registration("http://stub", "dstub", "dstub.t", 9)
        agent = DeviceAgent(_StubClient([]), st, images)
        rt = TorchRuntime()
        w1 = [read_weights(rt.train(task(1), model, agent).body) for _ in range(2)]
        w2 = read_weights(rt.train(task(2), model, agent).body)
    # same round, same inputs, same code path in one process (deterministic CPU ops): bit-equal
    assert all(np.array_equal(w1[0][k], w1[1][k]) for k in w1[0])
    assert any(not np.array_equal(w1[0][k], w2[k]) for k in w2)        # another round: another batch order


def read_weights(body: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(body)


# ---- against a real server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def fedfs_server(tmp_path_factory):
    """`fedfs serve`: tiny FedFS model with a served ξ; rounds are opened by the admin."""
    import torch

    from conftest_server import start_server
    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    d = tmp_path_factory.mktemp("fedfs-server")
    xi_cfg = ModelConfig(backbone="tiny")
    torch.manual_seed(1)
    save_checkpoint(d / "xi.safetensors", FaceNet(xi_cfg), xi_cfg)
    srv = start_server(d / "server", "--init-backbone", "tiny", "--proj-dim", "32", "--xi", str(d / "xi.safetensors"),
                       "--method", "fedfs", "--min-participants", "1",
                       "--train", json.dumps({"local_epochs": 1, "batch_size": 4}))
    yield srv
    srv.stop()


class Crash(BaseException):
    """The process dies here (nothing after it runs)."""


def _sha(path) -> str | None:
    return sha256_hex(path.read_bytes()) if path.exists() else None


def test_theta_c_advances_only_when_the_server_accepted_the_upload(fedfs_server, tmp_path):
    srv = fedfs_server
    images = [str(p) for p in write_images(tmp_path / "me", 6, seed=5)]
    personal = tmp_path / "dev" / "personal.safetensors"
    admin = srv.admin()

    def open_round() -> int:
        r = admin.post("/v1/admin/rounds")
        assert r.status_code == 201, r.text
        return r.json()["round_id"]

    def device(upload_wrapper=None):
        st = DeviceState(tmp_path / "dev")
        cl = ServerClient(srv.url, retry=RetryPolicy(attempts=2, base_delay_s=0.05))
        if upload_wrapper is not None:
            cl.upload = upload_wrapper(cl.upload)
        return st, cl, DeviceAgent(cl, st, images, DeviceConfig(rounds=1, wait_timeout_s=30))

    def crash(after_sending: bool):
        """An upload wrapper: the process dies before sending, or after the server accepted."""
        def wrap(upload):
            def wrapped(round_id, body):
                if after_sending:
                    upload(round_id, body)
                raise Crash()
            return wrapped
        return wrap

    def crashed_round(wrapper) -> dict | None:
        """One round that dies in the upload; returns what the device left pending."""
        st, cl, agent = device(wrapper)
        with st, cl:
            agent.ensure_registered()
            with pytest.raises(Crash):
                agent.run_round(cl.task())
            return st.pending()

    def restart():
        """A fresh device process on the same state: its report and recorded round ids."""
        st, cl, agent = device()
        with st, cl:
            return agent.run(), [r["round_id"] for r in st.info.rounds]

    st, cl, agent = device()
    with st, cl:
        agent.check_inputs()
        agent.ensure_registered()
        assert cl.task()["action"] == "wait"          # its first poll: only then is it sampled
        r1 = open_round()
        receipt = agent.run_round(cl.task())
        assert receipt["round_id"] == r1 and not receipt["duplicate"]
    theta_1 = _sha(personal)
    assert theta_1 is not None

    # 1. The server refuses the upload (the round closed meanwhile → 410): θ_c does not advance.
    r2 = open_round()

    def close_first(upload):
        def wrapped(round_id, body):
            assert admin.post(f"/v1/admin/rounds/{round_id}/close").status_code == 200
            return upload(round_id, body)
        return wrapped

    st, cl, agent = device(close_first)
    with st, cl:
        agent.ensure_registered()
        with pytest.raises(ServerError) as e:
            agent.run_round(cl.task())
        assert e.value.status == 410 and e.value.code in ("round_closed", "round_failed")
        assert st.pending() is None
    assert _sha(personal) == theta_1
    assert not [f for f in os.listdir(tmp_path / "dev") if f.startswith("pending")]

    # 2. The device dies before the upload: θ_c unchanged; the restart uploads the pending round.
    r3 = open_round()

    staged = crashed_round(crash(after_sending=False))
    assert staged["round_id"] == r3
    assert _sha(personal) == theta_1
    theta_3 = _sha(tmp_path / "dev" / "pending.personal.safetensors")
    assert theta_3 not in (None, theta_1)
    report, _ = restart()                             # restart: the pending round is settled first
    assert [r["round_id"] for r in report.rounds] == [r3] and report.rounds[0]["duplicate"] is False
    assert _sha(personal) == theta_3
    assert srv.status()["model_version"] == 3          # round 3 closed with this device's update

    # 3. The server accepted, the device died before recording it: the restart learns it (duplicate receipt).
    r4 = open_round()

    crashed_round(crash(after_sending=True))
    assert _sha(personal) == theta_3
    theta_4 = _sha(tmp_path / "dev" / "pending.personal.safetensors")
    report, recorded = restart()
    assert [r["round_id"] for r in report.rounds] == [r4] and report.rounds[0]["duplicate"] is True
    assert _sha(personal) == theta_4 and recorded == [r1, r3, r4]
    admin.close()


def test_bad_local_inputs_fail_before_the_device_registers(fedfs_server, tmp_path):
    import subprocess
    import sys

    from conftest_server import ROOT, cli_in_process, subprocess_env

    before = fedfs_server.status()["devices"]
    write_images(tmp_path / "img", 3, seed=1)
    (tmp_path / "img" / "broken.png").write_bytes(b"not an image")
    base = [sys.executable, "-m", "fedfs_sdk.cli.main", "device", "--server", fedfs_server.url,
            "--state", str(tmp_path / "state"), "--wait-timeout", "5"]
    cases = [(["--images", str(tmp_path / "img")], "broken.png"),
             (["--images", str(tmp_path / "me"), "--xi", str(tmp_path / "no-xi.safetensors")], "no-xi.safetensors"),
             (["--images", str(tmp_path / "me"), "--artifacts", str(tmp_path)], "ort-training"),
             (["--images", str(tmp_path / "me"), "--rounds", "-1"], "--rounds must be ≥ 0"),
             (["--images", str(tmp_path / "me"), "--server", "127.0.0.1:8080"], "scheme must be http")]
    write_images(tmp_path / "me", 3, seed=2)
    for i, (args, words) in enumerate(cases):
        if i == 0:     # `fedfs device` as a user runs it; the other refusals in this process (seconds each)
            r = subprocess.run(base + args, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                               timeout=120)
        else:
            r = cli_in_process(*base[3:], *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "state").exists(), args
    assert fedfs_server.status()["devices"] == before


def test_a_state_the_server_no_longer_knows_gets_a_hint(fedfs_server, tmp_path):
    images = [str(p) for p in write_images(tmp_path / "me", 3, seed=4)]
    with DeviceState(tmp_path / "dev") as st, ServerClient(fedfs_server.url) as cl:
        st.save_registration(fedfs_server.url, "d0123456789abcdef", "d0123456789abcdef.secret", 77)   # a reset server
        with pytest.raises(ServerError) as e:
            DeviceAgent(cl, st, images, DeviceConfig(rounds=1)).run()
    assert e.value.status == 401 and e.value.code == "unknown_device"
    assert "no longer knows this device" in str(e.value) and "new --state" in str(e.value)


@pytest.mark.timeout(180)
def test_device_waits_for_a_server_that_comes_up_late(tmp_path):
    import threading

    from conftest_server import free_port, start_server

    port = free_port()
    images = [str(p) for p in write_images(tmp_path / "me", 4, seed=6)]
    events: list[str] = []
    result: dict = {}

    def device():
        try:
            with DeviceState(tmp_path / "dev") as st, \
                    ServerClient(f"http://127.0.0.1:{port}", retry=RetryPolicy(attempts=2, base_delay_s=0.05)) as cl:
                result["report"] = DeviceAgent(cl, st, images, DeviceConfig(rounds=1, wait_timeout_s=90),
                                               on_event=lambda n, f: events.append(n)).run()
        except BaseException as e:   # noqa: BLE001 - reported by the test thread
            result["error"] = e

    t = threading.Thread(target=device, daemon=True)
    t.start()
    time.sleep(1.5)                                     # the device finds no server and keeps retrying
    assert t.is_alive() and "server_unreachable" in events
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--method", "feduv",
                       "--rounds", "1", "--min-participants", "1", "--train", json.dumps({"local_epochs": 1}),
                       port=port)
    try:
        t.join(120)
        assert not t.is_alive() and "error" not in result, result.get("error")
        assert len(result["report"].rounds) == 1 and srv.status()["rounds_completed"] == 1
    finally:
        srv.stop()


def test_device_gives_up_after_the_wait_timeout(tmp_path):
    from conftest_server import free_port

    images = [str(p) for p in write_images(tmp_path / "me", 2, seed=6)]
    clock = [0.0]

    def sleep(s):
        clock[0] += s

    with DeviceState(tmp_path / "dev") as st, \
            ServerClient(f"http://127.0.0.1:{free_port()}", retry=RetryPolicy(attempts=1), sleep=sleep) as cl:
        agent = DeviceAgent(cl, st, images, DeviceConfig(rounds=1, wait_timeout_s=5), sleep=sleep,
                            clock=lambda: clock[0])
        with pytest.raises(ProtocolError, match="unreachable or failing for 5 s"):
            agent.run()
    assert st.info is None                                 # never registered
