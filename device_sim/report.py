"""Results of a simulation as files: ``results.json``, a markdown table and ROC PNGs; paired
per-client Δ against the ``pretrained`` row (:func:`add_deltas`) and the combination of
several seeds (:func:`combine_seeds`, :func:`seeds_markdown_table`)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedfs_sdk.fileio import atomic_write_bytes
from fedfs_sdk.runtime.enrollment import min_warmup_images

from .metrics import paired_delta
from .plots import plot_roc

COLUMNS: tuple[tuple[str, str | tuple[str, ...]], ...] = (
    ("template AUROC", "verification.auroc.mean"),
    ("Δ ±SE", "delta:template_auroc"),
    ("pairwise AUROC", "pairwise.auroc.mean"),
    ("Δ ±SE", "delta:pairwise_auroc"),
    ("TPIR@FPIR 0.1 / 0.01 (other clients)", ("identification_clients.tpir_at_fpir.0.1.mean",
                                              "identification_clients.tpir_at_fpir.0.01.mean")),
    ("Δ TPIR@0.1 ±SE", "delta:tpir_clients@0.1"),
    ("TAR@FAR=1e-3", "verification.tar_at_far.0.001.mean"),
    ("Δ ±SE", "delta:tar@0.001"),
    ("pairwise TAR@FAR=1e-3", "pairwise.tar_at_far.0.001.mean"),
    ("Δ ±SE", "delta:pairwise_tar@0.001"),
    ("TPIR@FPIR 0.1 / 0.01 / 0.001 (new users)", ("identification.tpir_at_fpir.0.1.mean",
                                                  "identification.tpir_at_fpir.0.01.mean",
                                                  "identification.tpir_at_fpir.0.001.mean")),
    ("warm-up TPR", "warmup.tpr.mean"),
    ("FPR others", "warmup.fpr_participants.mean"),
    ("FPR new", "warmup.fpr_new_users.mean"),
    ("new-user TPR", "new_users.tpr.mean"),
    ("new-user FPR", "new_users.fpr.mean"),
)
"""Table columns: (header, source). A source is a dotted path into one method's ``eval``
dict (means over clients), a tuple of such paths (one cell, values joined by `` / ``), or
``"delta:KEY"`` — the row's paired Δ ± SE against the reference method (:func:`add_deltas`).
EER and TAR@FAR=1e-2 are left out of the table; they stay in ``results.json``. TAR@FAR=1e-3
(template) is usually a floor (``†``: fewer than 1,000 impostor images per client); the pairwise
TAR@FAR=1e-3 scores ``n·m`` impostor pairs per client and resolves it."""

DELTA_METRICS: dict[str, str] = {
    "template_auroc": "verification.per_client_auroc",
    "pairwise_auroc": "pairwise.per_client_auroc",
    "tar@0.001": "verification.per_client_tar_at_far.0.001",
    "pairwise_tar@0.001": "pairwise.per_client_tar_at_far.0.001",
    "tpir_clients@0.1": "identification_clients.per_client.0.1",
    "tpir_clients@0.01": "identification_clients.per_client.0.01",
    "tpir_new@0.1": "identification.per_client.0.1",
    "tpir_new@0.01": "identification.per_client.0.01",
}
"""Paired Δ keys → dotted path of the per-client list in ``eval`` (ordered as ``eval["clients"]``)."""

HEADLINE: dict[str, str] = {
    "template_auroc": "verification.auroc.mean",
    "pairwise_auroc": "pairwise.auroc.mean",
    "tpir_clients@0.1": "identification_clients.tpir_at_fpir.0.1.mean",
    "tpir_clients@0.01": "identification_clients.tpir_at_fpir.0.01.mean",
    "tpir_new@0.1": "identification.tpir_at_fpir.0.1.mean",
    "tpir_new@0.01": "identification.tpir_at_fpir.0.01.mean",
    "tar@0.01": "verification.tar_at_far.0.01.mean",
    "tar@0.001": "verification.tar_at_far.0.001.mean",
    "pairwise_tar@0.001": "pairwise.tar_at_far.0.001.mean",
    "warmup_tpr": "warmup.tpr.mean",
    "fpr_others": "warmup.fpr_participants.mean",
    "fpr_new": "warmup.fpr_new_users.mean",
}
"""Headline metrics of :func:`combine_seeds` → dotted path into one method's ``eval``."""


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


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


BELOW_RESOLUTION = "†"
"""Marks a FAR/FPIR cell whose target is below the resolution of the impostor (non-mated)
set: with ``n`` impostor images the smallest FAR that can be measured is ``1/n``, so the
printed TAR/TPIR is the value at FAR 0 — a floor, not a measurement."""
EMPTY_WHY = "‡"
"""Marks an empty cell whose reason is in the notes (e.g. too few warm-up images for ``q``)."""


