"""``softmax``: FedAvg of a backbone and a shared classifier over all clients' classes.

FedUV §6.2's "softmax" baseline: each user is one class, the model ends in a
fully-connected layer ``W ∈ R^{K×D}`` over all ``K`` users (FedUV Table 2, "FC(1024, c)",
``c`` = number of users, no scaling) and is trained by FedAvg with softmax cross-entropy
on the client's own label. Every client receives — and updates — every other client's
class embedding: the privacy leak FedUV §6.2 points out ("softmax shares the embedding of
each user with other users and the server"). The baseline of what sharing buys.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fedfs_sdk.errors import InputError

from ..base import ClientState, Params, RoundPlan, Weights
from .common import ClassEmbeddingBaseline, init_class_embeddings, unit

CLASSIFIER = "classifier.weight"


class SoftmaxFedAvg(ClassEmbeddingBaseline):
    """Softmax-FedAvg (FedUV §6.2 baseline).

    Args:
        scale: 0 — plain linear logits ``W g(x)`` (FedUV Table 2: FC layer, no scaling);
            ``s > 0`` — normalized logits ``s·cos(w_j, g(x))`` (NormFace-style cosine softmax).
        verify: see :class:`ClassEmbeddingBaseline`.
    """

    name = "softmax"
    CLASS_PARAMS = (CLASSIFIER,)

    def __init__(self, scale: float = 0.0, verify: str = "class") -> None:
        super().__init__(verify)
        if scale < 0:
            raise InputError(f"scale must be ≥ 0 (0 = plain linear logits), got {scale}")
        self.scale = float(scale)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "scale": self.scale}

    def extra_global(self) -> Weights:
        ctx = self.context
        return {CLASSIFIER: init_class_embeddings(ctx.num_clients, self.dim, ctx.seed)}

    def client_consts(self, plan: RoundPlan, state: ClientState) -> dict[str, torch.Tensor]:
        return {"label": torch.tensor(state.client, dtype=torch.long)}

    def objective(self, plan: RoundPlan, params: Params, consts: Mapping[str, torch.Tensor],
                  x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = params["global"]
        w = g[CLASSIFIER]                                              # [K, D]
        e = self.features(g, x)                                        # [B, D]
        if self.scale:
            logits = self.scale * unit(e) @ unit(w).t()
        else:
            logits = e @ w.t()
        # One-hot by comparison rather than indexing: stays vmappable over clients' labels.
        onehot = (torch.arange(w.shape[0], device=x.device) == consts["label"]).to(logits.dtype)
        target = (logits * onehot).sum(-1)
        ce = torch.logsumexp(logits, dim=-1) - target                  # softmax cross-entropy
        correct = (target >= logits.max(dim=-1).values).to(logits.dtype)
        loss = self.mean(ce, mask)
        return loss, {"loss": loss, "train_acc": self.mean(correct, mask)}

    def class_embedding(self, client: int, global_weights: Weights, private: Params | None) -> torch.Tensor:
        return global_weights[CLASSIFIER][client]


__all__ = ["SoftmaxFedAvg", "CLASSIFIER"]
