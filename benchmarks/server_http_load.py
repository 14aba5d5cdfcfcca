"""What untrusted HTTP traffic costs the aggregation server — measured over loopback
against a real ``fedfs serve`` subprocess (server RSS read from ``/proc/PID/status``).

1. **Concurrent uploads** — ``--devices`` devices upload a ~1M-parameter update
   (MobileFaceNet + FedUV head) all at once; server RSS peak vs idle, RSS after the phase,
   and ``/health`` latency while it runs (probed every 50 ms).
2. **Unauthenticated 60 MiB bodies** — ``--big-senders`` clients each start a 60 MiB body
   without a token (``PUT /v1/admin/config`` and ``PUT /v1/rounds/R/update``): time from
   the request head to the refusal, whether the server closed the connection without
   reading the body, RSS growth, ``/health`` latency.
3. **Stalled connections** — a connection that sends nothing, one with a partial request
   head, one with a partial upload body: seconds until the server closes each (against the
   ``--header-timeout`` / ``--body-timeout`` it was started with).

    PYTHONPATH=. python benchmarks/server_http_load.py
    PYTHONPATH=. python benchmarks/server_http_load.py --devices 50 --backbone tiny   # quick
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = 60 << 20


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class RssSampler:
    """Peak RSS of ``pid`` sampled every 5 ms while active."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._t.join()


