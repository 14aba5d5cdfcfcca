"""``privacyface``: DP local clustering + consensus-aware margin loss (PrivacyFace §3, Alg. 2).

Round ``t`` of Alg. 2: clients sync the backbone ``φ_{t−1}``; each client releases DP
cluster centres ``P^c`` of its (private) class centres ``W^c`` with DPLC (Alg. 1, line 3);
the server gathers and broadcasts ``P = {P^1, …, P^C}`` (line 4); each client trains
``(φ^c, W^c)`` on the consensus-aware loss (Eq. 5)

    L^c = −Σ_i log e^{u(w_{y_i}, f_i)} / (e^{u(w_{y_i}, f_i)} + Σ_{j≠y_i} e^{v(w_j, f_i)}
                                          + Σ_{k≠c} Σ_l e^{μ(p̂^k_l, f_i, ρ)})

with ``μ(p̂, f, ρ) = s·cos(max(θ − ρ, 0))``, and sends only ``φ^c`` back (``W^c`` stays
local); FedAvg of the backbones (line 8).

Here each client is one identity: ``W^c = {w_c}``, the local negatives ``Σ_{j≠y}`` are
empty, and the other clients' centres are the only negatives.

Simulation of Alg. 2's line 3: a client's DPLC input ``W^c`` only changes when it trains,
so its release for its next round is computed right after its local update (in
:meth:`receive`) — from the same ``W^c`` line 3 would use at the start of that round. A
client's first release, of its initial class embedding, is made when it is first sampled.
The server broadcasts the latest release of every client that has taken part (with full
participation: exactly Alg. 2), at most ``max_centres`` of them per round.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedfs_sdk.errors import CheckpointError, InputError

from ..base import ClientState, Params, RoundPlan, SimContext, Weights
from .common import (ClassEmbeddingBaseline, arcface_logit, check_positive, consensus_similarity, cosface_logit,
                     generator, init_class_embeddings, unit)
from .dplc import dplc, dplc_sigma

MARGIN_LOSSES = {"arcface": (arcface_logit, 0.5), "cosface": (cosface_logit, 0.35)}
OFFSET = "offset"


def consensus_aware_loss(f: torch.Tensor, w: torch.Tensor, centres: torch.Tensor, keep: torch.Tensor,
                         scale: float, margin: float, rho: float, loss: str = "arcface") -> torch.Tensor:
    """Per-sample PrivacyFace Eq. 5 for a one-class client: ``[B]``.

    Args:
        f: unit features ``[B, D]``; ``w``: the client's unit class embedding ``[D]``.
        centres: shared unit cluster centres ``p̂`` ``[M, D]``; ``keep``: ``[M]`` bool,
            False for the client's own centres (Eq. 5 sums over ``k ≠ c``).
        scale, margin: ``s`` and ``m`` of the positive margin logit ``u`` (ArcFace/CosFace).
        rho: cluster margin ρ of ``μ``.
    """
    u = MARGIN_LOSSES[loss][0](f @ w, scale, margin)                       # [B]
    mu = consensus_similarity(f @ centres.t(), scale, rho)                 # [B, M]
    mu = torch.where(keep[None, :], mu, torch.full_like(mu, -math.inf))
    logits = torch.cat([u[:, None], mu], dim=1)
    return torch.logsumexp(logits, dim=1) - u


class PrivacyFace(ClassEmbeddingBaseline):
    """PrivacyFace (PrivacyFace Alg. 2) for one-identity clients.

    Args:
        loss: positive margin logit ``u``: ``arcface`` (``s·cos(θ+m)``, the paper's main
            setting) or ``cosface`` (``s·(cos θ − m)``).
        scale: ``s`` of ``u`` and ``μ`` (64, the usual ArcFace/CosFace scale).
        margin: ``m``; default 0.5 for ArcFace, 0.35 for CosFace.
        rho: cluster margin ρ (paper default 1.3).
        epsilon, delta: per-release privacy budget (paper: ε = 1, δ ≈ 5e-5). ``inf``
            disables the noise (the paper's non-private "φ + p" variant).
        min_cluster: ``T``. The paper uses 512 class centres; a one-identity client has one
            centre, so only ``T = 1`` can ever release anything.
        queries: ``Q`` (with one centre, only the first query can succeed).
        max_centres: most centres broadcast per round (a seeded random subset beyond it).
        verify: see :class:`ClassEmbeddingBaseline`.
    """

    name = "privacyface"
    private_groups = ("class",)
    CLASS_PARAMS = (OFFSET,)

    def __init__(self, loss: str = "arcface", scale: float = 64.0, margin: float | None = None,
                 rho: float = 1.3, epsilon: float = 1.0, delta: float = 5e-5, min_cluster: int = 1,
                 queries: int = 1, max_centres: int = 4096, verify: str = "class") -> None:
        super().__init__(verify)
        if loss not in MARGIN_LOSSES:
            raise InputError(f"loss must be one of {sorted(MARGIN_LOSSES)}, got {loss!r}")
        if min_cluster != 1:
            raise InputError(f"min_cluster (T) must be 1: a one-identity client has a single class centre, "
                             f"so a cluster of T={min_cluster} can never form and nothing would be shared")
        check_positive(scale=scale, max_centres=max_centres, queries=queries)
        self.loss = loss
        self.scale = float(scale)
        self.margin = float(MARGIN_LOSSES[loss][1] if margin is None else margin)
        self.rho, self.epsilon, self.delta = float(rho), float(epsilon), float(delta)
        self.min_cluster, self.queries, self.max_centres = int(min_cluster), int(queries), int(max_centres)
        dplc_sigma(1, self.rho, self.epsilon, self.delta)   # validates ρ, ε, δ
        if not 0 <= self.margin < math.pi / 2:
            raise InputError(f"margin must be in [0, π/2), got {self.margin}")

    def options(self) -> dict[str, Any]:
        return {**super().options(), "loss": self.loss, "scale": self.scale, "margin": self.margin,
                "rho": self.rho, "epsilon": self.epsilon, "delta": self.delta, "min_cluster": self.min_cluster,
                "queries": self.queries, "max_centres": self.max_centres}

    def default_lr(self) -> float:
        return 1e-3   # PrivacyFace §4: fine-tuning φ_0 with SGD lr 0.001

    # ---- set-up ------------------------------------------------------------------------
    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        # w_c = unit(r_c + offset_c): r_c is the client's random initial class embedding
        # (regenerated from the seed, a constant), offset_c its trained private part. Every
        # client's private group then starts from the same zeros (the client store's θ_0).
        self.R = init_class_embeddings(ctx.num_clients, self.dim, ctx.seed)
        self.centres = torch.zeros(ctx.num_clients, self.queries, self.dim)   # latest releases
        self.valid = torch.zeros(ctx.num_clients, self.queries, dtype=torch.bool)
        self.released = torch.zeros(ctx.num_clients, dtype=torch.bool)
        self._received: set[int] = set()

    def init_private(self, global_weights: Weights) -> Params:
        return {"class": {OFFSET: torch.zeros(self.dim)}}

    def class_embedding(self, client: int, global_weights: Weights, private: Params | None) -> torch.Tensor:
        offset = private["class"][OFFSET].float().cpu() if private is not None else 0.0
        return unit(self.R[client] + offset)

    # ---- DPLC (client side) ------------------------------------------------------------
    def release(self, client: int, class_centres: torch.Tensor, round_idx: int, stage: int) -> None:
        """Client ``client`` runs DPLC (Alg. 1) on its class centres; the server keeps the result.

        The noise is seeded by ``(seed, client, round, stage)``: reproducible, and never
        reused between two releases (reused noise would cancel in their difference)."""
        out = dplc(class_centres, self.rho, self.min_cluster, self.queries, self.epsilon, self.delta,
                   generator(self.context.seed, 0xD91C, client, round_idx, stage))
        q = out.centres.shape[0]
        self.centres[client].zero_()
        self.centres[client, :q] = out.centres
        self.valid[client] = torch.arange(self.queries) < q
        self.released[client] = True

    def configure_round(self, round_idx: int, participants: np.ndarray) -> RoundPlan:
        participants = np.asarray(participants)
        for c in participants.tolist():                   # first-timers release W_0^c (Alg. 2 line 3)
            if not bool(self.released[c]):
                self.release(c, self.R[c][None], round_idx, stage=0)
        owners, slots = torch.nonzero(self.valid, as_tuple=True)
        if owners.numel() > self.max_centres:
            pick = torch.randperm(owners.numel(), generator=generator(self.context.seed, 0x5E1, round_idx))
            pick = pick[:self.max_centres].sort().values
            owners, slots = owners[pick], slots[pick]
        self._received = set()
        extras = {"centres": self.centres[owners, slots].clone(), "owners": owners.clone()}
        return RoundPlan(round_idx, participants, extras)

    # ---- local training ----------------------------------------------------------------
    def client_consts(self, plan: RoundPlan, state: ClientState) -> dict[str, torch.Tensor]:
        return {"class_base": self.R[state.client].clone(), "client": torch.tensor(state.client, dtype=torch.long)}

    def objective(self, plan: RoundPlan, params: Params, consts: Mapping[str, torch.Tensor],
                  x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = self.embed(params["global"], x)
        w = unit(consts["class_base"] + params["class"][OFFSET])
        centres = plan.extras["centres"].to(device=f.device, dtype=f.dtype)
        keep = plan.extras["owners"].to(f.device) != consts["client"]
        per = consensus_aware_loss(f, w, centres, keep, self.scale, self.margin, self.rho, self.loss)
        loss = self.mean(per, mask)
        return loss, {"loss": loss, "cos_pos": self.mean(f @ w, mask)}

    def receive(self, plan: RoundPlan, clients: Sequence[int], params: Params,
                num_samples: torch.Tensor) -> None:
        """After local training each client releases DPLC of its updated ``w_c`` — the input
        Alg. 2 line 3 uses at its next round (``w_c`` does not change in between)."""
        offsets = params["class"][OFFSET].detach().float().cpu()
        for i, c in enumerate(clients):
            self.release(int(c), unit(self.R[int(c)] + offsets[i])[None], plan.round, stage=1)
            self._received.add(int(c))

    def server_update(self, aggregated: Weights, plan: RoundPlan) -> Weights:
        missing = [int(c) for c in plan.participants if int(c) not in self._received]
        if missing:
            raise RuntimeError(
                f"{self.name}: no DPLC release from participants {missing[:5]} of round {plan.round}; the round "
                f"loop must call method.receive(plan, clients, params, num_samples) after each trained chunk")
        return aggregated

    # ---- server state (checkpoints) ----------------------------------------------------
    def server_state(self) -> dict[str, torch.Tensor]:
        return {"centres": self.centres.clone(), "valid": self.valid.clone(), "released": self.released.clone()}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        mine = self.server_state()
        if set(state) != set(mine) or any(tuple(state[k].shape) != tuple(v.shape) for k, v in mine.items()):
            raise CheckpointError(f"{self.name}: server state must hold {sorted(mine)} with shapes "
                                  f"{[tuple(v.shape) for v in mine.values()]}")
        self.centres = state["centres"].float().cpu().clone()
        self.valid = state["valid"].bool().cpu().clone()
        self.released = state["released"].bool().cpu().clone()

    def privacy_spent(self, releases: int) -> tuple[float, float]:
        """``(ε, δ)`` spent by a client after ``releases`` DPLC releases: ``(rQε, rQδ)``
        (Property 2 and Definition 4, composed over its rounds)."""
        return releases * self.queries * self.epsilon, releases * self.queries * self.delta


__all__ = ["PrivacyFace", "consensus_aware_loss", "MARGIN_LOSSES"]
