"""Predicted vs measured in-domain FAR of the do-no-harm check's impostor model (issue 29, item 2).

``fedfs simulate`` with ``select=auto`` and ``check=in-domain`` (the defaults of ``fedfs`` and
``fedfs+feduv``) records, per client and candidate, the threshold ``τ`` at which the impostor draws
of :mod:`fedfs_sdk.stats.impostor_model` predict a FAR of 1e-3 … 1e-1, and the FAR measured at that
``τ`` on every other client's real photos (the simulator's ground truth; never used to decide).
This script prints, per candidate and target FAR, the mean / median measured FAR over clients and
the share within a factor 2 and 3 of the target, and draws the per-client points (log–log).

    python benchmarks/in_domain_far.py runs/px-real-night/seed_0/results.json [--method fedfs+feduv] \
        [--plot docs/in_domain_far.png]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def collect(results: dict, method: str | None) -> tuple[str, dict[str, dict[str, list[float]]]]:
    """``(label, {candidate: {far: [measured FAR per client]}})`` of the first method whose label starts
    with ``method`` and that recorded the diagnostic."""
    for r in results["methods"]:
        if method is not None and not r["label"].startswith(method):
            continue
        checks = [c for c in (r.get("selection") or {}).get("checks") or [] if c and c.get("in_domain_far")]
        if not checks:
            continue
        out: dict[str, dict[str, list[float]]] = {}
        for c in checks:
            for cand, d in c["in_domain_far"].items():
                for far, v in d.items():
                    if isinstance(v, dict):
                        out.setdefault(cand, {}).setdefault(far, []).append(float(v["measured_far"]))
        return r["label"], out
    raise SystemExit(f"no method{' ' + method if method else ''} with in-domain FAR diagnostics in these results")


def table(label: str, data: dict[str, dict[str, list[float]]]) -> str:
    lines = [f"{label}: measured in-domain FAR at the τ the impostor model sets for each target "
             f"(per client; other clients' real photos)", "",
             "| candidate | target FAR | clients | mean measured | median | within ×2 | within ×3 |", "|---|---|---|---|---|---|---|"]
    for cand, by in data.items():
        for far, vals in sorted(by.items(), key=lambda kv: float(kv[0])):
            v, t = np.asarray(vals), float(far)
            within = lambda k: float(np.mean((v <= k * t) & (v >= t / k)))  # noqa: E731
            lines.append(f"| {cand} | {t:g} | {v.size} | {v.mean():.4f} | {np.median(v):.4f} | "
                         f"{within(2):.0%} | {within(3):.0%} |")
    return "\n".join(lines)


def plot(data: dict[str, dict[str, list[float]]], path: Path, label: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = list(data)
    fig, axes = plt.subplots(1, len(cands), figsize=(3.2 * len(cands), 3.3), sharey=True)
    for ax, cand in zip(np.atleast_1d(axes), cands):
        rng = np.random.default_rng(0)
        for far, vals in data[cand].items():
            t = float(far)
            v = np.maximum(np.asarray(vals), 1e-4)          # a measured 0 is drawn at 1e-4
            ax.scatter(t * np.exp(rng.uniform(-0.15, 0.15, v.size)), v, s=6, alpha=0.35)
            ax.scatter([t], [np.asarray(vals).mean()], marker="_", s=300, c="k")
        ax.plot([1e-4, 0.3], [1e-4, 0.3], "k:", lw=0.8)
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_title(cand, fontsize=9)
        ax.set_xlabel("predicted FAR (target)")
    np.atleast_1d(axes)[0].set_ylabel("measured FAR (real in-domain impostors)")
    fig.suptitle(f"{label}: per-client FAR at the predicted threshold (bar: mean)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--method", default=None, help="label prefix (default: the first method with the diagnostic)")
    p.add_argument("--plot", type=Path, default=None)
    a = p.parse_args(argv)
    label, data = collect(json.loads(a.results.read_text()), a.method)
    print(table(label, data))
    if a.plot is not None:
        plot(data, a.plot, label)
        print(f"\nwrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
