"""A real `fedfs serve` process on 127.0.0.1 with registered devices and an open round, for
the server benchmarks (`server_load.py`, `server_http_load.py`)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class OpenRound:
    proc: subprocess.Popen
    port: int
    url: str
    log_path: Path
    tokens: list[str]
    round_id: int
    model_version: int
    global_weights: dict[str, Any]

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN}"}


@contextlib.contextmanager
def serve_open_round(tmp: str, backbone: str, devices: int, *extra: str,
                     start_timeout_s: float = 120.0) -> Iterator[OpenRound]:
    """Start the server in ``tmp``, register ``devices`` devices, open round 1 and download its
    model; stop the server on exit (its log stays at ``tmp/server.log``)."""
    import httpx

    from fedfs_sdk.federation.wire import decode_weights

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "serve", "--port", str(port), "--state", f"{tmp}/state",
           "--admin-token", ADMIN, "--init-backbone", backbone, "--code-length", "127",
           "--min-participants", str(devices), "--round-timeout", "3600", "--log-level", "warning", *extra]
    log_path = Path(tmp) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not start") from None
                time.sleep(0.1)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=url, timeout=60) as c:
            tokens = [c.post("/v1/devices").json()["token"] for _ in range(devices)]
            opened = c.post("/v1/admin/rounds", headers=admin).json()
            rid, version = opened["round_id"], opened["model_version"]
            global_w, _ = decode_weights(c.get(f"/v1/models/{version}", headers=admin).content)
        yield OpenRound(proc, port, url, log_path, tokens, rid, version, global_w)
    finally:
        proc.terminate()
        proc.wait(30)
