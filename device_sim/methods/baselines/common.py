"""Machinery shared by the baselines: a backbone started from ξ, class embeddings, and the
angular similarities of the margin losses.

Every baseline trains the same backbone as the SDK methods (``ctx.model_config``, started
from ξ's weights) plus *class embeddings* ``w_u ∈ R^D``, one per client (each client is one
identity, so one class). They differ in who sees ``w_u`` and what the server does with it
(see ``docs/baselines.md``):

==============  ==================================  ==========================================
method          where ``w_u`` lives                 server step after FedAvg
==============  ==================================  ==========================================
softmax         global ``W`` [K, D], all clients    none
fedaws          server holds ``W``; client sees     spread-out regularizer (FedUV §3.3)
                only its own row
fedgc           as fedaws (FedPE)                   softmax regularizer (FedGC Eq. 5, Alg. 1)
privacyface     private on the client               none; DP cluster centres are shared
==============  ==================================  ==========================================

Verification: by default ``cos(g(x), w_y)`` with the client's own class embedding as the
reference (FedUV §2.2: "a test example is accepted if its embedding is close enough to a
reference embedding"); ``verify="template"`` enrolls a cosine template from warm-up images
instead. Both use the FedUV warm-up threshold rule (the evaluator's, unchanged).
"""
from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from fedfs_sdk.nn.backbones.layers import l2_normalize
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.losses.common import masked_mean
from fedfs_sdk.nn.model import FaceNet, ModelConfig

from ..base import (ClientState, FederatedMethod, Params, SimContext, VerifierSpec, Weights, backbone_weights,
                    frozen, verifier_net)

VERIFY_MODES = ("class", "template")
_CLASS_STREAM = 0xC1A55


def unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rows scaled to unit L2 norm (a zero row stays zero instead of becoming NaN)."""
    return l2_normalize(x, dim=dim, eps=1e-12)


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integer ``keys`` (independent streams per key tuple)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> np.uint64(1)))


def init_class_embeddings(num: int, dim: int, seed: int) -> torch.Tensor:
    """``[num, dim]`` random unit class embeddings, deterministic in ``seed`` (row ``u`` is
    client ``u``'s initial ``w_u``; random directions in high dimension are nearly
    orthogonal, so no class starts close to another)."""
    return unit(torch.randn(num, dim, generator=generator(seed, _CLASS_STREAM)))


def positive_loss(f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FedAwS's positive term ``d(g(x), w_y)² = ‖f − w‖²`` on unit vectors ``= 2 − 2 cos``
    (FedUV Eq. 2 positive term; Yu et al. 2020 ``ℓ_pos(d) = d²``). ``[B]``."""
    return 2.0 - 2.0 * (f * w).sum(-1)


def _sin(cos: torch.Tensor) -> torch.Tensor:
    # sin θ for θ ∈ [0, π]; the clamp keeps the gradient finite at cos = ±1.
    return torch.sqrt(torch.clamp(1.0 - cos * cos, min=1e-9))


def arcface_logit(cos: torch.Tensor, scale: float, margin: float) -> torch.Tensor:
    """ArcFace ``u(w, f) = s·cos(θ + m)`` (PrivacyFace Eq. 3), without ``acos``.

    Past ``θ > π − m`` the angle ``θ + m`` wraps and ``cos(θ + m)`` would grow again; as
    insightface does, the logit continues there as ``cos θ − m·sin m`` (monotone in θ).
    """
    phi = cos * math.cos(margin) - _sin(cos) * math.sin(margin)
    phi = torch.where(cos > math.cos(math.pi - margin), phi, cos - math.sin(math.pi - margin) * margin)
    return scale * phi


def cosface_logit(cos: torch.Tensor, scale: float, margin: float) -> torch.Tensor:
    """CosFace ``u(w, f) = s·(cos θ − m)`` (PrivacyFace Eq. 2)."""
    return scale * (cos - margin)


def consensus_similarity(cos: torch.Tensor, scale: float, rho: float) -> torch.Tensor:
    """PrivacyFace's cluster similarity ``μ(p̂, f, ρ) = s·cos(max(θ − ρ, 0))`` (Eq. 5),
    ``θ`` the angle between ``f`` and the cluster centre ``p̂``: a feature inside the cap of
    margin ρ scores the maximum ``s``; outside, ``cos(θ − ρ) = cos θ cos ρ + sin θ sin ρ``."""
    outside = cos * math.cos(rho) + _sin(cos) * math.sin(rho)
    return scale * torch.where(cos >= math.cos(rho), torch.ones_like(cos), outside)


