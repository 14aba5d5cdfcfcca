"""Do no harm: a device uses a trained model only where it can show that it verifies better.

After local training a device holds up to three verifiers: the frozen pre-trained ξ, the
global model the server ships, and its personalized model (θ_c, or FedFS+FedUV's dual
verifier). It never trained on a few of its owner's photos (the **hold-out**), and the app
ships a **public impostor set** (photos of public identities, never user data:
:mod:`fedfs_sdk.runtime.impostors`). Each candidate enrolls a cosine template from the photos
it trained on, scores the held-out photos (genuine) and the public impostors, and is judged at
the operating point the device will use — a false-accept rate ``far``:

* ``τ_f`` — the impostor score that at most ``⌊far·n⌋`` of the ``n`` impostors reach;
* **TAR** — share of held-out photos above ``τ_f``;
* **margin** — mean over held-out photos of ``(s − τ_f)/σ_imp`` clipped to ±``MARGIN_CLIP``:
  how far the owner's photos sit above the impostors' tail, in units of the impostors' spread
  (scale-free, so models with different score ranges compare); clipping stops photos that are
  already far above ``τ_f`` from outvoting the hard ones;
* **AUROC** — held-out vs impostors.

:func:`choose` walks the candidates in order (ξ first: the reference) and moves to the next one
only if it is at least as good on TAR and AUROC (up to ``auroc_slack``) *and* better on the
margin by ``min_gain`` — ties and noise keep the earlier, safer model. With a handful of
held-out photos the evidence is thin; the rule is built to fail towards ξ.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import InputError

MARGIN_CLIP = 4.0
"""Standardized margins are clipped to ±4 σ_imp: beyond that a photo is accepted by any
threshold near ``τ_f``, and a larger lead says nothing about the hard photos."""
MIN_GAIN = 0.25
"""A challenger must raise the mean margin by a quarter of the impostors' spread."""
AUROC_SLACK = 0.002
"""… without lowering its AUROC by more than this (the issue's tolerance for 'no harm')."""
HARM_MARGIN = 0.5
HARM_AUROC = 0.05
"""A device's own check *harms* when the candidate's margin is half an impostor σ below ξ's or
its AUROC 0.05 below: beyond the noise of a few held-out photos (measured: the per-device margin
gain of fedfs+feduv has an SD of 0.31 over SynthFaces' cross-domain clients, docs/personalization.md)."""
DEFAULT_HOLDOUT = 0.2
"""Share of the owner's photos a device keeps out of training to judge its models (at least
:data:`MIN_HOLDOUT`)."""
MIN_HOLDOUT = 2
CHECK_IMPOSTORS = 100
"""Public impostor photos a check scores, each matched to the capture statistics of the owner's
photos first (:func:`fedfs_sdk.runtime.capture_match.match_capture`): the set's first 100."""


@dataclass(frozen=True)
class CandidateCheck:
    """How one verifier did on the hold-out (genuine) and the public impostors."""

    name: str
    tar: float
    margin: float
    auroc: float
    threshold: float
    n_genuine: int
    n_impostor: int

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


@dataclass(frozen=True)
class Selection:
    """:func:`choose`'s outcome: the chosen candidate, every check, and why."""

    chosen: str
    checks: tuple[CandidateCheck, ...]
    reason: str

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "reason": self.reason, "checks": [c.to_dict() for c in self.checks]}


def holdout_count(n: int, fraction: float = DEFAULT_HOLDOUT, minimum: int = MIN_HOLDOUT) -> int:
    """How many of ``n`` photos a device holds out: ``max(minimum, round(fraction·n))``, or 0 when
    that would leave fewer than 2 photos to train on (FedFS contrasts pairs) — then nothing can
    be checked and :func:`choose` keeps the first candidate."""
    if not 0 < fraction < 1:
        raise InputError(f"holdout fraction must be in (0, 1), got {fraction!r}")
    k = max(int(minimum), int(round(fraction * n)))
    return k if n - k >= 2 else 0


