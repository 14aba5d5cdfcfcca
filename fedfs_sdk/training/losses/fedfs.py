"""FedFS intra-subject self-supervised losses (FedFS §3.2, Eq. 2–9).

Notation follows the paper: ``r'``/``q'`` are the global/personalized backbone outputs
before the extra linear layer, ``r``/``q`` after it, ``v = ξ(x)`` the frozen pre-trained
embedding, ``z = r ⊕ q`` (Eq. 2). The paper's ambiguities are resolved by the named
options of :class:`FedFSLossConfig`; ``docs/methods.md`` gives each choice and its reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ...nn.backbones.layers import l2_normalize
from ...errors import InputError
from ...exact import as_written
from .common import masked_mean as _masked_mean

Combine = Literal["concat", "sum"]
LogitMode = Literal["similarity", "literal"]
SoftScore = Literal["dot", "cosine"]

_NEG = -1e4  # "minus infinity" that stays finite in fp16 and ONNX


@dataclass(frozen=True)
class FedFSLossConfig:
    """Options of the FedFS objective.

    Attributes:
        combine: ``⊕`` of Eq. 2 — ``concat`` (r and q each half of ``dim v``) or ``sum``.
        logits: Eq. 3 — ``similarity`` uses ``s·cos_sim(z, v)`` as the logit (the evident
            intent); ``literal`` uses ``1 − cos_sim`` exactly as printed.
        logit_scale: ``s`` for ``similarity`` logits (a temperature of ``1/s``).
        top_k: K of Eq. 5–6. ``K < 1`` is a ratio of the batch (``⌈K·N⌉``, exact, see
            :func:`resolve_k`), ``K ≥ 1`` a count (a whole number).
        gamma: γ, the diagonal boost of Eq. 6.
        lam: λ of Eq. 9 (weight of ``F_insub``; ``1 − λ`` on ``F_reg``).
        soft_score: Eq. 5 ``ass = z·v`` — ``dot`` as printed, or ``cosine`` (scale-free).
    """

    combine: Combine = "concat"
    logits: LogitMode = "similarity"
    logit_scale: float = 10.0
    top_k: float = 4
    gamma: float = 2.0
    lam: float = 0.7
    soft_score: SoftScore = "dot"

    def __post_init__(self) -> None:
        if self.combine not in ("concat", "sum"):
            raise InputError(f"combine must be 'concat' or 'sum', got {self.combine!r}")
        if self.logits not in ("similarity", "literal"):
            raise InputError(f"logits must be 'similarity' or 'literal', got {self.logits!r}")
        if self.soft_score not in ("dot", "cosine"):
            raise InputError(f"soft_score must be 'dot' or 'cosine', got {self.soft_score!r}")
        k = as_written(self.top_k, "top_k")
        if not k > 0:
            raise InputError(f"top_k must be > 0, got {self.top_k}")
        if k >= 1 and k.denominator != 1:
            raise InputError(f"top_k ≥ 1 is a count and must be a whole number, got {self.top_k}")
        for name in ("logit_scale", "gamma"):
            v = as_written(getattr(self, name), name)
            if name == "logit_scale" and not v > 0:
                raise InputError(f"logit_scale must be > 0, got {self.logit_scale}")
        if not 0.0 <= self.lam <= 1.0:
            raise InputError(f"lam (λ) must be in [0, 1], got {self.lam}")

    def projection_dim(self, xi_dim: int) -> int:
        """Size of ``r`` and ``q`` so that ``z = r ⊕ q`` matches ``dim v = xi_dim``."""
        if self.combine == "sum":
            return xi_dim
        if xi_dim % 2:
            raise InputError(f"combine='concat' needs an even ξ embedding size, got {xi_dim}")
        return xi_dim // 2


def combine(r: torch.Tensor, q: torch.Tensor, mode: Combine = "concat") -> torch.Tensor:
    """``z = r ⊕ q`` (FedFS Eq. 2)."""
    return torch.cat([r, q], dim=-1) if mode == "concat" else r + q


def resolve_k(top_k: float, n: int) -> int:
    """K of Eq. 5–6 as a count: a ratio of the batch when ``K < 1``, else a count; clipped
    to ``[1, n]``. The ratio is exact: ``⌈K·n⌉`` with ``K`` the decimal written
    (``Fraction(str(K))``, :mod:`fedfs_sdk.exact`), so ``K = 0.28, n = 25`` gives 7, where
    ``⌈0.28·25⌉`` in floating point is 8."""
    k = as_written(top_k, "top_k")
    count = -((-k.numerator * n) // k.denominator) if k < 1 else int(k)   # ⌈p·n / q⌉ in integers
    return max(1, min(count, n))


def k_threshold(top_k: float, n_real: torch.Tensor) -> torch.Tensor | float:
    """:func:`resolve_k` for a real batch size held in a tensor (traced, vmapped, padded):
    entry ``(i, j)`` is in the top-K iff ``#{larger entries} < k_threshold``. A count K ≥ 1
    is the constant ``K`` (no upper clip needed: ``< K`` is all-true once K ≥ n). A ratio
    ``K = p/q`` gives ``max(1, ⌈n·p / q⌉)`` in float64: ``n·p`` and ``q`` are exact integers
    and the division is correctly rounded, so the ceiling is exact."""
    k = as_written(top_k, "top_k")
    if k >= 1:
        return float(int(k))
    n = n_real.to(torch.float64)
    return torch.clamp(torch.ceil(n * float(k.numerator) / float(k.denominator)), min=1.0)


def insub_logits(z: torch.Tensor, v: torch.Tensor, mode: LogitMode = "similarity",
                 scale: float = 10.0) -> torch.Tensor:
    """Logits ``[i, j]`` between ``z_i`` and ``v_j`` (FedFS Eq. 3).

    ``literal``: ``cos_ij = 1 − z_i·v_j / (||z_i|| ||v_j||)`` exactly as printed (a distance:
    minimizing Eq. 7 with it pushes matching pairs apart). ``similarity``: ``s · cos_sim``.
    """
    sim = l2_normalize(z) @ l2_normalize(v).t()
    return 1.0 - sim if mode == "literal" else scale * sim


def adaptive_soft_labels(z: torch.Tensor, v: torch.Tensor, top_k: float = 4, gamma: float = 2.0,
                         soft_score: SoftScore = "dot",
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Adaptive soft labels ``α`` (FedFS Eq. 5–6), rows sum to 1, no gradient.

    ``ass_ij = z_i · v_j`` (Eq. 5). For each column ``j`` the set ``ASS_{·,j}`` is ranked
    and ``β_ij = γ·ass_ij`` on the diagonal (``y = 1``), ``ass_ij`` where it is in the
    top-K of its column, else 0 (Eq. 6 cases, 0 as printed). ``α = (softmax_i β)ᵀ``: a
    softmax down each column, transposed, so row ``i`` of ``α`` is a distribution over
    ``j``. ``α`` is a label: it is computed from detached inputs.
    """
    with torch.no_grad():
        z, v = z.detach(), v.detach()
        if soft_score == "cosine":
            z, v = l2_normalize(z), l2_normalize(v)
        ass = z @ v.t()                                           # [i, j]
        n = ass.shape[0]
        eye = torch.eye(n, dtype=torch.bool, device=ass.device)
        valid = mask.to(torch.bool) if mask is not None else torch.ones(n, dtype=torch.bool, device=ass.device)
        ranked = ass.masked_fill(~valid[:, None], float("-inf"))  # padded rows never rank
        # Top-K of each column by counting the (real) entries strictly above: in the top K
        # ⟺ fewer than K are larger (ties kept together, as ≥ the K-th largest). K is a count
        # of the *real* batch (k_threshold = resolve_k of n_real, exact), so no data-dependent
        # shape appears and this runs unchanged under vmap with padding.
        k = k_threshold(top_k, valid.sum())
        larger = (ranked.unsqueeze(0) > ranked.unsqueeze(1)).sum(1)    # [i, j] = #{l : ass_lj > ass_ij}
        in_top = larger.to(torch.float64) < k
        beta = torch.where(eye, gamma * ass, torch.where(in_top, ass, torch.zeros_like(ass)))
        if mask is not None:
            beta = beta.masked_fill(~valid[:, None], _NEG)       # padded i: no weight in column j
        alpha = torch.softmax(beta, dim=0).t()
    return alpha


