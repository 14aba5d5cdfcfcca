"""A deployment rehearsal's default row against the simulator at several training seeds on the same split:

    python benchmarks/rehearsal_seeds.py RUN/rehearsal.json SIM0/results.json SIM1/results.json SIM2/results.json

(``RUN``: ``benchmarks/deployment_rehearsal.py --out RUN``; each ``SIMk``: ``fedfs simulate … --seed k
--split-seed S --out SIMk`` with the rehearsal's split seed, so the same clients, photos and shifts.)
Prints, paired per client (mean ± SE of the differences, ``(>2·SE)`` where outside), the deployment
minus each simulator run, minus the per-client mean of them all, and each pair of simulator runs
against each other: how far two simulator seeds differ is the yardstick for one deployment − simulator
comparison at a single seed (docs/personalization.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KEYS = ("template_auroc", "pairwise_auroc", "template_tar", "pairwise_tar")


def _fmt(d: dict) -> str:
    return f"{d['mean']:+.4f} ± {d['se']:.4f}" + ("" if abs(d["mean"]) <= 2 * d["se"] else " (>2·SE)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rehearsal", type=Path, help="the rehearsal's rehearsal.json")
    p.add_argument("simulations", type=Path, nargs="+", help="results.json of fedfs simulate runs (same split)")
    args = p.parse_args(argv)

    from device_sim.client_metrics import paired_delta
    from rehearsal_eval import per_client

    dep = json.loads(args.rehearsal.read_text())
    row = next(r for r in dep["rows"] if r["name"].startswith("deployment: ") and "ξ" not in r["name"])
    sims: dict[str, dict[str, list[float]]] = {}
    for path in args.simulations:
        res = json.loads(path.read_text())
        method = next(m for m in res["methods"] if m["label"].startswith(row["name"].split(": ", 1)[1]))
        if list(method["eval"]["clients"]) != list(dep["clients"]):
            raise SystemExit(f"{path}: other clients than the rehearsal's (another split?)")
        sims[f"{path.parent.name} (seed {res['settings']['seed']})"] = per_client(method["eval"])
    print("| paired per client | " + " | ".join(KEYS) + " |\n|---|" + "---|" * len(KEYS))
    for name, v in sims.items():
        print(f"| deployment − simulator {name} | " + " | ".join(_fmt(paired_delta(row["values"][k], v[k])) for k in KEYS) + " |")
    mean = {k: list(np.nanmean(np.array([v[k] for v in sims.values()], dtype=float), axis=0)) for k in KEYS}
    print(f"| deployment − the mean of the {len(sims)} simulator runs | "
          + " | ".join(_fmt(paired_delta(row["values"][k], mean[k])) for k in KEYS) + " |")
    names = list(sims)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            print(f"| simulator {a} − {b} | " + " | ".join(_fmt(paired_delta(sims[a][k], sims[b][k])) for k in KEYS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