class ClassEmbeddingBaseline(FederatedMethod):
    """Base of the four baselines: a global backbone started from ξ plus class embeddings.

    Subclasses add their class-embedding parameters (:meth:`extra_global`, private groups)
    and say where a client's ``w_y`` is (:meth:`class_embedding`).

    Args:
        verify: ``class`` — score ``cos(g(x), w_y)`` against the client's own class
            embedding; ``template`` — enroll a cosine template from warm-up images.
    """

    CLASS_PARAMS: tuple[str, ...] = ()
    """Names of the randomly started class-embedding tensors (trained at ``head_lr``)."""

    def __init__(self, verify: str = "class") -> None:
        super().__init__()
        if verify not in VERIFY_MODES:
            raise InputError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.verify = verify

    # ---- description -------------------------------------------------------------------
    @property
    def label(self) -> str:
        """The name plus the options that differ from the defaults, as typed on the command
        line (``privacyface (epsilon=inf)``): distinct specs get distinct table rows and
        checkpoint folders."""
        defaults = type(self)().options()
        changed = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in self.options().items() if defaults.get(k) != v]
        return f"{self.name} ({', '.join(changed)})" if changed else self.name

    def options(self) -> dict[str, Any]:
        return {"verify": self.verify}

    def default_lr(self) -> float:
        return 0.1  # FedUV §6.2 (softmax, FedAwS), FedGC §Experimental Settings: SGD lr 0.1

    def default_local_epochs(self) -> int:
        return 1  # FedUV §6.2: 1 local epoch

    def learning_rate(self, group: str, name: str, base_lr: float, head_lr: float | None) -> float:
        # Class embeddings start random while the backbone starts pre-trained (as FedUV's W).
        if name in self.CLASS_PARAMS and head_lr is not None:
            return head_lr
        return base_lr

    # ---- set-up ------------------------------------------------------------------------
    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        base = ctx.model_config.resolved()
        self.model_config: ModelConfig = replace(base, proj_dim=None, code_length=None)
        self.dim = int(self.model_config.embedding_dim)
        # Skeleton only: its tensors are replaced by functional_call's params.
        self.net = frozen(FaceNet(self.model_config)).to(torch.device(ctx.device))
        self._vnet = verifier_net(self.model_config, with_head=False)

    def init_global(self) -> Weights:
        """ξ's backbone (every method starts pre-trained) plus :meth:`extra_global`."""
        xi = backbone_weights(self.context.xi.state_dict())
        if not xi:
            raise InputError("ξ has no backbone.* weights to start the baselines from")
        return {**{k: v.detach().clone().cpu() for k, v in xi.items()}, **self.extra_global()}

    def extra_global(self) -> Weights:
        """Method tensors averaged with the backbone (none by default)."""
        return {}

    # ---- objective pieces ----------------------------------------------------------------
    def features(self, global_params: Weights, x: torch.Tensor) -> torch.Tensor:
        """Backbone output ``g(x)`` ``[B, D]`` with the global weights, functionally."""
        bb = {k: v for k, v in global_params.items() if k.startswith("backbone.")}
        return functional_call(self.net, bb, (x,)).embedding

    def embed(self, global_params: Weights, x: torch.Tensor) -> torch.Tensor:
        """Unit-norm features ``f = g(x)/‖g(x)‖``."""
        return unit(self.features(global_params, x))

    @staticmethod
    def mean(per_sample: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return masked_mean(per_sample, mask)

    # ---- evaluation --------------------------------------------------------------------
    @abstractmethod
    def class_embedding(self, client: int, global_weights: Weights, private: Params | None) -> torch.Tensor:
        """Client ``client``'s class embedding ``w_y`` after training, ``[D]``."""

    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        weights = backbone_weights(global_weights)
        if self.verify == "template":
            return VerifierSpec(self._vnet, weights, None, shared_key="global")
        ref = unit(self.class_embedding(state.client, global_weights, private).detach().float().cpu())
        return VerifierSpec(self._vnet, weights, None, shared_key="global", reference=ref)

    def new_user_verifier(self, state: ClientState, global_weights: Weights) -> VerifierSpec:
        """A new user has no class embedding: a template enrolled with the global backbone."""
        return VerifierSpec(self._vnet, backbone_weights(global_weights), None, shared_key="global")


def check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise InputError(f"{name} must be > 0, got {v}")


__all__ = ["ClassEmbeddingBaseline", "VERIFY_MODES", "unit", "generator", "init_class_embeddings",
           "positive_loss", "arcface_logit", "cosface_logit", "consensus_similarity", "check_positive"]
