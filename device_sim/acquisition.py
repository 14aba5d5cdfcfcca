"""Failure-to-acquire and where a run's time went (issue 31): the figures under the table.

**Failure-to-acquire** (FTA, ISO/IEC 19795-1): the share of photos in which no usable face is
found. A phone that cannot find its owner's face in a photo rejects its owner, so a verifier's
TAR counted only on the photos its preprocessing could use flatters it — and two ξ with
different preprocessing would not be compared on the same photos. The simulator drops those
photos before the split (they cannot be enrolled or probed); each client's enrolment and probe
photos are a uniform draw from its acquired photos, so the unacquired share of its folder,
``FTA_c = 1 − acquired_c / photos_c``, is its expected share of both its enrolment and its
probe photos, and

    TAR_all(FAR) = mean_c TAR_c(FAR) · (1 − FTA_c)

is TAR counted over all of its probes, an unacquired probe counted as a rejected owner.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["acquisition", "run_timing", "timing_line", "acquisition_line"]


def acquisition(faces: dict[str, Any], ev: dict[str, Any], ds, splits) -> dict[str, Any]:
    """FTA over the evaluated clients' photos and TAR over all their probes (module doc)."""
    photos = faces.get("identity_photos") or {}
    users = splits.clients
    ids = [users[c].identity for c in ev["clients"]]
    names = ds.identity_names(ids) if ids else []
    total = np.array([photos.get(n, 0) for n in names], dtype=np.float64)
    kept = np.array([ds.count(i) for i in ids], dtype=np.float64)
    fta_c = np.where(total > 0, 1.0 - kept / np.maximum(total, 1), 0.0)
    out: dict[str, Any] = {"fta": float((total - kept).sum() / total.sum()) if total.sum() else 0.0,
                           "fta_per_client": fta_c.round(6).tolist(),
                           "photos": int(total.sum()), "acquired": int(kept.sum()),
                           "folder_fta": faces.get("fta")}
    per = ev["verification"].get("per_client_tar_at_far") or {}
    out["tar_all_at_far"] = {f: float(np.nanmean(np.asarray(v, dtype=np.float64) * (1.0 - fta_c)))
                             for f, v in per.items() if len(v) == fta_c.size and fta_c.size}
    return out


def acquisition_line(rows: list[dict[str, Any]], far: str | None = None) -> str | None:
    """``failure-to-acquire …; TAR@FAR over all probes: method value · …`` (None without faces)."""
    acq = [(r["label"], r["eval"]["acquisition"]) for r in rows if (r.get("eval") or {}).get("acquisition")]
    if not acq:
        return None
    a0 = acq[0][1]
    fars = list(a0["tar_all_at_far"])
    if not fars:
        return None
    f = far if far in fars else ("0.001" if "0.001" in fars else fars[0])
    tars = " · ".join(f"{label} {a['tar_all_at_far'][f]:.4f}" for label, a in acq)
    return (f"failure-to-acquire: {a0['fta']:.1%} of the evaluated clients' photos ({a0['photos'] - a0['acquired']} "
            f"of {a0['photos']}; enrolment and probes alike); TAR@FAR={f} over all probes (an unacquired probe "
            f"is a rejected owner): {tars}")


def run_timing(data_s: float, faces: dict[str, Any] | None, xi_s: float, rows: list[dict[str, Any]],
               wall_s: float) -> dict[str, Any]:
    """``results.json`` → ``timing``: seconds of data (of which finding faces), ξ (loaded or
    pre-trained), training and evaluation per method, and the whole run."""
    return {"data_s": round(data_s, 2), "detection_s": round(float(faces["seconds"]), 2) if faces else None,
            "xi_s": round(xi_s, 2),
            "training_s": {r["label"]: round(float(r.get("seconds") or 0.0), 2) for r in rows},
            "evaluation_s": {r["label"]: round(float(r.get("eval_seconds") or 0.0), 2) for r in rows},
            "wall_s": round(wall_s, 2)}


def timing_line(t: dict[str, Any]) -> str:
    """The one line under the table: where the run's time went."""
    det = f" (faces {t['detection_s']:.0f} s)" if t.get("detection_s") is not None else ""
    train = " · ".join(f"{k} {v:.0f}" for k, v in t["training_s"].items())
    ev = " · ".join(f"{k} {v:.0f}" for k, v in t["evaluation_s"].items())
    return (f"time: data {t['data_s']:.0f} s{det}, ξ {t['xi_s']:.0f} s, training [{train}] s, "
            f"evaluation [{ev}] s, total {t['wall_s']:.0f} s")