def holdout_split(n: int, seed: int, fraction: float = DEFAULT_HOLDOUT) -> tuple[np.ndarray, np.ndarray]:
    """``(train, holdout)`` positions of ``n`` photos: a seeded permutation, the last
    :func:`holdout_count` held out (sorted, so the photos keep their order)."""
    k = holdout_count(n, fraction)
    order = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x401D]).permutation(n)
    return np.sort(order[:n - k]), np.sort(order[n - k:])


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def far_index(n: int, far: float) -> int:
    """``⌊far·n⌋``: how many of ``n`` impostor scores may lie at or above ``τ_f``."""
    if not 0 < far < 1:
        raise InputError(f"far must be in (0, 1), got {far!r}")
    return int(math.floor(far * n + 1e-9))


def check_candidate(name: str, enroll: np.ndarray, holdout: np.ndarray, impostors: np.ndarray,
                    far: float = 1e-3) -> CandidateCheck:
    """Score one verifier's embeddings: template from ``enroll`` (the photos it trained on),
    genuine = ``holdout``, impostors = the public set (all ``[n, D]``)."""
    if len(enroll) == 0 or len(holdout) == 0 or len(impostors) < 2:
        raise InputError(f"candidate {name!r}: needs enrollment photos, held-out photos and ≥ 2 impostors "
                         f"(got {len(enroll)}, {len(holdout)}, {len(impostors)})")
    template = _unit(_unit(enroll).sum(0))
    return check_scores(name, _unit(holdout) @ template, _unit(impostors) @ template, far)


def check_scores(name: str, genuine: np.ndarray, impostor: np.ndarray, far: float = 1e-3) -> CandidateCheck:
    """:class:`CandidateCheck` of one verifier's scores: ``genuine`` (held-out photos against the
    enrollment) and ``impostor`` (public impostors against it)."""
    g, i = np.asarray(genuine, dtype=np.float64).ravel(), np.asarray(impostor, dtype=np.float64).ravel()
    if g.size == 0 or i.size < 2:
        raise InputError(f"candidate {name!r}: needs held-out photos and ≥ 2 impostors (got {g.size}, {i.size})")
    if not (np.isfinite(g).all() and np.isfinite(i).all()):
        return CandidateCheck(name, 0.0, -MARGIN_CLIP, 0.0, math.inf, len(g), len(i))
    desc = np.sort(i)[::-1]
    tau = float(desc[min(far_index(len(i), far), len(i) - 1)])
    spread = max(float(i.std()), 1e-6)
    margin = float(np.clip((g - tau) / spread, -MARGIN_CLIP, MARGIN_CLIP).mean())
    tar = float((g > tau).mean())
    auroc = float(((g[:, None] > i[None, :]).sum() + 0.5 * (g[:, None] == i[None, :]).sum()) / (len(g) * len(i)))
    return CandidateCheck(name, tar, margin, auroc, tau, len(g), len(i))


