"""Aggregation-server load figures.

1. **Upload throughput** — a real ``fedfs serve`` subprocess on loopback; ``--devices``
   simulated devices register, one round is opened for all of them, and they upload
   concurrently (at most ``--concurrency`` requests in flight). Prints accepted uploads/s
   and upload latency percentiles. Every upload is fully validated, written (fsync) and
   committed before its 200, and the last one triggers the FedAvg close.
2. **Streaming aggregation** — ``--updates`` updates of a ``--params``-parameter model
   through :class:`server_agg.aggregate.StreamingFedAvg`, in a fresh process so the peak
   RSS is this work's: time per update, total time, peak RSS, next to what holding all
   updates at once would need. Also the server's per-update path (decode safetensors +
   validate + update norm + add).

Both measure throughput and the aggregation's own memory; what concurrent or hostile HTTP
traffic costs the server process (RSS, /health latency, refusals, timeouts) is measured
over loopback by ``benchmarks/server_http_load.py``.

    PYTHONPATH=. python benchmarks/server_load.py                   # both, defaults below
    PYTHONPATH=. python benchmarks/server_load.py --skip-load --updates 1000 --params 1000000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- 1. upload throughput --------------------------------------------------------------

def load_test(devices: int, concurrency: int, backbone: str) -> dict:
    import httpx
    import numpy as np
    import torch

    from bench_server import serve_open_round
    from fedfs_sdk.federation.wire import encode_update

    with tempfile.TemporaryDirectory() as tmp, serve_open_round(tmp, backbone, devices) as srv:
        url, rid, version, tokens, global_w = srv.url, srv.round_id, srv.model_version, srv.tokens, srv.global_weights
        nparams = sum(t.numel() for t in global_w.values())
        rng = torch.Generator().manual_seed(0)
        bodies = []
        for i in range(devices):
            w = {k: v + 1e-3 * torch.randn(v.shape, generator=rng) for k, v in global_w.items()}
            bodies.append(encode_update(w, round_id=rid, model_version=version, num_samples=1 + i % 17))
        latencies: list[float] = []

        async def upload_all() -> float:
            sem = asyncio.Semaphore(concurrency)
            limits = httpx.Limits(max_connections=concurrency)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as ac:
                async def one(tok: str, body: bytes) -> None:
                    async with sem:
                        t = time.perf_counter()
                        r = await ac.put(f"/v1/rounds/{rid}/update", content=body,
                                         headers={"Authorization": f"Bearer {tok}",
                                                  "Content-Type": "application/octet-stream"})
                        latencies.append(time.perf_counter() - t)
                        if r.status_code != 200:
                            raise RuntimeError(f"upload refused: {r.status_code} {r.text}")
                t0 = time.perf_counter()
                await asyncio.gather(*(one(t, b) for t, b in zip(tokens, bodies)))
                return time.perf_counter() - t0

        wall = asyncio.run(upload_all())
        with httpx.Client(base_url=url, timeout=60) as c:
            st = c.get(f"/v1/rounds/{rid}", headers=srv.admin).json()
        assert st["state"] == "closed" and st["accepted"] == devices, st
        lat = np.array(latencies) * 1000
        return {"backbone": backbone, "params": nparams, "body_bytes": len(bodies[0]), "devices": devices,
                "concurrency": concurrency, "wall_s": wall, "uploads_per_s": devices / wall,
                "MB_per_s": devices * len(bodies[0]) / wall / 1e6,
                "latency_ms_p50": float(np.percentile(lat, 50)), "latency_ms_p95": float(np.percentile(lat, 95))}


# ---- 2. streaming aggregation ----------------------------------------------------------

def _layout(params: int) -> dict[str, tuple[int, ...]]:
    """A conv-net-like layout of ``params`` float32 parameters (a few big, many small tensors)."""
    shapes: dict[str, tuple[int, ...]] = {}
    left = params
    i = 0
    for frac in (0.4, 0.25, 0.15, 0.1):
        n = int(params * frac) // 128 * 128
        shapes[f"block{i}.conv.weight"] = (n // 128, 128)
        left -= n
        i += 1
    while left > 0:
        n = min(left, 512)
        shapes[f"block{i}.norm.weight"] = (n,)
        left -= n
        i += 1
    return shapes


def aggregation_test(updates: int, params: int, threads: int, pool: int = 4) -> dict:
    """Run in a fresh process (see main) so ru_maxrss is this measurement's peak."""
    import torch

    from fedfs_sdk.federation.wire import check_finite, check_layout, clip_update, decode_update, encode_update
    from server_agg.aggregate import StreamingFedAvg

    torch.set_num_threads(threads)
    shapes = _layout(params)
    g = torch.Generator().manual_seed(0)
    reference = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    # A small pool of distinct updates, cycled: the aggregation cost does not depend on values.
    ups = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in reference.items()} for _ in range(pool)]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    acc = StreamingFedAvg(reference)
    t0 = time.perf_counter()
    for i in range(updates):
        acc.add(ups[i % pool], 1 + i % 50)
    result = acc.result()
    t_stream = time.perf_counter() - t0
    rss_stream = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # The server's per-update path: parse safetensors bytes, check layout/finiteness, add.
    bodies = [encode_update(u, round_id=1, model_version=1, num_samples=1) for u in ups]
    acc2 = StreamingFedAvg(reference)
    t0 = time.perf_counter()
    for i in range(updates):
        w, meta = decode_update(bodies[i % pool])
        check_layout(w, reference)
        check_finite(w)
        w, _norm, _ = clip_update(w, reference, None)   # the server always measures ‖Δ‖ (receipt, logs)
        acc2.add(w, meta.num_samples)
    acc2.result()
    t_server = time.perf_counter() - t0
    rss_server = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model_mb = params * 4 / 2**20
    del result
    return {"updates": updates, "params": sum(v.numel() for v in reference.values()), "tensors": len(shapes),
            "model_MB": model_mb, "stream_total_s": t_stream, "stream_ms_per_update": 1000 * t_stream / updates,
            "server_path_total_s": t_server, "server_path_ms_per_update": 1000 * t_server / updates,
            "rss_MB_before": rss_before, "peak_rss_MB_stream": rss_stream, "peak_rss_MB_server_path": rss_server,
            "all_updates_in_memory_MB": updates * model_mb}


