"""Bytes per device and seconds of an authenticated statistics round (issue 29), over HTTP.

A real ``fedfs serve --secure-aggregation --secagg-ca ca.pub`` on 127.0.0.1 (plain HTTP on loopback,
or ``--tls``) and ``--devices`` devices with CA-certified identities in this process (threads, each a
:class:`~fedfs_sdk.stats.client.StatsParticipant` with the default floor + pinned CA): the admin opens a
round of ξ's embedding moments (D) and trunk-feature moments (F; MobileFaceNet: D = 128, F = 512) and
every device runs the weight rounds' ``fedfs-secagg/2`` exchange on its packed contribution. Prints
per device the bytes sent and received (JSON messages, the raw masked vector), and the round's wall
time from opening to the published sum — all devices and the server share this machine's cores, so
it is an upper bound of one device's time.

    python benchmarks/stats_round.py [--devices 10] [--dim 128] [--features 512] [--tls]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest_server import ADMIN, self_signed_cert, start_server  # noqa: E402
from fedfs_sdk.federation.secagg import CaPublicKey, CertificateAuthority, DeviceIdentity, DevicePolicy  # noqa: E402
from fedfs_sdk.federation.server_client import ServerClient  # noqa: E402
from fedfs_sdk.stats import embedding_moments, feature_length, feature_moments  # noqa: E402
from fedfs_sdk.stats.client import StatsParticipant  # noqa: E402
from fedfs_sdk.stats.transport import StatsDevicePolicy  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--photos", type=int, default=16)
    p.add_argument("--tls", action="store_true", help="HTTPS with a self-signed certificate")
    a = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="fedfs-stats-bench-"))
    ca = CertificateAuthority.generate()
    _, pub = ca.save(root / "ca")
    tls = self_signed_cert(root / "tls") if a.tls else None
    srv = start_server(root / "server", "--init-backbone", "tiny", "--secure-aggregation", "--secagg-ca", str(pub),
                       "--secagg-phase-timeout", "300", tls=tls)
    rng = np.random.default_rng(0)
    stats = [{"name": "xi.embedding", "kind": "embedding", "length": 2 * a.dim + 1, "bound": 1e3},
             {"name": "xi.features", "kind": "features", "length": feature_length(a.features), "bound": 1e3}]
    try:
        t0 = time.perf_counter()
        own = [{"xi.embedding": embedding_moments(rng.normal(size=(a.photos, a.dim))),
                "xi.features": feature_moments(rng.normal(size=(a.photos, a.features)))} for _ in range(a.devices)]
        t_stats = (time.perf_counter() - t0) / a.devices
        policy = StatsDevicePolicy(secagg=DevicePolicy(ca=CaPublicKey.load(pub)))
        devs = []
        for u in range(a.devices):
            tok = ServerClient(srv.url, tls_ca=tls[0] if tls else None).register()["token"]
            ident = DeviceIdentity.generate()
            ident = ident.with_certificate(ca.sign_request(ident.request(f"bench{u}")))
            devs.append(StatsParticipant(ServerClient(srv.url, tok, tls_ca=tls[0] if tls else None),
                                         lambda task, u=u: own[u], policy, identity=ident, wait_timeout_s=600))
        admin = ServerClient(srv.url, ADMIN, tls_ca=tls[0] if tls else None)
        t0 = time.perf_counter()
        r = admin.request("POST", "/v1/admin/stats-round",
                          json_body={"stats": stats, "min_contributors": min(10, a.devices)}).json()
        with ThreadPoolExecutor(a.devices) as pool:
            got = list(pool.map(lambda d: d.take_part(), devs))
        published = devs[0].fetch_published()
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    dim = 2 * a.dim + 1 + feature_length(a.features)
    sent = [g["bytes_sent"] for g in got]
    recv = [g["bytes_received"] for g in got]
    print(f"statistics round {r['round_id']} ({r['protocol']}, {'https' if a.tls else 'http'} on 127.0.0.1): "
          f"{dim:,} numbers per device (embedding moments {2 * a.dim + 1:,}, feature moments "
          f"{feature_length(a.features):,}); {a.devices} devices, {published['count']} in the published sum")
    print(f"bytes per device: sent {statistics.mean(sent):,.0f} (of which the masked vector 8 × {dim + 1:,} = "
          f"{8 * (dim + 1):,}), received {statistics.mean(recv):,.0f}")
    print(f"seconds: contribution of {a.photos} photos (moments only) {t_stats:.3f} s per device; round wall time "
          f"{wall:.2f} s (open → published, {a.devices} devices + server on this machine); per device "
          f"{statistics.mean(g['seconds'] for g in got):.2f} s in take_part")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
