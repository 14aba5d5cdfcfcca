"""The federation's evidence for a FAR-targeted threshold: what ``enroll(far=…, in_domain=…)`` reads.

A device holds the published statistics sum (:class:`~.contributions.StatSum`) of a round that
carried ``xi.features`` (ξ's trunk-feature moments) and ``xi.tail`` (the tail histograms of
:mod:`.tail` along the public people's templates moved into the federation's conditions). From it,
its verifier (ξ's trunk followed by a top: ``scope="top"``), ξ's top and the public impostor set it
ships with, :func:`in_domain_evidence` builds an :class:`InDomainEvidence`:

* ``draws`` — the verifier's outputs for :data:`~.impostor_model.DRAWS` trunk features drawn from
  the *other* devices' moments (:mod:`.impostor_model`): the Gaussian's location ``m_u`` and scale
  ``s_u`` of the owner's impostor scores, whatever the enrolled template;
* ``z(far)`` — the federation's tail quantile ``z*`` (:func:`~.tail.tail_z`), the histograms
  standardized by ξ's draws along the same directions.

``enroll`` sets ``τ = m_u + s_u·z*(far)`` (:func:`~.tail.calibrated_threshold`). The directions
are a deterministic function of public things (the public set, ξ, the published feature sum), so
every device computes the same ones (:func:`tail_directions`) — the histogram round follows the
feature-moment round (two statistics rounds, or the tail of the previous model version's round).

Everything here is numpy on callables ``features [n, F] → outputs``; :func:`torch_top` makes one
from a torch verifier (lazy torch import), :func:`fedfs_sdk.federation.ort_check.far_evidence` from an
export's ``trunk.onnx`` and ``onnx/top.onnx`` (the phone's runtime, no torch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import InputError
from .contributions import TAIL_BINS, StatSum, feature_moments, moments_of
from .impostor_model import DRAWS, impostor_features, standard_draws
from .tail import TAIL, draw_location_scale, public_directions, tail_z

FEATURES = "xi.features"
"""ξ's trunk-feature moments (the simulator's :data:`device_sim.methods.client_stats.FEATURES`)."""
TAIL_MODE = "coral"
"""How the public features move into the federation's conditions before they give directions:
``coral`` (mean and covariance matched to the published feature moments), ``shift`` (mean only),
``none`` (as shipped). ``coral`` was the calibrated one on LFW (docs/personalization.md)."""
ESTIMATOR = "gaussian-location-scale+federation-tail"
TopFn = Callable[[np.ndarray], Mapping[str, np.ndarray]]


def _sqrtm(c: np.ndarray, power: float, ridge: float = 1e-3) -> np.ndarray:
    """``(C + ε I)^power`` (ε relative to the mean variance: a public set has fewer photos than
    feature dimensions, so its covariance is singular)."""
    w, v = np.linalg.eigh(0.5 * (c + c.T) + ridge * float(np.trace(c)) / c.shape[0] * np.eye(c.shape[0]))
    return (v * np.clip(w, 1e-12, None) ** power) @ v.T


def move_public(public_features: np.ndarray, fed_sum: np.ndarray, mode: str = TAIL_MODE) -> np.ndarray:
    """The public set's trunk features moved into the federation's capture conditions (``mode``:
    :data:`TAIL_MODE`). CORAL: ``f' = μ_fed + C_fed^{½} C_pub^{-½} (f − μ_pub)``."""
    f = np.asarray(public_features, dtype=np.float64)
    if mode == "none":
        return f
    mu_f, cov_f, _ = moments_of(fed_sum)
    if f.shape[1] != mu_f.size:
        raise InputError(f"public features have {f.shape[1]} dimensions, the federation's moments {mu_f.size}")
    mu_p = f.mean(0)
    if mode == "shift":
        return f - mu_p + mu_f
    if mode == "coral":
        a = _sqrtm(cov_f, 0.5) @ _sqrtm(np.cov(f.T, bias=True), -0.5)
        return (f - mu_p) @ a.T + mu_f
    raise InputError(f"tail mode must be coral, shift or none, got {mode!r}")


def tail_directions(public_features: np.ndarray, public_ids: np.ndarray, xi_embed: Callable[[np.ndarray], np.ndarray],
                    fed_sum: np.ndarray, mode: str = TAIL_MODE) -> np.ndarray:
    """``[P, D]`` the directions of the ``xi.tail`` histograms: the public people's templates under
    ξ's top, from their trunk features moved into the federation's conditions."""
    return public_directions(xi_embed(move_public(public_features, fed_sum, mode)), public_ids)


