"""What the design guarantees about float results, as assertions (issue 13, defect 1).

FedAvg accumulates in float64 and casts once to float32 (server_agg.aggregate): two
summation orders agree to float64 rounding, which can still put the single float32 cast on
either side of a rounding boundary — so results of different code paths (chunked vs whole,
sliced vs one reduction, numpy vs torch) agree to **one float32 ulp**, not bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch


def float32_ulps_apart(a, b) -> float:
    """Largest distance between ``a`` and ``b`` in units of float32 ulp of the larger magnitude."""
    x = np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float64)
    y = np.asarray(b.detach().cpu() if isinstance(b, torch.Tensor) else b, dtype=np.float64)
    ulp = np.spacing(np.maximum(np.abs(x), np.abs(y)).astype(np.float32)).astype(np.float64)
    return float((np.abs(x - y) / ulp).max()) if x.size else 0.0


def assert_within_float32_ulps(a, b, ulps: float = 1.0, what: str = "") -> None:
    """``a`` and ``b`` differ by at most ``ulps`` float32 ulps everywhere."""
    d = float32_ulps_apart(a, b)
    assert d <= ulps, f"{what}: {d:.2f} float32 ulps apart (> {ulps})"
