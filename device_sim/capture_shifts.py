"""Capture shifts for real photos: how the owner's phone sees a face, applied after the fact.

The SynthFaces domains (:mod:`device_sim.synth_domains`) render a look into synthetic faces.
Real photos cannot be re-rendered, but the capture part of a look can be applied to them:
low light, a strong side light, a colour style (saturation, white balance, gamma, contrast),
greyscale, blur, sensor noise, low resolution, JPEG and a face mask. A :class:`CaptureShift`
holds those settings; :func:`apply_shift` applies them to an aligned face crop.

Two kinds of randomness, both derived from ``(seed, identity, image)`` so every image is the
same in any batch, chunk or process and another seed gives another draw:

* **per phone** (one draw per identity: a client is one person with one phone): white-balance
  cast, noise level, JPEG quality and resolution of its camera;
* **per photo**: exposure, side-light direction and strength, blur, greyscale, mask.

Where the shift goes (``--scenario real-phone`` / ``real-night``): the clients' and new users'
photos only — they are what phones capture. ξ's public identities and the public impostor set
stay as they were (they ship with the model, they were not taken by this phone).

The mask is drawn in face coordinates of the ArcFace 112×112 template (nose at y ≈ 0.64 of the
crop, mouth at 0.82): on photos that are not aligned crops (no ``--detect-face``, not a
pre-aligned folder) it lands wherever that region is.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields

import cv2
import numpy as np

from fedfs_sdk.errors import InputError

__all__ = ["CaptureShift", "CAPTURE_SHIFTS", "CaptureShiftDataset", "get_shift", "apply_shift", "shift_images"]

_MASK_COLORS = np.array([[0.62, 0.78, 0.92], [0.93, 0.93, 0.92], [0.10, 0.10, 0.12], [0.30, 0.45, 0.70]])
_LUMA = np.array([0.299, 0.587, 0.114])


@dataclass(frozen=True)
class CaptureShift:
    """Capture settings of a population of phones; the defaults change nothing.

    Attributes:
        name: label (enters dataset fingerprints through :meth:`key`).
        exposure: ``(lo, hi)`` brightness gain per photo, log-uniform (``< 1``: low light).
        side_light: strongest directional light gradient (0: none; 1: one side twice as bright
            as the middle, the other black), per photo a random direction and a strength in
            ``[0, side_light]``.
        saturation: colour saturation around the luma (0 = greyscale).
        grey: probability that a photo is greyscale (an IR / night mode capture).
        tint: white-balance gains (R, G, B) of the population; each phone jitters them by ±8 %.
        gamma: tone curve ``x ** gamma`` (> 1 crushes shadows).
        contrast: ``(x − ½)·contrast + ½``.
        blur: largest Gaussian blur σ in pixels at 112×112 (per photo uniform in ``[0, blur]``).
        noise: largest sensor-noise σ in intensity units (per phone in ``[noise/2, noise]``).
        low_res: largest downscale factor before upscaling back (per phone, ``[1, low_res]``).
        jpeg: ``(lo, hi)`` JPEG quality of a phone (uniform), or ``None`` (no compression).
        occlusion: probability of a face mask over nose, mouth and chin.
    """

    name: str
    exposure: tuple[float, float] = (1.0, 1.0)
    side_light: float = 0.0
    saturation: float = 1.0
    grey: float = 0.0
    tint: tuple[float, float, float] = (1.0, 1.0, 1.0)
    gamma: float = 1.0
    contrast: float = 1.0
    blur: float = 0.0
    noise: float = 0.0
    low_res: float = 1.0
    jpeg: tuple[int, int] | None = None
    occlusion: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.exposure
        checks = [("exposure", 0.05 <= lo <= hi <= 4.0), ("side_light", 0 <= self.side_light <= 1),
                  ("saturation", 0 <= self.saturation <= 2), ("grey", 0 <= self.grey <= 1),
                  ("tint", len(self.tint) == 3 and all(0 < t <= 3 for t in self.tint)),
                  ("gamma", 0.25 <= self.gamma <= 4), ("contrast", 0.1 <= self.contrast <= 3),
                  ("blur", 0 <= self.blur <= 8), ("noise", 0 <= self.noise <= 0.5),
                  ("low_res", 1 <= self.low_res <= 8), ("occlusion", 0 <= self.occlusion <= 1),
                  ("jpeg", self.jpeg is None or (len(self.jpeg) == 2 and 5 <= self.jpeg[0] <= self.jpeg[1] <= 100))]
        for name, ok in checks:
            if not ok:
                raise InputError(f"CaptureShift.{name} is out of range: {getattr(self, name)!r}")

    def key(self) -> str:
        """``name`` and every non-default field: two shifts that differ never share a key."""
        base = CaptureShift("none")
        ch = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
              if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)]
        return self.name + (":" + ",".join(ch) if ch else "")


CAPTURE_SHIFTS: dict[str, CaptureShift] = {
    "none": CaptureShift("none"),
    # SynthFaces 'phone' on real photos: hand-held captures in harsh light, a warm washed-out
    # ISP, masks on a third of the photos, motion/focus blur, small-sensor noise, JPEG
    "phone": CaptureShift("phone", exposure=(0.55, 1.2), side_light=0.6, saturation=0.35, tint=(1.15, 1.0, 0.8),
                          gamma=1.4, contrast=0.8, blur=2.0, noise=0.06, low_res=2.0, jpeg=(20, 50),
                          occlusion=0.35),
    # SynthFaces 'night' on real photos: dim, bluish or greyscale (night mode), low contrast,
    # strong noise amplified by the gain, blur, heavy JPEG
    "night": CaptureShift("night", exposure=(0.5, 1.0), side_light=0.5, saturation=0.5, grey=0.5,
                          tint=(0.8, 0.9, 1.2), gamma=1.5, contrast=0.75, blur=1.5, noise=0.08, low_res=2.0,
                          jpeg=(15, 40)),
}


def get_shift(shift: str | CaptureShift | None) -> CaptureShift:
    """A :class:`CaptureShift` from a preset name, an instance, or None (``none``)."""
    if shift is None:
        return CAPTURE_SHIFTS["none"]
    if isinstance(shift, CaptureShift):
        return shift
    if shift in CAPTURE_SHIFTS:
        return CAPTURE_SHIFTS[shift]
    raise InputError(f"unknown capture shift {shift!r}; known: {', '.join(CAPTURE_SHIFTS)}")


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x5A1F7, *[int(k) & 0xFFFFFFFF for k in keys]])


def _identity_key(name: str) -> int:
    """A stable 32-bit key of an identity name (positions shift when folders change; names do not)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def apply_shift(rgb: np.ndarray, shift: CaptureShift, seed: int, identity: str, index: int) -> np.ndarray:
    """``rgb`` (uint8 ``[S, S, 3]``, an aligned face crop) as phone ``identity`` captured photo
    ``index`` under ``shift``; deterministic in ``(seed, identity, index)``."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise InputError(f"apply_shift needs a uint8 [H, W, 3] image, got {rgb.dtype} {list(rgb.shape)}")
    if shift.key() == "none":
        return rgb
    ident = _identity_key(identity)
    phone = _rng(seed, ident, 0xFFFFFFFF)
    photo = _rng(seed, ident, index)
    # per phone (fixed draw order: adding a field later appends, never reorders)
    tint = np.asarray(shift.tint) * phone.uniform(0.92, 1.08, 3)
    noise = shift.noise * phone.uniform(0.5, 1.0)
    low_res = phone.uniform(1.0, shift.low_res)
    quality = int(round(phone.uniform(*shift.jpeg))) if shift.jpeg is not None else None
    # per photo
    lo, hi = shift.exposure
    exposure = math.exp(photo.uniform(math.log(lo), math.log(hi)))
    light_g, light_ang = photo.uniform(0.0, shift.side_light), photo.uniform(0, 2 * math.pi)
    blur = photo.uniform(0.0, shift.blur)
    grey = photo.uniform() < shift.grey
    masked = photo.uniform() < shift.occlusion
    mask_color = _MASK_COLORS[photo.integers(len(_MASK_COLORS))]
    mask_top = photo.uniform(-0.03, 0.03)
    noise_seed = int(photo.integers(1 << 31))

    h, w = rgb.shape[:2]
    s = w / 112.0
    x = rgb.astype(np.float64) / 255.0
    yy, xx = np.mgrid[0:h, 0:w]
    X, Y = (xx + 0.5) / w * 2 - 1, (yy + 0.5) / h * 2 - 1
    if masked:   # a surgical-mask-like band below the nose, inside a dilated face ellipse
        face = ((X / 0.78) ** 2 + ((Y - 0.22) / 0.95) ** 2) <= 1.0
        below = Y >= (0.27 + mask_top)
        pleats = 0.97 + 0.06 * np.sin((Y - 0.27) * 2 * math.pi / 0.18)
        m = (face & below)[..., None]
        x = np.where(m, mask_color[None, None, :] * pleats[..., None], x)
    light = (1 + light_g * (math.cos(light_ang) * X + math.sin(light_ang) * Y)).clip(0.0, 2.0)
    x = x * (exposure * light)[..., None]
    luma = (x * _LUMA).sum(-1, keepdims=True)
    sat = 0.0 if grey else shift.saturation
    x = luma + (x - luma) * sat
    if not grey:
        x = x * tint
    x = x.clip(0.0, 1.0) ** shift.gamma
    x = (x - 0.5) * shift.contrast + 0.5
    if blur > 0.05 * s:
        sigma = blur * s
        x = cv2.GaussianBlur(x, (0, 0), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT)
    if low_res > 1.05:
        small = (max(8, int(round(w / low_res))), max(8, int(round(h / low_res))))
        x = cv2.resize(cv2.resize(x, small, interpolation=cv2.INTER_AREA), (w, h), interpolation=cv2.INTER_LINEAR)
    if noise > 0:
        n = np.random.default_rng(noise_seed).standard_normal((h, w, 3 if not grey else 1))
        x = x + noise * n
    out = np.rint(x.clip(0.0, 1.0) * 255.0).astype(np.uint8)
    if quality is not None:
        ok, buf = cv2.imencode(".jpg", cv2.cvtColor(out, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise RuntimeError("OpenCV could not JPEG-encode a shifted image")
        out = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return out


def shift_images(u8: np.ndarray, shift: CaptureShift, seed: int, identities: list[str],
                 indices: np.ndarray) -> np.ndarray:
    """:func:`apply_shift` over a batch: ``u8`` ``[N, 3, S, S]`` uint8 (the simulator's layout),
    photo ``i`` of identity ``identities[i]`` with image index ``indices[i]``."""
    out = np.empty_like(u8)
    for i in range(u8.shape[0]):
        hwc = np.ascontiguousarray(u8[i].transpose(1, 2, 0))
        out[i] = apply_shift(hwc, shift, seed, identities[i], int(indices[i])).transpose(2, 0, 1)
    return out


class CaptureShiftDataset:
    """An :class:`~device_sim.datasets.IdentityDataset` whose ``shifted`` identities are seen
    through :func:`apply_shift` (the phones' captures); the others (ξ's public identities,
    the public impostor set) are passed through unchanged.

    Images stay on the uint8 grid of every fedfs input; shifted images are cached (uint8, LRU).
    """

    def __init__(self, base, shift: str | CaptureShift, seed: int, shifted: "np.ndarray | list[int]",
                 cache_bytes: int = 256 << 20) -> None:
        from .datasets import LRUImageCache

        self.base = base
        self.shift = get_shift(shift)
        self.seed = int(seed)
        self.shifted = np.zeros(base.num_identities, dtype=bool)
        self.shifted[np.asarray(shifted, dtype=np.int64)] = True
        self.num_identities = base.num_identities
        self.image_size = base.image_size
        self.cache = LRUImageCache(cache_bytes)
        self._names = base.identity_names(np.arange(base.num_identities))

    def __repr__(self) -> str:
        return (f"CaptureShiftDataset({self.base!r}, shift={self.shift.key()!r}, seed={self.seed}, "
                f"shifted={int(self.shifted.sum())})")

    def __getattr__(self, name: str):
        # names, counts, path, skip_summary … of the wrapped folder
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def identity_names(self, identities) -> list[str]:
        return self.base.identity_names(identities)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.base.fingerprint().encode())
        h.update(f"{self.shift.key()}|{self.seed}|".encode())
        h.update(np.packbits(self.shifted).tobytes())
        return h.hexdigest()

    def count(self, identity: int) -> int:
        return self.base.count(identity)

    def images(self, identity: int, indices):
        return self.batch(identity, indices)

    def batch(self, identities, indices):
        from .image_cache import normalize

        return normalize(self.batch_uint8(identities, indices))

    def batch_uint8(self, identities, indices, device=None, cache: bool = True):
        """uint8 ``[N, 3, S, S]``: the folder's photos, the shifted identities' through their
        capture shift (the image store and the population read this; without it they would get
        the wrapped folder's unshifted photos)."""
        import torch

        from .synthfaces import broadcast_pairs

        ids, idx = broadcast_pairs(identities, indices)
        x = self.base.batch_uint8(ids, idx, cache=cache)
        on = self.shifted[ids] if ids.size else np.zeros(0, dtype=bool)
        if on.any():
            pos = np.flatnonzero(on)
            S = self.image_size
            shifted = torch.empty((pos.size, 3, S, S), dtype=torch.uint8)
            missing = self.cache.fetch_into(ids[pos], idx[pos], shifted) if cache else list(range(pos.size))
            if missing:
                m = np.asarray(missing)
                names = [self._names[int(i)] for i in ids[pos[m]]]
                fresh = torch.from_numpy(shift_images(x[torch.as_tensor(pos[m])].cpu().numpy(), self.shift, self.seed,
                                                      names, idx[pos[m]]))
                shifted[torch.as_tensor(m)] = fresh
                if cache:
                    self.cache.put_many(ids[pos], idx[pos], missing, fresh)
            x = x.clone()
            x[torch.as_tensor(pos)] = shifted.to(x.device)
        return x if device is None else x.to(device)
