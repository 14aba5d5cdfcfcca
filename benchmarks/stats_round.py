"""Bytes per device and time of a secure statistics round (issue 29): every device contributes ξ's
embedding moments (D = 128) and trunk-feature moments (F = 512, the MobileFaceNet GDC output) through
the secure-sum protocol of weight rounds (server_agg.stats_round), in one process — the messages are
the ones a device sends; no network. Prints the JSON bytes each device sends, its masked vector's
share, and the protocol's wall time (device + server work of every device, on this machine).

    python benchmarks/stats_round.py [--devices 10] [--dim 128] [--features 512]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.device import SecAggDevice
from fedfs_sdk.stats import embedding_moments, feature_length, feature_moments
from fedfs_sdk.stats.transport import StatSpec, StatsDevicePolicy, StatsTask, pack, secagg_params
from server_agg.stats_round import StatsRound


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--photos", type=int, default=16)
    a = p.parse_args(argv)
    task = StatsTask(1, 1, (StatSpec("xi.embedding", "embedding", 2 * a.dim + 1, 64.0),
                            StatSpec("xi.features", "features", feature_length(a.features), 64.0)),
                     min_contributors=min(10, a.devices))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    packed = {u: pack({"xi.embedding": embedding_moments(rng.normal(size=(a.photos, a.dim)), bound=64.0),
                       "xi.features": feature_moments(rng.normal(size=(a.photos, a.features)), bound=64.0)}, task)
              for u in range(1, a.devices + 1)}
    t_stats = time.perf_counter() - t0
    rnd = StatsRound(task, list(packed))
    # the statistics round runs unauthenticated keys today: devices opt in (honest-but-curious server)
    devs = {u: SecAggDevice(secagg_params(task, a.devices), u, policy=StatsDevicePolicy.honest_but_curious().secagg)
            for u in packed}
    sent = {u: 0 for u in packed}
    masked_bytes = 0

    def send(u: int, msg: dict) -> None:
        sent[u] += len(M.to_json(msg))
        rnd.secagg.receive(msg)

    t0 = time.perf_counter()
    for u, d in devs.items():
        send(u, d.advertise())
    roster = rnd.secagg.close_advertise()
    for u, d in devs.items():
        send(u, d.share_keys(roster))
    inboxes = rnd.secagg.close_share_keys()
    for u, d in devs.items():
        m = d.masked_input(inboxes[u], packed[u], 1)
        masked_bytes = len(M.to_json(m))
        send(u, m)
    req = rnd.secagg.close_masked()
    for u in req["survivors"]:
        send(u, devs[u].unmask(req))
    pub = rnd.close()
    t_round = time.perf_counter() - t0
    per = int(np.mean(list(sent.values())))
    print(f"statistics: {task.dim:,} numbers per device (embedding moments {2 * a.dim + 1:,}, feature moments "
          f"{feature_length(a.features):,}); {a.devices} devices, {pub['count']} contributed")
    print(f"bytes sent per device: {per:,} (masked vector {masked_bytes:,} as JSON; raw 8 × {task.dim + 1:,} = "
          f"{8 * (task.dim + 1):,})")
    print(f"time: statistics of {a.photos} photos ×{a.devices} {t_stats:.2f} s; secure round (all devices + server, "
          f"one process) {t_round:.2f} s = {t_round / a.devices:.2f} s per device")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