# ---- main ----------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--backbone", default="tiny", choices=("tiny", "feduv_cnn", "mobilefacenet"))
    ap.add_argument("--updates", type=int, default=1000)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the aggregation (default 1: "
                    "memory-bound adds gain little from more, and a shared machine loses a lot)")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-agg", action="store_true")
    ap.add_argument("--_agg-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._agg_child:
        print(json.dumps(aggregation_test(args.updates, args.params, args.threads)))
        return 0
    print(f"machine: {os.cpu_count()} CPU core(s), load average {os.getloadavg()[0]:.1f}, "
          f"python {sys.version.split()[0]}")
    if not args.skip_load:
        r = load_test(args.devices, args.concurrency, args.backbone)
        print(f"\n[upload throughput] {r['devices']} devices, ≤{r['concurrency']} concurrent, {r['backbone']} "
              f"({r['params']:,} params, {r['body_bytes'] / 1e6:.2f} MB per upload), loopback")
        print(f"  accepted uploads/s : {r['uploads_per_s']:.1f}   ({r['MB_per_s']:.1f} MB/s, all {r['devices']} in {r['wall_s']:.2f} s, incl. the FedAvg close)")
        print(f"  upload latency     : p50 {r['latency_ms_p50']:.1f} ms, p95 {r['latency_ms_p95']:.1f} ms")
    if not args.skip_agg:
        out = subprocess.run([sys.executable, __file__, "--_agg-child", "--updates", str(args.updates),
                              "--params", str(args.params), "--threads", str(args.threads)], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        a = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n[streaming FedAvg] {a['updates']} updates × {a['params']:,} params ({a['tensors']} tensors, "
              f"{a['model_MB']:.1f} MB float32 each), {args.threads} torch thread(s)")
        print(f"  aggregation        : {a['stream_total_s']:.2f} s total, {a['stream_ms_per_update']:.2f} ms/update (float64 running sums)")
        print(f"  server path        : {a['server_path_total_s']:.2f} s total, {a['server_path_ms_per_update']:.2f} ms/update "
              f"(decode safetensors + validate + ‖Δ‖ + add)")
        print(f"  peak RSS           : {a['peak_rss_MB_stream']:.0f} MB (process with inputs ready: {a['rss_MB_before']:.0f} MB); "
              f"after server path {a['peak_rss_MB_server_path']:.0f} MB")
        print(f"  holding all updates: would need {a['all_updates_in_memory_MB']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
