"""A calibrated in-domain impostor tail: the Gaussian's location and scale, the federation's tail shape.

The Gaussian impostor model (:mod:`.impostor_model`) gets the bulk of a device's in-domain impostor
scores right (within ×2 at FAR 0.1) and its tail wrong: real impostors are a mixture of *people*,
and a few lookalikes put far more mass above the owner's threshold than a Gaussian does
(docs/personalization.md: at a predicted FAR 1e-3 the measured one was 4–16× higher on LFW
``real-night``). This module replaces the Gaussian's tail with one the federation measures, under
secure aggregation, along **public directions**:

* the public impostor set (shipped with the model) gives ``P`` public people's unit templates
  ``t_p`` (:func:`public_directions`) — faces, as an owner's template is, but of nobody in the
  federation;
* each device contributes, per direction, a histogram of the cosine scores ``s = e·t_p`` of its
  own photos' unit embeddings on fixed bins over ``[-1, 1]`` (:func:`tail_histogram`;
  ``P·B`` counts, at most :data:`~.contributions.MAX_PHOTOS` photos, so one device moves the sum by
  at most 64 per direction); the federation learns only the sum ``H`` ``[P, B]``;
* a device standardizes each direction's histogram with the **Gaussian model's own** location and
  scale along that direction (``m_p``, ``s_p``: the mean and SD of its draws' scores on ``t_p``),
  pools the ``P`` standardized distributions, and reads the ``1 − far`` quantile ``z*``
  (:func:`tail_z`): how many Gaussian-predicted SDs above the Gaussian-predicted mean real in-domain
  impostors reach at that rate. Standardizing with the model (not with ``H``'s own moments) lets
  ``z*`` also absorb the model's bias in location and scale;
* for its own template ``u`` the device sets ``τ = m_u + s_u·z*`` (:func:`calibrated_threshold`),
  ``m_u``, ``s_u`` from the same draws scored on ``u``.

What the server learns: for each public person, how many of the contributing devices' photos fall
in each score bin against that person's template — the federation's lookalike profile of public
faces, summed over ≥ 10 devices; nothing of any one device under secure aggregation. A device's
own contribution is subtracted before use (its photos are genuine for it, not impostors).

``z*`` is a property of the federation's conditions and the embedding, not of one template: a
device whose template is unusually close to a crowd of others still gets its Gaussian ``m_u``,
``s_u``, but only the federation's average tail shape — the per-device spread of the measured FAR
stays (docs/personalization.md gives it).
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .contributions import MAX_PHOTOS, TAIL_BINS

TAIL_EDGES = np.linspace(-1.0, 1.0, TAIL_BINS + 1)
TAIL = "xi.tail"
"""Name of the statistic (the histograms under ξ's embedding)."""


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def public_directions(embeddings: np.ndarray, identities: np.ndarray, min_photos: int = 2) -> np.ndarray:
    """``[P, D]`` unit templates of the public set's people (the normalized mean of each person's unit
    embeddings; people with fewer than ``min_photos`` photos left out), in order of identity."""
    e = _unit(embeddings)
    ids = np.asarray(identities).ravel()
    if ids.size != e.shape[0]:
        raise InputError(f"{e.shape[0]} public embeddings but {ids.size} identities")
    people = [p for p in np.unique(ids) if (ids == p).sum() >= min_photos]
    if len(people) < 2:
        raise InputError(f"tail directions need ≥ 2 public people with ≥ {min_photos} photos, got {len(people)}")
    return _unit(np.stack([e[ids == p].sum(0) for p in people]))


def tail_histogram(embeddings: np.ndarray, directions: np.ndarray, max_photos: int = MAX_PHOTOS) -> np.ndarray:
    """One device's contribution: ``[P·B]`` counts of its photos' cosine scores against each public
    direction, on :data:`TAIL_EDGES` (its first ``max_photos`` photos; row-major by direction)."""
    e = _unit(embeddings)[:max_photos]
    t = np.asarray(directions, dtype=np.float64)
    if e.ndim != 2 or t.ndim != 2 or e.shape[1] != t.shape[1]:
        raise InputError(f"tail histogram: embeddings {list(e.shape)} and directions {list(t.shape)} do not match")
    if not np.isfinite(e).all():
        raise InputError("tail histogram got non-finite embeddings: nothing contributed")
    s = np.clip(e @ t.T, -1.0, 1.0)                              # [n, P]
    b = np.minimum(((s + 1.0) / 2.0 * TAIL_BINS).astype(np.int64), TAIL_BINS - 1)
    out = np.zeros((t.shape[0], TAIL_BINS))
    for p in range(t.shape[0]):
        out[p] = np.bincount(b[:, p], minlength=TAIL_BINS)
    return out.ravel()


def _survival(hist: np.ndarray, loc: np.ndarray, scale: np.ndarray, z: float) -> float:
    """Pooled share above ``z`` of the directions' standardized scores (mass uniform within a bin)."""
    edges = (TAIL_EDGES[None, :] - loc[:, None]) / scale[:, None]         # [P, B+1]
    lo, hi = edges[:, :-1], edges[:, 1:]
    frac = np.clip((hi - z) / np.maximum(hi - lo, 1e-300), 0.0, 1.0)       # share of each bin above z
    n = hist.sum(1)
    return float(np.mean((hist * frac).sum(1) / n))


def tail_z(hist_sum: np.ndarray, loc: np.ndarray, scale: np.ndarray, far: float) -> float:
    """``z*``: the ``1 − far`` quantile of the pooled standardized scores ``(s − loc_p)/scale_p`` of the
    summed histograms ``hist_sum`` (``[P·B]`` or ``[P, B]``; directions with no photos ignored).
    ``loc``/``scale``: the Gaussian model's mean and SD of the score along each direction."""
    if not 0 < far < 1:
        raise InputError(f"far must be in (0, 1), got {far}")
    h = np.asarray(hist_sum, dtype=np.float64).reshape(-1, TAIL_BINS)
    loc, scale = np.asarray(loc, dtype=np.float64).ravel(), np.asarray(scale, dtype=np.float64).ravel()
    if loc.size != h.shape[0] or scale.size != h.shape[0]:
        raise InputError(f"{h.shape[0]} tail directions but {loc.size} locations / {scale.size} scales")
    keep = (h.sum(1) > 0) & (scale > 0)
    if not keep.any():
        raise InputError("the tail histogram holds no photos")
    h, loc, scale = h[keep], loc[keep], scale[keep]
    photos = h.sum(1).min()
    if photos * keep.sum() * far < 5:
        raise InputError(f"the federation's tail histogram holds {int(photos)} photos on {int(keep.sum())} directions: "
                         f"too few to estimate FAR {far:g} (need ≥ {int(np.ceil(5 / far))} scores in all)")
    a, b = -50.0, 50.0
    for _ in range(80):                 # bisection: the survival is monotone in z
        m = 0.5 * (a + b)
        if _survival(h, loc, scale, m) > far:
            a = m
        else:
            b = m
    return 0.5 * (a + b)


def draw_location_scale(draw_embeddings: np.ndarray, directions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and SD of the Gaussian draws' cosine scores along each row of ``directions`` ``[K, D]``."""
    s = _unit(draw_embeddings) @ _unit(np.atleast_2d(directions)).T
    return s.mean(0), s.std(0)


def calibrated_threshold(draw_scores: np.ndarray, z: float) -> float:
    """``τ = m_u + s_u·z*`` from the draws' scores on the owner's template and :func:`tail_z`."""
    s = np.asarray(draw_scores, dtype=np.float64).ravel()
    if s.size < 2:
        raise InputError("a calibrated threshold needs ≥ 2 impostor draws")
    return float(s.mean() + s.std() * z)


__all__ = ["public_directions", "tail_histogram", "tail_z", "draw_location_scale", "calibrated_threshold",
           "TAIL_BINS", "TAIL_EDGES", "TAIL"]
