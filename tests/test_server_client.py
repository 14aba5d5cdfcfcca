"""Device side: HTTP retries/back-off (mock transport), the device-state directory, and the
agent's handling of lost rounds."""
from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from fedfs_sdk.client import DeviceAgent, DeviceConfig, RetryPolicy, ServerClient, ServerError
from fedfs_sdk.codes import make_codeword
from fedfs_sdk.device_state import DeviceState, DeviceStateError
from fedfs_sdk.errors import CodeError, ProtocolError
from fedfs_sdk.wire import sha256_hex


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
    st.codeword(127)
    s = json.loads((tmp_path / "s" / "secrets.json").read_text())
    s["r_bits"] = ("1" if s["r_bits"][0] == "0" else "0") + s["r_bits"][1:]
    (tmp_path / "s" / "secrets.json").write_text(json.dumps(s))
    with pytest.raises(DeviceStateError, match="corrupt"):
        st.codeword(127)
    st.close()


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
    with DeviceState(tmp_path / "s") as st:
        agent = DeviceAgent(stub, st, ["img.png"], DeviceConfig(rounds=0), on_event=lambda n, f: events.append(n),
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

    from fedfs_sdk.client import _retry_after

    def hint(v):
        return _retry_after(httpx.Response(503, headers={"Retry-After": v}))

    assert hint("2.5") == 2.5 and hint("0") == 0.0
    assert hint("nan") is None and hint("inf") is None and hint("-1") is None and hint("soon") is None
