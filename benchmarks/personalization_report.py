"""Per-seed paired Δ of every method against the references, from a ``fedfs simulate --seeds K`` folder.

``fedfs simulate --seeds K --out DIR`` writes ``DIR/seed_k/results.json``; this prints, for each
seed and each method, the paired per-client Δ (mean ± SE, wins/losses) of the template AUROC,
the pairwise AUROC and TPIR@FPIR 0.1 (other clients) against ``pretrained`` (ξ) and against
``local-compact`` (the trivial positives-only fine-tune) — the figures docs/personalization.md
quotes. Example::

    fedfs simulate --scenario cross-domain --seeds 3 --method pretrained local-compact norm-adapt \\
        oracle fedfs:paper fedfs+feduv:paper fedfs+feduv --clients 100 --new-users 10 --rounds 20 \\
        --threads 1 --out runs/cross-domain
    python benchmarks/personalization_report.py runs/cross-domain
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from device_sim.report import add_deltas, fmt_delta

KEYS = (("template_auroc", "template AUROC"), ("pairwise_auroc", "pairwise AUROC"),
        ("tpir_clients@0.1", "TPIR@0.1 (others)"))


def _cell(d: dict | None) -> str:
    if not d or d.get("n", 0) == 0:
        return "–"
    flag = " ✓" if d["mean"] > 2 * d["se"] else (" ✗" if d["mean"] < -2 * d["se"] else "")
    return f"{fmt_delta(d)} ({d['wins']}/{d['losses']}){flag}"


def report(folder: Path, references: tuple[str, ...] = ("pretrained", "local-compact")) -> str:
    seeds = sorted(folder.glob("seed_*/results.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not seeds:
        raise SystemExit(f"no seed_*/results.json under {folder} (run fedfs simulate --seeds K --out {folder})")
    lines = [f"# {folder}: paired per-client Δ (mean ± SE over clients, wins/losses; ✓ = Δ > 2·SE)", ""]
    for ref in references:
        lines += [f"## Δ vs {ref}", "", "| seed | method | " + " | ".join(h for _, h in KEYS) + " |",
                  "|---|---|" + "---|" * len(KEYS)]
        for path in seeds:
            res = json.loads(path.read_text())
            rows = copy.deepcopy(res["methods"])
            add_deltas(rows, ref)
            for r in rows:
                if "delta" not in r or r.get("method") == ref:
                    continue
                cells = [_cell(r["delta"].get(k)) for k, _ in KEYS]
                lines.append(f"| {res['settings']['seed']} | {r['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the --out folder of a fedfs simulate --seeds K run")
    p.add_argument("--reference", nargs="+", default=["pretrained", "local-compact"],
                   help="reference methods (names or labels)")
    a = p.parse_args()
    print(report(a.folder, tuple(a.reference)))


if __name__ == "__main__":
    main()