def _target(path: str) -> float | None:
    try:
        return float(path.rsplit(".", 2)[-2] + "." + path.rsplit(".", 1)[-1]) if path.count(".") >= 2 else None
    except ValueError:
        return None


def column_notes(ev: Mapping[str, Any], q: float | None = None) -> dict[str, str]:
    """Why a cell of one method's row is a floor or empty: ``{dotted path: reason}``.

    * TAR@FAR / TPIR@FPIR targets below ``1/n_impostor`` (``verification.far_resolution``,
      the coarsest client's; the new users' images for the new-user TPIR) — the value
      printed is the one at FAR 0;
    * warm-up / new-user TPR and FPR that are empty because every user had fewer than
      ``⌈1/(1−q)⌉`` warm-up images (FedUV Alg. 2 needs that many for a threshold at ``q``).
    """
    notes: dict[str, str] = {}
    res = lookup(ev, "verification.far_resolution")
    n_new = ev.get("new_user_images")
    for _, source in COLUMNS:
        for path in (source if isinstance(source, tuple) else (source,)):
            if path.startswith("delta:"):
                continue
            if path.startswith(("verification.tar_at_far.", "identification_clients.tpir_at_fpir.")):
                r = res
            elif path.startswith("identification.tpir_at_fpir."):
                r = 1.0 / n_new if n_new else None
            else:
                r = None
            f = _target(path.removesuffix(".mean"))
            if _finite(r) and f is not None and f < r and lookup(ev, path) is not None:
                n = round(1 / r)
                notes[path] = (f"target {f:g} is below the resolution of the impostor set ({n} impostor images "
                               f"→ smallest measurable rate 1/{n} = {r:.4f}): the value is the one at rate 0, a "
                               f"floor; more clients / test images (or new users) make it measurable")
    for path, count in (("warmup.tpr.mean", "warmup.n_insufficient"), ("warmup.fpr_participants.mean", "warmup.n_insufficient"),
                        ("warmup.fpr_new_users.mean", "warmup.n_insufficient"),
                        ("new_users.tpr.mean", "new_users.n_insufficient"), ("new_users.fpr.mean", "new_users.n_insufficient")):
        v, k = lookup(ev, path), lookup(ev, count)
        if (v is None or (isinstance(v, float) and math.isnan(v))) and isinstance(k, int) and k > 0:
            need = min_warmup_images(q) if q is not None and 0 < q < 1 else None
            notes[path] = (f"empty: all {k} users had too few warm-up images for q = {q}"
                           + (f" (FedUV Alg. 2 needs ⌈1/(1−q)⌉ = {need})" if need else "")
                           + "; lower --q or give each identity more images")
    return notes


def annotate_rows(rows: Sequence[dict[str, Any]], q: float | None = None) -> Sequence[dict[str, Any]]:
    """``row["column_notes"] = column_notes(row["eval"], q)`` for every row, in place."""
    for r in rows:
        r["column_notes"] = column_notes(r.get("eval") or {}, q)
    return rows


def notes_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The table's footnotes: each distinct reason of the rows' ``column_notes``, once, with
    the columns (and methods) it applies to."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        for path, why in (r.get("column_notes") or {}).items():
            by_reason.setdefault(why, [])
            col = _column_of(path)
            if col not in by_reason[why]:
                by_reason[why].append(col)
    lines = []
    for why, cols in by_reason.items():
        mark = EMPTY_WHY if why.startswith("empty") else BELOW_RESOLUTION
        lines.append(f"{mark} {', '.join(cols)}: {why}")
    return lines


def _column_of(path: str) -> str:
    for head, source in COLUMNS:
        if path == source or (isinstance(source, tuple) and path in source):
            if isinstance(source, tuple) and path.startswith(("identification", "verification")):
                return f"{head.split(' (')[0].split(' / ')[0].rsplit(' ', 1)[0]} {_target(path.removesuffix('.mean')):g}" \
                    + (f" ({head.split(' (')[1]}" if " (" in head else "")
            return head
    return path


def fmt_delta(d: Mapping[str, Any] | None) -> str:
    """``+0.0123 ± 0.0045`` (mean Δ ± SE); ``–`` when there is no Δ, ``± –`` without an SE."""
    if not d or not _finite(d.get("mean")):
        return "–"
    se = d.get("se")
    return f"{d['mean']:+.4f} ± {se:.4f}" if _finite(se) else f"{d['mean']:+.4f} ± –"