def probe_loop(port: int) -> None:
    """Child process: ``GET /health`` every 50 ms on a fresh TCP connection until stdin closes;
    prints one latency (ms, connect to last byte) or ``err`` per line."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        t = time.perf_counter()
        connected = t
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                connected = time.perf_counter()
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            ok = data.startswith(b"HTTP/1.1 200")
        except OSError:
            ok = False
        # latency@end time@connect share (ms): a slow connect is the kernel's accept queue /
        # loopback, not the server's request handling
        print(f"{1000 * (time.perf_counter() - t):.3f}@{time.time():.3f}@{1000 * (connected - t):.3f}" if ok else "err",
              flush=True)
        time.sleep(0.05)


class HealthProbe:
    """:func:`probe_loop` in its own process while active, so the figure is the server's
    latency, not the GIL of this (busy, many-connection) client process."""

    def __init__(self, port: int) -> None:
        self.port, self.ms, self.errors, self.at, self.connect_ms = port, [], 0, [], []

    def __enter__(self) -> "HealthProbe":
        self._p = subprocess.Popen([sys.executable, __file__, "--_probe", str(self.port)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *_: object) -> None:
        out, _ = self._p.communicate("", timeout=60)
        for line in out.split():
            if line == "err":
                self.errors += 1
            else:
                ms, at, conn = line.split("@")
                self.ms.append(float(ms))
                self.at.append(float(at))
                self.connect_ms.append(float(conn))

    def summary(self) -> str:
        if not self.ms:
            return f"no answer ({self.errors} errors)"
        ms = sorted(self.ms)
        p99 = ms[min(len(ms), math.ceil(0.99 * len(ms))) - 1]          # nearest rank
        return (f"{len(ms)} probes, p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
                f"max {ms[-1]:.1f} ms, errors {self.errors}")


def big_unauthenticated(port: int, path: str, results: list) -> None:
    """Start a 60 MiB body without a token; time to the refusal; does the server hang up?"""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG}\r\n\r\n").encode()
    chunk = b"[" * (256 << 10)
    t0 = time.perf_counter()
    s.sendall(head + chunk)
    status = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    refused_ms = 1000 * (time.perf_counter() - t0)
    sent, closed = len(chunk), False
    try:
        while sent < BIG:                      # keep pushing: a server that drains would accept it all
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        closed = True
    if not closed:
        s.settimeout(5)
        try:
            closed = s.recv(1 << 16) == b""
        except OSError:
            closed = True
    s.close()
    results.append({"path": path, "status": status, "refused_ms": refused_ms, "closed": closed,
                    "body_MiB_sent": sent / 2**20})


def stalled(port: int, payload: bytes) -> float:
    """Seconds until the server closes a connection that sent ``payload`` and then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    t0 = time.perf_counter()
    if payload:
        s.sendall(payload)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    s.close()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--backbone", default="mobilefacenet", choices=("tiny", "feduv_cnn", "mobilefacenet"))
    ap.add_argument("--big-senders", type=int, default=4)
    ap.add_argument("--header-timeout", type=float, default=3.0)
    ap.add_argument("--body-timeout", type=float, default=5.0)
    ap.add_argument("--server-args", default="", help="more fedfs serve flags (space-separated)")
    ap.add_argument("--keep-log", type=Path, help="copy the server's log here")
    ap.add_argument("--client-nice", type=int, default=0, metavar="N",
                    help="lower this load generator's CPU priority by N once the server and the /health "
                         "probe run (both keep theirs): on a small machine the 200 uploading clients share "
                         "the server's cores, which no real deployment does")
    ap.add_argument("--_probe", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._probe:
        probe_loop(args._probe)
        return 0

    import httpx
    import torch

    from fedfs_sdk.federation.wire import encode_update

    from bench_server import serve_open_round

    extra = ("--header-timeout", str(args.header_timeout), "--body-timeout", str(args.body_timeout),
             *args.server_args.split())
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with serve_open_round(tmp, args.backbone, args.devices, *extra) as srv:
                proc, port, url, admin = srv.proc, srv.port, srv.url, srv.admin
                tokens, rid, version, global_w = srv.tokens, srv.round_id, srv.model_version, srv.global_weights
                nparams = sum(t.numel() for t in global_w.values())
                g = torch.Generator().manual_seed(0)
                w = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                     for k, v in global_w.items()}
                body = encode_update(w, round_id=rid, model_version=version, num_samples=5)
                del global_w, w
                with HealthProbe(port) as hp:            # the machine's own noise: an idle server
                    time.sleep(3.0)
                idle = rss_mb(proc.pid)
                print(f"\n[0] idle server          : RSS {idle:.0f} MB; /health {hp.summary()}")

                # ---- 1. concurrent uploads
                statuses: list[int] = []
                started: list[float] = []

                async def upload_all() -> float:
                    limits = httpx.Limits(max_connections=args.devices + 8, max_keepalive_connections=0)
                    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as ac:
                        async def one(tok: str) -> None:
                            r = await ac.put(f"/v1/rounds/{rid}/update", content=body,
                                             headers={"Authorization": f"Bearer {tok}",
                                                      "Content-Type": "application/octet-stream"})
                            statuses.append(r.status_code)
                        t0 = time.perf_counter()
                        started.append(time.time())
                        await asyncio.gather(*(one(t) for t in tokens))
                        return time.perf_counter() - t0

                with RssSampler(proc.pid) as rs, HealthProbe(port) as hp:
                    if args.client_nice:
                        os.nice(args.client_nice)       # after the probe started: it keeps its priority
                    wall = asyncio.run(upload_all())
                time.sleep(0.5)
                after = rss_mb(proc.pid)
                ok = sum(s == 200 for s in statuses)
                print(f"\n[1] {args.devices} concurrent uploads, {args.backbone} + FedUV head ({nparams:,} params, "
                      f"{len(body) / 2**20:.2f} MiB each), all started at once")
                print(f"  accepted            : {ok}/{args.devices} in {wall:.2f} s")
                print(f"  server RSS          : idle {idle:.0f} MB, peak {rs.peak:.0f} MB (+{rs.peak - idle:.0f} MB), "
                      f"after {after:.0f} MB (+{after - idle:.0f} MB)")
                print(f"  /health meanwhile   : {hp.summary()}")
                if os.environ.get("FEDFS_BENCH_DEBUG"):
                    print("  slow probes (s after the uploads started, ms, of which connecting):",
                          [(round(a - m / 1000 - started[0], 2), round(m), round(c)) for m, a, c
                           in zip(hp.ms, hp.at, hp.connect_ms) if m > 20])

                with httpx.Client(base_url=url, timeout=60) as c:      # an open round for phases 2–3
                    rid2 = c.post("/v1/admin/rounds", headers=admin).json()["round_id"]

                # ---- 2. unauthenticated 60 MiB bodies
                before = rss_mb(proc.pid)
                results: list[dict] = []
                paths = ["/v1/admin/config", f"/v1/rounds/{rid2}/update"]
                with RssSampler(proc.pid) as rs, HealthProbe(port) as hp:
                    threads = [threading.Thread(target=big_unauthenticated, args=(port, paths[i % 2], results))
                               for i in range(args.big_senders)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    time.sleep(0.3)
                print(f"\n[2] {args.big_senders} clients each start a 60 MiB body with no token")
                for r in sorted(results, key=lambda r: r["path"]):
                    print(f"  {r['path']:<22}: {r['status']!r} after {r['refused_ms']:.1f} ms; connection closed by the "
                          f"server: {r['closed']} (client got {r['body_MiB_sent']:.1f} MiB into the socket)")
                print(f"  server RSS          : before {before:.0f} MB, peak {rs.peak:.0f} MB (+{rs.peak - before:.0f} MB)")
                print(f"  /health meanwhile   : {hp.summary()}")

                # ---- 3. stalled connections
                tok = tokens[0]
                partial_body = (f"PUT /v1/rounds/{rid2}/update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tok}\r\n"
                                f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
                print(f"\n[3] stalled connections (server started with --header-timeout {args.header_timeout:g} "
                      f"--body-timeout {args.body_timeout:g})")
                with HealthProbe(port) as hp:
                    for what, payload in (("sends nothing", b""), ("partial request head", b"GET /health HTTP/1.1\r\nHo"),
                                          ("partial upload body", partial_body + body[:1000])):
                        print(f"  {what:<20}: closed by the server after {stalled(port, payload):.2f} s")
                print(f"  /health meanwhile   : {hp.summary()}")
        finally:
            text = Path(f"{tmp}/server.log").read_text()
            if args.keep_log:
                args.keep_log.write_text(text)
            bad = [line for line in text.splitlines()
                   if '"status": 5' in line or "Exception in ASGI" in line or '"level": "error"' in line]
            print(f"\nserver log: {len(bad)} line(s) with a 5xx, an error or an ASGI exception")
            for line in bad[:5]:
                print("  " + line[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
