"""Server memory is O(model), not O(uploads in flight × model) (issue 13, defect 4): many
uploads arriving at once are spooled to disk and decoded a few at a time. A real server
subprocess on 127.0.0.1; its RSS is read from /proc while 48 devices upload concurrently."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from conftest_server import new_device, start_server
from fedfs_sdk.federation.wire import decode_weights, encode_update

pytestmark = pytest.mark.timeout(300)

DEVICES = 48


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_concurrent_uploads_cost_o_model_memory(tmp_path):
    # tiny backbone with a wide FedUV head: 1.2M parameters, 4.6 MiB per upload
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--embedding-dim", "2048",
                       "--code-length", "511", "--min-participants", str(DEVICES), "--log-level", "warning")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            tokens = [new_device(srv.url)["token"] for _ in range(DEVICES)]
        with srv.admin() as a:
            rid = a.post("/v1/admin/rounds").json()["round_id"]
            w, _ = decode_weights(a.get("/v1/models/1").content)
        body = encode_update({k: v + 0.01 for k, v in w.items()}, round_id=rid, model_version=1, num_samples=2)
        model_mb = len(body) / 2**20
        idle = rss_mb(srv.proc.pid)
        peak, stop = [idle], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_mb(srv.proc.pid))
                time.sleep(0.005)

        async def upload_all() -> list[int]:
            limits = httpx.Limits(max_connections=DEVICES + 4)
            async with httpx.AsyncClient(base_url=srv.url, timeout=240, limits=limits) as ac:
                rs = await asyncio.gather(*(ac.put(f"/v1/rounds/{rid}/update", content=body, headers={
                    "Authorization": f"Bearer {t}", "Content-Type": "application/octet-stream"}) for t in tokens))
            return [r.status_code for r in rs]

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            statuses = asyncio.run(upload_all())
        finally:
            stop.set()
            sampler.join()
        assert statuses == [200] * DEVICES
        assert srv.status()["round"] is None                         # the round closed on its quorum
        growth = peak[0] - idle
        # The old server held every body in flight and decoded them all at once: +730 MB here.
        # Spooled to disk and decoded 2 at a time it stays far below even one copy of every
        # body in flight (DEVICES × 4.6 MiB = 222 MB); measured +92 MB.
        assert growth < DEVICES * model_mb, \
            f"server RSS grew by {growth:.0f} MB for {DEVICES} concurrent uploads of {model_mb:.1f} MiB"
    finally:
        srv.stop()
