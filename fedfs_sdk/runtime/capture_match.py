"""Public impostor photos as the owner's phone would have taken them.

The public impostor set (:mod:`fedfs_sdk.runtime.impostors`) holds well-lit photos; the owner's
photos carry the phone's capture conditions — night, blur, noise, a colour cast. Against such a
set every model separates the owner from the impostors by *capture* as much as by identity, so
a check of "is the personalized model better than ξ" measured on it says little about the
impostors the device will really meet (people in front of this phone). :func:`match_capture`
moves each impostor photo towards the capture statistics of one of the owner's photos (seeded):

* **colour**: per-channel mean and standard deviation (a Reinhard-style colour transfer in RGB),
  and greyscale when the owner's photo is grey;
* **sharpness**: Gaussian blur until the variance of the Laplacian drops to the owner's;
* **noise**: Gaussian noise added up to the owner's noise level (estimated from the
  median absolute deviation of a high-pass residual, Donoho's σ̂ = MAD/0.6745).

Only statistics of the owner's photos are used, on the device; nothing leaves it. It cannot
reproduce everything (masks, pose, JPEG blocks): the matched set is closer to the phone's
impostors, not equal to them.
"""
from __future__ import annotations

import cv2
import numpy as np

from ..errors import InputError

_BLURS = (0.0, 0.5, 0.8, 1.1, 1.5, 2.0, 2.6, 3.4)


def _grey(img: np.ndarray) -> bool:
    x = img.astype(np.float32)
    return float(np.abs(x[..., 0] - x[..., 1]).mean() + np.abs(x[..., 1] - x[..., 2]).mean()) < 2.0


def _sharpness(grey: np.ndarray) -> float:
    return float(cv2.Laplacian(grey, cv2.CV_32F).var())


def _noise_sigma(grey: np.ndarray) -> float:
    resid = grey - cv2.GaussianBlur(grey, (0, 0), 1.0)
    return float(np.median(np.abs(resid - np.median(resid))) / 0.6745)


def capture_stats(rgb: np.ndarray) -> dict[str, object]:
    """The statistics :func:`match_capture` transfers, of one uint8 ``[S, S, 3]`` photo."""
    x = rgb.astype(np.float32)
    g = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).astype(np.float32)
    return {"mean": x.reshape(-1, 3).mean(0), "std": x.reshape(-1, 3).std(0) + 1e-3, "grey": _grey(rgb),
            "sharpness": _sharpness(g), "noise": _noise_sigma(g)}


def match_one(img: np.ndarray, ref: dict[str, object], rng: np.random.Generator) -> np.ndarray:
    """``img`` (uint8 ``[S, S, 3]``) with the capture statistics ``ref`` of an owner's photo."""
    x = img.astype(np.float32)
    if ref["grey"]:
        x = np.repeat(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(np.float32)[..., None], 3, axis=2)
    mu, sd = x.reshape(-1, 3).mean(0), x.reshape(-1, 3).std(0) + 1e-3
    x = (x - mu) / sd * np.asarray(ref["std"]) + np.asarray(ref["mean"])
    x = np.clip(x, 0, 255)
    target = float(ref["sharpness"])
    for sigma in _BLURS:               # the least blur that brings the sharpness down to the owner's
        y = x if sigma == 0 else cv2.GaussianBlur(x, (0, 0), sigma)
        if _sharpness(cv2.cvtColor(y.astype(np.uint8), cv2.COLOR_RGB2GRAY).astype(np.float32)) <= target:
            break
    x = y
    have = _noise_sigma(cv2.cvtColor(np.clip(x, 0, 255).astype(np.uint8), cv2.COLOR_RGB2GRAY).astype(np.float32))
    add = float(np.sqrt(max(float(ref["noise"]) ** 2 - have ** 2, 0.0)))
    if add > 0.5:
        n = rng.standard_normal(x.shape[:2] + ((1,) if ref["grey"] else (3,))).astype(np.float32)
        x = x + add * n
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def match_capture(impostors: np.ndarray, owner: np.ndarray, seed: int = 0) -> np.ndarray:
    """Every impostor photo (uint8 ``[N, S, S, 3]``) matched to the capture statistics of one of
    the owner's photos (uint8 ``[M, S, S, 3]``), drawn with ``seed``."""
    if impostors.dtype != np.uint8 or owner.dtype != np.uint8 or impostors.ndim != 4 or owner.ndim != 4 \
            or owner.shape[0] == 0 or impostors.shape[1:] != owner.shape[1:]:
        raise InputError(f"match_capture needs uint8 [N, S, S, 3] impostors and owner photos of one size, got "
                         f"{impostors.dtype} {list(impostors.shape)} and {owner.dtype} {list(owner.shape)}")
    stats = [capture_stats(o) for o in owner]
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xCA97])
    pick = rng.integers(len(stats), size=impostors.shape[0])
    return np.stack([match_one(im, stats[k], rng) for im, k in zip(impostors, pick)])


__all__ = ["match_capture", "capture_stats", "match_one"]
