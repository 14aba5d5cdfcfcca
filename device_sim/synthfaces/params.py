"""SynthFaces' parameters per identity, look and image (numpy float64, one row per image).

The columns are drawn in a fixed order from :class:`~device_sim.synthfaces.hashing.ParamStream`:
adding a parameter means appending a column at the end of its stream (or a new hash
domain, as :mod:`device_sim.synth_domains` does), so every existing image stays the same.
"""
from __future__ import annotations

import math

import numpy as np

from ..synth_domains import SynthDomain
from .hashing import DOMAIN_IDENTITY, DOMAIN_IMAGE, DOMAIN_LOOK, ParamStream, hash_uniforms

__all__ = ["identity_params", "look_params", "image_params", "NOISE_TILES", "MAX_BLUR"]

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
def identity_params(seed: int, ids: np.ndarray) -> dict[str, np.ndarray]:
    s = ParamStream(hash_uniforms([DOMAIN_IDENTITY, seed, ids], 96))
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


def look_params(seed: int, ids: np.ndarray, looks: np.ndarray, beardy: np.ndarray,
                 glassy: np.ndarray) -> dict[str, np.ndarray]:
    s = ParamStream(hash_uniforms([DOMAIN_LOOK, seed, ids, looks], 24))
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


NOISE_TILES = 16        # noise bank size (per seed and image size)
MAX_BLUR = 1.5          # blur σ at difficulty 1, in pixels at 112×112


def image_params(seed: int, ids: np.ndarray, idx: np.ndarray, d: float, looks: int,
                  dom: SynthDomain | None = None) -> dict[str, np.ndarray]:
    # a domain only scales σ's of existing columns (× 1.0 is exact: "none" is unchanged)
    pose, light, blur, noise = (dom.pose, dom.light, dom.blur, dom.noise) if dom else (1.0,) * 4
    s = ParamStream(hash_uniforms([DOMAIN_IMAGE, seed, ids, idx], 80))
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
    p["blur"] = s.uniform(0.0, MAX_BLUR) * d * blur  # σ in pixels at 112×112
    p["noise"] = s.uniform(0.0, 0.04) * d * noise     # σ in [0, 1] intensity units
    p["noise_tile"] = s.choice(NOISE_TILES)
    p["noise_dx"] = s.choice(1 << 16)
    p["noise_dy"] = s.choice(1 << 16)
    p["jpeg"] = s.bernoulli(0.5 * min(d, 1.0)) * s.uniform(0.3, 1.6) * d   # quant-table scale
    return p