@dataclass
class InDomainEvidence:
    """What ``enroll(far=…)`` needs from the federation: the verifier's outputs for the impostor
    draws (``draws``, named as the backend's) and the tail pieces behind ``z(far)``."""

    draws: dict[str, np.ndarray]
    tail_hist: np.ndarray
    tail_loc: np.ndarray
    tail_scale: np.ndarray
    record: dict[str, Any] = field(default_factory=dict)

    def z(self, far: float) -> float:
        """The federation's tail quantile ``z*`` at ``far`` (:func:`~.tail.tail_z`)."""
        return tail_z(self.tail_hist, self.tail_loc, self.tail_scale, far)


def drawn_features(others_sum: np.ndarray, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """``[draws, F]`` impostor trunk features in the federation's conditions: the Gaussian of the other
    devices' summed feature moments (the published ``xi.features``, less the device's own where it
    contributed; :func:`~.impostor_model.impostor_features`) — what :func:`in_domain_evidence` scores every
    verifier on; computed once where several verifiers are scored on the same draws."""
    mu, cov, _ = moments_of(np.asarray(others_sum, dtype=np.float64))
    return impostor_features(mu, cov, draws, seed, z=standard_draws(mu.size, draws, seed))


def in_domain_evidence(stats: StatSum, verifier_top: TopFn, xi_embed: Callable[[np.ndarray], np.ndarray],
                       public_features: np.ndarray, public_ids: np.ndarray, own_features: np.ndarray | None = None,
                       mode: str = TAIL_MODE, draws: int = DRAWS, seed: int = 0, directions: np.ndarray | None = None,
                       features: np.ndarray | None = None) -> InDomainEvidence:
    """An :class:`InDomainEvidence` from the published ``stats`` (needs ``xi.features`` and ``xi.tail``).

    ``verifier_top``: trunk features → the enrolled verifier's outputs; ``xi_embed``: trunk features →
    ξ's embeddings; ``public_features``/``public_ids``: the shipped public set's trunk features and
    people; ``own_features``: the device's contribution to the round (subtracted: its photos are not
    impostors of itself), None when it did not contribute. ``directions`` (from :func:`tail_directions`
    for this round) and ``features`` (the draws, :func:`~.impostor_model.impostor_features` of the same
    others' moments and seed) may be passed when already computed — a device that sets τ for several
    verifiers draws once."""
    for name in (FEATURES, TAIL):
        if name not in stats.sums:
            raise InputError(f"the statistics sum has no {name!r} (it holds {sorted(stats.sums)}): a FAR target in the "
                             "federation's conditions needs a round that carried ξ's feature moments and tail histograms")
    total = np.asarray(stats.sums[FEATURES], dtype=np.float64)
    others = total if own_features is None else total - feature_moments(own_features)
    n = float(others[-1])                   # the other devices' photos (the moment vector's count)
    f = drawn_features(others, draws, seed) if features is None else features
    draws = int(len(f))
    dirs = tail_directions(public_features, public_ids, xi_embed, total, mode) if directions is None else directions
    hist = np.asarray(stats.sums[TAIL], dtype=np.float64)
    if hist.size % dirs.shape[0] or hist.size // dirs.shape[0] != TAIL_BINS:
        raise InputError(f"the tail histogram has {hist.size} numbers; {dirs.shape[0]} public directions need "
                         f"{dirs.shape[0] * TAIL_BINS} — the round was computed on another public set")
    loc, scale = draw_location_scale(xi_embed(f), dirs)
    out = {k: np.asarray(v, dtype=np.float64) for k, v in verifier_top(f).items()}
    rec = {"estimator": ESTIMATOR, "contributors": int(stats.count), "photos": float(n), "draws": int(draws),
           "tail_mode": mode, "tail_directions": int(dirs.shape[0]), "own_subtracted": own_features is not None}
    return InDomainEvidence(out, hist, loc, scale, rec)


def _torch_net(verifier: Any) -> Any:
    """The torch verifier of a backend (or the verifier itself); refuses anything else."""
    from ..nn.model import DualVerifierNet, VerifierNet

    net = getattr(verifier, "verifier", verifier)
    if not isinstance(net, (VerifierNet, DualVerifierNet)):
        raise InputError(f"a FAR target from the federation's statistics needs a torch verifier (VerifierNet) to run its "
                         f"top on trunk features, got {type(net).__name__} (an ONNX verifier file alone has no top graph: "
                         f"enroll with the torch model, as a device from its export — fedfs device --artifacts, "
                         f"whose onnx/top.onnx runs the top — or without the statistics)")
    return net


def torch_top(verifier: Any) -> TopFn:
    """``features → outputs`` of a torch :class:`~fedfs_sdk.nn.model.VerifierNet` (or a backend holding
    one) whose backbone splits into ξ's trunk and a top (``scope="top"``)."""
    import torch

    from ..nn.model import DualVerifierNet, VerifierNet
    from ..training.scope import EmbeddingTop

    net = _torch_net(verifier)
    if isinstance(net, DualVerifierNet):
        top = DualVerifierNet(EmbeddingTop(net.backbone), EmbeddingTop(net.global_backbone), net.uv_head).eval()
    else:
        top = VerifierNet(EmbeddingTop(net.backbone), net.uv_head, project=net.project).eval()
    names = top.output_names

    def run(f: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            outs = [top(torch.from_numpy(np.asarray(f[a:a + 2048], dtype=np.float32))) for a in range(0, len(f), 2048)]
        return {k: np.concatenate([o[i].double().numpy() for o in outs]) for i, k in enumerate(names)}

    return run


def xi_verifier(path: str | Path) -> Any:
    """ξ's checkpoint as a torch :class:`~fedfs_sdk.nn.model.VerifierNet` (its backbone: what
    ``xi.tail`` is computed with)."""
    from ..nn.checkpoint import load_checkpoint
    from ..nn.model import VerifierNet

    return VerifierNet(load_checkpoint(Path(path))[0].backbone).eval()


def torch_trunk(verifier: Any) -> Callable[[np.ndarray], np.ndarray]:
    """Preprocessed images ``[n, 3, S, S]`` → trunk features of a torch verifier's backbone."""
    import torch

    from ..training.scope import Trunk

    trunk = Trunk(_torch_net(verifier).backbone).eval()

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return np.concatenate([trunk(torch.from_numpy(np.asarray(x[a:a + 128], dtype=np.float32))).double().numpy()
                                   for a in range(0, len(x), 128)])

    return run


def read_stat_sum(stats: StatSum | str | Path) -> StatSum:
    """A :class:`StatSum`, or one read from a published statistics file (``{"count", "sums", …}``)."""
    if not isinstance(stats, (str, Path)):
        return stats
    try:
        return StatSum.from_dict(json.loads(Path(stats).read_text()))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the published statistics {stats}: {e}") from None


def require_public_people(impostors: Any) -> None:
    """Refuse a FAR target from statistics without the public set (and its people) the tail's directions
    came from."""
    if impostors is None or getattr(impostors, "identity", None) is None:
        raise InputError("a FAR target from the federation's statistics needs the public impostor set the round's "
                         "tail directions came from (--impostors FILE, or the server's)")


def evidence_for_backend(stats: StatSum | str | Path, backend: Any, xi_backend: Any, impostors: Any,
                         own_images: np.ndarray | None = None, mode: str = TAIL_MODE) -> InDomainEvidence:
    """:func:`in_domain_evidence` for a torch backend (the enrolled verifier), the torch backend the
    round's tail histograms were computed with (``xi_backend``: ξ for ``xi.tail``; measured on LFW,
    the tail shape is calibrated for the model it was measured with and does *not* carry over to
    another top — docs/personalization.md) and the public
    :class:`~fedfs_sdk.runtime.impostors.ImpostorSet` the round's directions came from.
    ``stats``: a :class:`StatSum` or a published statistics file (``{"count", "sums", …}``).
    ``own_images``: the preprocessed photos this device contributed to the round (their moments are
    subtracted), None if it did not contribute. Refuses a verifier whose trunk is not ξ's."""
    stats = read_stat_sum(stats)
    require_public_people(impostors)
    trunk, xi_trunk = torch_trunk(backend), torch_trunk(xi_backend)
    x = impostors.batch(int(backend.input_size))
    pub = trunk(x)
    if not np.allclose(xi_trunk(x[:8]), pub[:8], rtol=1e-4, atol=1e-4):
        raise InputError("the enrolled verifier's trunk is not ξ's: the federation's statistics describe ξ's trunk "
                         "features (scope=top); enroll with a scope=top model of this ξ, or without --far-stats")
    xi_top = torch_top(xi_backend)
    ev = in_domain_evidence(stats, torch_top(backend), lambda f: xi_top(f)["embedding"], pub, impostors.identity,
                            own_features=None if own_images is None else trunk(own_images), mode=mode)
    ev.record.update(model_id=getattr(backend, "model_id", None), tail_model_id=getattr(xi_backend, "model_id", None))
    return ev


__all__ = ["InDomainEvidence", "evidence_for_backend", "drawn_features", "read_stat_sum", "require_public_people", "xi_verifier", "in_domain_evidence", "tail_directions", "move_public", "torch_top", "torch_trunk",
           "FEATURES", "TAIL_MODE", "ESTIMATOR"]
