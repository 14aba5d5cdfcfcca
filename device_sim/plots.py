"""ROC figures as PNG files (matplotlib's Agg canvas; no pyplot, no global backend switch)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from fedfs_sdk.errors import InputError

__all__ = ["plot_roc"]

Curve = tuple[np.ndarray, np.ndarray]


def plot_roc(curves: Mapping[str, Curve], path: str | os.PathLike[str], title: str = "ROC",
             log_x: bool = True, min_fpr: float = 1e-4, mark_fprs: Sequence[float] = (),
             dpi: int = 120) -> Path:
    """Write ROC curves ``{label: (fpr, tpr)}`` to a PNG at ``path`` and return the path.

    With ``log_x`` the FPR axis is logarithmic from ``min_fpr`` (points at FPR 0 are drawn at
    ``min_fpr``, the convention of face-verification ROC plots); ``mark_fprs`` draws dotted
    vertical guides (e.g. the TAR@FAR operating points).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not curves:
        raise InputError("no curves to plot")
    fig = Figure(figsize=(5.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, (fpr, tpr) in curves.items():
        fpr = np.asarray(fpr, dtype=np.float64)
        tpr = np.asarray(tpr, dtype=np.float64)
        if fpr.shape != tpr.shape or fpr.ndim != 1:
            raise InputError(f"curve {label!r}: fpr and tpr must be 1-D of equal length")
        x = np.maximum(fpr, min_fpr) if log_x else fpr
        ax.plot(x, tpr, label=label, linewidth=1.6, drawstyle="steps-post")
    for f in mark_fprs:
        ax.axvline(f, color="0.6", linestyle=":", linewidth=0.8)
    if log_x:
        ax.set_xscale("log")
        ax.set_xlim(min_fpr, 1.0)
    else:
        ax.set_xlim(0.0, 1.0)
        ax.plot([0, 1], [0, 1], color="0.8", linewidth=0.8, linestyle="--")
    ax.set_ylim(0.0, 1.01)
    ax.set_xlabel("false accept rate (FPR)")
    ax.set_ylabel("true accept rate (TPR)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out), dpi=dpi)
    return out