def f_insub(z: torch.Tensor, v: torch.Tensor, cfg: FedFSLossConfig = FedFSLossConfig(),
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F_insub = −Σ_j α_ij log softmax_j(cos_ij)`` (FedFS Eq. 7), mean over anchors ``i``."""
    alpha = adaptive_soft_labels(z, v, cfg.top_k, cfg.gamma, cfg.soft_score, mask)
    logits = insub_logits(z, v, cfg.logits, cfg.logit_scale)
    if mask is not None:
        logits = logits.masked_fill(~mask.to(torch.bool)[None, :], _NEG)
    per = -(alpha * F.log_softmax(logits, dim=-1)).sum(-1)
    return _masked_mean(per, mask)


def f_reg(r_prime: torch.Tensor, q_prime: torch.Tensor,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F_reg = 1 − cos(r', q')`` (FedFS Eq. 8), batch mean."""
    cos = (l2_normalize(r_prime) * l2_normalize(q_prime)).sum(-1)
    return _masked_mean(1.0 - cos, mask)


def f_total(r_prime: torch.Tensor, q_prime: torch.Tensor, r: torch.Tensor, q: torch.Tensor,
            v: torch.Tensor, cfg: FedFSLossConfig = FedFSLossConfig(),
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``F_total = λ F_insub + (1 − λ) F_reg`` (FedFS Eq. 9). Returns ``(loss, parts)``."""
    z = combine(r, q, cfg.combine)
    if z.shape[-1] != v.shape[-1]:
        raise InputError(f"z = r ⊕ q has {z.shape[-1]} dims but v = ξ(x) has {v.shape[-1]} "
                         f"(combine={cfg.combine!r}); set proj_dim = {cfg.projection_dim(v.shape[-1])}")
    insub = f_insub(z, v, cfg, mask)
    reg = f_reg(r_prime, q_prime, mask)
    return cfg.lam * insub + (1.0 - cfg.lam) * reg, {"F_insub": insub, "F_reg": reg}

