"""Several seeds of one experiment (``fedfs simulate --seeds K``): mean ± sd over seeds and each
seed's paired Δ (:func:`combine_seeds`, :func:`seeds_markdown_table`). Re-exported by
:mod:`device_sim.report`."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from .report import (DELTA_METRICS, HEADLINE, SELECTION_HEAD, _finite, add_deltas, fmt_delta, lookup,
                     selection_cell)


# ---------------------------------------------------------------------------------------------
def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    v = np.asarray([x if _finite(x) else np.nan for x in values], dtype=np.float64)
    ok = v[np.isfinite(v)]
    return {"mean": float(ok.mean()) if ok.size else math.nan,
            "sd": float(ok.std(ddof=1)) if ok.size >= 2 else math.nan,
            "n": int(ok.size), "values": [float(x) for x in v]}


def combine_seeds(per_seed_results: Sequence[Mapping[str, Any]], reference: str = "pretrained") -> list[dict[str, Any]]:
    """Combine the ``results`` dicts of K runs that differ only in the seed (``--seeds K``).

    Each input is one seed's results (``{"methods": [row, …], "settings": {"seed": …}, …}``);
    rows without ``delta`` get one here (:func:`add_deltas` on copies, against ``reference``).
    Methods are matched across seeds by ``label``, in first-seen order. Returns one row per
    label::

        {"label": str, "method": str,
         "seeds": [seed of each run holding this label (settings.seed, else its index)],
         "n_seeds": int,
         "metrics": {name: {"mean", "sd", "n", "values": [per seed]}},      # HEADLINE names
         "delta": {key: {"mean", "sd", "n", "values": [Δ mean per seed],    # DELTA_METRICS keys
                         "se": [paired SE per seed], "per_seed": [paired_delta dict | None],
                         "above_2se": #seeds with Δ > 2·SE, "below_2se": #seeds with Δ < −2·SE}},
         "delta_reference": reference label | None,
         "rounds": [per seed], "seconds": {"mean", "sd", "n", "values"}}

    ``mean``/``sd`` are over the seeds with a finite value (sd with ddof=1: NaN for one
    seed); ``values``/``se`` hold NaN where a seed has no value. The reference row's
    ``delta`` is ``{}``.
    """
    order: list[str] = []
    per_label: dict[str, list[tuple[Any, Mapping[str, Any]]]] = {}
    for k, res in enumerate(per_seed_results):
        rows = res["methods"]
        if not any("delta" in r for r in rows):
            rows = add_deltas([dict(r) for r in rows], reference)
        seed = (res.get("settings") or {}).get("seed", k)
        for r in rows:
            if r["label"] not in per_label:
                order.append(r["label"])
                per_label[r["label"]] = []
            per_label[r["label"]].append((seed, r))
    out = []
    nan = math.nan
    for label in order:
        runs = per_label[label]
        row: dict[str, Any] = {
            "label": label, "method": runs[0][1].get("method", label), "seeds": [s for s, _ in runs],
            "n_seeds": len(runs),
            "metrics": {name: _mean_sd([lookup(r["eval"], path) for _, r in runs]) for name, path in HEADLINE.items()},
            "delta": {},
            "delta_reference": next((r["delta_reference"] for _, r in runs if "delta_reference" in r), None),
            "rounds": [r.get("rounds") for _, r in runs],
            "selection": [(r.get("selection") or {}).get("counts") for _, r in runs],
            "seconds": _mean_sd([r.get("seconds", nan) for _, r in runs]),
        }
        keys = [k for k in DELTA_METRICS if any(k in (r.get("delta") or {}) for _, r in runs)]
        for key in keys:
            per_seed = [(r.get("delta") or {}).get(key) for _, r in runs]
            means = [d["mean"] if d and _finite(d.get("mean")) else nan for d in per_seed]
            ses = [d["se"] if d and _finite(d.get("se")) else nan for d in per_seed]
            agg = _mean_sd(means)
            agg.update({"se": ses, "per_seed": per_seed,
                        "above_2se": sum(1 for m, e in zip(means, ses) if _finite(m) and _finite(e) and m > 2 * e),
                        "below_2se": sum(1 for m, e in zip(means, ses) if _finite(m) and _finite(e) and m < -2 * e)})
            row["delta"][key] = agg
        out.append(row)
    return out


def _fmt_ms(m: Mapping[str, Any] | None) -> str:
    if not m or not _finite(m.get("mean")):
        return "–"
    return f"{m['mean']:.4f} ± {m['sd']:.4f}" if _finite(m.get("sd")) else f"{m['mean']:.4f}"


def fmt_seed_delta(d: Mapping[str, Any] | None) -> str:
    """``+0.0610 ± 0.0040 (3/3 seeds > 2·SE)``: mean ± sd over seeds of the paired Δ means and
    on how many seeds the Δ is beyond 2 SE in the direction of the mean (``< −2·SE`` when it
    is negative)."""
    if not d or not _finite(d.get("mean")):
        return "–"
    sd = f"{d['sd']:.4f}" if _finite(d.get("sd")) else "–"
    if d["mean"] >= 0:
        k, what = d["above_2se"], "> 2·SE"
    else:
        k, what = d["below_2se"], "< −2·SE"
    return f"{d['mean']:+.4f} ± {sd} ({k}/{d['n']} seeds {what})"


SEED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("template AUROC", "metrics:template_auroc"),
    ("Δ", "delta:template_auroc"),
    ("pairwise AUROC", "metrics:pairwise_auroc"),
    ("Δ", "delta:pairwise_auroc"),
    ("TPIR@FPIR 0.1 (other clients)", "metrics:tpir_clients@0.1"),
    ("TPIR@FPIR 0.01 (other clients)", "metrics:tpir_clients@0.01"),
    ("Δ TPIR@0.1", "delta:tpir_clients@0.1"),
    ("TAR@FAR=1e-3", "metrics:tar@0.001"),
    ("Δ", "delta:tar@0.001"),
    ("pairwise TAR@FAR=1e-3", "metrics:pairwise_tar@0.001"),
    ("Δ", "delta:pairwise_tar@0.001"),
    ("TPIR@FPIR 0.1 (new users)", "metrics:tpir_new@0.1"),
    ("warm-up TPR", "metrics:warmup_tpr"),
    ("FPR others", "metrics:fpr_others"),
)
"""Columns of :func:`seeds_markdown_table`: ``metrics:NAME`` (mean ± sd over seeds) or
``delta:KEY`` (:func:`fmt_seed_delta`)."""


def seeds_markdown_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> str:
    """Markdown of :func:`combine_seeds` rows: a table of mean ± sd over seeds (Δ cells add
    on how many seeds the paired Δ exceeds 2 SE), then a per-seed table of the paired
    ``Δ ± SE (wins/losses)`` of each method against the reference."""
    sel = any(any(r.get("selection") or []) for r in rows)
    head = ["method", "seeds", *(h for h, _ in SEED_COLUMNS), *([SELECTION_HEAD + " (per seed)"] if sel else []),
            "train s"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = next((r.get("delta_reference") for r in rows if r.get("delta_reference")), None)
    for r in rows:
        cells = [r["label"], str(r["n_seeds"])]
        for _, src in SEED_COLUMNS:
            kind, key = src.split(":", 1)
            if kind == "metrics":
                cells.append(_fmt_ms(r["metrics"].get(key)))
            else:
                cells.append("ref" if r["label"] == ref else fmt_seed_delta(r["delta"].get(key)))
        if sel:
            cells.append(", ".join(selection_cell({"counts": c}) for c in r.get("selection") or [] if c) or "–")
        s = r.get("seconds") or {}
        cells.append(f"{s['mean']:.0f}" if _finite(s.get("mean")) else "–")
        lines.append("| " + " | ".join(cells) + " |")
    keys = [k for k in DELTA_METRICS if any(k in r["delta"] for r in rows)]
    if keys:
        lines += ["", f"Paired Δ ± SE per seed (vs {ref}; wins/losses over clients):", "",
                  "| method | seed | " + " | ".join(f"Δ {k}" for k in keys) + " |",
                  "|" + "---|" * (len(keys) + 2)]
        for r in rows:
            if not r["delta"]:
                continue
            for i, seed in enumerate(r["seeds"]):
                cells = [r["label"], str(seed)]
                for k in keys:
                    d = r["delta"].get(k, {}).get("per_seed", [None] * (i + 1))[i]
                    cells.append(f"{fmt_delta(d)} ({d['wins']}/{d['losses']})" if d and _finite(d.get("mean")) else "–")
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["combine_seeds", "seeds_markdown_table", "fmt_seed_delta", "SEED_COLUMNS"]
