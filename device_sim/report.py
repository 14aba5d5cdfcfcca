"""Results of a simulation as files: ``results.json``, a markdown table and ROC PNGs."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedfs_sdk.checkpoint import atomic_write_bytes

from .plots import plot_roc

COLUMNS: tuple[tuple[str, str], ...] = (
    ("AUROC", "verification.auroc.mean"),
    ("EER", "verification.eer.mean"),
    ("TAR@FAR=1e-2", "verification.tar_at_far.0.01.mean"),
    ("TAR@FAR=1e-3", "verification.tar_at_far.0.001.mean"),
    ("TPIR@FPIR=0.1", "identification.tpir_at_fpir.0.1.mean"),
    ("TPIR@FPIR=0.01", "identification.tpir_at_fpir.0.01.mean"),
    ("TPIR@FPIR=0.001", "identification.tpir_at_fpir.0.001.mean"),
    ("warm-up TPR", "warmup.tpr.mean"),
    ("FPR others", "warmup.fpr_participants.mean"),
    ("FPR new", "warmup.fpr_new_users.mean"),
    ("new-user TPR", "new_users.tpr.mean"),
    ("new-user FPR", "new_users.fpr.mean"),
)
"""Table columns: (header, dotted path into one method's ``eval`` dict); means over clients."""


def lookup(d: Mapping[str, Any], dotted: str) -> Any:
    """``d["a"]["b"]…`` for ``"a.b…"``; keys may themselves hold dots (``"0.01"``)."""
    cur: Any = d
    parts = dotted.split(".")
    i = 0
    while i < len(parts):
        if not isinstance(cur, Mapping):
            return None
        for j in range(len(parts), i, -1):          # longest key first ("0.001" before "0")
            key = ".".join(parts[i:j])
            if key in cur:
                cur, i = cur[key], j
                break
        else:
            return None
    return cur


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> str:
    """One row per method: ``{"label", "eval", "rounds", "seconds"}``."""
    head = ["method", *(h for h, _ in COLUMNS), "rounds", "train s"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], *(_fmt(lookup(r["eval"], path)) for _, path in COLUMNS),
                 str(r.get("rounds", 0)), f"{r.get('seconds', 0.0):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-").lower() or "method"


def write_results(out_dir: str | Path, results: Mapping[str, Any], title: str) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``roc.png`` (mean ROC per method) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "roc": out / "roc.png"}
    atomic_write_bytes(paths["json"], json.dumps(results, indent=1, default=_json_default).encode())
    table = markdown_table(results["methods"], title)
    notes = ["", "Means over clients. AUROC/EER/TAR: each client's verifier on its own test images vs other "
             "participants' test images. TPIR@FPIR: FedFR 1:N protocol with new users' images as non-mated probes. "
             f"Warm-up: FedUV Alg. 2 threshold at q = {results.get('eval_config', {}).get('q', 0.9)} from the "
             "client's training images; TPR on its test images, FPR on other participants ('others') and on "
             "new users ('new'). New-user columns: users who never trained enroll with the shipped model.", ""]
    atomic_write_bytes(paths["md"], (table + "\n".join(notes)).encode())
    curves = {r["label"]: (np.asarray(r["eval"]["roc"]["fpr"]), np.asarray(r["eval"]["roc"]["tpr"]))
              for r in results["methods"] if "roc" in r["eval"]}
    if curves:
        plot_roc(curves, paths["roc"], title=f"{title}: mean per-client ROC", mark_fprs=(1e-2, 1e-3))
    else:
        paths.pop("roc")
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


__all__ = ["markdown_table", "write_results", "lookup", "slug", "COLUMNS"]
