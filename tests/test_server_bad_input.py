"""Every malformed or unauthorised request gets a 4xx with a reason — never a 5xx — and
leaves the server's state as it was. One real server subprocess for the module."""
from __future__ import annotations

import json
import socket
import struct
import time

import httpx
import pytest
import torch

from conftest_server import ADMIN, new_device, start_server
from fedfs_sdk.federation.wire import decode_weights, encode_update, encode_weights

pytestmark = pytest.mark.timeout(120)


class Ctx:
    """Round 1 closed (one update), round 2 open with devices A and B sampled, no uploads."""

    def __init__(self, srv, tokens: list[str], global_w: dict[str, torch.Tensor]) -> None:
        self.srv, self.tokens, self.global_w = srv, tokens, global_w
        self.http = httpx.Client(base_url=srv.url, timeout=30)

    def put(self, body: bytes, round_id: int = 2, token: str | None = "A", **headers: str) -> httpx.Response:
        h = {"Content-Type": "application/octet-stream", **headers}
        if token is not None:
            h["Authorization"] = f"Bearer {self.tokens[0] if token == 'A' else self.tokens[1] if token == 'B' else token}"
        return self.http.put(f"/v1/rounds/{round_id}/update", content=body, headers=h)

    def update(self, round_id: int = 2, version: int = 2, n: int = 5, **changes: torch.Tensor) -> bytes:
        w = {k: v.clone() for k, v in self.global_w.items()}
        w.update(changes)
        return encode_update(w, round_id=round_id, model_version=version, num_samples=n)

    def snapshot(self) -> tuple:
        st = self.srv.status()
        files = sorted(str(p.relative_to(self.srv.state)) for p in (self.srv.state / "updates").rglob("*"))
        models = sorted(p.name for p in (self.srv.state / "models").iterdir())
        return json.dumps(st, sort_keys=True), files, models


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    state = tmp_path_factory.mktemp("bad") / "server"
    srv = start_server(state, "--init-backbone", "tiny", "--code-length", "127", "--min-participants", "2",
                       "--quorum", "1.0", "--min-updates", "1")
    try:
        tokens = [new_device(srv.url)["token"] for _ in range(2)]
        with srv.admin() as a:
            assert a.post("/v1/admin/rounds").status_code == 201
            w, _ = decode_weights(a.get("/v1/models/1").content)
            body = encode_update({k: v + 0.01 for k, v in w.items()}, round_id=1, model_version=1, num_samples=3)
            r = httpx.put(srv.url + "/v1/rounds/1/update", content=body,
                          headers={"Authorization": f"Bearer {tokens[0]}", "Content-Type": "application/octet-stream"})
            assert r.status_code == 200, r.text
            assert a.post("/v1/admin/rounds/1/close").json()["state"] == "closed"
            assert a.post("/v1/admin/rounds").json()["round_id"] == 2
            w2, _ = decode_weights(a.get("/v1/models/2").content)
        c = Ctx(srv, tokens, w2)
        c.round1_body = body
        yield c
        c.http.close()
    finally:
        srv.stop()
        log = srv.log.read_text()
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert any(e.get("msg") == "update accepted" for e in lines)         # structured JSON logs
        assert not any(str(e.get("status", "")).startswith("5") for e in lines), "the server answered a 5xx"
        for secret in (*tokens, ADMIN):
            assert secret.split(".")[-1] not in log                          # no credential is logged


