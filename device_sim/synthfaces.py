"""SynthFaces: procedural face-like identities, rendered in batches by a vectorized torch renderer.

In the spirit of DigiFace-1M (Bae et al., WACV 2023), which renders each synthetic identity
with fixed geometry and texture under a few "looks" (hair style, accessories) and many
per-image nuisances. Here:

* **identity** ``(seed, identity)`` fixes face shape (superellipse width/height/exponent, jaw
  taper), skin tone, skin texture (a sum of identity-specific sinusoids), moles, cheek blush,
  hair colour and hairline, eye position/size/tilt/iris colour, brows, nose, mouth and lips,
  ears;
* **look** ``(seed, identity, look)``, one of ``looks_per_identity`` chosen per image: hair
  volume/length/fringe variation, beard/moustache, glasses;
* **image** ``(seed, identity, index)``: rotation, scale, translation, yaw and pitch (features
  shift with their depth and the face squashes horizontally), expression (smile, open mouth,
  brow raise, blink, gaze), hat, occluder, background, illumination gradient and colour cast,
  clothing, Gaussian blur, sensor noise, JPEG-like 8×8 DCT quantization.

Every random number comes from a counter-based hash (SplitMix64) of ``(seed, domain, identity,
look | index, parameter)`` computed in float64 numpy, so an image's parameters depend neither
on the other images in its batch nor on the device. All per-pixel work is elementwise torch on
a ``[N, 1, S, S]`` coordinate grid (signed-distance shapes with ~1-pixel soft edges, painter's
algorithm compositing), so a batch runs the same code on CPU and CUDA with no per-image loop,
and an image is bit-identical in any batch, chunking or thread count on a given device.

``difficulty`` scales every nuisance range and probability (0 = frontal, clean, neutral
images; 1 = the calibrated default, see ``docs/synthfaces.md`` for measured baselines).
``domain`` (:mod:`device_sim.synth_domains`) changes how the same identities are captured —
pose range, lighting, colour processing, face masks, blur, noise, texture — for cross-domain
scenarios; the default ``"none"`` renders the images above bit for bit.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .synth_domains import (STYLE_COLUMNS, SynthDomain, apply_colour_style, apply_texture, draw_mask,
                            get_domain, style_params)

__all__ = ["SynthFaces", "hash_uniforms", "write_image_folder"]

# ---------------------------------------------------------------------------------------------
# Counter-based randomness
# ---------------------------------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_DOMAIN_IDENTITY, _DOMAIN_LOOK, _DOMAIN_IMAGE, _DOMAIN_NOISE = 1, 2, 3, 4
_DOMAIN_STYLE = 5        # per-image numbers of a SynthDomain (mask, texture phase)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """One SplitMix64 step on a uint64 array (wrapping arithmetic, vectorized)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_uniforms(keys: Sequence[np.ndarray | int], count: int) -> np.ndarray:
    """``[N, count]`` float64 uniforms in [0, 1) from a hash of the integer ``keys``.

    Each row depends only on its own keys (broadcast to a common length ``N``), so results
    are independent of batch composition; column ``k`` is stream ``k`` of that row.
    """
    arrays = [np.asarray(k, dtype=np.int64).astype(np.uint64) for k in keys]
    shape = np.broadcast_shapes(*[a.shape for a in arrays])
    if len(shape) > 1:
        raise InputError(f"hash keys must be scalars or 1-D, got shape {shape}")
    n = int(shape[0]) if shape else 1
    with np.errstate(over="ignore"):
        z = np.zeros(n, dtype=np.uint64)
        for a in arrays:
            z = _splitmix64(z ^ np.broadcast_to(a, (n,)))
        streams = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        out = _splitmix64(_splitmix64(z[:, None] ^ streams[None, :]))
    return (out >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class _Stream:
    """Hands out named parameters from a ``[N, K]`` matrix of uniforms, column by column."""

    def __init__(self, u: np.ndarray) -> None:
        self.u = u
        self.k = 0

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        col = self.u[:, self.k]
        self.k += 1
        return lo + (hi - lo) * col

    def normal(self, sigma: float = 1.0, clip: float = 2.5) -> np.ndarray:
        """Gaussian (Box–Muller) with standard deviation ``sigma``, clipped at ``clip`` σ."""
        u1 = np.maximum(self.uniform(), 1e-12)
        u2 = self.uniform()
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * math.pi * u2)
        return sigma * np.clip(z, -clip, clip)

    def bernoulli(self, p: float | np.ndarray) -> np.ndarray:
        return (self.uniform() < p).astype(np.float64)

    def choice(self, k: int) -> np.ndarray:
        return np.minimum((self.uniform() * k).astype(np.int64), k - 1)


# ---------------------------------------------------------------------------------------------
# Palettes (linear-ish RGB in [0, 1])
# ---------------------------------------------------------------------------------------------
_SKIN = np.array([[0.98, 0.87, 0.78], [0.95, 0.80, 0.68], [0.89, 0.70, 0.56], [0.80, 0.59, 0.43],
                  [0.66, 0.46, 0.32], [0.50, 0.34, 0.23], [0.36, 0.24, 0.17]])
_HAIR = np.array([[0.07, 0.06, 0.06], [0.20, 0.13, 0.09], [0.38, 0.25, 0.15], [0.55, 0.27, 0.13],
                  [0.78, 0.63, 0.40], [0.92, 0.84, 0.62], [0.55, 0.55, 0.55], [0.85, 0.85, 0.83]])
_HAIR_P = np.array([0.30, 0.25, 0.15, 0.06, 0.09, 0.04, 0.07, 0.04])
_IRIS = np.array([[0.33, 0.19, 0.09], [0.14, 0.09, 0.06], [0.30, 0.48, 0.72], [0.32, 0.52, 0.33],
                  [0.50, 0.39, 0.19], [0.50, 0.55, 0.60]])
_ACCESSORY = np.array([[0.05, 0.05, 0.05], [0.55, 0.38, 0.15], [0.75, 0.75, 0.78], [0.60, 0.10, 0.10],
                       [0.10, 0.20, 0.50], [0.85, 0.70, 0.30]])


