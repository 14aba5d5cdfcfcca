"""``fedgc``: FedPE + the server-side softmax-regularizer gradient correction (FedGC Eq. 5, Alg. 1).

FedPE: each client keeps its class embedding(s) away from other clients and trains them
with its local loss; FedGC's server, after FedAvg of the backbones, corrects the gradients
of the class embeddings with one step on the *softmax regularizer* (Eq. 5)

    Reg(W) = Σ_k Σ_i −log( e^{W_{k,i}ᵀW'_{k,i}} / (e^{W_{k,i}ᵀW'_{k,i}} + Σ_{z≠k} Σ_j e^{W_{z,j}ᵀW'_{k,i}}) )

(``(·)'``: no gradient flows into that copy), ``W ← W̃ − λη∇Reg(W̃)`` (Alg. 1 line 14),
λ ≈ 20 (FedGC Table 2). Its gradient on ``W_{z,j}`` is the cross-client term of Eq. 11/13
that local training cannot produce: ``p(z,j | k,i)·W_{k,i}``, largest for the most similar
pairs (hard-example mining, FedGC "Remark").

One identity per client: with a single local class the local softmax (Eq. 4) is identically
0 — ``−log(e^a/e^a)`` — and so is its gradient ``(p − 1)X`` (Eq. 12, ``p = 1``). FedPE/FedGC
cannot train anything locally in this setting, so the client loss here is the positive-only
loss of FedAwS (the setting FedGC cites, Yu et al. 2020); FedGC's contribution, the server
correction, is kept exactly. See ``docs/baselines.md``.
"""
from __future__ import annotations

from typing import Any

import torch

from fedfs_sdk.errors import InputError

from .common import unit
from .server_held import ServerHeldClassEmbeddings, chunked_regularizer_grad


def softmax_regularizer_block(W: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """The anchors ``rows``' share of Reg(W) (Eq. 5), one class per client.

    ``scale > 0``: logits ``s·ŵ_zᵀŵ'_k`` on unit rows (the CosFace/ArcFace-style variant);
    ``scale == 0``: raw dot products ``w_zᵀw'_k`` (Eq. 5 literally, the Softmax variant).
    """
    V = unit(W) * scale if scale else W
    anchors = (unit(W) if scale else W)[rows].detach()                   # W'_{k}: no gradient
    logits = anchors @ V.t()                                             # [|rows|, K]: a_{z,k}
    own = logits.gather(1, rows[:, None]).squeeze(1)                      # a_{k,k}
    return (torch.logsumexp(logits, dim=-1) - own).sum()


def softmax_regularizer(W: torch.Tensor, scale: float = 64.0) -> torch.Tensor:
    """``Reg(W)`` of FedGC Eq. 5 over all rows of ``W`` (one class per client); differentiable."""
    return softmax_regularizer_block(W, torch.arange(W.shape[0], device=W.device), scale)


def gradient_correction_step(W: torch.Tensor, scale: float, step: float, chunk: int = 1024) -> torch.Tensor:
    """FedGC Alg. 1 line 14: ``W̃ − step·∇Reg(W̃)`` with ``step = λη``."""
    _, grad = chunked_regularizer_grad(W, lambda w, rows: softmax_regularizer_block(w, rows, scale), chunk)
    return W - step * grad


class FedGC(ServerHeldClassEmbeddings):
    """FedGC: FedPE clients, softmax-regularizer correction of ``W`` at the server.

    Args:
        lam: learning-rate multiplier ``λ`` of the correction (FedGC Table 2: best at 20).
        scale: logit scale ``s`` of Reg on unit class embeddings (FedGC §Evaluations:
            ``s = 64``); 0 = raw dot products (Eq. 5 literally; the norms are then free, and
            the server still projects rows back to the unit sphere after the step).
        server_lr, chunk, verify: see :class:`ServerHeldClassEmbeddings`.
    """

    name = "fedgc"

    def __init__(self, lam: float = 20.0, scale: float = 64.0, server_lr: float = 0.1, chunk: int = 1024,
                 verify: str = "class") -> None:
        super().__init__(lam, server_lr, chunk, verify)
        if scale < 0:
            raise InputError(f"scale must be ≥ 0 (0 = raw dot products), got {scale}")
        self.scale = float(scale)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "scale": self.scale}

    def server_step(self, W: torch.Tensor) -> torch.Tensor:
        return gradient_correction_step(W, self.scale, self.lam * self.server_lr, self.chunk)


__all__ = ["FedGC", "softmax_regularizer", "softmax_regularizer_block", "gradient_correction_step"]
