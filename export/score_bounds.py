"""How far a converted verifier (Core ML fp16, ONNX int8) can move verification scores.

Both scores a device thresholds are bounded by the outputs' change, for *every* enrollment:

* ``uv`` (FedUV Eq. 5, score ``vᵀ uv / c`` for a ±1 codeword ``v``): by Cauchy–Schwarz
  ``|Δscore| ≤ ‖Δuv‖ · ‖v‖ / c = ‖Δuv‖ / √c`` whatever the codeword;
* ``embedding`` (template mode, cosine to an enrolled template): each side's unit vector
  moves by ``‖Δ unit(e)‖``, so the cosine moves by at most ``2 · ‖Δ unit(e)‖``.

The bound over a set of images is the max over those images. What it guarantees, and all
it guarantees: an accept/reject decision can differ from the reference's only where the
reference score lies within the bound of ``τ`` (plus the change of ``τ`` itself, which a
device computes from its own warm-up scores with the model it runs). Exact decision equality
for every image is not something any other precision can promise — a score within rounding
of ``τ`` flips either way.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

GUARANTEE = ("decisions can differ from the reference only for images whose score is within "
             "max_score_change of tau (Cauchy-Schwarz bound over these images, every codeword/template)")


def _unit(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-30)


def score_change_bound(name: str, have: np.ndarray, want: np.ndarray) -> float:
    """Largest verification-score change output ``name`` (``uv`` / ``embedding``) can cause
    over the images of ``have`` vs the reference ``want`` (both ``[N, d]``); ``inf`` when
    ``have`` is not finite."""
    have = np.asarray(have, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if not np.isfinite(have).all():
        return float("inf")
    if name == "uv":
        return float(np.linalg.norm(have - want, axis=-1).max() / np.sqrt(want.shape[-1]))
    return float(2 * np.linalg.norm(_unit(have) - _unit(want), axis=-1).max())


def score_change_bounds(have: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> dict[str, float]:
    """:func:`score_change_bound` of every output of ``want`` (missing in ``have``: KeyError)."""
    return {name: score_change_bound(name, have[name], ref) for name, ref in want.items()}


FLIP_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def _scores(name: str, out: np.ndarray, codewords: np.ndarray) -> np.ndarray:
    """Score columns a device would threshold: ``uv`` → ``vᵀ uv / c`` per codeword ``[N, K]``;
    ``embedding`` → the cosine of every image pair ``[N(N−1)/2, 1]``."""
    out = np.asarray(out, dtype=np.float64)
    if name == "uv":
        return out @ codewords.T / out.shape[-1]
    u = _unit(out)
    iu = np.triu_indices(len(u), 1)
    return (u @ u.T)[iu][:, None]


def decision_flip_rate(name: str, have: np.ndarray, want: np.ndarray, *, codewords: int = 64,
                       quantiles: tuple[float, ...] = FLIP_QUANTILES, seed: int = 0) -> float:
    """Largest fraction of accept/reject decisions that differ between ``have`` and ``want``.

    No identities are needed: for ``uv``, ``codewords`` random ±1 codewords score every image;
    for ``embedding``, every image pair is scored by cosine. For each score column and each
    quantile ``q`` of ``quantiles``, each model thresholds at the ``q``-quantile of its *own*
    scores (as a device computes ``τ`` with the model it runs), and the decisions are compared;
    the result is the fraction of differing decisions, averaged over the quantiles. ``1.0`` if
    ``have`` is not finite, ``0.0`` if there is nothing to score (one image, no pairs)."""
    have = np.asarray(have, dtype=np.float64)
    if not np.isfinite(have).all():
        return 1.0
    c = np.asarray(want).shape[-1]
    v = np.random.default_rng(seed).choice([-1.0, 1.0], size=(codewords, c))
    s_have, s_want = _scores(name, have, v), _scores(name, want, v)
    if s_want.shape[0] < 2:
        return 0.0
    rates = []
    for q in quantiles:
        a = s_have >= np.quantile(s_have, q, axis=0, method="lower")
        b = s_want >= np.quantile(s_want, q, axis=0, method="lower")
        rates.append(float((a != b).mean()))
    return float(np.mean(rates))
