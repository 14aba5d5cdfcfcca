"""The do-no-harm rule of the defaults with statistics (issue 29): one implementation for the
simulator (:mod:`device_sim.methods.selection`, ``check=in-domain``) and the device agent
(:mod:`fedfs_sdk.federation.device_stats`).

From the statistics rounds a device holds the federation's sums and its own contributions:

* ``xi.embedding`` → ``norm-adapt`` ξ, ξ whose ``embed_norm`` affine is re-fitted to the pooled
  embedding moments (:func:`norm_adapt_weights`, :func:`fold_standardization`);
* ``xi.features`` → impostors in the federation's capture conditions: :data:`~.impostor_model.DRAWS`
  trunk features from the Gaussian of every *other* device's features (:func:`in_domain_draws`), run
  through each candidate's top (:func:`top_verifier`) — the same draws for every candidate;
* ``checks`` → the federation's verdict on each candidate (:func:`~.contributions.verdict_from_sum`).

:func:`decide` is the choice itself: :func:`~fedfs_sdk.training.selection.choose` over the candidates'
checks (ξ first) with the verdicts of the published check sum, or none when nothing was published.
Torch is imported only by the functions that build models.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import InputError
from .contributions import check_contribution, norm_fold_from_sum, verdict_from_sum
from .impostor_model import DRAWS, draws_from_factor, gaussian_factor, others_moments, standard_draws

EMBEDDING = "xi.embedding"
"""ξ's embedding moments (:func:`~.contributions.embedding_moments`)."""
FEATURES = "xi.features"
"""ξ's trunk-feature moments (:func:`~.contributions.feature_moments`)."""
CHECKS = "checks"
"""Every device's check results (:func:`~.contributions.check_contribution`)."""
IN_DOMAIN_CANDIDATES = ("xi", "norm-adapt", "global", "personalized")


def candidate_names(personalized: bool, norm_adapt: bool, candidates: Sequence[str] = IN_DOMAIN_CANDIDATES) -> tuple[str, ...]:
    """The candidates of the check, ξ first: ``norm-adapt`` only where ξ has an ``embed_norm`` to
    re-fit (and the embedding moments were published), ``personalized`` only for FedFS methods."""
    return tuple(c for c in candidates if (c != "norm-adapt" or norm_adapt) and (c != "personalized" or personalized))


def in_domain_draws(total_features: np.ndarray, own_features: np.ndarray | None, seed: int = 0,
                    draws: int = DRAWS, z: np.ndarray | None = None) -> np.ndarray:
    """``[draws, F]`` float32 trunk features of impostors in the federation's conditions: the
    Gaussian of the published feature-moment sum minus this device's own contribution."""
    mu, factor = in_domain_factor(total_features, own_features)
    z = standard_draws(mu.size, draws, seed) if z is None else z
    return draws_from_factor(mu, factor, z)


