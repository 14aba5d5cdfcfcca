"""What one device contributes to a statistics round, and the sum the federation learns.

A **statistic** is a named float vector that a device computes from its own photos and clips to
a published bound; the federation learns only the element-wise **sum** over devices and the
number of contributors (under secure aggregation, ``fedfs-secagg/2``: no single contribution).
The same functions run on a device (:mod:`fedfs_sdk.federation`), in the server's round
(:mod:`server_agg.stats_round`) and in the simulator (:mod:`device_sim.methods.selection`), so what
the simulator credits a client with is what a device obtains.

Three statistics (issue 29, item 1):

* **embedding moments** of ξ — per channel ``Σ e``, ``Σ e²`` and the photo count ``n`` of the
  pre-L2 embedding: what ``norm-adapt`` / ``norm_init`` fold into ξ's embedding normalization
  (:func:`norm_fold_from_sum`);
* **feature moments** — ``Σ f``, the upper triangle of ``Σ f fᵀ`` and ``n`` of ξ's trunk features
  (``scope="top"``: the input of every candidate's top): the federation's capture conditions, from
  which a device predicts the impostor scores of its own template
  (:mod:`fedfs_sdk.stats.impostor_model`);
* **check results** — per candidate the device's margin gain over ξ, its square, its AUROC gain
  and a 1: the federation's verdict (:func:`verdict_from_sum`) without any device's check.

Clipping: every photo's vector is clipped to an L2 norm ``bound`` before it enters a sum, and a
device contributes at most ``max_photos`` photos, so one device moves each element of the sum by a
bounded amount (what a DP noise scale needs; :func:`sensitivity`).

Noisy sums (optional DP on the same sums, :mod:`.privacy`): the consumers here read a sum that may
carry Gaussian noise — the photo count through :func:`clamp_count`, variances through
:func:`variance_floor`, the feature covariance through :func:`psd_project`, the check verdict with
its count clamped (:func:`verdict_from_sum`). On a noise-free sum each is the identity (up to
float rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import InputError

MAX_PHOTOS = 64
"""Photos one device contributes to a moment statistic (its first ``MAX_PHOTOS``)."""
EMBEDDING_BOUND = 1e3
"""L2 bound of one photo's pre-L2 embedding in the embedding moments (ξ's outputs sit far below:
MobileFaceNet ‖e‖ ≈ 10–40; a bound only stops a malicious device from dominating the sum)."""
FEATURE_BOUND = 1e3
"""L2 bound of one photo's trunk feature vector in the feature moments."""
TAIL_BINS = 400
"""Score bins of :func:`tail_histogram` over ``[-1, 1]`` (width 0.005: about 1/20 of an impostor
score's SD for the face models measured)."""
MIN_CONTRIBUTORS = 10
"""A round's sum is published only over at least this many devices: with 2 devices a sum of
``f fᵀ`` minus one's own reveals the other's moments; with ≥ 10 it is a crowd's."""


def _clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise InputError(f"statistics need a [photos, dim] array, got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise InputError("statistics got non-finite values (NaN/inf) from the model: nothing contributed")
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, bound / np.maximum(norm, 1e-300))


def embedding_moments(e: np.ndarray, bound: float = EMBEDDING_BOUND, max_photos: int = MAX_PHOTOS) -> np.ndarray:
    """``[Σ e (D), Σ e² (D), n]`` of a device's embeddings ``e`` ``[n, D]`` (each photo clipped to
    L2 ``bound``, at most ``max_photos``)."""
    x = _clip_rows(e, bound)[:max_photos]
    return np.concatenate([x.sum(0), (x * x).sum(0), [float(len(x))]])


