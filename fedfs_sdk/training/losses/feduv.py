"""FedUV losses (FedUV §4, Eq. 4, Alg. 2).

All functions take the already-scaled head output ``s = σ(W g_θ(x))`` (norm √c, see
:func:`fedfs_sdk.nn.model.scale_to_sqrt_c`) and codewords ``v ∈ {−1,+1}^c``.
"""
from __future__ import annotations

import torch

from .common import masked_mean as _masked_mean


def uv_score(s: torch.Tensor, codeword: torch.Tensor) -> torch.Tensor:
    """Verification score ``e = (1/c) v_yᵀ σ(W g_θ(x))`` (FedUV Eq. 5); ``[B]``. In [−1, 1]."""
    c = s.shape[-1]
    return (s * codeword.to(s.dtype)).sum(-1) / c


def feduv_pos_loss(s: torch.Tensor, codeword: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """``ℓ_pos = max(0, 1 − (1/c) v_yᵀ σ(W g_θ(x)))`` (FedUV Eq. 4 with σ, Alg. 2), batch mean.

    By Lemma 1, with ``||σ(·)|| = √c`` and ``v ∈ {±1}^c``: ``ℓ_pos = 0`` iff ``σ(W g) = v``.
    ``mask`` ([B] bool/0-1) excludes padded samples from the mean.
    """
    per = torch.relu(1.0 - uv_score(s, codeword))
    return _masked_mean(per, mask)


def feduv_neg_loss(s: torch.Tensor, other_codewords: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """``ℓ_neg = max_{u≠y} (1/c) v_uᵀ σ(W g_θ(x))`` (FedUV Eq. 4), batch mean.

    ``other_codewords`` is ``[U, c]``. FedUV's Theorem 1 makes this term redundant once
    ``ℓ_pos`` is small; it needs other users' codewords, which only a simulation has (a
    device may use codewords of random messages instead, see ``docs/methods.md``).
    """
    c = s.shape[-1]
    corr = s @ other_codewords.to(s.dtype).t() / c          # [B, U]
    # max as gather-at-argmax: same value and gradient as corr.max(-1), but exports to
    # ArgMax + GatherElements, which ONNX Runtime training differentiates (ReduceMax has no
    # ORT gradient; its TopK gradient aborts when the indices output is unused).
    top = corr.gather(-1, corr.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return _masked_mean(top, mask)