def _lerp_palette(pal: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation along a palette, ``t`` in [0, 1] → ``[N, 3]``."""
    x = np.clip(t, 0, 1) * (len(pal) - 1)
    i = np.minimum(x.astype(np.int64), len(pal) - 2)
    f = (x - i)[:, None]
    return pal[i] * (1 - f) + pal[i + 1] * f


def _weighted_choice(u: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(np.cumsum(p / p.sum()), u, side="right"), len(p) - 1)


# ---------------------------------------------------------------------------------------------
# Parameter sampling (numpy float64, per row)
# ---------------------------------------------------------------------------------------------
def _identity_params(seed: int, ids: np.ndarray) -> dict[str, np.ndarray]:
    s = _Stream(hash_uniforms([_DOMAIN_IDENTITY, seed, ids], 96))
    p: dict[str, np.ndarray] = {}
    p["face_a"] = s.uniform(0.40, 0.54)          # half-width (face units)
    p["face_b"] = s.uniform(0.56, 0.70)          # half-height
    p["face_p"] = s.uniform(1.8, 3.0)            # superellipse exponent (round ↔ square)
    p["jaw"] = s.uniform(0.05, 0.45)             # chin taper
    skin_t = s.uniform() ** 1.1
    p["skin"] = np.clip(_lerp_palette(_SKIN, skin_t) * (1 + np.stack([s.normal(0.04) for _ in range(3)], 1)), 0, 1)
    hair_i = _weighted_choice(s.uniform(), _HAIR_P)
    p["hair"] = np.clip(_HAIR[hair_i] * (1 + np.stack([s.normal(0.08) for _ in range(3)], 1)) + s.normal(0.03)[:, None], 0, 1)
    p["hairline"] = s.uniform(-0.52, -0.30)
    p["hair_vol"] = s.uniform(0.0, 1.0)
    p["hair_len"] = s.uniform(0.0, 1.0) ** 1.5
    p["fringe_amp"] = s.uniform(0.0, 0.10)
    p["fringe_freq"] = s.uniform(4.0, 14.0)
    p["fringe_phase"] = s.uniform(0, 2 * math.pi)
    p["part"] = s.uniform(-0.25, 0.25)
    p["strand_freq"] = s.uniform(25.0, 60.0)
    p["bald"] = s.bernoulli(0.05)
    p["eye_x"] = s.uniform(0.16, 0.26)
    p["eye_y"] = s.uniform(-0.14, -0.02)
    p["eye_w"] = s.uniform(0.065, 0.105)
    p["eye_aspect"] = s.uniform(0.32, 0.62)
    p["eye_tilt"] = s.uniform(-0.22, 0.22)
    p["iris"] = np.clip(_IRIS[s.choice(len(_IRIS))] * (1 + s.normal(0.1)[:, None]), 0, 1)
    p["iris_r"] = s.uniform(0.75, 1.05)
    p["brow_gap"] = s.uniform(0.06, 0.12)
    p["brow_len"] = s.uniform(0.07, 0.13)
    p["brow_thick"] = s.uniform(0.010, 0.028)
    p["brow_angle"] = s.uniform(-0.30, 0.25)
    p["brow_arch"] = s.uniform(-0.005, 0.04)
    p["nose_len"] = s.uniform(0.13, 0.27)
    p["nose_w"] = s.uniform(0.04, 0.085)
    p["mouth_y"] = s.uniform(0.28, 0.44)
    p["mouth_w"] = s.uniform(0.10, 0.19)
    p["lip_u"] = s.uniform(0.012, 0.035)
    p["lip_l"] = s.uniform(0.015, 0.045)
    p["lip"] = np.clip(p["skin"] * np.array([0.95, 0.62, 0.62]) + s.normal(0.04)[:, None], 0, 1)
    p["smile0"] = s.uniform(-0.3, 0.5)
    p["ear_size"] = s.uniform(0.8, 1.3)
    p["ear_y"] = s.uniform(-0.08, 0.06)
    p["blush"] = s.uniform(0.0, 0.35)
    p["tex_amp"] = s.uniform(0.02, 0.09)
    for k in range(3):
        ang = s.uniform(0, math.pi)
        fr = s.uniform(6.0, 22.0)
        p[f"tex_fx{k}"] = fr * np.cos(ang)
        p[f"tex_fy{k}"] = fr * np.sin(ang)
        p[f"tex_ph{k}"] = s.uniform(0, 2 * math.pi)
    for k in range(3):   # moles: presence, position, size
        p[f"mole{k}"] = s.bernoulli(0.45)
        p[f"mole_u{k}"] = s.uniform(-0.35, 0.35)
        p[f"mole_v{k}"] = s.uniform(-0.35, 0.45)
        p[f"mole_r{k}"] = s.uniform(0.012, 0.028)
    p["beardy"] = s.uniform(0.0, 1.0)            # propensity to wear a beard in a look
    p["glassy"] = s.uniform(0.0, 1.0)            # propensity to wear glasses in a look
    return p


def _look_params(seed: int, ids: np.ndarray, looks: np.ndarray, beardy: np.ndarray,
                 glassy: np.ndarray) -> dict[str, np.ndarray]:
    s = _Stream(hash_uniforms([_DOMAIN_LOOK, seed, ids, looks], 24))
    p: dict[str, np.ndarray] = {}
    p["d_vol"] = s.normal(0.25)
    p["d_len"] = s.normal(0.25)
    p["d_hairline"] = s.normal(0.04)
    p["d_fringe"] = s.uniform(0, 2 * math.pi)
    p["d_part"] = s.normal(0.12)
    p["beard"] = (s.uniform() < 0.55 * beardy ** 2).astype(np.float64)
    p["beard_density"] = s.uniform(0.35, 0.9)
    p["beard_top"] = s.uniform(-0.08, 0.06)
    p["moustache"] = np.maximum(p["beard"], s.bernoulli(0.08)) * s.bernoulli(0.8)
    p["glasses"] = (s.uniform() < 0.5 * glassy).astype(np.float64)
    p["glasses_color"] = _ACCESSORY[s.choice(len(_ACCESSORY))]
    p["glasses_p"] = s.uniform(2.0, 5.0)
    p["glasses_tint"] = s.bernoulli(0.2)
    return p


_NOISE_TILES = 16        # noise bank size (per seed and image size)
_MAX_BLUR = 1.5          # blur σ at difficulty 1, in pixels at 112×112


def _image_params(seed: int, ids: np.ndarray, idx: np.ndarray, d: float, looks: int,
                  dom: SynthDomain | None = None) -> dict[str, np.ndarray]:
    # a domain only scales σ's of existing columns (× 1.0 is exact: "none" is unchanged)
    pose, light, blur, noise = (dom.pose, dom.light, dom.blur, dom.noise) if dom else (1.0,) * 4
    s = _Stream(hash_uniforms([_DOMAIN_IMAGE, seed, ids, idx], 80))
    p: dict[str, np.ndarray] = {}
    p["look"] = s.choice(looks)
    p["rot"] = s.normal(0.14 * d * pose)              # rad, ~8° σ at d = 1
    p["yaw"] = s.normal(0.38 * d * pose, clip=2.0)    # rad, ~22° σ
    p["pitch"] = s.normal(0.16 * d * pose, clip=2.0)
    p["scale"] = np.exp(s.normal(0.08 * d))
    p["tx"] = s.normal(0.05 * d)
    p["ty"] = s.normal(0.05 * d)
    p["smile"] = s.uniform(-0.6, 1.0) * min(d, 1.5)
    p["mouth_open"] = s.bernoulli(0.3 * min(d, 1.0)) * s.uniform(0.2, 1.0)
    p["brow_raise"] = s.normal(0.02 * d)
    p["blink"] = np.clip(1.0 - s.bernoulli(0.15 * min(d, 1.0)) * s.uniform(0.5, 1.0), 0.08, 1.0)
    p["gaze_x"] = s.uniform(-1, 1) * min(d, 1.0)
    p["gaze_y"] = s.uniform(-1, 1) * min(d, 1.0)
    p["bg"] = np.clip(s.uniform(0.15, 0.85)[:, None] + np.stack([s.normal(0.12) for _ in range(3)], 1), 0, 1)
    p["bg2"] = np.clip(s.uniform(0.15, 0.85)[:, None] + np.stack([s.normal(0.12) for _ in range(3)], 1), 0, 1)
    p["bg_ang"] = s.uniform(0, 2 * math.pi)
    p["bg_fx"] = s.uniform(1, 5)
    p["bg_fy"] = s.uniform(1, 5)
    p["bg_ph"] = s.uniform(0, 2 * math.pi)
    p["cloth"] = np.stack([s.uniform(0.05, 0.9) for _ in range(3)], 1)
    p["amb"] = np.exp(s.normal(0.16 * d * light))
    p["light_g"] = s.uniform(0.0, 0.55) * d * light
    p["light_ang"] = s.uniform(0, 2 * math.pi)
    p["temp"] = s.normal(0.06 * d)
    p["hat"] = s.bernoulli(0.12 * min(d, 1.5))
    p["hat_color"] = np.stack([s.uniform(0.05, 0.9) for _ in range(3)], 1)
    p["hat_h"] = s.uniform(-0.42, -0.22)
    p["occ"] = s.bernoulli(0.18 * min(d, 1.5))
    p["occ_x"] = s.uniform(-0.8, 0.8)
    p["occ_y"] = s.uniform(-0.2, 0.9)
    p["occ_rx"] = s.uniform(0.15, 0.40) * max(d, 0.3)
    p["occ_ry"] = s.uniform(0.10, 0.30) * max(d, 0.3)
    p["occ_ang"] = s.uniform(0, math.pi)
    p["occ_color"] = np.where(s.bernoulli(0.5)[:, None] > 0,
                              _lerp_palette(_SKIN, s.uniform()),
                              np.stack([s.uniform(0.0, 1.0) for _ in range(3)], 1))
    p["blur"] = s.uniform(0.0, _MAX_BLUR) * d * blur  # σ in pixels at 112×112
    p["noise"] = s.uniform(0.0, 0.04) * d * noise     # σ in [0, 1] intensity units
    p["noise_tile"] = s.choice(_NOISE_TILES)
    p["noise_dx"] = s.choice(1 << 16)
    p["noise_dy"] = s.choice(1 << 16)
    p["jpeg"] = s.bernoulli(0.5 * min(d, 1.0)) * s.uniform(0.3, 1.6) * d   # quant-table scale
    return p




# ---------------------------------------------------------------------------------------------
# Rendering helpers (torch, elementwise on [N, 1, S, S])
# ---------------------------------------------------------------------------------------------
def _soft(d: torch.Tensor, aa: torch.Tensor | float) -> torch.Tensor:
    """Coverage of a signed distance ``d`` (negative inside) with an anti-aliasing width."""
    return torch.sigmoid(-d / aa)


def _ellipse(du: torch.Tensor, dv: torch.Tensor, a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """Signed distance to an axis-aligned ellipse, approximated as ``(r − 1)·min(a, b)``.

    Cheap and exact enough near the boundary for shapes of moderate aspect ratio; use
    :func:`_ellipse_exact` for thin ones (far along the long axis this form tends to 0).
    """
    r = torch.sqrt((du / a) ** 2 + (dv / b) ** 2)
    m = min(a, b) if isinstance(a, float) and isinstance(b, float) else torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return (r - 1.0) * m


def _ellipse_exact(du: torch.Tensor, dv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """First-order signed distance ``(r − 1)/|∇r|`` to an ellipse; right for any aspect ratio."""
    qa, qb = (du / a) ** 2, (dv / b) ** 2
    s = qa + qb
    grad2 = (qa / (a * a) + qb / (b * b)) / (s + 1e-12)
    return (torch.sqrt(s) - 1.0) * torch.rsqrt(grad2 + 1e-12)


def _circle(du: torch.Tensor, dv: torch.Tensor, r: torch.Tensor | float) -> torch.Tensor:
    return torch.sqrt(du * du + dv * dv) - r


def _rotate(du: torch.Tensor, dv: torch.Tensor, ang: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = torch.cos(ang), torch.sin(ang)
    return c * du + s * dv, c * dv - s * du


def _shift_sum(img: torch.Tensor, w: torch.Tensor, dim: int) -> torch.Tensor:
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


def _dct_matrix(n: int = 8) -> np.ndarray:
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


def _jpeg_like(img: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """8×8 block DCT quantization in YCbCr with the JPEG tables times ``scale [N]``.

    ``scale`` = 0 leaves the image unchanged. Reductions run over the 8-element block axes
    with broadcast products, so each block's result does not depend on the batch size.
    """
    n, _, h, w = img.shape
    ph, pw = (-h) % 8, (-w) % 8
    x = torch.nn.functional.pad(img, (0, pw, 0, ph), mode="replicate") if (ph or pw) else img
    ycc_m = img.new_tensor([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])
    ycc = (x.unsqueeze(1) * ycc_m.view(1, 3, 3, 1, 1)).sum(2)
    H, W = ycc.shape[2] // 8, ycc.shape[3] // 8
    blocks = ycc.view(n, 3, H, 8, W, 8).permute(0, 1, 2, 4, 3, 5)          # [n,3,H,W,8,8]
    D = img.new_tensor(_dct_matrix())
    # C = D X Dᵀ as explicit broadcast sums over the 8-long axes
    t = (blocks.unsqueeze(-3) * D.view(1, 1, 1, 1, 8, 8, 1)).sum(-2)          # [.., k, j] = Σ_i D[k,i] X[i,j]
    coef = (t.unsqueeze(-2) * D.view(1, 1, 1, 1, 1, 8, 8)).sum(-1)            # [.., k, l] = Σ_j T[k,j] D[l,j]
    q = torch.stack([img.new_tensor(_Q_LUMA), img.new_tensor(_Q_CHROMA), img.new_tensor(_Q_CHROMA)]) / 255.0
    step = q.view(1, 3, 1, 1, 8, 8) * scale.view(-1, 1, 1, 1, 1, 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    coef = torch.where(step > 0, torch.round(coef / safe) * safe, coef)
    t = (coef.unsqueeze(-1) * D.view(1, 1, 1, 1, 1, 8, 8)).sum(-2)           # [.., k, j] = Σ_l C[k,l] D[l,j]
    rec = (D.t().reshape(1, 1, 1, 1, 8, 8, 1) * t.unsqueeze(-3)).sum(-2)      # [.., i, j] = Σ_k D[k,i] T[k,j]
    ycc = rec.permute(0, 1, 2, 4, 3, 5).reshape(n, 3, H * 8, W * 8)
    rgb_m = img.new_tensor([[1.0, 0.0, 1.402], [1.0, -0.344136, -0.714136], [1.0, 1.772, 0.0]])
    out = (ycc.unsqueeze(1) * rgb_m.view(1, 3, 3, 1, 1)).sum(2)
    return out[:, :, :h, :w]


# ---------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------
def index_array(x: object, what: str) -> np.ndarray:
    """``x`` (int, sequence, ndarray or tensor of whole numbers ≥ 0) as a 1-D int64 array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim > 1:
        raise InputError(f"{what} must be an int or a 1-D sequence, got shape {list(a.shape)}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if not np.issubdtype(a.dtype, np.number) or not np.all(np.equal(np.mod(a, 1), 0)):
            raise InputError(f"{what} must be integers, got dtype {a.dtype}")
    a = a.astype(np.int64).reshape(-1)
    if a.size and a.min() < 0:
        raise InputError(f"{what} must be ≥ 0, got {int(a.min())}")
    return a


def broadcast_pairs(identities: object, indices: object) -> tuple[np.ndarray, np.ndarray]:
    """``(identities[i], indices[i])`` pairs as two equal-length int64 arrays; a single value
    on either side is repeated to the other's length."""
    ids, idx = index_array(identities, "identities"), index_array(indices, "indices")
    if ids.size != idx.size:
        if ids.size == 1:
            ids = np.repeat(ids, idx.size)
        elif idx.size == 1:
            idx = np.repeat(idx, ids.size)
        else:
            raise InputError(f"identities ({ids.size}) and indices ({idx.size}) must have the same "
                             "length, or one of them must be a single value")
    return ids, idx


class SynthFaces:
    """Deterministic procedural face identities (see module docstring).

    Args:
        seed: selects the universe of identities; the same ``(seed, identity, index)`` always
            gives the same image.
        image_size: output side ``S`` in pixels (≥ 16).
        difficulty: nuisance strength; 0 = clean frontal images, 1 = calibrated default.
        looks_per_identity: how many hair/beard/glasses "looks" an identity alternates between.
        chunk_size: images rendered per internal chunk; ``None`` picks ~128k pixels per chunk
            on CPU (keeps the working set in cache: 3× faster than large chunks) and ~16M
            on CUDA. It bounds peak memory and never changes pixels.
        num_threads: torch intra-op threads while rendering on CPU (restored afterwards);
            ``None`` keeps the process setting. The renderer is ~1,000 small elementwise ops
            per chunk, each an OpenMP barrier, so on a busy machine 1 thread can be much
            faster than several (benchmarks/synthfaces_speed.py measures both).
        domain: capture style, a preset name of ``synth_domains.DOMAINS`` or a ``SynthDomain``;
            ``None``/``"none"`` renders exactly as without one (and keeps the repr).
    """

    def __init__(self, seed: int = 0, image_size: int = 32, difficulty: float = 1.0,
                 looks_per_identity: int = 4, chunk_size: int | None = None,
                 num_threads: int | None = None, domain: str | SynthDomain | None = None) -> None:
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InputError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(image_size, (int, np.integer)) or image_size < 16:
            raise InputError(f"image_size must be an int ≥ 16, got {image_size!r}")
        if not (isinstance(difficulty, (int, float)) and 0.0 <= difficulty <= 3.0):
            raise InputError(f"difficulty must be a number in [0, 3], got {difficulty!r}")
        if looks_per_identity < 1:
            raise InputError(f"looks_per_identity must be ≥ 1, got {looks_per_identity}")
        self.seed = int(seed)
        self.image_size = int(image_size)
        self.difficulty = float(difficulty)
        self.looks_per_identity = int(looks_per_identity)
        if chunk_size is not None and chunk_size < 1:
            raise InputError(f"chunk_size must be ≥ 1, got {chunk_size}")
        self.chunk_size = chunk_size
        if num_threads is not None and num_threads < 1:
            raise InputError(f"num_threads must be ≥ 1, got {num_threads}")
        self.num_threads = num_threads
        self.domain = get_domain(domain)
        self._noise_bank: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        # the domain enters only when it changes pixels: repr keys fingerprints and caches
        dom = "" if self.domain.is_neutral() else f", domain={self.domain.key()!r}"
        return (f"SynthFaces(seed={self.seed}, image_size={self.image_size}, "
                f"difficulty={self.difficulty}, looks_per_identity={self.looks_per_identity}{dom})")

    # -- public API ---------------------------------------------------------------------------
    def render(self, identities: int | Sequence[int] | np.ndarray | torch.Tensor,
               indices: int | Sequence[int] | np.ndarray | torch.Tensor,
               device: str | torch.device | None = None) -> torch.Tensor:
        """Images ``[N, 3, S, S]`` float32 normalized ``(x − 127.5)/127.5`` on ``device``.

        ``identities`` and ``indices`` broadcast against each other (a scalar with a list
        renders many images of one identity). Pixels are quantized to uint8 levels first, so
        ``render`` equals ``fedfs_sdk.runtime.preprocess.preprocess(render_uint8(...), S)``.
        """
        u8 = self._render_levels(identities, indices, device)
        return (u8 - 127.5) / 127.5

    def render_uint8(self, identities: int | Sequence[int] | np.ndarray | torch.Tensor,
                     indices: int | Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Images ``[N, S, S, 3]`` uint8 RGB (rendered on CPU)."""
        u8 = self._render_levels(identities, indices, "cpu")
        return u8.permute(0, 2, 3, 1).to(torch.uint8).numpy()

    # -- internals ----------------------------------------------------------------------------
    def _render_levels(self, identities: object, indices: object, device: str | torch.device | None) -> torch.Tensor:
        """Float32 ``[N, 3, S, S]`` holding integer levels 0..255."""
        ids, idx = broadcast_pairs(identities, indices)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        S = self.image_size
        if ids.size == 0:
            return torch.zeros((0, 3, S, S), dtype=torch.float32, device=dev)
        out = torch.empty((ids.size, 3, S, S), dtype=torch.float32, device=dev)
        saved = torch.get_num_threads()
        scoped = self.num_threads is not None and dev.type == "cpu" and self.num_threads != saved
        if scoped:
            torch.set_num_threads(self.num_threads)
        try:
            with torch.no_grad():
                chunk = self.chunk_size or max(1, (1 << (24 if dev.type == "cuda" else 17)) // (S * S))
                for a in range(0, ids.size, chunk):
                    b = min(a + chunk, ids.size)
                    img = self._draw(ids[a:b], idx[a:b], dev)
                    out[a:b] = torch.round(img.clamp(0.0, 1.0) * 255.0)
        finally:
            if scoped:
                torch.set_num_threads(saved)
        return out

    def _noise(self, dev: torch.device) -> torch.Tensor:
        """A bank of ``_NOISE_TILES`` unit-variance noise tiles ``[T, 3, S, S]`` (from the seed)."""
        key = str(dev)
        if key not in self._noise_bank:
            g = torch.Generator().manual_seed(int(hash_uniforms([_DOMAIN_NOISE, self.seed], 1)[0, 0] * 2 ** 62))
            S = self.image_size
            self._noise_bank[key] = torch.randn((_NOISE_TILES, 3, S, S), generator=g).to(dev)
        return self._noise_bank[key]

    def _draw(self, ids: np.ndarray, idx: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Render one chunk: float32 ``[N, 3, S, S]`` in (roughly) [0, 1], before quantization."""
        S, d, dom = self.image_size, self.difficulty, self.domain
        ip = _identity_params(self.seed, ids)
        mp = _image_params(self.seed, ids, idx, d, self.looks_per_identity, dom)
        sp = style_params(hash_uniforms([_DOMAIN_STYLE, self.seed, ids, idx], STYLE_COLUMNS), dom)
        lp = _look_params(self.seed, ids, mp["look"], ip["beardy"], ip["glassy"])
        n = ids.size

        def T(a: np.ndarray) -> torch.Tensor:   # per-image scalar → [N,1,1,1]
            return torch.as_tensor(np.asarray(a, dtype=np.float32), device=dev).view(-1, 1, 1, 1)

        def C(a: np.ndarray) -> torch.Tensor:   # per-image colour → [N,3,1,1]
            return torch.as_tensor(np.asarray(a, dtype=np.float32), device=dev).view(-1, 3, 1, 1)

        def K(*rgb: float) -> torch.Tensor:     # constant colour → [1,3,1,1]
            return torch.tensor(rgb, dtype=torch.float32, device=dev).view(1, 3, 1, 1)

        lin = (torch.arange(S, device=dev, dtype=torch.float32) + 0.5) / S * 2 - 1
        X, Y = lin.view(1, 1, 1, S), lin.view(1, 1, S, 1)

        # --- background: two muted colours, a soft gradient and a low-frequency wave ------
        ang = T(mp["bg_ang"])
        g = torch.tanh(1.5 * (torch.cos(ang) * X + torch.sin(ang) * Y)).mul_(0.5).add_(0.5)
        img = C(mp["bg"]).expand(n, 3, S, S).clone()
        img.lerp_(C(mp["bg2"]), g)
        img.mul_(torch.sin(math.pi * (T(mp["bg_fx"]) * X + T(mp["bg_fy"]) * Y) + T(mp["bg_ph"])).mul_(0.05).add_(1))

        # --- pose: image → face coordinates (rotation, scale, translation) ---------------
        sc = 1.35 * T(mp["scale"])
        rot = T(mp["rot"])
        px, py = X - T(mp["tx"]), Y - (T(mp["ty"]) + 0.06)
        cr, sr = torch.cos(rot) / sc, torch.sin(rot) / sc
        u = cr * px + sr * py
        v = cr * py - sr * px
        aa = 1.7 / (S * sc)                                      # ~0.85 px soft edge in face units
        yaw, pitch = T(mp["yaw"]), T(mp["pitch"])
        cy_, sy_ = torch.cos(yaw), torch.sin(yaw)
        cyc = cy_.clamp(min=0.3)
        cp_, sp_ = torch.cos(pitch), torch.sin(pitch)

        def fx(cx: torch.Tensor | float, depth: float) -> torch.Tensor:
            """x-centre of a part at ``depth`` after yaw (nearer parts move further)."""
            return cx * cy_ + depth * sy_

        def fy(cy: torch.Tensor | float, depth: float) -> torch.Tensor:
            return cy * cp_ + depth * 0.6 * sp_

        def mirrored(half: torch.Tensor, depth: float) -> tuple[torch.Tensor, torch.Tensor]:
            """Outward x-offset from a left/right pair of parts at ``±half`` and the side sign.

            Both parts of a pair are drawn at once in the mirrored frame (eyes, brows, ...).
            """
            du = u - depth * sy_
            return (du.abs() - half * cy_) / cyc, torch.sign(du)

        # --- identity / look geometry -----------------------------------------------------
        fa, fb = T(ip["face_a"]), T(ip["face_b"])
        skin, hair = C(ip["skin"]), C(ip["hair"])
        no_bald = 1 - T(ip["bald"])
        fcx = -0.05 * sy_
        face_w = fa * (0.78 + 0.22 * cy_)
        hair_vol = (T(ip["hair_vol"]) + T(lp["d_vol"])).clamp(0, 1.3) * no_bald
        hair_len = (T(ip["hair_len"]) + T(lp["d_len"])).clamp(0, 1.2) * no_bald
        has_hair = (hair_vol > 0.02).float()

        # --- clothes and neck -------------------------------------------------------------
        img.lerp_(C(mp["cloth"]), _soft(_ellipse(u - fcx * 0.5, v - (fb + 0.62), 1.05, 0.42), aa))
        neck = torch.maximum(torch.maximum((u - fcx * 0.3).abs() - fa * 0.52, fb * 0.4 - v), v - (fb + 0.35))
        img.lerp_(skin * 0.78, _soft(neck, aa))

        # --- back hair ----------------------------------------------------------------------
        hcx = fcx - 0.04 * sy_
        du_h = u - hcx
        hb = _ellipse(du_h, v + 0.06 + 0.05 * hair_vol, face_w * (1.05 + 0.22 * hair_vol), fb * (0.98 + 0.16 * hair_vol))
        long_ = torch.maximum(du_h.abs() - face_w * (1.02 + 0.2 * hair_vol),
                              torch.maximum(-0.05 - v, v - fb * (0.2 + 1.1 * hair_len)))
        long_ = long_ + (hair_len <= 0.15).float() * 10.0
        strands = torch.sin(T(ip["strand_freq"]) * du_h + 3 * torch.sin(7 * v)).mul_(0.1).add_(1)
        img.lerp_(hair * strands * 0.85, _soft(torch.minimum(hb, long_), aa) * has_hair)

        # --- ears (mirrored pair) -----------------------------------------------------------
        es = T(ip["ear_size"])
        de = _ellipse((u - fcx).abs() - face_w * 0.97, v - fy(T(ip["ear_y"]), -0.2), 0.065 * es * (0.6 + 0.4 * cy_), 0.12 * es)
        img.lerp_(skin * 0.9, _soft(de, aa))

        # --- face: jaw-tapered superellipse with texture, shading, blush and moles --------
        du = (u - fcx) / face_w
        dv = v / fb
        dvc = dv.clamp(-1, 1)
        taper = torch.where(dv > 0, 1 - T(ip["jaw"]) * dvc * dvc, 1 - 0.12 * dvc * dvc)
        pe = T(ip["face_p"])
        r = ((du / taper).abs() ** pe + dv.abs() ** pe) ** (1 / pe)
        dface = (r - 1) * torch.minimum(face_w, fb)
        tex = sum(torch.sin(T(ip[f"tex_fx{k}"]) * u + T(ip[f"tex_fy{k}"]) * v + T(ip[f"tex_ph{k}"])) for k in range(3))
        shade = (tex * (T(ip["tex_amp"]) / 3) + 1) * (1 - 0.22 * r.clamp(max=1) ** 4)
        my = T(ip["mouth_y"])
        mb, _ = mirrored(fa * 0.55, 0.25)
        db = _ellipse(mb * cyc, v - fy(my - 0.14, 0.25), 0.11, 0.08)
        skin_map = torch.lerp(skin * shade, K(0.85, 0.35, 0.35), torch.exp(-(db.clamp(min=0) * 20) ** 2) * (T(ip["blush"]) * 0.5))
        dm = None
        for k in range(3):
            dk = _circle(u - fx(T(ip[f"mole_u{k}"]), 0.3), v - fy(T(ip[f"mole_v{k}"]), 0.3), T(ip[f"mole_r{k}"]))
            dk = dk + (1 - T(ip[f"mole{k}"])) * 10.0
            dm = dk if dm is None else torch.minimum(dm, dk)
        skin_map.lerp_(skin * 0.35, _soft(dm, aa) * 0.85)
        img.lerp_(skin_map, _soft(dface, aa))

        # --- front hair (fringe), inside a slightly dilated head --------------------------
        hl = (T(ip["hairline"]) + T(lp["d_hairline"])
              + T(ip["fringe_amp"]) * torch.sin(T(ip["fringe_freq"]) * du + T(ip["fringe_phase"]) + T(lp["d_fringe"]))
              + (T(ip["part"]) + T(lp["d_part"])) * du + 0.28 * du * du) * (fb / 0.62)
        front = torch.maximum(dface - 0.02 - 0.03 * hair_vol, v - fy(hl, 0.1))
        img.lerp_(hair * strands, _soft(front, aa) * has_hair)

        # --- beard and moustache (look) ---------------------------------------------------
        mcx, mcy = fx(0.0, 0.42), fy(my, 0.4)
        mw = T(ip["mouth_w"]) * (0.55 + 0.45 * cy_)
        top = mcy - 0.03 + T(lp["beard_top"]) - 0.16 * du * du
        stub = (torch.sin(60 * u) * torch.sin(55 * v)).mul_(0.15).add_(1)
        img.lerp_(hair * 0.8 * stub, _soft(torch.maximum(dface, top - v), aa) * (T(lp["beard"]) * T(lp["beard_density"])))
        mdu = (u - mcx) / mw
        must = torch.maximum((v - (mcy - 0.045 + 0.02 * mdu * mdu)).abs() - 0.022, (mdu.abs() - 1.05) * mw)
        img.lerp_(hair * 0.75, _soft(must, aa) * (T(lp["moustache"]) * 0.85))

        # --- eyes and brows (mirrored pairs) ----------------------------------------------
        ew = T(ip["eye_w"])
        eh = ew * T(ip["eye_aspect"])
        ecy = fy(T(ip["eye_y"]), 0.35)
        ex = T(ip["eye_x"])
        mu, side = mirrored(ex, 0.35)
        edu, edv = _rotate(mu, v - ecy, T(ip["eye_tilt"]))
        img.lerp_(skin * 0.72, _soft(_ellipse(edu, edv + 0.01, ew * 1.45, eh * 1.9), 0.04 + aa) * 0.35)
        # eye opening: a lens between two parabolic lids (stays a short arc when blinking)
        eho = eh * T(mp["blink"])
        prof = (1 - (edu / ew) ** 2).clamp(min=0)
        deye = torch.maximum(edv.abs() - eho * prof, edu.abs() - ew)
        eye_m = _soft(deye, aa)
        img.lerp_(K(0.93, 0.91, 0.88), eye_m)
        ir = eh * T(ip["iris_r"])
        di = _circle(edu - side * (T(mp["gaze_x"]) * ew * 0.35), edv - T(mp["gaze_y"]) * eh * 0.25, ir)
        img.lerp_(C(ip["iris"]), _soft(di, aa) * eye_m)
        img.lerp_(K(0.03, 0.03, 0.03), _soft(di + ir * 0.55, aa) * eye_m)
        lid = torch.maximum((edv + eho * prof).abs() - 0.012, edu.abs() - ew * 1.05)
        img.lerp_(skin * 0.3, _soft(lid, aa) * 0.9)
        bmu, _ = mirrored(ex * 1.05, 0.33)
        bcy = ecy - T(ip["brow_gap"]) - eh - T(mp["brow_raise"])
        bdu, bdv = _rotate(bmu, v - bcy, T(ip["brow_angle"]))
        bl = T(ip["brow_len"])
        t = (bdu / bl).clamp(-1, 1)
        dbrow = torch.maximum((bdv + T(ip["brow_arch"]) * (1 - t * t)).abs() - T(ip["brow_thick"]), bdu.abs() - bl)
        img.lerp_(hair * 0.6 + skin * 0.1, _soft(dbrow, aa) * 0.9)

        # --- nose -------------------------------------------------------------------------
        nl, nw = T(ip["nose_len"]), T(ip["nose_w"])
        ny = ecy + nl
        light_side = torch.sign(torch.cos(T(mp["light_ang"])) + 1e-6)
        dbr = _ellipse_exact(u - fx(-light_side * nw * 0.6, 0.55), v - (ecy + ny) / 2, nw * 0.35, nl * 0.5)
        img.lerp_(skin * 0.7, _soft(dbr, 0.02 + aa) * 0.45)
        dtip = _ellipse(u - fx(0.0, 0.65), v - (ny - 0.01), nw * 0.9, nw * 0.7)
        img.lerp_(skin * 0.82, _soft(dtip.abs() - 0.006, aa) * 0.5)
        nmu, _ = mirrored(nw * 0.6, 0.55)
        img.lerp_(skin * 0.3, _soft(_ellipse(nmu * cyc, v - (ny + 0.012), nw * 0.32, nw * 0.2), aa) * 0.8)

        # --- mouth ------------------------------------------------------------------------
        t = ((u - mcx) / mw).clamp(-1, 1)
        prof = torch.sqrt((1 - t * t).clamp(min=0))
        line = mcy - (T(ip["smile0"]) + T(mp["smile"])) * 0.05 * (t * t - 0.3)
        op = T(mp["mouth_open"]) * 0.07
        in_x = (u - mcx).abs() - mw
        lipc = C(ip["lip"])
        inner = torch.maximum(torch.maximum(line - v, v - (line + op)), in_x)
        img.lerp_(K(0.25, 0.05, 0.06), _soft(inner, aa) * (op > 0.005).float())
        up = torch.maximum(torch.maximum(line - T(ip["lip_u"]) * prof - v, v - line), in_x)
        img.lerp_(lipc, _soft(up, aa))
        lo = torch.maximum(torch.maximum(line + op - v, v - (line + op + T(ip["lip_l"]) * prof)), in_x)
        img.lerp_(lipc * 1.08, _soft(lo, aa))
        img.lerp_(lipc * 0.45, _soft(torch.maximum((v - line).abs() - 0.004, in_x), aa) * 0.8)

        # --- face mask (domain, under glasses): nose, mouth and chin; top curves down sideways
        if sp["mask"].any():
            top = fy(T(ip["eye_y"]) + 0.55 * nl + T(sp["mask_top"]), 0.55) + 0.12 * du * du
            draw_mask(img, dface, v, top, aa, T(sp["mask"]), C(sp["mask_color"]), T(sp["pleat_ph"]))

        # --- glasses (look) ---------------------------------------------------------------
        gm = T(lp["glasses"])
        if bool((gm > 0).any()):
            gcol, gp = C(lp["glasses_color"]), T(lp["glasses_p"])
            gmu, _ = mirrored(ex, 0.45)
            rr = ((gmu / (ew * 1.55)).abs() ** gp + ((v - ecy) / (ew * 1.2)).abs() ** gp) ** (1 / gp)
            dr = (rr - 1) * ew * 1.2
            img.lerp_(K(0.08, 0.08, 0.1), _soft(dr, aa) * (gm * T(lp["glasses_tint"]) * 0.8))
            img.lerp_(gcol, _soft(dr.abs() - 0.012, aa) * gm)
            bridge = torch.maximum((v - (ecy - 0.01)).abs() - 0.01,
                                   (u - fx(0.0, 0.5)).abs() - (ex - ew * 1.5).clamp(min=0.01) * cy_)
            img.lerp_(gcol, _soft(bridge, aa) * gm)

        # --- hat (image) --------------------------------------------------------------------
        hat = T(mp["hat"])
        if bool((hat > 0).any()):
            hat_v = fy(T(mp["hat_h"]), 0.1) * (fb / 0.62)
            dh = torch.maximum(_ellipse(u - fcx, v + 0.05, face_w * 1.12, fb * 1.08), v - hat_v)
            img.lerp_(C(mp["hat_color"]), _soft(dh, aa) * hat)
            brim = torch.maximum((v - hat_v).abs() - 0.025, (u - fcx).abs() - face_w * 1.2)
            img.lerp_(C(mp["hat_color"]) * 0.8, _soft(brim, aa) * hat)

        # --- occluder (image coordinates) ---------------------------------------------------
        occ = T(mp["occ"])
        if bool((occ > 0).any()):
            odu, odv = _rotate(X - T(mp["occ_x"]), Y - T(mp["occ_y"]), T(mp["occ_ang"]))
            img.lerp_(C(mp["occ_color"]), _soft(_ellipse(odu, odv, T(mp["occ_rx"]), T(mp["occ_ry"])), 2.0 / S) * occ)

        # --- illumination: ambient × directional gradient × colour temperature -----------
        la = T(mp["light_ang"])
        light = (torch.cos(la) * X + torch.sin(la) * Y).mul_(T(mp["light_g"])).add_(1).mul_(T(mp["amb"]))
        temp = T(mp["temp"])
        img.mul_(light.clamp_(0.15, 2.0)).mul_(torch.cat([1 + temp, torch.ones_like(temp), 1 - temp], 1))

        # --- blur (per-image Gaussian, separable) -----------------------------------------
        # The kernel support depends only on (S, difficulty, domain blur), never on the chunk, so an image's
        # weights (normalized over that support) are the same in any batch.
        sig = T(mp["blur"]).view(-1) * (S / 112.0)
        rad = int(math.ceil(3 * _MAX_BLUR * d * dom.blur * S / 112.0))
        if rad > 0 and bool((sig > 0).any()):
            k = torch.arange(-rad, rad + 1, device=dev, dtype=torch.float32).view(1, -1)
            w = torch.exp(-0.5 * (k / sig.clamp(min=1e-3).view(-1, 1)) ** 2)
            w = w / w.sum(1, keepdim=True)
            img = _shift_sum(_shift_sum(img, w, 3), w, 2)

        # --- sensor noise: a per-image circular shift of one tile of a fixed bank ---------
        tile = self._noise(dev)[torch.as_tensor(mp["noise_tile"], device=dev)]
        ar = torch.arange(S, device=dev).view(1, -1)
        rows = (ar + torch.as_tensor(mp["noise_dy"], device=dev).view(-1, 1)) % S
        cols = (ar + torch.as_tensor(mp["noise_dx"], device=dev).view(-1, 1)) % S
        tile = tile.gather(2, rows.view(n, 1, S, 1).expand(n, 3, S, S)).gather(3, cols.view(n, 1, 1, S).expand(n, 3, S, S))
        # σ is defined at 112×112; a smaller render is that image area-downsampled, which
        # divides i.i.d. noise by the downsampling factor (capped at 1 for larger renders).
        img.add_(tile.mul_(T(mp["noise"]) * min(1.0, S / 112.0)))

        # --- domain style: texture overlay, then the colour processing of the camera -------
        if dom.texture > 0:
            img = apply_texture(img, X, Y, dom.texture, T(sp["tex_px"]), T(sp["tex_py"]))
        img = apply_colour_style(img, dom)

        # --- JPEG-like compression --------------------------------------------------------
        # 8×8 blocks are defined at 112×112; at smaller sizes a block covers more of the face,
        # so the quantization strength shrinks with the size (as after downsampling a JPEG).
        jq = torch.as_tensor(mp["jpeg"], dtype=torch.float32, device=dev) * min(1.0, S / 112.0)
        if bool((jq > 0).any()):   # per-image select: the DCT round trip is not bit-exact
            img = torch.where(jq.view(-1, 1, 1, 1) > 0, _jpeg_like(img.clamp(0, 1), jq), img)
        return img


def write_image_folder(faces: SynthFaces, root: str | Path, identities: Sequence[int],
                       images_per_identity: int, ext: str = ".png", start_index: int = 0) -> Path:
    """Render ``identities × images_per_identity`` images to ``root/<identity>/<index>.png``.

    The ImageFolder layout that :class:`device_sim.datasets.ImageFolderDataset` reads: a disk
    cache of a synthetic population, or a stand-in for a real dataset in tests. PNG is
    lossless, so reading back through ``preprocess`` reproduces ``faces.render`` exactly.
    """
    import cv2

    root = Path(root)
    idx = np.arange(start_index, start_index + images_per_identity)
    for ident in identities:
        folder = root / f"{int(ident):06d}"
        folder.mkdir(parents=True, exist_ok=True)
        imgs = faces.render_uint8(int(ident), idx)
        for i, im in zip(idx, imgs):
            path = folder / f"{int(i):04d}{ext}"
            if not cv2.imwrite(str(path), cv2.cvtColor(im, cv2.COLOR_RGB2BGR)):
                raise InputError(f"could not write {path}")
    return root
