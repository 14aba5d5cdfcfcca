"""OpenCV's Haar-cascade face crop and the centre square (numpy + OpenCV only).

The piece :mod:`fedfs_sdk.runtime.preprocess` and :mod:`fedfs_sdk.runtime.align` share (align
falls back to it without dlib; preprocess offers it as ``detect_face="haar"``): kept here, below
both, so neither imports the other's module for it.
"""
from __future__ import annotations

import functools
from pathlib import Path

import cv2
import numpy as np

from ..errors import NoFaceError

__all__ = ["crop_face", "center_square"]


@functools.lru_cache(maxsize=1)
def _face_detector() -> cv2.CascadeClassifier:
    path = Path(cv2.data.haarcascades) / "haarcascade_frontalface_default.xml"
    det = cv2.CascadeClassifier(str(path))
    if det.empty():
        raise RuntimeError(f"OpenCV Haar cascade not loadable from {path}")
    return det


def crop_face(rgb: np.ndarray, margin: float = 0.2) -> np.ndarray:
    """Crop the largest frontal face (Haar cascade) with ``margin`` on each side.

    Raises :class:`NoFaceError` when none is found.
    """
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    min_side = max(20, min(gray.shape) // 8)
    faces = _face_detector().detectMultiScale(gray, scaleFactor=1.1, minNeighbors=5,
                                              minSize=(min_side, min_side))
    if len(faces) == 0:
        raise NoFaceError(f"no face found in a {rgb.shape[1]}×{rgb.shape[0]} image")
    x, y, w, h = max(faces, key=lambda f: f[2] * f[3])
    m = int(round(margin * max(w, h)))
    x0, y0 = max(0, x - m), max(0, y - m)
    x1, y1 = min(rgb.shape[1], x + w + m), min(rgb.shape[0], y + h + m)
    return rgb[y0:y1, x0:x1]


def center_square(rgb: np.ndarray) -> np.ndarray:
    """Central square crop (keeps the aspect ratio of faces when resizing)."""
    h, w = rgb.shape[:2]
    s = min(h, w)
    y0, x0 = (h - s) // 2, (w - s) // 2
    return rgb[y0:y0 + s, x0:x0 + s]