def feature_moments(f: np.ndarray, bound: float = FEATURE_BOUND, max_photos: int = MAX_PHOTOS) -> np.ndarray:
    """``[Σ f (F), triu(Σ f fᵀ) (F(F+1)/2, row-major), n]`` of a device's trunk features ``f``
    ``[n, F]`` (clipped as :func:`embedding_moments`)."""
    x = _clip_rows(f, bound)[:max_photos]
    iu = np.triu_indices(x.shape[1])
    return np.concatenate([x.sum(0), (x.T @ x)[iu], [float(len(x))]])


def feature_length(dim: int) -> int:
    return dim + dim * (dim + 1) // 2 + 1


def feature_dim(length: int) -> int:
    """``F`` of a feature-moment vector of ``length`` (inverse of :func:`feature_length`)."""
    dim = int(round((math.sqrt(9 + 8 * (length - 1)) - 3) / 2))
    if feature_length(dim) != length:
        raise InputError(f"a feature-moment vector of length {length} matches no feature dimension")
    return dim


def sensitivity(kind: str, length: int, bound: float, max_photos: int = MAX_PHOTOS) -> list[tuple[np.ndarray, float]]:
    """How far one device moves a statistic's sum: ``[(indices, Δ)]`` per **segment** — the
    elements of one kind of sum — with ``Δ`` the L2 bound of that segment of one device's
    contribution (add/remove one device). ``P = max_photos``, ``B = bound`` (each photo's L2 clip):

    * ``embedding`` / ``features``: ``Σ x`` → ``P·B`` (a sum of ≤ P vectors of norm ≤ B);
      ``Σ x²`` (per channel) or ``triu(Σ x xᵀ)`` → ``P·B²`` (‖Σ x xᵀ‖_F ≤ Σ‖x‖² and the upper
      triangle / the diagonal is part of it); ``n`` → ``P``;
    * ``checks`` (``c`` candidates, ``[Δm, Δm², ΔA, 1]`` each; margins clipped to ±4): ``Δm`` →
      ``8√c``, ``Δm²`` → ``64√c``, ``ΔA`` → ``√c``, the count → ``√c``;
    * ``tail`` (``P`` directions × :data:`~.tail.TAIL_BINS` counts, each photo one count per direction):
      ``P_photos·√P`` (all of a device's photos in one bin of every direction).

    The noise of :mod:`.privacy` gives each segment a std proportional to its own ``Δ`` (a count
    is not drowned by noise sized for second moments)."""
    p, b, n = float(max_photos), float(bound), int(length)
    if not (p >= 1 and b > 0 and math.isfinite(b)):
        raise InputError(f"sensitivity needs max_photos ≥ 1 and a finite bound > 0, got {max_photos}, {bound}")
    if kind == "embedding":
        d = (n - 1) // 2
        if 2 * d + 1 != n or d < 1:
            raise InputError(f"an embedding-moment statistic has 2·D + 1 numbers, got {n}")
        return [(np.arange(d), p * b), (np.arange(d, 2 * d), p * b * b), (np.array([n - 1]), p)]
    if kind == "features":
        f = feature_dim(n)
        return [(np.arange(f), p * b), (np.arange(f, n - 1), p * b * b), (np.array([n - 1]), p)]
    if kind == "checks":
        if n % 4 or n < 4:
            raise InputError(f"a check statistic has 4 numbers per candidate, got {n}")
        c = math.sqrt(n // 4)
        return [(np.arange(j, n, 4), m * c) for j, m in enumerate((8.0, 64.0, 1.0, 1.0))]
    if kind == "tail":          # each photo adds one count per direction: ‖·‖₂ ≤ P_photos·√directions
        if n % TAIL_BINS or n < TAIL_BINS:
            raise InputError(f"a tail statistic has {TAIL_BINS} counts per public direction, got {n}")
        return [(np.arange(n), p * math.sqrt(n // TAIL_BINS))]
    raise InputError(f"unknown statistic kind {kind!r} (embedding, features, checks, tail)")


def clamp_count(n: float, floor: float = 1.0) -> float:
    """A photo or device count read from a (possibly noisy) sum: at least ``floor``."""
    n = float(n)
    return n if n >= floor else float(floor)


def variance_floor(var: np.ndarray, rel: float = 1e-2) -> np.ndarray:
    """Per-channel variances from a (possibly noisy) sum, floored at ``rel`` × the median of the
    positive ones (a noisy ``Σx²/n − μ²`` can be ≤ 0; a standardization by ``√0`` would blow the
    channel up). Noise-free variances above the floor are returned unchanged."""
    v = np.asarray(var, dtype=np.float64)
    pos = v[v > 0]
    floor = rel * float(np.median(pos)) if pos.size else 1e-12
    return np.maximum(v, max(floor, 1e-300))


def psd_project(c: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """The nearest (Frobenius) symmetric matrix to ``c`` with eigenvalues ≥ ``floor``: symmetrize,
    clip the eigenvalues (Higham 1988). A covariance from a noisy ``Σ f fᵀ`` can be indefinite."""
    a = np.asarray(c, dtype=np.float64)
    a = 0.5 * (a + a.T)
    w, v = np.linalg.eigh(a)
    if w.size and w[0] >= floor:
        return a
    return (v * np.maximum(w, floor)) @ v.T


def moments_of(vec: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(μ, C, n)`` — mean and covariance (population, ``/n``) of a summed feature-moment vector;
    ``C`` projected to PSD (:func:`psd_project`: a noisy sum's covariance may be indefinite)."""
    v = np.asarray(vec, dtype=np.float64)
    dim = feature_dim(v.size)
    n = float(v[-1])
    if n < 2:
        raise InputError(f"feature moments need ≥ 2 photos, got {n:g}")
    s = v[:dim]
    m2 = np.zeros((dim, dim))
    m2[np.triu_indices(dim)] = v[dim:-1]
    m2 = m2 + np.triu(m2, 1).T
    mu = s / n
    return mu, psd_project(m2 / n - np.outer(mu, mu)), n


def check_contribution(checks: Sequence, candidates: Sequence[str], reference: str = "xi") -> np.ndarray:
    """A device's check results as 4 numbers per candidate (``candidates``, in order):
    ``[Δmargin, Δmargin², ΔAUROC, 1]`` against ``reference`` — zeros for a candidate it did not
    check (the trailing 1 counts who did). Margins are already clipped to ±``MARGIN_CLIP``."""
    by = {c.name: c for c in checks}
    out = np.zeros(4 * len(candidates))
    if reference not in by:
        return out
    ref = by[reference]
    for i, name in enumerate(candidates):
        if name in by:
            dm, da = by[name].margin - ref.margin, by[name].auroc - ref.auroc
            out[4 * i:4 * i + 4] = (dm, dm * dm, da, 1.0)
    return out


def verdict_from_sum(summed: np.ndarray, candidates: Sequence[str]) -> dict:
    """Each candidate's :class:`~fedfs_sdk.training.selection.Verdict` from the federation's sum of
    :func:`check_contribution` vectors: mean margin gain, its SE (``√((Σx² − n·m²)/(n−1)/n)``) and
    mean AUROC gain — the numbers :func:`~fedfs_sdk.training.selection.population_verdict` gives
    from every device's checks, without any one device's.

    A noisy sum (DP, :mod:`.privacy`): the count is read as ``max(Σ1, 0)`` and the rule needs ≥ 2
    (the same rule; a noise-driven count near 0 cannot divide a mean into a landslide), and
    ``Σx² − n·m²`` is floored at 0 as before — noise then widens the SE, so a verdict errs
    toward "not better than ξ"."""
    from ..training.selection import AUROC_SLACK, Verdict

    v = np.asarray(summed, dtype=np.float64)
    if v.size != 4 * len(candidates):
        raise InputError(f"a check sum for {len(candidates)} candidates has {4 * len(candidates)} numbers, got {v.size}")
    out = {}
    for i, name in enumerate(candidates):
        s1, s2, sa, n = v[4 * i:4 * i + 4]
        k = int(round(max(float(n), 0.0)))
        if k < 2:
            out[name] = Verdict(name, False, float("nan"), float("nan"), float("nan"), k)
            continue
        m = s1 / n
        se = math.sqrt(max(s2 - n * m * m, 0.0) / (n - 1) / n)
        a = sa / n
        out[name] = Verdict(name, bool(m - 2 * se > 0 and a >= -AUROC_SLACK), float(m), float(se), float(a), k)
    return out


def norm_fold_from_sum(summed: np.ndarray, mode: str = "standardize") -> tuple[np.ndarray, np.ndarray | None]:
    """``(μ, s)`` of ``norm-adapt`` from the federation's sum of :func:`embedding_moments`: the
    pooled per-channel mean and standard deviation (``s`` None for ``mode="center"``)."""
    v = np.asarray(summed, dtype=np.float64)
    if v.size < 3 or v.size % 2 != 1:
        raise InputError(f"an embedding-moment sum has 2·D + 1 numbers, got {v.size}")
    dim = (v.size - 1) // 2
    n = float(v[-1])
    if n < 0.5:
        raise InputError("norm-adapt needs at least one photo in the embedding moments")
    n = clamp_count(n)
    mu = v[:dim] / n
    var = variance_floor(v[dim:2 * dim] / n - mu * mu)
    return mu, (np.sqrt(var) if mode == "standardize" else None)


@dataclass
class StatSum:
    """The federation's sum of one round's statistics: ``sums[name]`` and how many devices
    contributed (``count``). Only this is published (never a contribution)."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    count: int = 0

    def minus(self, own: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The sum of every *other* device: what a device derives from the published sum and its
        own contribution (kept on the device)."""
        return {k: self.sums[k] - np.asarray(own[k], dtype=np.float64) for k in self.sums if k in own}

    def to_dict(self) -> dict:
        return {"count": self.count, "sums": {k: v.tolist() for k, v in self.sums.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "StatSum":
        try:
            return cls({str(k): np.asarray(v, dtype=np.float64) for k, v in d["sums"].items()}, int(d["count"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"not a statistics sum ({e}): expected {{'count': N, 'sums': {{name: [..]}}}}") from None


def sum_contributions(contributions: Iterable[Mapping[str, np.ndarray]],
                      min_contributors: int = 1) -> StatSum:
    """Element-wise sum of devices' contributions (each a ``{name: vector}``; every device the same
    names and lengths) — the server's and the simulator's one sum. Refuses fewer than
    ``min_contributors`` devices (the server's :data:`MIN_CONTRIBUTORS`)."""
    out = StatSum()
    for c in contributions:
        if out.count and set(c) != set(out.sums):
            raise InputError(f"a contribution names {sorted(c)}, the round {sorted(out.sums)}")
        for k, v in c.items():
            v = np.asarray(v, dtype=np.float64)
            if not np.isfinite(v).all():
                raise InputError(f"statistic {k!r}: a contribution is not finite")
            if k in out.sums:
                if out.sums[k].shape != v.shape:
                    raise InputError(f"statistic {k!r}: length {v.size}, the round's is {out.sums[k].size}")
                out.sums[k] = out.sums[k] + v
            else:
                out.sums[k] = v.copy()
        out.count += 1
    if out.count < min_contributors:
        raise InputError(f"a statistics sum needs ≥ {min_contributors} devices, got {out.count} "
                         "(a smaller sum would reveal too much of each device's vector)")
    return out


__all__ = ["sensitivity", "clamp_count", "variance_floor", "psd_project", "embedding_moments", "feature_moments", "feature_length", "feature_dim", "moments_of",
           "check_contribution", "verdict_from_sum", "norm_fold_from_sum", "StatSum", "sum_contributions",
           "MAX_PHOTOS", "EMBEDDING_BOUND", "FEATURE_BOUND", "MIN_CONTRIBUTORS"]
