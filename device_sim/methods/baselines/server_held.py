"""Class embeddings held by the server, each seen only by its own client (FedAwS, FedGC/FedPE).

FedAwS (Yu et al. 2020, FedUV §3.3) and FedGC (Alg. 1) share one protocol: the server keeps
``W = [w_1, …, w_K]``; in round ``t`` it sends client ``k`` the backbone ``θ^t`` and *its
own* ``w_k^t`` (never another client's); the client trains both on its data and returns
``(θ_k^{t+1}, w_k^{t+1})``; the server averages the backbones (FedAvg), writes the returned
``w_k^{t+1}`` into ``W̃^{t+1}`` and applies a regularizer step ``W^{t+1} = W̃^{t+1} −
λη∇Reg(W̃^{t+1})`` (FedGC Alg. 1 lines 12–14; FedAwS's server step has the same form).

How it maps onto the simulator's interface (``docs/baselines.md``): ``w_k^t`` reaches the
client as the constant ``class_base``; the trainable tensor is ``class_delta`` (zero at
the start of every round, in the global group so every client starts from the same zero),
and the client's class embedding during training is ``w = class_base + class_delta``. The
trained deltas reach the server through :meth:`receive` (called by the round loop after
each chunk); FedAvg's average of the deltas is discarded. SGD on ``class_delta`` from 0
is SGD on ``w`` from ``w_k^t``: the same trajectory.

Class embeddings are kept on the unit sphere: every loss normalizes ``w``, and the server
projects each row back after the upload and after its step (projected SGD).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fedfs_sdk.errors import CheckpointError

from ..base import ClientState, Params, RoundPlan, SimContext, Weights
from .common import ClassEmbeddingBaseline, check_positive, init_class_embeddings, positive_loss, unit

DELTA = "class_delta"


class ServerHeldClassEmbeddings(ClassEmbeddingBaseline):
    """FedPE-style training: positive loss locally, a regularizer step on ``W`` at the server.

    Args:
        lam: the regularizer's learning-rate multiplier ``λ`` (FedGC Alg. 1 line 14).
        server_lr: ``η`` of the server step ``W ← W − λη∇Reg(W)`` (the clients' SGD lr of
            the papers, 0.1).
        chunk: rows of ``W`` per block when the server computes the regularizer's gradient
            (memory ``chunk × K``; the result does not depend on it).
        verify: see :class:`ClassEmbeddingBaseline`.
    """

    CLASS_PARAMS = (DELTA,)

    def __init__(self, lam: float, server_lr: float = 0.1, chunk: int = 1024, verify: str = "class") -> None:
        super().__init__(verify)
        check_positive(lam=lam, server_lr=server_lr, chunk=chunk)
        self.lam, self.server_lr, self.chunk = float(lam), float(server_lr), int(chunk)
        self._uploads: dict[int, torch.Tensor] = {}

    def options(self) -> dict[str, Any]:
        return {**super().options(), "lam": self.lam, "server_lr": self.server_lr}

    # ---- set-up ------------------------------------------------------------------------
    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        self.W = init_class_embeddings(ctx.num_clients, self.dim, ctx.seed)   # server state
        self._uploads = {}

    def extra_global(self) -> Weights:
        return {DELTA: torch.zeros(self.dim)}

    # ---- one round ---------------------------------------------------------------------
    def configure_round(self, round_idx: int, participants: np.ndarray) -> RoundPlan:
        self._uploads = {}
        return RoundPlan(round_idx, np.asarray(participants))

    def client_consts(self, plan: RoundPlan, state: ClientState) -> dict[str, torch.Tensor]:
        # Client k receives w_k^t only (FedGC Alg. 1 line 4); a copy, so server-side writes
        # during the round never reach a client still to train.
        return {"class_base": self.W[state.client].clone()}

    def objective(self, plan: RoundPlan, params: Params, consts: Mapping[str, torch.Tensor],
                  x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = params["global"]
        f = self.embed(g, x)                                           # [B, D] unit
        w = unit(consts["class_base"] + g[DELTA])                      # [D] unit
        loss = self.mean(positive_loss(f, w), mask)
        return loss, {"loss": loss, "cos_pos": self.mean(f @ w, mask)}

    def receive(self, plan: RoundPlan, clients: Sequence[int], params: Params,
                num_samples: torch.Tensor) -> None:
        """The chunk's uploaded class embeddings ``w_k^{t+1} = w_k^t + Δ_k`` (FedGC Alg. 1 line 8)."""
        deltas = params["global"][DELTA].detach().float().cpu()
        for i, c in enumerate(clients):
            self._uploads[int(c)] = unit(self.W[int(c)] + deltas[i])

    def server_update(self, aggregated: Weights, plan: RoundPlan) -> Weights:
        missing = [int(c) for c in plan.participants if int(c) not in self._uploads]
        if missing:
            raise RuntimeError(
                f"{self.name}: no class embedding received from participants {missing[:5]} of round "
                f"{plan.round}; the round loop must call method.receive(plan, clients, params, "
                f"num_samples) after each trained chunk")
        idx = torch.tensor(sorted(self._uploads), dtype=torch.long)
        self.W[idx] = torch.stack([self._uploads[int(i)] for i in idx])   # W̃^{t+1} (Alg. 1 line 12)
        # Alg. 1 line 14, on the simulation device: O(K²·D) per round, the step that makes
        # FedAwS/FedGC servers expensive (FedUV §4.3) — seconds for K = 10,000 on a CPU.
        self.W = unit(self.server_step(self.W.to(self.context.device))).cpu()
        self._uploads = {}
        out = dict(aggregated)
        out[DELTA] = torch.zeros_like(aggregated[DELTA])   # the average of deltas is meaningless
        return out

    @abstractmethod
    def server_step(self, W: torch.Tensor) -> torch.Tensor:
        """``W − λη∇Reg(W)`` for the method's regularizer."""

    # ---- server state (checkpoints) ----------------------------------------------------
    def server_state(self) -> dict[str, torch.Tensor]:
        return {"class_embeddings": self.W.clone()}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        W = state.get("class_embeddings")
        if W is None or tuple(W.shape) != tuple(self.W.shape) or set(state) != {"class_embeddings"}:
            raise CheckpointError(f"{self.name}: server state must hold class_embeddings of shape "
                                  f"{tuple(self.W.shape)}, got {({k: tuple(v.shape) for k, v in state.items()})}")
        self.W = W.detach().float().cpu().clone()

    # ---- evaluation --------------------------------------------------------------------
    def class_embedding(self, client: int, global_weights: Weights, private: Params | None) -> torch.Tensor:
        return self.W[client]


def chunked_regularizer_grad(W: torch.Tensor, block_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and gradient of ``Σ_blocks block_loss(W, rows)`` w.r.t. ``W``, one block of
    anchor rows at a time (memory ``chunk × K`` instead of ``K × K``)."""
    W = W.detach().float().requires_grad_(True)
    grad = torch.zeros_like(W)
    total = torch.zeros((), dtype=torch.float64, device=W.device)
    for start in range(0, W.shape[0], chunk):
        rows = torch.arange(start, min(start + chunk, W.shape[0]), device=W.device)
        value = block_loss(W, rows)
        (g,) = torch.autograd.grad(value, W)
        grad += g
        total += value.detach().double()
    return total, grad


__all__ = ["ServerHeldClassEmbeddings", "chunked_regularizer_grad", "DELTA"]
