"""``fedaws``: Federated Averaging with Spreadout (Yu et al. 2020, as described in FedUV §3.3).

Each client has only positive data and sees only its own class embedding ``w_y``; it trains
the backbone and ``w_y`` with the positive loss ``d(g(x), w_y)²`` (FedUV Eq. 2 without the
negative term). After FedAvg the server, which holds every ``w_u``, takes one step on the
spread-out regularizer (FedUV §3.3)

    reg_sp(W) = Σ_u Σ_{u'≠u} (max(0, ν − d(w_u, w_{u'})))²

so that no two class embeddings come closer than the margin ``ν`` — the negative term the
clients cannot compute. ``d`` is the Euclidean distance of the unit-normalized embeddings.
FedUV's criticism, and why FedUV exists: every ``w_u`` is revealed to the server.
"""
from __future__ import annotations

from typing import Any

import torch

from .common import check_positive, unit
from .server_held import ServerHeldClassEmbeddings, chunked_regularizer_grad


def pairwise_distances(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between unit rows, ``√(2 − 2 aᵀb)``; ``[|A|, |B|]``. The clamp
    keeps the gradient finite at distance 0 (a pair of identical rows)."""
    return torch.sqrt(torch.clamp(2.0 - 2.0 * (A @ B.t()), min=1e-12))


def spreadout_block(W: torch.Tensor, rows: torch.Tensor, nu: float) -> torch.Tensor:
    """``Σ_{u∈rows} Σ_{u'≠u} (max(0, ν − d(ŵ_u, ŵ_{u'})))²`` — the anchor rows' share of reg_sp."""
    Wn = unit(W)
    d = pairwise_distances(Wn[rows], Wn)                                  # [|rows|, K]
    hinge = torch.relu(nu - d) ** 2
    not_self = torch.arange(W.shape[0], device=W.device)[None, :] != rows[:, None]
    return (hinge * not_self).sum()


def spreadout_regularizer(W: torch.Tensor, nu: float = 0.9) -> torch.Tensor:
    """``reg_sp(W)`` (FedUV §3.3) of the rows of ``W`` (normalized inside); differentiable."""
    return spreadout_block(W, torch.arange(W.shape[0], device=W.device), nu)


def spreadout_step(W: torch.Tensor, nu: float, step: float, chunk: int = 1024) -> torch.Tensor:
    """One server step ``W − step·∇reg_sp(W)`` (``step = λη``), gradient in row blocks."""
    _, grad = chunked_regularizer_grad(W, lambda w, rows: spreadout_block(w, rows, nu), chunk)
    return W - step * grad


class FedAwS(ServerHeldClassEmbeddings):
    """FedAwS: positive loss on the client, spread-out step on ``W`` at the server.

    Args:
        nu: margin ``ν`` of reg_sp on unit vectors (0.9: the spread-out setting recommended
            by FedFace's authors, PrivacyFace §A.2.5); pairs farther apart than ``ν`` (cosine
            below ``1 − ν²/2``) do not interact.
        lam: learning-rate multiplier ``λ`` of the server step (10, ibid.).
        server_lr, chunk, verify: see :class:`ServerHeldClassEmbeddings`.
    """

    name = "fedaws"

    def __init__(self, nu: float = 0.9, lam: float = 10.0, server_lr: float = 0.1, chunk: int = 1024,
                 verify: str = "class") -> None:
        super().__init__(lam, server_lr, chunk, verify)
        check_positive(nu=nu)
        self.nu = float(nu)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "nu": self.nu}

    def server_step(self, W: torch.Tensor) -> torch.Tensor:
        return spreadout_step(W, self.nu, self.lam * self.server_lr, self.chunk)


__all__ = ["FedAwS", "spreadout_regularizer", "spreadout_step", "spreadout_block", "pairwise_distances"]
