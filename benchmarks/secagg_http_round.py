"""One secure-aggregation round over real HTTP: ``fedfs serve --secure-aggregation`` on
127.0.0.1 and K devices speaking the protocol with :class:`SecAggSession` (the device agents'
code), driven from this process with synthetic updates of the server's model layout.

    PYTHONPATH=. .venv/bin/python benchmarks/secagg_http_round.py --devices 5 --threshold 3

Prints the round's wall time (first advertise → new version published), the bytes each
device sent and received, and the largest difference between the published model and the
exact weighted mean of the updates. The devices run one after another in one process, so
the wall time is the sum of their work plus the server's, not a concurrency measurement.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest_server import read_safetensors, start_server  # noqa: E402
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient# noqa: E402
from fedfs_sdk.training.ort_device import encode_update  # noqa: E402
from fedfs_sdk.federation.secagg.http_device import SecAggSession, flatten_update  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=5)
    p.add_argument("--threshold", type=int, default=None)
    p.add_argument("--neighbours", type=int, default=None)
    p.add_argument("--drop-after-mask", type=int, default=0, help="devices that never answer the unmask request")
    p.add_argument("--phase-timeout", type=float, default=5.0)
    a = p.parse_args()
    args = ["--init-backbone", "tiny", "--code-length", "127", "--min-participants", str(a.devices), "--rounds", "1",
            "--secure-aggregation", "--secagg-phase-timeout", str(a.phase_timeout), "--device-ttl", "0",
            "--round-timeout", str(4 * a.phase_timeout)]
    if a.threshold:
        args += ["--secagg-threshold", str(a.threshold)]
    if a.neighbours:
        args += ["--secagg-neighbours", str(a.neighbours)]
    srv = start_server(Path(tempfile.mkdtemp()) / "server", *args)
    try:
        clients = [ServerClient(srv.url, httpx.post(srv.url + "/v1/devices").json()["token"],
                                retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0))
                   for _ in range(a.devices)]
        while httpx.get(srv.url + "/health").json()["round_id"] != 1:
            time.sleep(0.05)
        with srv.admin() as c:
            ref = read_safetensors(c.get("/v1/models/1").content)[0]
        rng = np.random.default_rng(0)
        sessions, bodies = [], []
        for cl in clients:
            task = cl.task()
            sessions.append(SecAggSession(cl, task))
            upd = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in ref.items()}
            bodies.append(encode_update(upd, round_id=1, model_version=1, num_samples=int(rng.integers(1, 50))))
        t0 = time.perf_counter()
        for s in sessions:
            s.advertise()
        for s in sessions:
            s.share_keys()
        for s, b in zip(sessions, bodies):
            s.masked_input(b)
        for s in sessions[a.drop_after_mask:]:
            s.unmask()
        while True:
            with srv.admin() as c:
                info = c.get("/v1/rounds/1").json()
            if info["state"] != "open":
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        assert info["state"] == "closed", info
        with srv.admin() as c:
            pub = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)[0]
        got = np.concatenate([pub[k].astype(np.float64).ravel() for k in sorted(pub)])
        ups = [flatten_update(b) for b in bodies]
        exact = sum(w * n for w, n in ups) / sum(n for _, n in ups)
        print(f"devices {a.devices}, dim {got.size}, threshold {info['secure_aggregation']['threshold']}, "
              f"dropped after masking {a.drop_after_mask}: round wall {wall:.2f} s "
              f"(includes {a.phase_timeout:g} s unmask deadline if any dropped)")
        print(f"bytes sent per device {sessions[0].bytes_sent:,} (masked vector {8 * (got.size + 1):,}; "
              f"plain update body {len(bodies[0]):,}), received {sessions[0].bytes_received:,}")
        print(f"max |published - exact weighted mean| = {np.abs(got - exact).max():.3g}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