def candidate_scores(backend, train: np.ndarray, holdout: np.ndarray, impostors: np.ndarray, mode: str = "template",
                     output: str = "embedding", codeword: np.ndarray | None = None,
                     chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``(genuine, impostor)`` scores of one verifier on a device: an enrollment from ``train``
    (a cosine template of the backend's ``output``, or the FedUV ``codeword``), scoring the
    ``holdout`` photos and the public ``impostors`` (float32 ``[N, 3, S, S]`` batches)."""
    def run(x: np.ndarray) -> np.ndarray:
        outs = [backend.run(x[a:a + chunk]) for a in range(0, x.shape[0], chunk)]
        key = "uv" if (mode == "codeword" or output == "uv") else "embedding"
        return np.concatenate([o[key] for o in outs]).astype(np.float64)

    if mode == "codeword":
        if codeword is None:
            raise InputError("codeword scoring needs the device's codeword")
        v = np.asarray(codeword, dtype=np.float64)
        return run(holdout) @ v / v.size, run(impostors) @ v / v.size
    template = _unit(_unit(run(train)).sum(0))
    return _unit(run(holdout)) @ template, _unit(run(impostors)) @ template


@dataclass(frozen=True)
class Verdict:
    """The federation's evidence that ``candidate`` verifies better than ξ on its devices: the
    mean and standard error over devices of each device's margin gain (candidate − ξ, from its
    own check) and the mean AUROC gain. ``helps``: the mean margin gain exceeds twice its
    standard error and the AUROC does not fall (by more than :data:`AUROC_SLACK`)."""

    candidate: str
    helps: bool
    mean_margin_gain: float
    se: float
    mean_auroc_gain: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def population_verdict(candidate: str, checks: Sequence[Sequence[CandidateCheck]],
                       reference: str = "xi") -> Verdict:
    """:class:`Verdict` for ``candidate`` from every device's checks (one list per device). Each
    device contributes one clipped number pair — what a federation can sum (under secure
    aggregation) without learning any device's photos, embeddings or scores."""
    dm, da = [], []
    for per_device in checks:
        by = {c.name: c for c in per_device}
        if candidate in by and reference in by:
            dm.append(by[candidate].margin - by[reference].margin)
            da.append(by[candidate].auroc - by[reference].auroc)
    n = len(dm)
    if n < 2:
        return Verdict(candidate, False, float("nan"), float("nan"), float("nan"), n)
    m, se, a = float(np.mean(dm)), float(np.std(dm, ddof=1) / math.sqrt(n)), float(np.mean(da))
    return Verdict(candidate, bool(m - 2 * se > 0 and a >= -AUROC_SLACK), m, se, a, n)


def choose(checks: Sequence[CandidateCheck], verdicts: Mapping[str, Verdict] | None = None,
           min_gain: float = MIN_GAIN, auroc_slack: float = AUROC_SLACK) -> Selection:
    """The candidate to verify with (``checks[0]`` is the reference, ξ).

    A later candidate replaces the current choice when

    * **its own evidence** says it is better: TAR ≥, AUROC ≥ − ``auroc_slack`` and margin ≥ +
      ``min_gain`` (all a device can show alone; with a few held-out photos it fails towards ξ);
    * or the **federation's** evidence (``verdicts[name].helps``, :func:`population_verdict`) says
      it helps on the devices at large and this device's check does not say it harms *here*
      (margin ≥ ξ's − :data:`HARM_MARGIN`, AUROC ≥ ξ's − :data:`HARM_AUROC`) — a device's few photos
      cannot show a modest gain, but they do show a broken model (a planted bad update)."""
    if not checks:
        raise InputError("choose() needs at least one candidate")
    ref = best = checks[0]
    reason = f"{best.name}: the reference"
    for c in checks[1:]:
        own = c.tar >= best.tar and c.auroc >= best.auroc - auroc_slack and c.margin >= best.margin + min_gain
        v = (verdicts or {}).get(c.name)
        pooled = v is not None and v.helps and c.margin >= ref.margin - HARM_MARGIN and c.auroc >= ref.auroc - HARM_AUROC
        if own:
            reason = (f"{c.name}: its own check — margin {c.margin:+.2f} vs {best.margin:+.2f} ({best.name}), TAR "
                      f"{c.tar:.2f} vs {best.tar:.2f}, AUROC {c.auroc:.4f} vs {best.auroc:.4f}")
            best = c
        elif pooled:
            reason = (f"{c.name}: helps across the federation (margin gain {v.mean_margin_gain:+.2f} ± "
                      f"{v.se:.2f} over {v.n} devices) and no harm here (margin {c.margin:+.2f} vs ξ {ref.margin:+.2f}, "
                      f"AUROC {c.auroc:.4f} vs {ref.auroc:.4f})")
            best = c
    return Selection(best.name, tuple(checks), reason)


__all__ = ["CandidateCheck", "Selection", "Verdict", "population_verdict", "check_candidate", "check_scores",
           "candidate_scores", "choose", "HARM_MARGIN", "HARM_AUROC", "CHECK_IMPOSTORS", "holdout_count", "holdout_split", "far_index",
           "MARGIN_CLIP", "MIN_GAIN", "AUROC_SLACK", "DEFAULT_HOLDOUT", "MIN_HOLDOUT"]
