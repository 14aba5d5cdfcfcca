"""Domains for SynthFaces: how a population *looks*, independent of who is in it.

A cross-domain simulation pre-trains a model on one look of faces (e.g. clean ``studio``
shots) and personalizes on another (``phone`` selfies): the identities are the same people
(identity and look parameters are untouched), only the capture changes — pose range,
lighting, colour processing, occluders, optics and sensor. A :class:`SynthDomain` holds those
multipliers; its defaults change nothing, so ``DOMAINS["none"]`` renders exactly the
original images.

The renderer (:mod:`device_sim.synthfaces`) calls the helpers here. They are elementwise
torch with no reductions over the image, so a domain keeps the renderer's guarantee that an
image is bit-identical in any batch or chunk. Per-image random numbers of a domain come from
their own hash stream (never new columns of the image stream), which keeps every existing
parameter — and so every ``none`` image — unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from fedfs_sdk.errors import InputError

__all__ = ["SynthDomain", "DOMAINS", "get_domain"]

# allowed [lo, hi] of each scalar field (inclusive); tint channels use _TINT_RANGE
_RANGES: dict[str, tuple[float, float]] = {
    "pose": (0.0, 3.0), "light": (0.0, 4.0), "saturation": (0.0, 2.0), "gamma": (0.25, 4.0),
    "contrast": (0.1, 3.0), "occlusion": (0.0, 1.0), "blur": (0.0, 4.0), "noise": (0.0, 5.0),
    "texture": (0.0, 1.0),
}
_TINT_RANGE = (0.0, 3.0)
_MASK_COLORS = np.array([[0.62, 0.78, 0.92], [0.93, 0.93, 0.92], [0.10, 0.10, 0.12], [0.30, 0.45, 0.70]])
_LUMA = (0.299, 0.587, 0.114)


def _number(name: str, x: object, lo: float, hi: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(x)) or not lo <= float(x) <= hi:
        raise InputError(f"SynthDomain.{name} must be a number in [{lo}, {hi}], got {x!r}")
    return float(x)


@dataclass(frozen=True)
class SynthDomain:
    """Capture style of a SynthFaces population; every default means "as the base renderer".

    Attributes:
        name: label shown in ``key()`` (letters, digits, ``_``, ``-``).
        pose: multiplies the σ of in-plane rotation, yaw and pitch.
        light: multiplies the directional light gradient and the ambient-level spread.
        saturation: colour saturation around the luma (0 = greyscale, >1 = more vivid).
        tint: per-channel RGB gain after saturation (white balance / colour cast).
        gamma: tone curve ``x ** gamma`` (> 1 darkens mid-tones and crushes shadows).
        contrast: ``(x − ½)·contrast + ½`` after the gamma.
        occlusion: probability of a face mask over nose, mouth and chin (face coordinates).
        blur: multiplies the Gaussian blur σ.
        noise: multiplies the sensor-noise σ.
        texture: strength of a domain-wide vignette + screen/moiré overlay.
    """

    name: str
    pose: float = 1.0
    light: float = 1.0
    saturation: float = 1.0
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0)
    gamma: float = 1.0
    contrast: float = 1.0
    occlusion: float = 0.0
    blur: float = 1.0
    noise: float = 1.0
    texture: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or \
                not all(c.isascii() and (c.isalnum() or c in "_-") for c in self.name):
            raise InputError(f"SynthDomain.name must be a non-empty string of letters, digits, '_' "
                             f"or '-', got {self.name!r}")
        for f, (lo, hi) in _RANGES.items():
            object.__setattr__(self, f, _number(f, getattr(self, f), lo, hi))
        t = self.tint
        if not isinstance(t, (tuple, list)) or len(t) != 3:
            raise InputError(f"SynthDomain.tint must be 3 numbers (R, G, B gains) in "
                             f"[{_TINT_RANGE[0]}, {_TINT_RANGE[1]}], got {t!r}")
        object.__setattr__(self, "tint", tuple(_number("tint", c, *_TINT_RANGE) for c in t))

    def changes(self) -> dict[str, object]:
        """The fields (other than ``name``) that differ from the defaults, in field order."""
        base = _DEFAULTS
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)}

    def is_neutral(self) -> bool:
        """True when this domain renders exactly like the base renderer (whatever its name)."""
        return not self.changes()

    def key(self) -> str:
        """``name`` plus every non-default field with exact float reprs, e.g.
        ``mask:occlusion=0.8``. It enters ``repr(SynthFaces)`` and through it dataset
        fingerprints and ξ cache keys, so two domains that render differently never share it."""
        ch = self.changes()
        return self.name + (":" + ",".join(f"{k}={v!r}" for k, v in ch.items()) if ch else "")


_DEFAULTS = SynthDomain("none")

DOMAINS: dict[str, SynthDomain] = {
    "none": _DEFAULTS,
    # clean source domain: near-frontal, soft light, sharp, low noise
    "studio": SynthDomain("studio", pose=0.6, light=0.5, blur=0.5, noise=0.5),
    # the main cross-domain target: hand-held selfies, harsh light, warm washed-out ISP,
    # masks, motion/focus blur, small-sensor noise, screen/lens artefacts
    "phone": SynthDomain("phone", pose=1.6, light=2.0, saturation=0.35, tint=(1.15, 1.0, 0.8),
                         gamma=1.4, contrast=0.8, occlusion=0.35, blur=2.0, noise=2.5, texture=0.3),
    # dim, bluish, noisy, low-contrast captures with a single harsh source
    "night": SynthDomain("night", light=1.5, saturation=0.5, tint=(0.8, 0.9, 1.2), gamma=2.0,
                         contrast=0.7, blur=1.5, noise=3.5, texture=0.2),
    # masked faces: only the lower face is hidden, the upper face still identifies
    "mask": SynthDomain("mask", occlusion=0.8),
}


def get_domain(domain: str | SynthDomain | None) -> SynthDomain:
    """A :class:`SynthDomain` from a preset name, an instance, or ``None`` (= ``"none"``)."""
    if domain is None:
        return _DEFAULTS
    if isinstance(domain, SynthDomain):
        return domain
    if isinstance(domain, str) and domain in DOMAINS:
        return DOMAINS[domain]
    raise InputError(f"unknown SynthFaces domain {domain!r}; known domains: {', '.join(DOMAINS)} "
                     "(or pass a SynthDomain)")


# ---------------------------------------------------------------------------------------------
# Rendering helpers (called by the SynthFaces painter, device_sim.synthfaces.painter)
# ---------------------------------------------------------------------------------------------
STYLE_COLUMNS = 6   # uniforms per image drawn from the domain-style hash stream


def style_params(u: np.ndarray, dom: SynthDomain) -> dict[str, np.ndarray]:
    """Per-image domain parameters from ``u [N, STYLE_COLUMNS]`` uniforms.

    One uniform decides the mask (``u < occlusion``), so a domain with a higher occlusion
    masks a superset of the images masked by a lower one.
    """
    return {"mask": (u[:, 0] < dom.occlusion).astype(np.float64),
            "mask_color": _MASK_COLORS[np.minimum((u[:, 1] * len(_MASK_COLORS)).astype(np.int64),
                                                  len(_MASK_COLORS) - 1)],
            "mask_top": (u[:, 2] - 0.5) * 0.06,            # face units, added to the top edge
            "pleat_ph": u[:, 3] * 2 * math.pi,
            "tex_px": u[:, 4] * 2 * math.pi, "tex_py": u[:, 5] * 2 * math.pi}


def draw_mask(img: torch.Tensor, dface: torch.Tensor, v: torch.Tensor, top: torch.Tensor,
              aa: float | torch.Tensor, on: torch.Tensor, color: torch.Tensor,
              pleat_ph: torch.Tensor) -> None:
    """Paint a surgical-mask-like band in place: the face outline (slightly dilated, so it
    covers the jaw line) below the curve ``v = top``, with three soft horizontal pleats."""
    d = torch.maximum(dface - 0.03, top - v)
    pleats = torch.sin((v - top) * (2 * math.pi / 0.1) + pleat_ph).mul_(0.06).add_(0.97)
    img.lerp_(color * pleats, torch.sigmoid(-d / aa) * on)


def apply_texture(img: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, strength: float,
                  px: torch.Tensor, py: torch.Tensor) -> torch.Tensor:
    """Multiply by a vignette (corners darker by ``strength/2``) and a grey screen/moiré
    pattern (±15 %·strength; fixed frequencies in image coordinates, per-image phase), so a
    model sees a consistent domain artefact that is not a constant offset."""
    vig = 1 - strength * 0.25 * (X * X + Y * Y)
    pat = torch.sin(2 * math.pi * (4.5 * X + 2.5 * Y) + px) * torch.sin(2 * math.pi * (2.0 * X - 5.5 * Y) + py)
    return img * (vig * (1 + 0.15 * strength * pat))


def apply_colour_style(img: torch.Tensor, dom: SynthDomain) -> torch.Tensor:
    """Saturation around the luma, then tint, gamma and contrast (a camera ISP), each skipped
    at its default. Saturation 0 gives three exactly equal channels."""
    if dom.saturation != 1.0:
        luma = img[:, 0:1] * _LUMA[0] + img[:, 1:2] * _LUMA[1] + img[:, 2:3] * _LUMA[2]
        img = luma + (img - luma) * dom.saturation if dom.saturation else luma.expand_as(img).clone()
    if dom.tint != (1.0, 1.0, 1.0):
        img = img * img.new_tensor(dom.tint).view(1, 3, 1, 1)
    if dom.gamma != 1.0:
        img = img.clamp(0.0, 1.0) ** dom.gamma
    if dom.contrast != 1.0:
        img = (img - 0.5) * dom.contrast + 0.5
    return img
