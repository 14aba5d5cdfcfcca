"""Report: paired Δ against the reference method, the markdown table, combining seeds."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from device_sim.report import (add_deltas, combine_seeds, fmt_delta, fmt_seed_delta, markdown_table,
                               seeds_markdown_table, write_results)


def _eval(clients: list[int], template: list[float], pairwise: list[float] | None = None,
          tpir: list[float] | None = None) -> dict:
    """A minimal ``evaluate()`` result: per-client lists ordered as ``clients``."""
    ev: dict = {"clients": clients,
                "verification": {"auroc": {"mean": float(np.mean(template))}, "per_client_auroc": template,
                                 "eer": {"mean": 0.25}, "tar_at_far": {"0.01": {"mean": 0.5}, "0.001": {"mean": 0.125}}},
                "warmup": {"tpr": {"mean": 0.9}, "fpr_participants": {"mean": 0.05}}}
    if pairwise is not None:
        ev["pairwise"] = {"auroc": {"mean": float(np.nanmean(pairwise))}, "per_client_auroc": pairwise}
    if tpir is not None:
        ev["identification_clients"] = {"tpir_at_fpir": {"0.1": {"mean": float(np.mean(tpir))}, "0.01": {"mean": 0.0}},
                                        "per_client": {"0.1": tpir, "0.01": [0.0] * len(tpir)}}
    return ev


def _rows() -> list[dict]:
    ref = {"method": "pretrained", "label": "pretrained", "rounds": 0, "seconds": 0.0,
           "eval": _eval([0, 1, 2, 3], [0.5, 0.6, 0.7, 0.8], [0.6, 0.6, 0.6, 0.6], [0.2, 0.2, 0.2, 0.2])}
    # the same clients in another order; client 1's pairwise AUROC is degenerate (NaN)
    fed = {"method": "fedfs", "label": "fedfs", "rounds": 3, "seconds": 12.0,
           "eval": _eval([3, 2, 1, 0], [0.9, 0.8, 0.65, 0.6], [0.5, 0.6, math.nan, 0.9], [0.3, 0.4, 0.2, 0.1])}
    return [ref, fed]


def test_add_deltas_pairs_by_client_id() -> None:
    rows = add_deltas(_rows())
    assert "delta" not in rows[0] and rows[1]["delta_reference"] == "pretrained"
    d = rows[1]["delta"]
    # template: client 0: .6−.5, 1: .65−.6, 2: .8−.7, 3: .9−.8 → Δ = .1, .05, .1, .1
    t = d["template_auroc"]
    assert t["n"] == 4 and t["wins"] == 4 and t["losses"] == 0 and t["mean"] == pytest.approx(0.0875)
    assert t["se"] == pytest.approx(np.std([0.1, 0.05, 0.1, 0.1], ddof=1) / 2)
    # pairwise: client 0: .9−.6, 2: .6−.6, 3: .5−.6 (client 1 NaN, dropped) → .3, 0, −.1
    p = d["pairwise_auroc"]
    assert p["n"] == 3 and p["wins"] == 1 and p["losses"] == 1 and p["mean"] == pytest.approx(0.2 / 3)
    # TPIR (other clients) @0.1: client 0: .1−.2, 1: .2−.2, 2: .4−.2, 3: .3−.2
    assert d["tpir_clients@0.1"]["mean"] == pytest.approx(0.05)
    assert d["tpir_clients@0.01"]["mean"] == 0.0 and "tpir_new@0.1" not in d     # no new-user block here


def test_add_deltas_without_reference_or_ids() -> None:
    rows = _rows()[1:]
    assert add_deltas(rows) is rows and "delta" not in rows[0]
    # rows without client ids pair positionally when the lengths agree
    a = {"method": "pretrained", "label": "pre", "eval": {"verification": {"per_client_auroc": [0.5, 0.5]}}}
    b = {"method": "x", "label": "x", "eval": {"verification": {"per_client_auroc": [0.75, 0.25]}}}
    add_deltas([a, b], reference="pre")
    assert b["delta"]["template_auroc"]["mean"] == 0.0 and b["delta"]["template_auroc"]["wins"] == 1


def test_fmt_delta() -> None:
    assert fmt_delta({"mean": 0.0123, "se": 0.0045}) == "+0.0123 ± 0.0045"
    assert fmt_delta({"mean": -0.5, "se": math.nan}) == "-0.5000 ± –"
    assert fmt_delta(None) == "–" and fmt_delta({"mean": math.nan, "se": 0.1}) == "–"


def test_markdown_table_new_columns() -> None:
    rows = _rows()
    table = markdown_table(rows, "t")
    assert "delta" not in rows[1]                      # computed for display, rows untouched
    head = table.splitlines()[2]
    for col in ("template AUROC", "Δ ±SE", "pairwise AUROC", "TPIR@FPIR 0.1 / 0.01 (other clients)",
                "Δ TPIR@0.1 ±SE", "TAR@FAR=1e-3", "warm-up TPR"):
        assert col in head
    assert "EER" not in head and "TAR@FAR=1e-2" not in head       # 1e-2 stays in results.json
    assert "pairwise TAR@FAR=1e-3" in head
    assert head.index("template AUROC") < head.index("pairwise AUROC") < head.index("TAR@FAR=1e-3")
    fed = next(line for line in table.splitlines() if line.startswith("| fedfs |"))
    cells = [c.strip() for c in fed.strip("|").split("|")]
    assert cells[1] == "0.7375" and cells[2].startswith("+0.0875 ± ")
    assert cells[5] == "0.2500 / 0.0000" and cells[6].startswith("+0.0500 ± ")
    pre = next(line for line in table.splitlines() if line.startswith("| pretrained |"))
    assert "| ref |" in pre
    assert len({line.count("|") for line in table.splitlines()[2:]}) == 1


def test_write_results_stores_deltas(tmp_path) -> None:
    results = {"methods": _rows(), "eval_config": {"q": 0.9}}
    paths = write_results(tmp_path, results, "t")
    saved = json.loads(paths["json"].read_text())
    assert saved["methods"][1]["delta"]["template_auroc"]["n"] == 4
    assert "Δ ±SE: paired per-client difference to pretrained" in paths["md"].read_text()


def _seed(seed: int, pre: list[float], fed: list[float], pairwise: bool) -> dict:
    c = list(range(len(pre)))
    return {"settings": {"seed": seed}, "methods": [
        {"method": "pretrained", "label": "pretrained", "rounds": 0, "seconds": 0.0,
         "eval": _eval(c, pre, pre if pairwise else None)},
        {"method": "fedfs", "label": "fedfs", "rounds": 2, "seconds": 10.0 + seed,
         "eval": _eval(c, fed, fed if pairwise else None)}]}


def test_combine_seeds_two_fake_seeds() -> None:
    s0 = _seed(7, [0.5, 0.5, 0.5], [0.6, 0.7, 0.8], pairwise=True)      # Δ = .1, .2, .3
    s1 = _seed(8, [0.5, 0.5, 0.4], [0.5, 0.6, 0.9], pairwise=False)     # Δ = 0, .1, .5
    rows = combine_seeds([s0, s1])
    assert [r["label"] for r in rows] == ["pretrained", "fedfs"]
    pre, fed = rows
    assert pre["delta"] == {} and fed["delta_reference"] == "pretrained"
    assert fed["seeds"] == [7, 8] and fed["n_seeds"] == 2 and fed["rounds"] == [2, 2]
    m = fed["metrics"]["template_auroc"]
    assert m["values"] == pytest.approx([0.7, 2 / 3]) and m["mean"] == pytest.approx((0.7 + 2 / 3) / 2)
    assert m["sd"] == pytest.approx(np.std([0.7, 2 / 3], ddof=1)) and m["n"] == 2
    t = fed["delta"]["template_auroc"]
    # seed 7: mean .2, se = .1/√3 = .058 → Δ > 2·SE; seed 8: mean .2, sd √.07 → se .153 → not
    assert t["values"] == pytest.approx([0.2, 0.2]) and t["mean"] == pytest.approx(0.2) and t["sd"] == pytest.approx(0, abs=1e-12)
    assert t["se"] == pytest.approx([0.1 / math.sqrt(3), math.sqrt(0.07 / 3)])
    assert t["above_2se"] == 1 and t["below_2se"] == 0 and t["n"] == 2
    assert [d["wins"] for d in t["per_seed"]] == [3, 2]
    assert fmt_seed_delta(t) == "+0.2000 ± 0.0000 (1/2 seeds > 2·SE)"
    # pairwise only on seed 7: one seed, no sd
    p = fed["delta"]["pairwise_auroc"]
    assert p["n"] == 1 and p["per_seed"][1] is None and math.isnan(p["sd"]) and math.isnan(p["values"][1])
    assert fmt_seed_delta(p) == "+0.2000 ± – (1/1 seeds > 2·SE)"
    assert fed["seconds"]["mean"] == 17.5 and fed["seconds"]["values"] == [17.0, 18.0]
    # a negative gain counts the seeds below −2·SE
    neg = combine_seeds([_seed(0, [0.6, 0.7, 0.8], [0.5, 0.5, 0.5], False)])[1]["delta"]["template_auroc"]
    assert fmt_seed_delta(neg) == "-0.2000 ± – (1/1 seeds < −2·SE)"


def test_combine_seeds_keeps_given_deltas_and_table() -> None:
    s0 = _seed(0, [0.5, 0.5, 0.5], [0.6, 0.7, 0.8], pairwise=True)
    add_deltas(s0["methods"])
    s0["methods"][1]["delta"]["template_auroc"] = {"mean": 0.061, "se": 0.004, "n": 3, "wins": 3, "losses": 0}
    s1 = _seed(1, [0.5, 0.5, 0.5], [0.6, 0.7, 0.8], pairwise=True)
    rows = combine_seeds([s0, s1])
    assert rows[1]["delta"]["template_auroc"]["values"] == pytest.approx([0.061, 0.2])
    md = seeds_markdown_table(rows, "2 seeds")
    lines = md.splitlines()
    assert lines[0] == "### 2 seeds"
    head = lines[2]
    for col in ("seeds", "template AUROC", "pairwise AUROC", "Δ TPIR@0.1", "TPIR@FPIR 0.1 (other clients)"):
        assert col in head
    fed = next(line for line in lines if line.startswith("| fedfs | 2 |"))
    assert "(2/2 seeds > 2·SE)" in fed and "0.7000 ± 0.0000" in fed
    assert "| ref |" in next(line for line in lines if line.startswith("| pretrained |"))
    # per-seed paired Δ ± SE (wins/losses)
    assert "| fedfs | 0 | +0.0610 ± 0.0040 (3/0) |" in md
    assert any(line.startswith("| fedfs | 1 | +0.2000 ± 0.0577 (3/0)") for line in lines)
