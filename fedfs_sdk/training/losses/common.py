"""Helpers shared by the losses."""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is true (all when None).

    Padded samples of a client with fewer images (batched simulation) are masked out.
    """
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)
