"""Per-seed paired Δ of every method against the references, from a ``fedfs simulate --seeds K`` folder.

``fedfs simulate --seeds K --out DIR`` writes ``DIR/seed_k/results.json`` (so do K separate runs
``--seed k --split-seed k --out DIR/seed_k``); this prints the table of mean ± sd over seeds,
each do-no-harm method's choices and the federation's verdicts per seed, then, for each seed and
each method, the paired per-client Δ (mean ± SE, wins/losses) of the template and pairwise AUROC,
the template and pairwise TAR@FAR 1e-3 and TPIR@FPIR 0.1 (other clients) against ``pretrained``
(ξ) and against ``local-compact`` (the positives-only fine-tune) — the figures
docs/personalization.md quotes. Example::

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

from device_sim.report import add_deltas, combine_seeds, fmt_delta, seeds_markdown_table

KEYS = (("template_auroc", "template AUROC"), ("pairwise_auroc", "pairwise AUROC"),
        ("tar@0.001", "TAR@FAR 1e-3"), ("pairwise_tar@0.001", "pairwise TAR@FAR 1e-3"),
        ("tpir_clients@0.1", "TPIR@0.1 (others)"))


def _cell(d: dict | None) -> str:
    if not d or d.get("n", 0) == 0:
        return "–"
    flag = " ✓" if d["mean"] > 2 * d["se"] else (" ✗" if d["mean"] < -2 * d["se"] else "")
    return f"{fmt_delta(d)} ({d['wins']}/{d['losses']}){flag}"


def report(folder: Path, references: tuple[str, ...] = ("pretrained", "local-compact")) -> str:
    seeds = sorted(folder.glob("seed_*/results.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    # (separate `fedfs simulate --seed k --split-seed k --out DIR/seed_k` runs combine the same way)
    if not seeds:
        raise SystemExit(f"no seed_*/results.json under {folder} (run fedfs simulate --seeds K --out {folder})")
    per_seed = [json.loads(p.read_text()) for p in seeds]
    lines = [seeds_markdown_table(combine_seeds(per_seed), f"{folder}: mean ± sd over {len(seeds)} seeds"), ""]
    for res in per_seed:
        for r in res["methods"]:
            if r.get("selection"):
                v = {k: f"{d['mean_margin_gain']:+.3f} ± {d['se']:.3f} ({'helps' if d['helps'] else 'no'})"
                     for k, d in (r["selection"].get("verdicts") or {}).items()}
                lines.append(f"seed {res['settings']['seed']}, {r['label']}: chose ξ / global / personalized "
                             f"{' / '.join(str(r['selection']['counts'].get(k, 0)) for k in ('xi', 'global', 'personalized'))}"
                             f"{' / norm-adapt ' + str(r['selection']['counts']['norm-adapt']) if 'norm-adapt' in r['selection']['counts'] else ''}"
                             f"; federation's verdicts (margin gain over ξ): {v}")
    lines += ["", f"# {folder}: paired per-client Δ (mean ± SE over clients, wins/losses; ✓ = Δ > 2·SE)", ""]
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


COMPACT = (("template AUROC", "template_auroc"), ("pairwise AUROC", "pairwise_auroc"),
           ("TAR@FAR=1e-3", "tar@0.001"), ("pairwise TAR@FAR=1e-3", "pairwise_tar@0.001"))


def compact(folder: Path) -> str:
    """The docs' table: mean ± sd over seeds of each headline metric, its paired Δ vs ξ (mean over
    seeds; the smallest and largest seed's Δ; on how many seeds Δ > 2·SE) and the choices."""
    from device_sim.report import lookup  # noqa: F401 (keeps the report module's helpers importable)

    seeds = sorted(folder.glob("seed_*/results.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    rows = combine_seeds([json.loads(p.read_text()) for p in seeds])
    head = ["method"] + [h for h, _ in COMPACT] + ["chose ξ / global / personalized"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"]]
        for _, key in COMPACT:
            m = r["metrics"].get({"template_auroc": "template_auroc", "pairwise_auroc": "pairwise_auroc"}.get(key, key))
            d = r["delta"].get(key)
            val = f"{m['mean']:.4f}" if m and m.get("n") else "–"
            if d and d.get("n"):
                vals = [v for v in d["values"] if v == v]
                val += (f" ({d['mean']:+.4f}; seeds {min(vals):+.4f} … {max(vals):+.4f}; "
                        f"{d['above_2se'] if d['mean'] >= 0 else d['below_2se']}/{d['n']} "
                        f"{'> 2·SE' if d['mean'] >= 0 else '< −2·SE'})")
            cells.append(val)
        sel = [c for c in r.get("selection") or [] if c]
        cells.append(", ".join(" / ".join(str(c.get(k, 0)) for k in ("xi", "global", "personalized"))
                               + (f" (norm-adapt {c['norm-adapt']})" if "norm-adapt" in c else "") for c in sel)
                     or "–")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the --out folder of a fedfs simulate --seeds K run")
    p.add_argument("--reference", nargs="+", default=["pretrained", "local-compact"],  # a label works too
                   help="reference methods (names or labels)")
    p.add_argument("--compact", action="store_true", help="only the docs' table (mean over seeds, Δ range, choices)")
    a = p.parse_args()
    print(compact(a.folder) if a.compact else report(a.folder, tuple(a.reference)))


if __name__ == "__main__":
    main()
