"""Durability: SIGKILL the server after some accepted uploads, restart it on the same state
directory; the round completes and every accepted update is counted exactly once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_server import read_safetensors, start_server, weighted_average
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient
from fedfs_sdk.federation.wire import decode_weights, encode_update

pytestmark = pytest.mark.timeout(120)

FAST = RetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.2)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _update(global_w: dict[str, torch.Tensor], seed: int, round_id: int, n: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    w = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in global_w.items()}
    return encode_update(w, round_id=round_id, model_version=1, num_samples=n)


def test_sigkill_mid_round_keeps_each_accepted_update_once(tmp_path):
    state = tmp_path / "server"
    args = ("--init-backbone", "tiny", "--code-length", "127", "--min-participants", "3", "--quorum", "1.0")
    srv = start_server(state, *args)
    clients = []
    try:
        for _ in range(3):
            c = ServerClient(srv.url, retry=FAST)
            c.token = c.register()["token"]
            c.task()                                    # its first poll: only then is it sampled
            clients.append(c)
        with srv.admin() as a:
            assert a.post("/v1/admin/rounds").status_code == 201
        task = clients[0].task()
        assert task["action"] == "train" and task["round_id"] == 1
        global_w, _ = decode_weights(clients[0].download_model(1, task["model_sha256"]))
        bodies = [_update(global_w, seed=i, round_id=1, n=n) for i, n in enumerate((3, 5, 7))]

        for c, body in zip(clients[:2], bodies[:2]):
            assert c.upload(1, body)["duplicate"] is False
        assert srv.status()["round"]["accepted"] == 2

        srv.kill()                                   # no shutdown handler, no flush

        # What an interrupted request leaves behind: an update file whose row never committed
        # (here: device 3's valid update) and a half-written temp file. Neither may count.
        rdir = state / "updates" / "r000001"
        (rdir / f"{clients[2].token.split('.')[0]}.safetensors").write_bytes(bodies[2])
        (rdir / ".incoming.partial.tmp").write_bytes(bodies[2][:1000])

        srv = start_server(state, *args, port=_port(srv.url))
        st = srv.status()
        assert st["model_version"] == 1
        assert st["round"]["accepted"] == 2 and st["round"]["total_samples"] == 8 and st["round"]["state"] == "open"
        assert sorted(p.name for p in rdir.iterdir()) == sorted(
            f"{c.token.split('.')[0]}.safetensors" for c in clients[:2])

        # The device whose answer was lost retries: same receipt, counted once.
        again = clients[1].upload(1, bodies[1])
        assert again["duplicate"] is True
        assert srv.status()["round"]["accepted"] == 2

        # The third device uploads for real: quorum, the round closes, version 2 is published.
        assert clients[2].upload(1, bodies[2])["duplicate"] is False
        st = srv.status()
        assert st["round"] is None and st["model_version"] == 2
        with srv.admin() as a:
            r1 = a.get("/v1/rounds/1").json()
            assert r1["state"] == "closed" and r1["accepted"] == 3 and r1["total_samples"] == 15
            published, meta = read_safetensors(a.get("/v1/models/2").content)
        expected = weighted_average([(read_safetensors(b)[0], n) for b, n in zip(bodies, (3, 5, 7))])
        for k in expected:
            np.testing.assert_allclose(published[k], expected[k].astype(np.float32), rtol=0, atol=1e-6, err_msg=k)
        assert '"num_updates": 3' in meta["meta"]
    finally:
        for c in clients:
            c.close()
        srv.stop()
