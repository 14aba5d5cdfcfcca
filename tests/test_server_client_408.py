"""A device retries an upload the server timed out (408 from ``fedfs serve --body-timeout``):
the server refused it before acting on the body, so sending it again is safe."""
from __future__ import annotations

import httpx

from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient, ServerError, is_transient
from fedfs_sdk.federation.wire_format import sha256_hex


def test_a_408_upload_is_sent_again_and_counts_as_transient():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.read())
        if len(calls) == 1:
            return httpx.Response(408, json={"error": "body_timeout", "reason": "the body did not arrive in 120 s"})
        return httpx.Response(200, json={"sha256": sha256_hex(b"abc"), "duplicate": False})

    sleeps: list[float] = []
    c = ServerClient("http://server.test", token="d1.x", transport=httpx.MockTransport(handler),
                     retry=RetryPolicy(attempts=3, base_delay_s=0.1, max_delay_s=1.0), sleep=sleeps.append)
    assert c.upload(2, b"abc")["duplicate"] is False
    assert calls == [b"abc", b"abc"] and len(sleeps) == 1
    assert is_transient(ServerError(408, "body_timeout", "slow", "PUT", "/v1/rounds/2/update"))
    assert not is_transient(ServerError(400, "bad_request", "no", "PUT", "/v1/rounds/2/update"))
