"""Accept/reject parity of an exported verifier with torch, as a device would decide.

FedUV codeword mode (FedUV Eq. 5, Alg. 2): the owner's score is ``e = vᵀ uv / c`` with the
device's ±1 codeword ``v``; ``τ`` is the warm-up threshold (the ``⌊n(1−q)⌋``-th smallest
warm-up score) computed **with the model that runs** (thresholds never carry over between
precisions); accept iff ``e ≥ τ``. This module replays that on one owner's warm-up, genuine
and impostor images for several backends' ``uv`` outputs and counts decisions that differ
from torch's. Used by the Core ML / int8 tests and ``benchmarks/export_fp16_parity.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedfs_sdk.runtime.enrollment import warmup_threshold


@dataclass(frozen=True)
class Decisions:
    """One backend's warm-up threshold and decisions (``True`` = accept)."""

    tau: float
    genuine: np.ndarray
    impostor: np.ndarray

    @property
    def tpr(self) -> float:
        return float(self.genuine.mean())

    @property
    def fpr(self) -> float:
        return float(self.impostor.mean())


def owner_codeword(uv_warmup: np.ndarray) -> np.ndarray:
    """A ±1 codeword the model is "trained towards" for the owner: the sign pattern of the
    owner's mean ``uv`` (a stand-in for FedUV training, which aligns ``σ(W g)`` with ``v``)."""
    v = np.sign(np.asarray(uv_warmup, dtype=np.float64).mean(axis=0))
    v[v == 0] = 1
    return v


def decide(uv_warmup: np.ndarray, uv_genuine: np.ndarray, uv_impostor: np.ndarray,
           codeword: np.ndarray, q: float = 0.9) -> Decisions:
    """Warm-up ``τ`` and decisions of one backend (scores ``vᵀ uv / c``)."""
    v = np.asarray(codeword, dtype=np.float64)
    c = v.size

    def score(uv: np.ndarray) -> np.ndarray:
        return np.asarray(uv, dtype=np.float64) @ v / c

    tau = warmup_threshold(score(uv_warmup), q)
    return Decisions(tau, score(uv_genuine) >= tau, score(uv_impostor) >= tau)


def disagreements(ref: Decisions, other: Decisions) -> int:
    """How many genuine + impostor decisions of ``other`` differ from ``ref``'s."""
    return int((ref.genuine != other.genuine).sum() + (ref.impostor != other.impostor).sum())