def _aligned(ev: Mapping[str, Any], ref: Mapping[str, Any], path: str) -> tuple[list, list] | None:
    """Per-client values of ``ev`` and ``ref`` at ``path`` paired by client id (``clients``);
    positional when either lacks ids and the lengths agree; None when they cannot be paired."""
    a, b = lookup(ev, path), lookup(ref, path)
    if not isinstance(a, (Sequence, np.ndarray)) or not isinstance(b, (Sequence, np.ndarray)):
        return None
    ca, cb = ev.get("clients"), ref.get("clients")
    if ca is not None and cb is not None and len(ca) == len(a) and len(cb) == len(b):
        pos = {int(c): k for k, c in enumerate(cb)}
        pairs = [(a[k], b[pos[int(c)]]) for k, c in enumerate(ca) if int(c) in pos]
        return [x for x, _ in pairs], [y for _, y in pairs]
    if len(a) == len(b):
        return list(a), list(b)
    return None


def add_deltas(rows: Sequence[dict[str, Any]], reference: str = "pretrained") -> Sequence[dict[str, Any]]:
    """Paired per-client Δ of every row against the reference row, in place; returns ``rows``.

    ``reference`` is a method name (``row["method"]``) or a label (``row["label"]``); the first
    matching row is the reference. Without one nothing changes. Every other row gets
    ``row["delta"] = {key: metrics.paired_delta(row's values, reference's values)}`` for the
    keys of :data:`DELTA_METRICS` both rows have (``template_auroc``, ``pairwise_auroc``,
    ``tpir_clients@0.1``, ``tpir_clients@0.01``, ``tpir_new@0.1``, ``tpir_new@0.01``), each
    ``{"mean", "se", "n", "wins", "losses"}`` with Δ = row − reference over the clients both
    evaluated (paired by ``eval["clients"]``) with finite values; and
    ``row["delta_reference"] = reference row's label``.
    """
    ref = next((r for r in rows if r.get("method") == reference), None) or \
        next((r for r in rows if r.get("label") == reference), None)
    if ref is None:
        return rows
    for r in rows:
        if r is ref:
            continue
        delta: dict[str, Any] = {}
        for key, path in DELTA_METRICS.items():
            ab = _aligned(r["eval"], ref["eval"], path)
            if ab is not None:
                delta[key] = paired_delta(*ab)
        r["delta"] = delta
        r["delta_reference"] = ref["label"]
    return rows


def _marked(row: Mapping[str, Any], path: str) -> str:
    why = (row.get("column_notes") or {}).get(path)
    text = _fmt(lookup(row["eval"], path))
    if why is None:
        return text
    return text + (EMPTY_WHY if why.startswith("empty") else BELOW_RESOLUTION)


def _cell(row: Mapping[str, Any], source: str | tuple[str, ...], ref_label: str | None) -> str:
    if isinstance(source, tuple):
        return " / ".join(_marked(row, p) for p in source)
    if source.startswith("delta:"):
        if "delta" not in row:
            return "ref" if ref_label is not None and row.get("label") == ref_label else "–"
        return fmt_delta(row["delta"].get(source[len("delta:"):]))
    return _marked(row, source)


def _dp_cell(dp: Mapping[str, Any] | None) -> str:
    if not dp:
        return "–"
    eps = dp["epsilon"]
    return f"{eps if isinstance(eps, str) else format(eps, '.3g')} ({dp['delta']:.2g}; σ={dp['noise_multiplier']:.3g})"


SELECTION_HEAD = "chose ξ / global / personalized"


def selection_cell(sel: Mapping[str, Any] | None, new_users: Mapping[str, int] | None = None) -> str:
    """``12 / 3 / 87``: clients whose do-no-harm check (``select=on``) kept ξ, the global model,
    their personalized model; ``–`` for a method without the check. ``new_users``: what the users
    who never trained chose (ξ / global, norm-adapt), appended as ``; new users 10 / 0 (norm-adapt 6)``."""
    if not sel:
        return "–"
    c = sel.get("counts") or {}
    cell = " / ".join(str(c.get(k, 0)) for k in ("xi", "global", "personalized"))
    cell += f" (norm-adapt {c['norm-adapt']})" if "norm-adapt" in c else ""   # check=in-domain's 4th candidate
    if new_users:
        cell += f"; new users {new_users.get('xi', 0)} / {new_users.get('global', 0)}" + \
            (f" (norm-adapt {new_users['norm-adapt']})" if "norm-adapt" in new_users else "")
    return cell


