"""Per-round cost of secure aggregation: device CPU per step, bytes per device, server CPU.

    PYTHONPATH=. python benchmarks/secagg_cost.py                       # 100 and 1,000 devices, 1M parameters
    PYTHONPATH=. python benchmarks/secagg_cost.py --devices 20 --dim 10000   # quick look

Each configuration runs one real round in-process (:mod:`device_sim.secagg_sim`: every
device's and the server's state machine, every message sized as it travels) and checks the
unmasked result against the exact weighted mean. CPU times are ``thread_time`` of each call:
one device's work on one core; the server's per step.

Full SecAgg needs n − 1 PRG expansions of the whole vector per device and, per dropped
device, |survivors| more on the server: running 1,000 devices × 1M parameters in-process is
~10^12 AES-CTR words, beyond a shared 2-core machine. Where ``n · (degree + 1) · dim`` exceeds
``--direct-budget`` the round runs at ``--run-dim`` parameters and the dim-dependent costs
are extrapolated linearly in the parameter count: each PRG expansion, encoding and vector
addition is re-timed here at ``--dim`` and at ``--run-dim`` and the difference is added once
per operation the round did (the counts are exact: device masking does degree + 1
expansions, the server ``stats['prg_expansions']``). Such rows are marked ``extrap.``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_sim.secagg_sim import gaussian_updates, run_round  # noqa: E402
from fedfs_sdk.federation.secagg import SecAggParams  # noqa: E402
from fedfs_sdk.federation.secagg.encoding import FixedPoint  # noqa: E402
from fedfs_sdk.federation.secagg.prg import add_mask  # noqa: E402


def _best(fn, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return min(out)


def unit_costs(dim: int) -> dict[str, float]:
    """CPU seconds of one PRG expansion + add, one encoding, one vector add, at ``dim`` params."""
    acc = np.zeros(dim + 1, np.uint64)
    w = np.random.default_rng(0).normal(0, 0.05, dim).astype(np.float32)
    other = np.ones(dim + 1, np.uint64)
    reps = 5 if dim >= 100_000 else 50
    return {"prg": _best(lambda: add_mask(acc, bytes(32), 1), reps),
            "encode": _best(lambda: FixedPoint().encode(w, 7), reps),
            "add": _best(lambda: np.add(acc, other, out=acc), reps)}


def measure(n: int, dim: int, k: int | None, n_drop: int, run_dim: int) -> dict:
    # unit costs right before the run: on a shared machine they drift with the load
    units = {d: unit_costs(d) for d in {dim, run_dim}}
    p = SecAggParams(round_id=1, dim=run_dim, neighbours=k)
    ids = list(range(1, n + 1))
    dropped = list(range(1, n + 1, max(1, n // max(1, n_drop))))[:n_drop]   # spread over the graph
    t0 = time.perf_counter()
    rep = run_round(p, ids, gaussian_updates(run_dim), {"masked_input": dropped})
    wall = time.perf_counter() - t0
    deg = len(rep.server.graph[ids[-1]])
    fp = p.fixed_point
    tol = fp.error_bound() + float(np.max(np.abs(rep.expected))) * 2.0**-24
    assert rep.max_abs_error <= tol, (rep.max_abs_error, tol)
    s = rep.steps
    d_prg = d_enc = d_add = 0.0
    if run_dim != dim:
        u_big, u_run = units[dim], units[run_dim]
        d_prg, d_enc, d_add = (u_big[x] - u_run[x] for x in ("prg", "encode", "add"))
    mean = statistics.fmean
    dev = {st: mean(s[st].device_cpu_s) for st in s}
    dev["masked_input"] += (deg + 1) * d_prg + d_enc
    y_extra = 8 * (dim - run_dim)
    n_surv = len(rep.result.survivors)
    srv_mask = s["masked_input"].server_cpu_s + n_surv * d_add
    st = rep.server.stats
    srv_unmask = s["unmask"].server_cpu_s + st["prg_expansions"] * d_prg
    srv_self = st["self_masks_cpu_s"] + n_surv * d_prg
    srv_dropped = st["dropped_masks_cpu_s"] + (st["prg_expansions"] - n_surv) * d_prg
    return {
        "n": n, "mode": "SecAgg" if k is None else f"SecAgg+ k={k}", "deg": deg, "t": rep.server.threshold,
        "drop": n_drop, "how": "direct" if run_dim == dim else f"extrap. from {run_dim:,}",
        "dev_share_s": dev["share_keys"], "dev_mask_s": dev["masked_input"], "dev_unmask_s": dev["unmask"],
        "sent_kb": (sum(mean(s[st].sent) for st in s) + y_extra) / 1024,
        "recv_kb": sum(mean(s[st].received) for st in s if s[st].received) / 1024,
        "srv_collect_s": srv_mask + s["share_keys"].server_cpu_s + s["advertise"].server_cpu_s,
        "srv_unmask_s": srv_unmask, "srv_self_s": srv_self, "srv_dropped_s": srv_dropped, "prg": int(rep.server.stats["prg_expansions"]),
        "err": rep.max_abs_error, "wall_s": wall, "prg_ms": 1e3 * units[dim]["prg"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--dim", type=int, default=1_000_000, help="model parameters (default 1M)")
    ap.add_argument("--run-dim", type=int, default=1000, help="parameters actually run when extrapolating")
    ap.add_argument("--direct-budget", type=float, default=1.2e10,
                    help="largest n·(degree+1)·dim PRG words to run directly")
    ap.add_argument("--drop-frac", type=float, default=0.05, help="share of devices dropping after ShareKeys")
    ap.add_argument("--zero-drop-max-devices", type=int, default=500,
                    help="above this many devices, full SecAgg runs only the round with dropouts (its "
                         "'self masks' column is the server's unmasking work of a round without dropouts)")
    ap.add_argument("--no-plus", action="store_true", help="skip SecAgg+ (k = 2⌈log2 n⌉ neighbours)")
    a = ap.parse_args(argv)
    rows = []
    for n in a.devices:
        modes: list[int | None] = [None]
        k_plus = 2 * math.ceil(math.log2(n))
        if not a.no_plus and k_plus < n - 1:
            modes.append(k_plus)
        for k in modes:
            deg = n - 1 if k is None else k
            run_dim = a.dim if n * (deg + 1) * a.dim <= a.direct_budget else a.run_dim
            drops = [0, max(1, round(a.drop_frac * n))]
            if k is None and n > a.zero_drop_max_devices:
                drops = drops[1:]
            for n_drop in drops:
                rows.append(measure(n, a.dim, k, n_drop, run_dim))
                print(f"  done n={n} {rows[-1]['mode']} drop={n_drop} ({rows[-1]['wall_s']:.0f} s wall)",
                      file=sys.stderr, flush=True)
    print(f"secure aggregation, one round, {a.dim:,} parameters; device CPU ms and server CPU s (thread_time), "
          "KiB per device")
    hdr = ("| devices | mode | t | dropped | how | device ShareKeys ms | device Masking ms | device Unmask ms "
           "| sent KiB | recv KiB | server collect s | server unmask s | of which self masks s | of which dropped "
           "devices' masks s | server PRG exp. | PRG+add ms per expansion | max err |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        print(f"| {r['n']} | {r['mode']} | {r['t']} | {r['drop']} | {r['how']} | {1e3 * r['dev_share_s']:.1f} | "
              f"{1e3 * r['dev_mask_s']:.1f} | {1e3 * r['dev_unmask_s']:.2f} | {r['sent_kb']:,.0f} | {r['recv_kb']:,.0f} | "
              f"{r['srv_collect_s']:.3f} | {r['srv_unmask_s']:.3f} | {r['srv_self_s']:.3f} | {r['srv_dropped_s']:.3f} | "
              f"{r['prg']:,} | {r['prg_ms']:.2f} | {r['err']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
