"""The operating point of an enrollment: its threshold's true- and false-accept rates.

FedUV's warm-up (Alg. 2) sets ``τ`` for a true-positive rate ``q`` on the owner's photos and
leaves the false accepts wherever they fall (issue 23: 47 % of other people's photos passed the
demo's default). With a public impostor set (:mod:`fedfs_sdk.runtime.impostors`) the device
can set ``τ`` for a false-accept rate instead:

* the enrolled model scores the ``n`` public impostor photos against the enrollment;
* ``τ_far`` lets at most ``k = ⌊far·(n+1)⌋ − 1`` of them through (accept iff ``score ≥ τ``,
  ``τ`` just above the ``(k+1)``-th largest score);
* **the bound**: for an impostor photo exchangeable with the set's, the chance that it is
  accepted is at most ``(k+1)/(n+1) ≤ far`` (the rank argument of split conformal prediction:
  its score is equally likely to take any of the ``n+1`` ranks, and it passes only from the top
  ``k+1``). ``far·(n+1) < 1`` — fewer than ``⌈1/far⌉ − 1`` impostors, 999 for 1e-3 — leaves no
  admissible ``k``: refused, naming the size needed;
* the warm-up TPR at ``τ_far`` (share of the owner's leave-one-out warm-up scores ≥ ``τ_far``)
  is reported next to it; below ``q`` the enrollment is refused (:class:`OperatingPointError`)
  with both numbers, because ``far`` and ``q`` cannot both hold.

The photo-level bound assumes impostor photos exchangeable with the set's, one at a time. Real
impostors come as *people*: photos of one person are alike, so a lookalike of the owner who is
not in the set brings many accepted photos at once. With the set's identities the record also
gives the people-level bound ``(k_people+1)/(m+1)`` (``m`` public people), which holds then — and
is loose unless ``m`` is large: measured on LFW (79 public people, 1,303 photos) the photo FAR
of held-out people at a 1e-3 target was 2–3× the target (docs/real-faces.md). A photo bound
of 1e-3 that holds for people needs about a thousand public people. The set's capture conditions
matter too: people in front of the owner's phone can differ — measure, don't assume.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OperatingPointError
from ..exact import as_written

FAR_TOLERANCE = 1e-6
"""τ_far is raised this much above the impostor score it excludes: a float32 forward of one
image and of a batch differ by ~1e-7, and the impostor side of the bound must not depend on it."""


@dataclass(frozen=True)
class FarThreshold:
    """``tau``: accept iff score ≥ tau; ``k`` of the ``n`` public impostor scores pass;
    ``bound = (k+1)/(n+1)``: the chance an exchangeable impostor *photo* passes. With the set's
    identities: ``m`` public people, ``k_people`` of them with a photo ≥ tau, and
    ``bound_people = (k_people+1)/(m+1)``: the chance that a new *person* exchangeable with the set's
    has any photo accepted — the bound that holds when impostors come as people (their photos
    alike), and an upper bound on their photo FAR too."""

    tau: float
    k: int
    n: int
    bound: float
    m: int | None = None
    k_people: int | None = None
    bound_people: float | None = None


def min_impostors(far: float) -> int:
    """Smallest impostor set that can bound ``far``: ``far·(n+1) ≥ 1``, i.e. ``⌈1/far⌉ − 1``."""
    return math.ceil(1 / as_written(far, "far")) - 1


def far_threshold(impostor_scores: np.ndarray, far: float, identities: np.ndarray | None = None) -> FarThreshold:
    """``τ`` for a false-accept rate ``far`` from public impostor scores (module docstring);
    ``identities`` (the person of each score) adds the people-level bound."""
    f = as_written(far, "far")
    if not 0 < f < 1:
        raise OperatingPointError(f"far must be in (0, 1), got {far}")
    s = np.sort(np.asarray(impostor_scores, dtype=np.float64).ravel())[::-1]
    n = s.size
    if not np.isfinite(s).all():
        raise OperatingPointError("impostor scores contain NaN or Inf: the model diverged")
    k = math.floor(f * (n + 1)) - 1
    if k < 0:
        raise OperatingPointError(f"the public impostor set has {n} photos: a false-accept rate of {far:g} needs at "
                                  f"least {min_impostors(far)} to be bounded (far·(n+1) ≥ 1); build a larger one "
                                  f"(`fedfs impostors --images DIR`), give the federation's published statistics (--far-stats FILE: τ "
                                  f"in the federation's conditions), or ask for a larger far")
    tau = float(s[k]) + FAR_TOLERANCE
    raw = np.asarray(impostor_scores, dtype=np.float64).ravel()
    m = kp = bp = None
    if identities is not None:
        ids = np.asarray(identities).ravel()
        m = int(np.unique(ids).size)
        kp = int(np.unique(ids[raw >= tau]).size)
        bp = (kp + 1) / (m + 1)
    return FarThreshold(tau, int((s >= tau).sum()), int(n), (k + 1) / (n + 1), m, kp, bp)


FAR_EVIDENCE = ("auto", "public", "federation")
"""Which evidence sets a FAR-targeted τ: ``public`` — the shipped public impostor set (the
conformal bound above); ``federation`` — the federation's published statistics
(:mod:`fedfs_sdk.stats.evidence`: the impostor scores of the owner's template predicted in the
federation's capture conditions, a prediction, not a bound); ``auto`` — the public set when it is
large enough for the target, else the federation's statistics."""


def _refuse_far(far: float, impostor_scores: np.ndarray | None, why: str = "") -> OperatingPointError:
    n = 0 if impostor_scores is None else int(np.asarray(impostor_scores).size)
    have = "no public impostor set" if impostor_scores is None else f"a public impostor set of {n} photos"
    return OperatingPointError(
        f"a false-accept target of {far:g} needs a public impostor set of ≥ {min_impostors(far)} photos or the "
        f"federation's published statistics (in-domain evidence); this enrollment has {have} and "
        f"{why or 'no statistics'}: pass --impostors FILE with a larger set (`fedfs impostors --images DIR`), "
        f"--far-stats FILE (a statistics round's published sum with xi.features and xi.tail; a device reads its "
        f"server's own where the server ships a public set — fedfs serve --impostors — and pins --secagg-ca), "
        f"or ask for a larger far")


def _federation_tau(in_domain: tuple[np.ndarray, Any], far: float) -> tuple[float, dict[str, Any]]:
    """``τ = m_u + s_u·z*(far)`` from the draws' scores on the owner's template and the federation's
    tail (:mod:`fedfs_sdk.stats.tail`), and its record."""
    from ..stats.tail import calibrated_threshold

    scores, ev = in_domain
    s = np.asarray(scores, dtype=np.float64).ravel()
    z = float(ev.z(far))
    tau = calibrated_threshold(s, z)
    return tau, {**dict(ev.record), "z": z, "location": float(s.mean()), "scale": float(s.std()),
                 "gaussian_far_at_tau": float((s >= tau).mean())}


def operating_point(warmup_scores: np.ndarray, q: float, far: float | None, impostor_scores: np.ndarray | None,
                    tau_q: float, identities: np.ndarray | None = None,
                    in_domain: tuple[np.ndarray, Any] | None = None, far_evidence: str = "auto") -> tuple[float, dict[str, Any]]:
    """The enrollment's ``τ`` and its record (stored in ``meta["operating_point"]``).

    Without ``far`` ``τ`` is the warm-up's ``tau_q``; impostor scores, when given, measure its
    FAR on the public set. With ``far`` ``τ`` is set on the evidence ``far_evidence`` names
    (:data:`FAR_EVIDENCE`; ``record["far_evidence"]`` says which set it): the public set
    (``τ_far``), or the federation's statistics — ``in_domain = (draw scores on the owner's
    template, an InDomainEvidence)``. Either way the warm-up TPR there must be ≥ ``q``, else
    :class:`OperatingPointError` names both rates; with neither evidence the error names both."""
    if far_evidence not in FAR_EVIDENCE:
        raise OperatingPointError(f"far_evidence must be one of {', '.join(FAR_EVIDENCE)}, got {far_evidence!r}")
    w = np.asarray(warmup_scores, dtype=np.float64)
    rec: dict[str, Any] = {"q": float(q), "tau_q": float(tau_q)}
    if impostor_scores is not None:
        i = np.asarray(impostor_scores, dtype=np.float64)
        rec.update(n_impostors=int(i.size), far_public_at_tau_q=float((i >= tau_q).mean()) if i.size else None)
    if far is None:
        rec.update(tau=float(tau_q), warmup_tpr=float((w >= tau_q).mean()), far_target=None,
                   far_public=rec.get("far_public_at_tau_q"))
        return float(tau_q), rec
    f = as_written(far, "far")
    if not 0 < f < 1:
        raise OperatingPointError(f"far must be in (0, 1), got {far}")
    public_ok = impostor_scores is not None and np.asarray(impostor_scores).size >= min_impostors(far)
    use_federation = far_evidence == "federation" or (far_evidence == "auto" and not public_ok and in_domain is not None)
    if use_federation:
        if in_domain is None:
            raise _refuse_far(far, impostor_scores, "far_evidence='federation' but no statistics")
        tau, fed = _federation_tau(in_domain, float(far))
        tpr = float((w >= tau).mean())
        i = None if impostor_scores is None else np.asarray(impostor_scores, dtype=np.float64)
        rec.update(tau=tau, far_target=float(far), far_evidence="federation-statistics", in_domain=fed,
                   far_bound=None, far_public=None if i is None or not i.size else float((i >= tau).mean()),
                   warmup_tpr=tpr, warmup_tpr_at_tau_q=float((w >= tau_q).mean()))
        if tpr < float(as_written(q, "q")):
            raise OperatingPointError(
                f"cannot meet both targets: at FAR {far:g} in the federation's conditions (τ = {tau:.4f}, predicted from "
                f"{fed['contributors']} devices' statistics) the warm-up accepts {tpr:.1%} of the owner's {w.size} photos, "
                f"below q = {q:g}. Lower q, raise far, or add clearer photos of the owner")
        return tau, rec
    if impostor_scores is None:
        raise _refuse_far(far, impostor_scores)
    ft = far_threshold(impostor_scores, far, identities)
    tpr = float((w >= ft.tau).mean())
    rec.update(tau=ft.tau, far_target=float(far), far_evidence="public-set", far_bound=ft.bound, far_public=ft.k / ft.n,
               warmup_tpr=tpr, warmup_tpr_at_tau_q=float((w >= tau_q).mean()), public_people=ft.m,
               far_bound_people=ft.bound_people)
    if in_domain is not None:          # what the federation's statistics would have set, for the record
        rec["tau_federation"], _ = _federation_tau(in_domain, float(far))
    if tpr < float(as_written(q, "q")):
        raise OperatingPointError(
            f"cannot meet both targets: at FAR ≤ {far:g} (τ = {ft.tau:.4f}, {ft.k}/{ft.n} public impostors accepted) "
            f"the warm-up accepts {tpr:.1%} of the owner's {w.size} photos, below q = {q:g}; at q (τ = {tau_q:.4f}) "
            f"{rec['far_public_at_tau_q']:.2%} of the public impostors are accepted. Lower q, raise far, or add "
            f"clearer photos of the owner")
    return ft.tau, rec


def describe(meta: dict[str, Any]) -> str:
    """One line for ``fedfs verify`` / ``fedfs demo``: the enrollment's operating point."""
    op = (meta or {}).get("operating_point")
    if not op:
        return "operating point: TAR ≥ q on the warm-up photos (FedUV warm-up); FAR not measured (enroll with " \
               "--impostors FILE, or --far, to know it)"
    tar = f"TAR {op['warmup_tpr']:.3f} on the {op.get('n_warmup', '?')} warm-up photos (q = {op['q']:g})"
    if op.get("far_target") is not None and op.get("far_evidence") == "federation-statistics":
        d = op.get("in_domain") or {}
        far = (f"FAR ≈ {op['far_target']:g} predicted for impostors in the federation's capture conditions "
               f"(statistics of {d.get('contributors', '?')} devices, {d.get('estimator', '?')}; a prediction, "
               f"not a bound — measured within about ×2 on LFW, docs/personalization.md)")
        if op.get("far_public") is not None:
            far += f"; {op['far_public']:.4f} of the {op['n_impostors']} public impostor photos accepted"
    elif op.get("far_target") is not None:
        far = (f"FAR ≤ {op['far_bound']:.2g} for impostor photos like the public set's, taken independently "
               f"(target {op['far_target']:g}; {op['far_public']:.4f} of its {op['n_impostors']} photos accepted)")
        if op.get("far_bound_people") is not None:
            far += (f"; a new person is accepted at all with probability ≤ {op['far_bound_people']:.2g} "
                    f"({op['public_people']} public people)")
    elif op.get("far_public") is not None:
        far = f"FAR {op['far_public']:.4f} on the {op['n_impostors']} public impostor photos (no FAR target)"
    else:
        far = "FAR not measured (no public impostor set)"
    return f"operating point: {tar}; {far}; τ = {op['tau']:.4f}"


__all__ = ["FarThreshold", "far_threshold", "min_impostors", "operating_point", "describe", "FAR_TOLERANCE",
           "FAR_EVIDENCE"]
