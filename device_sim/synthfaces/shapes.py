"""SynthFaces' drawing primitives: signed distances, per-image blur and JPEG-like compression.

All elementwise torch on ``[N, C, S, S]`` (reductions only over fixed-size axes: the blur
support, the 8×8 DCT block), so an image's pixels never depend on the batch it is drawn in.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["soft", "ellipse", "ellipse_exact", "circle", "rotate", "shift_sum", "jpeg_like"]


def soft(d: torch.Tensor, aa: torch.Tensor | float) -> torch.Tensor:
    """Coverage of a signed distance ``d`` (negative inside) with an anti-aliasing width."""
    return torch.sigmoid(-d / aa)


def ellipse(du: torch.Tensor, dv: torch.Tensor, a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """Signed distance to an axis-aligned ellipse, approximated as ``(r − 1)·min(a, b)``.

    Cheap and exact enough near the boundary for shapes of moderate aspect ratio; use
    :func:`ellipse_exact` for thin ones (far along the long axis this form tends to 0).
    """
    r = torch.sqrt((du / a) ** 2 + (dv / b) ** 2)
    m = min(a, b) if isinstance(a, float) and isinstance(b, float) else torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return (r - 1.0) * m


def ellipse_exact(du: torch.Tensor, dv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """First-order signed distance ``(r − 1)/|∇r|`` to an ellipse; right for any aspect ratio."""
    qa, qb = (du / a) ** 2, (dv / b) ** 2
    s = qa + qb
    grad2 = (qa / (a * a) + qb / (b * b)) / (s + 1e-12)
    return (torch.sqrt(s) - 1.0) * torch.rsqrt(grad2 + 1e-12)


def circle(du: torch.Tensor, dv: torch.Tensor, r: torch.Tensor | float) -> torch.Tensor:
    return torch.sqrt(du * du + dv * dv) - r


def rotate(du: torch.Tensor, dv: torch.Tensor, ang: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = torch.cos(ang), torch.sin(ang)
    return c * du + s * dv, c * dv - s * du


def shift_sum(img: torch.Tensor, w: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-image separable convolution along ``dim`` with weights ``w [N, 2R+1]`` (replicate pad).

    Written as a sum of shifted copies (elementwise), so each image's result is independent
    of the batch it is rendered in — unlike a batched conv whose kernel choice may vary.
    """
    r = (w.shape[1] - 1) // 2
    n = img.shape[dim]
    out = torch.zeros_like(img)
    for k in range(-r, r + 1):
        idx = torch.clamp(torch.arange(n, device=img.device) + k, 0, n - 1)
        out = out + w[:, k + r].view(-1, 1, 1, 1) * img.index_select(dim, idx)
    return out


def dct_matrix(n: int = 8) -> np.ndarray:
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    m = np.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


# Standard JPEG (ITU T.81 Annex K) quantization tables, in 0–255 units.
_Q_LUMA = np.array([
    [16, 11, 10, 16, 24, 40, 51, 61], [12, 12, 14, 19, 26, 58, 60, 55],
    [14, 13, 16, 24, 40, 57, 69, 56], [14, 17, 22, 29, 51, 87, 80, 62],
    [18, 22, 37, 56, 68, 109, 103, 77], [24, 35, 55, 64, 81, 104, 113, 92],
    [49, 64, 78, 87, 103, 121, 120, 101], [72, 92, 95, 98, 112, 100, 103, 99]], dtype=np.float64)
_Q_CHROMA = np.full((8, 8), 99.0)
_Q_CHROMA[:4, :4] = np.array([[17, 18, 24, 47], [18, 21, 26, 66], [24, 26, 56, 99], [47, 66, 99, 99]])


_JPEG_CONSTANTS: dict[tuple[str, torch.dtype], tuple[torch.Tensor, ...]] = {}


def _jpeg_constants(like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(RGB→YCbCr, DCT, quantization steps, YCbCr→RGB) on ``like``'s device, made once per
    device (a copy per chunk would wait for the GPU)."""
    key = (str(like.device), like.dtype)
    if key not in _JPEG_CONSTANTS:
        _JPEG_CONSTANTS[key] = (
            like.new_tensor([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]]),
            like.new_tensor(dct_matrix()),
            torch.stack([like.new_tensor(_Q_LUMA), like.new_tensor(_Q_CHROMA), like.new_tensor(_Q_CHROMA)]) / 255.0,
            like.new_tensor([[1.0, 0.0, 1.402], [1.0, -0.344136, -0.714136], [1.0, 1.772, 0.0]]))
    return _JPEG_CONSTANTS[key]


def jpeg_like(img: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """8×8 block DCT quantization in YCbCr with the JPEG tables times ``scale [N]``.

    ``scale`` = 0 leaves the image unchanged. Reductions run over the 8-element block axes
    with broadcast products, so each block's result does not depend on the batch size.
    """
    n, _, h, w = img.shape
    ph, pw = (-h) % 8, (-w) % 8
    x = torch.nn.functional.pad(img, (0, pw, 0, ph), mode="replicate") if (ph or pw) else img
    ycc_m, D, q, rgb_m = _jpeg_constants(img)
    ycc = (x.unsqueeze(1) * ycc_m.view(1, 3, 3, 1, 1)).sum(2)
    H, W = ycc.shape[2] // 8, ycc.shape[3] // 8
    blocks = ycc.view(n, 3, H, 8, W, 8).permute(0, 1, 2, 4, 3, 5)          # [n,3,H,W,8,8]
    # C = D X Dᵀ as explicit broadcast sums over the 8-long axes
    t = (blocks.unsqueeze(-3) * D.view(1, 1, 1, 1, 8, 8, 1)).sum(-2)          # [.., k, j] = Σ_i D[k,i] X[i,j]
    coef = (t.unsqueeze(-2) * D.view(1, 1, 1, 1, 1, 8, 8)).sum(-1)            # [.., k, l] = Σ_j T[k,j] D[l,j]
    step = q.view(1, 3, 1, 1, 8, 8) * scale.view(-1, 1, 1, 1, 1, 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    coef = torch.where(step > 0, torch.round(coef / safe) * safe, coef)
    t = (coef.unsqueeze(-1) * D.view(1, 1, 1, 1, 1, 8, 8)).sum(-2)           # [.., k, j] = Σ_l C[k,l] D[l,j]
    rec = (D.t().reshape(1, 1, 1, 1, 8, 8, 1) * t.unsqueeze(-3)).sum(-2)      # [.., i, j] = Σ_k D[k,i] T[k,j]
    ycc = rec.permute(0, 1, 2, 4, 3, 5).reshape(n, 3, H * 8, W * 8)
    out = (ycc.unsqueeze(1) * rgb_m.view(1, 3, 3, 1, 1)).sum(2)
    return out[:, :, :h, :w]