def in_domain_factor(total_features: np.ndarray, own_features: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(μ, L)`` of the others' trunk features (``L Lᵀ`` = their covariance, shrunk): what
    :func:`in_domain_draws` draws from — a simulator keeps it per client and redraws."""
    mu, cov, _ = others_moments(total_features, own_features)
    return mu, gaussian_factor(cov)


def decide(checks: Sequence, check_sum: np.ndarray | None = None, candidates: Sequence[str] | None = None):
    """The candidate a device verifies with: :func:`~fedfs_sdk.training.selection.choose` of its
    ``checks`` (ξ's first) and the federation's verdicts from ``check_sum`` (the published sum of
    :func:`check_contributions` over ``candidates[1:]``; None: no verdict, each device alone)."""
    from ..training.selection import choose

    verdicts = {}
    if check_sum is not None:
        names = list(candidates if candidates is not None else [c.name for c in checks])[1:]
        verdicts = verdict_from_sum(check_sum, names)
    return choose(checks, verdicts)


def check_contributions(checks: Sequence, candidates: Sequence[str]) -> np.ndarray:
    """A device's contribution to the check round: :func:`check_contribution` against ξ (= ``candidates[0]``)
    for ``candidates[1:]``."""
    return check_contribution(checks, list(candidates)[1:], reference=candidates[0])


# ---- models (torch) ---------------------------------------------------------------------------
def embedding_norm_prefix(weights: Mapping[str, Any]) -> str:
    """The state-dict prefix of the backbone's embedding normalization (``embed_norm``)."""
    for k in weights:
        if k.endswith("embed_norm.weight"):
            return k[: -len("weight")]
    raise InputError("norm-adapt needs a backbone whose embedding ends in a GroupNormP 'embed_norm' layer")


def fold_standardization(weights: Mapping[str, Any], mu, sd) -> dict:
    """New weights whose embedding is ``(e − μ)/s`` (``s = 1`` when ``sd`` is None), folded
    into the ``embed_norm`` affine: ``γ' = γ/s``, ``β' = (β − μ)/s``. Torch tensors (``mu``, ``sd`` from
    :func:`torch_fold`) or float32 numpy arrays (:func:`norm_adapt_arrays`, the ONNX runtime's)."""
    pre = embedding_norm_prefix(weights)
    if isinstance(mu, np.ndarray):
        s = np.ones_like(mu) if sd is None else np.maximum(sd, np.float32(1e-6))
    else:
        import torch

        s = torch.ones_like(mu) if sd is None else sd.clamp_min(1e-6)
    out = dict(weights)
    out[pre + "weight"] = weights[pre + "weight"] / s
    out[pre + "bias"] = (weights[pre + "bias"] - mu) / s
    return out


def torch_fold(fold: tuple[np.ndarray, np.ndarray | None]):
    import torch

    mu, sd = fold
    return torch.from_numpy(mu).float(), None if sd is None else torch.from_numpy(sd).float()


def norm_adapt_weights(weights: Mapping[str, Any], embedding_sum: np.ndarray, mode: str = "standardize") -> dict:
    """ξ's weights (with its ``embed_norm``) as ``norm-adapt`` ξ: the normalization re-fitted to the
    federation's summed embedding moments (:func:`~.contributions.norm_fold_from_sum`)."""
    return fold_standardization(weights, *torch_fold(norm_fold_from_sum(embedding_sum, mode)))


def norm_adapt_arrays(weights: Mapping[str, np.ndarray], embedding_sum: np.ndarray, mode: str = "standardize") -> dict:
    """:func:`norm_adapt_weights` on float32 numpy arrays (no torch): the same float32 arithmetic."""
    mu, sd = norm_fold_from_sum(embedding_sum, mode)
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    return fold_standardization(w, mu.astype(np.float32), None if sd is None else sd.astype(np.float32))


def top_verifier(net):
    """The verifier ``net`` after ξ's trunk: the same heads on :class:`~fedfs_sdk.training.scope.EmbeddingTop`
    backbones (shared modules, so its parameter names are the top-only subset of ``net``'s)."""
    from ..nn.model import DualVerifierNet, VerifierNet
    from ..training.scope import EmbeddingTop

    if isinstance(net, DualVerifierNet):
        return DualVerifierNet(EmbeddingTop(net.backbone), EmbeddingTop(net.global_backbone), net.uv_head)
    if isinstance(net, VerifierNet):
        return VerifierNet(EmbeddingTop(net.backbone), net.uv_head, project=net.project)
    raise InputError(f"scope='top' cannot split a {type(net).__name__} verifier")


__all__ = ["EMBEDDING", "FEATURES", "CHECKS", "IN_DOMAIN_CANDIDATES", "candidate_names", "in_domain_draws", "in_domain_factor", "decide",
           "check_contributions", "embedding_norm_prefix", "fold_standardization", "torch_fold", "norm_adapt_weights", "norm_adapt_arrays",
           "top_verifier"]