def markdown_table(rows: Sequence[Mapping[str, Any]], title: str | None = None,
                   reference: str = "pretrained") -> str:
    """One row per method: ``{"label", "eval", "rounds", "seconds"[, "delta"]}``.

    Δ columns: the rows' ``delta`` (:func:`add_deltas`); when no row has one they are computed
    here against ``reference`` (the rows are not modified). The reference row shows ``ref``.
    """
    if not any("delta" in r for r in rows):
        rows = add_deltas([dict(r) for r in rows], reference)
    if not any("column_notes" in r for r in rows):
        rows = annotate_rows([dict(r) for r in rows])
    ref_label = next((r.get("delta_reference") for r in rows if "delta_reference" in r), None)
    dp = any(r.get("dp") for r in rows)     # user-level DP-FedAvg runs (device_sim.dp_sim): ε (δ) column
    sel = any(r.get("selection") for r in rows)     # do-no-harm selection: how many clients chose which model
    head = ["method", *(["ε (δ)"] if dp else []), *(h for h, _ in COLUMNS), *([SELECTION_HEAD] if sel else []),
            "rounds", "train s"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], *([_dp_cell(r.get("dp"))] if dp else []), *(_cell(r, src, ref_label) for _, src in COLUMNS),
                 *([selection_cell(r.get("selection"), ((r.get("eval") or {}).get("new_users") or {}).get("chose"))]
                   if sel else []),
                 str(r.get("rounds", 0)), f"{r.get('seconds', 0.0):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    foot = notes_lines(rows)
    return "\n".join(lines + ([""] + foot if foot else [])) + "\n"


# Several seeds: device_sim.report_seeds (re-exported here)
def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-").lower() or "method"


def headroom(rows: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """How much room a scenario leaves for personalization: the ``oracle`` row (supervised
    fine-tune with every client's labels) minus the ``pretrained`` row (ξ), for the template
    and pairwise AUROC; None unless both rows are there."""
    by = {r.get("method"): r for r in rows}
    if "oracle" not in by or "pretrained" not in by:
        return None
    out = {}
    for name, path in (("template_auroc", "verification.auroc.mean"), ("pairwise_auroc", "pairwise.auroc.mean")):
        a, b = lookup(by["oracle"]["eval"], path), lookup(by["pretrained"]["eval"], path)
        out[name] = float(a) - float(b) if a is not None and b is not None else float("nan")
    return out


def headroom_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line for the table: ``headroom (oracle − ξ): template +0.218, pairwise +0.144``."""
    h = headroom(rows)
    if h is None:
        return "headroom: run the 'oracle' and 'pretrained' rows too to see how much room personalization has"
    return f"headroom (oracle − ξ): template AUROC {h['template_auroc']:+.4f}, pairwise AUROC {h['pairwise_auroc']:+.4f}"


def write_results(out_dir: str | Path, results: dict[str, Any], title: str) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``roc.png`` (mean ROC per method) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "roc": out / "roc.png"}
    add_deltas(results["methods"])
    annotate_rows(results["methods"], results.get("eval_config", {}).get("q"))
    results["headroom"] = headroom(results["methods"])
    atomic_write_bytes(paths["json"], json.dumps(results, indent=1, default=_json_default).encode())
    table = markdown_table(results["methods"], title)
    ref = next((r["delta_reference"] for r in results["methods"] if "delta_reference" in r), None)
    notes = ["", headroom_line(results["methods"]), "", "Means over clients (docs/evaluation.md). Template AUROC/TAR: each client's verifier enrolls on its "
             "training images and scores its own test images vs other participants' test images. Pairwise AUROC "
             "(FedFR 1:1): cosine of the client's verifier's embeddings, every pair of its own test images vs each "
             "own test image × other participants' images. TPIR@FPIR: FedFR 1:N protocol with the other clients' "
             "images or new users' images as non-mated probes. "
             + (f"Δ ±SE: paired per-client difference to {ref} (mean ± standard error over clients). " if ref else "")
             + f"Warm-up: FedUV Alg. 2 threshold at q = {results.get('eval_config', {}).get('q', 0.9)} from the "
             "client's training images (fresh warm-up images with --warmup-per-client); TPR on its test images, FPR on other participants ('others') and on "
             "new users ('new'). New-user columns: users who never trained enroll with the shipped model.", ""]
    notes += list(results.get("notes") or [])      # how the split / q were chosen (folders)
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


from .report_seeds import (SEED_COLUMNS, combine_seeds, fmt_seed_delta,  # noqa: E402,F401 (re-exported)
                           seeds_markdown_table)

__all__ = ["column_notes", "annotate_rows", "notes_lines", "BELOW_RESOLUTION", "EMPTY_WHY",
           "markdown_table", "write_results", "headroom", "headroom_line", "lookup", "slug", "COLUMNS", "DELTA_METRICS", "HEADLINE",
           "add_deltas", "fmt_delta", "selection_cell", "SELECTION_HEAD", "combine_seeds", "fmt_seed_delta", "seeds_markdown_table", "SEED_COLUMNS"]