def refused(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["reason"], body
    if code is not None:
        assert body["error"] == code, body
    return body


@pytest.fixture
def unchanged(ctx):
    before = ctx.snapshot()
    yield
    assert ctx.snapshot() == before


# ---- authentication --------------------------------------------------------------------

def test_missing_token(ctx, unchanged):
    refused(ctx.put(ctx.update(), token=None), 401, "missing_token")
    refused(ctx.http.get("/v1/task"), 401, "missing_token")


def test_wrong_token(ctx, unchanged):
    device_id = ctx.tokens[0].split(".")[0]
    refused(ctx.put(ctx.update(), token=f"{device_id}.not-the-secret"), 401, "invalid_token")
    refused(ctx.put(ctx.update(), token="garbage"), 401, "invalid_token")
    refused(ctx.http.get("/v1/task", headers={"Authorization": "Basic abc"}), 401)


def test_unknown_device(ctx, unchanged):
    r = refused(ctx.put(ctx.update(), token="d0123456789abcdef.secret"), 401, "unknown_device")
    assert "d0123456789abcdef" in r["reason"]


def test_admin_endpoints_need_the_admin_token(ctx, unchanged):
    refused(ctx.http.post("/v1/admin/rounds"), 401, "missing_token")
    refused(ctx.http.post("/v1/admin/rounds", headers={"Authorization": f"Bearer {ctx.tokens[0]}"}), 401, "invalid_token")
    refused(ctx.http.put("/v1/admin/config", json={"rounds": 5}, headers={"Authorization": "Bearer nope"}), 401)


# ---- malformed updates -----------------------------------------------------------------

def test_wrong_shape(ctx, unchanged):
    k = "uv_head.weight"
    r = refused(ctx.put(ctx.update(**{k: torch.zeros(10, 64)})), 422, "invalid_update")
    assert k in r["reason"] and "shape" in r["reason"]


def test_missing_and_extra_keys(ctx, unchanged):
    w = {k: v for k, v in ctx.global_w.items() if k != "uv_head.weight"}
    refused(ctx.put(encode_update(w, round_id=2, model_version=2, num_samples=1)), 422, "invalid_update")
    refused(ctx.put(ctx.update(extra=torch.zeros(3))), 422, "invalid_update")


def test_wrong_dtype(ctx, unchanged):
    k = "uv_head.weight"
    r = refused(ctx.put(ctx.update(**{k: ctx.global_w[k].double()})), 422, "invalid_update")
    assert "dtype" in r["reason"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(ctx, unchanged, bad):
    k = "backbone.embed.weight"
    t = ctx.global_w[k].clone()
    t[3, 4] = bad
    r = refused(ctx.put(ctx.update(**{k: t})), 422, "invalid_update")
    assert "NaN or Inf" in r["reason"]


def test_truncated_safetensors(ctx, unchanged):
    body = ctx.update()
    for cut in (4, 100, len(body) // 2, len(body) - 1):
        r = refused(ctx.put(body[:cut]), 400, "malformed_update")
        assert "safetensors" in r["reason"] or "short" in r["reason"]


def test_garbage_and_hostile_headers(ctx, unchanged):
    refused(ctx.put(b"not a tensor file at all"), 400, "malformed_update")
    refused(ctx.put(struct.pack("<Q", 1 << 40) + b"{}"), 400, "malformed_update")          # absurd header size
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 30]}}).encode()
    refused(ctx.put(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16), 400, "malformed_update")  # offsets past the end
    # a model checkpoint (wrong format) is not an update
    refused(ctx.put(encode_weights(ctx.global_w, {"format": "fedfs-checkpoint/1"})), 400, "malformed_update")
    # headers that crash naive parsers: unhashable dtype, deep nesting, a 5000-digit offset
    for hdr in (json.dumps({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode(),
                json.dumps({"x": {"dtype": {}, "shape": [1], "data_offsets": [0, 4]}}).encode(),
                b"[" * 200_000 + b"]" * 200_000,
                b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"9" * 5000 + b"]}}"):
        refused(ctx.put(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4), 400, "malformed_update")


def test_bad_metadata(ctx, unchanged):
    refused(ctx.put(ctx.update(round_id=1)), 400, "round_mismatch")
    refused(ctx.put(ctx.update(version=1)), 409, "stale_model_version")
    w = encode_weights(ctx.global_w, {"format": "fedfs-update/1", "round_id": "2", "model_version": "2",
                                      "num_samples": "0"})
    refused(ctx.put(w), 400, "malformed_update")
    refused(ctx.put(ctx.update(n=10**9)), 422, "too_many_samples")
    huge = encode_weights(ctx.global_w, {"format": "fedfs-update/1", "round_id": "2", "model_version": "2",
                                         "num_samples": "9" * 30})
    refused(ctx.put(huge), 400, "malformed_update")                      # beyond SQLite's INTEGER


def test_wrong_content_type(ctx, unchanged):
    refused(ctx.put(ctx.update(), **{"Content-Type": "application/json"}), 415)


def test_oversize_body_declared(ctx, unchanged):
    """Refused from Content-Length alone, before the body is read."""
    host, port = ctx.srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall((f"PUT /v1/rounds/2/update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ctx.tokens[0]}\r\n"
                   f"Content-Type: application/octet-stream\r\nContent-Length: {1 << 30}\r\n\r\n").encode())
        s.sendall(b"\0" * 1024)
        data = b""
        while chunk := s.recv(65536):             # the server closes the connection after answering
            data += chunk
        head = data.decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert "payload_too_large" in head


def test_oversize_body_streamed(ctx, unchanged):
    """A chunked body (no Content-Length) is cut off once it passes the limit."""
    def chunks():
        for _ in range(64):
            yield b"\0" * (64 << 10)                  # 4 MiB in all; the tiny model is ~170 kB

    try:
        r = ctx.http.put("/v1/rounds/2/update", content=chunks(),
                         headers={"Authorization": f"Bearer {ctx.tokens[0]}", "Content-Type": "application/octet-stream"})
    except httpx.TransportError:
        pytest.fail("the server should answer 413, not drop the connection")
    refused(r, 413, "payload_too_large")


def test_unknown_round_and_bad_path(ctx, unchanged):
    refused(ctx.put(ctx.update(round_id=99), round_id=99), 404, "unknown_round")
    refused(ctx.http.put("/v1/rounds/abc/update", headers={"Authorization": f"Bearer {ctx.tokens[0]}"}), 422)
    refused(ctx.http.get("/v1/models/77", headers={"Authorization": f"Bearer {ctx.tokens[0]}"}), 404)
    big = 2**63                                                          # one past SQLite's INTEGER
    refused(ctx.http.get(f"/v1/models/{big}", headers={"Authorization": f"Bearer {ctx.tokens[0]}"}), 422)
    refused(ctx.http.get(f"/v1/rounds/{big}", headers={"Authorization": f"Bearer {ctx.tokens[0]}"}), 422)
    refused(ctx.put(ctx.update(), round_id=big), 422)
    refused(ctx.http.get("/v1/nothing-here"), 404)


def test_upload_to_closed_round(ctx, unchanged):
    body = ctx.update(round_id=1, version=1)
    refused(ctx.put(body, round_id=1, token="B"), 410, "round_closed")
    refused(ctx.put(body, round_id=1, token="A"), 410, "round_closed")   # A's different body too
    # A's exact round-1 upload again (its answer was lost): the same receipt, counted once.
    again = ctx.put(ctx.round1_body, round_id=1, token="A")
    assert again.status_code == 200 and again.json()["duplicate"] is True and again.json()["num_samples"] == 3


def test_invalid_admin_requests(ctx, unchanged):
    with ctx.srv.admin() as a:
        refused(a.put("/v1/admin/config", json={"participation": 2}), 422, "invalid_policy")
        refused(a.put("/v1/admin/config", json={"no_such_setting": 1}), 422, "invalid_policy")
        refused(a.put("/v1/admin/config", json={"train": {"lr": "fast"}}), 422, "invalid_policy")
        refused(a.put("/v1/admin/config", content=b"{not json", headers={"Content-Type": "application/json"}), 422)
        refused(a.post("/v1/admin/rounds"), 409, "round_open")
        refused(a.post("/v1/admin/rounds/1/close"), 409, "round_not_open")
        refused(a.post("/v1/admin/model", content=b"junk", headers={"Content-Type": "application/octet-stream"}), 422)
        refused(a.put("/v1/admin/config", content=b'{"round_timeout_s": 1' + b"0" * 400 + b"}",
                      headers={"Content-Type": "application/json"}), 422, "invalid_policy")   # overflows a float
        refused(a.put("/v1/admin/config", json={"max_num_samples": 10**30}), 422, "invalid_policy")
        refused(a.put("/v1/admin/config", json={"train": {"objective": {"uv_weight": "a"}}}), 422, "invalid_policy")
        refused(a.put("/v1/admin/config", json={"train": {"objective": {"lambda_neg": -1}}}), 422, "invalid_policy")


# ---- replays (these change state on purpose, so they run last) --------------------------

def test_replayed_upload_is_counted_once(ctx):
    body = ctx.update(n=4, **{"uv_head.weight": ctx.global_w["uv_head.weight"] + 0.5})
    first = ctx.put(body, token="B")
    assert first.status_code == 200 and first.json()["duplicate"] is False
    before = ctx.snapshot()
    again = ctx.put(body, token="B")                       # a retry / replay of the same bytes
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert {k: v for k, v in again.json().items() if k != "duplicate"} == \
        {k: v for k, v in first.json().items() if k != "duplicate"}
    other = ctx.update(n=9)
    refused(ctx.put(other, token="B"), 409, "already_uploaded")  # a different second update
    assert ctx.snapshot() == before
    assert ctx.srv.status()["round"]["accepted"] == 1 and ctx.srv.status()["round"]["total_samples"] == 4


def test_upload_after_deadline(ctx):
    with ctx.srv.admin() as a:
        a.post("/v1/admin/rounds/2/close")
        # device_ttl_s 0: A and B stay eligible however long the earlier tests took (a 0.5 s
        # timeout would otherwise make the liveness window 1 s)
        assert a.put("/v1/admin/config", json={"round_timeout_s": 0.5, "device_ttl_s": 0}).status_code == 200
        opened = a.post("/v1/admin/rounds").json()
    assert "round_id" in opened, opened
    time.sleep(1.0)
    body = ctx.update(round_id=opened["round_id"], version=opened["model_version"])
    r = ctx.put(body, round_id=opened["round_id"])
    assert r.status_code == 410 and r.json()["error"] in ("deadline_passed", "round_closed"), r.text
    with ctx.srv.admin() as a:
        info = a.get(f"/v1/rounds/{opened['round_id']}").json()
    assert info["state"] == "failed" and info["accepted"] == 0 and "deadline" in info["reason"]


def test_openapi_document_describes_the_protocol(ctx):
    doc = ctx.http.get("/openapi.json").json()
    upload = doc["paths"]["/v1/rounds/{round_id}/update"]["put"]
    assert "application/octet-stream" in upload["requestBody"]["content"]
    assert {"401", "409", "410", "413", "422"} <= set(upload["responses"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert {"/health", "/v1/devices", "/v1/task", "/v1/rounds/current", "/v1/admin/rounds"} <= set(doc["paths"])
