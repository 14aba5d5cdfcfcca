"""Image preprocessing in one place (numpy + OpenCV only, no torch).

Contract of every fedfs model input (insightface convention): RGB, float32 NCHW,
``(x − 127.5) / 127.5`` so pixels lie in [−1, 1], square ``input_size`` (112 for
MobileFaceNet). Grayscale images are repeated to 3 channels; RGBA drops alpha. With
``detect_face=True`` the largest face found by OpenCV's bundled Haar cascade is cropped
(with a margin) before resizing; no face → :class:`NoFaceError`.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence, Union

import cv2
import numpy as np

from .errors import ImageDecodeError, ImageNotFoundError, InputError, NoFaceError

MEAN = 127.5
STD = 127.5
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".bmp", ".webp")

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray]


def load_image(src: ImageSource) -> np.ndarray:
    """Decode a path, encoded bytes or an array into an RGB ``uint8`` ``[H, W, 3]`` array.

    Arrays are taken as RGB (``[H,W]``, ``[H,W,1]``, ``[H,W,3]`` or ``[H,W,4]``, uint8).
    """
    if isinstance(src, np.ndarray):
        return _as_rgb(src, "array")
    if isinstance(src, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(bytes(src), dtype=np.uint8)
        if buf.size == 0:
            raise ImageDecodeError("empty image bytes")
        img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
        if img is None:
            raise ImageDecodeError(f"could not decode {buf.size} bytes as an image")
        return _bgr_to_rgb(img)
    if isinstance(src, (str, os.PathLike)):
        p = Path(src)
        if not p.is_file():
            raise ImageNotFoundError(f"image not found: {p}")
        data = p.read_bytes()
        if not data:
            raise ImageDecodeError(f"empty image file: {p}")
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None:
            raise ImageDecodeError(f"could not decode image file: {p}")
        return _bgr_to_rgb(img)
    raise InputError(f"unsupported image source type {type(src).__name__}")


def _bgr_to_rgb(img: np.ndarray) -> np.ndarray:
    if img.dtype == np.uint16:  # 16-bit PNG: keep the high byte
        img = (img >> 8).astype(np.uint8)
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    if img.shape[2] == 4:
        return cv2.cvtColor(img, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def _as_rgb(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype != np.uint8:
        raise InputError(f"{what} must be uint8 RGB, got dtype {a.dtype}")
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise InputError(f"{what} must have shape [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], got {list(a.shape)}")
    if a.shape[0] < 8 or a.shape[1] < 8:
        raise InputError(f"{what} is too small ({a.shape[0]}×{a.shape[1]}); need at least 8×8 pixels")
    if a.shape[2] == 1:
        return np.repeat(a, 3, axis=2)
    return np.ascontiguousarray(a[:, :, :3])


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


def to_model_input(rgb: np.ndarray, input_size: int) -> np.ndarray:
    """RGB uint8 ``[H,W,3]`` → float32 ``[3, S, S]`` normalized to [−1, 1]."""
    sq = center_square(rgb)
    interp = cv2.INTER_AREA if sq.shape[0] > input_size else cv2.INTER_LINEAR
    resized = cv2.resize(sq, (input_size, input_size), interpolation=interp)
    return ((resized.astype(np.float32) - MEAN) / STD).transpose(2, 0, 1)


def preprocess(images: ImageSource | Sequence[ImageSource], input_size: int,
               detect_face: bool = False) -> np.ndarray:
    """Decode, (optionally) detect, crop, resize and normalize images.

    Accepts one source, a list of sources, or a uint8 batch ``[N, H, W, C]``.
    Returns float32 ``[N, 3, input_size, input_size]``.
    """
    if not isinstance(input_size, int) or input_size < 8:
        raise InputError(f"input_size must be an int ≥ 8, got {input_size!r}")
    if isinstance(images, np.ndarray) and images.ndim == 4:
        srcs: Sequence[ImageSource] = list(images)
    elif isinstance(images, (list, tuple)):
        srcs = images
    else:
        srcs = [images]  # type: ignore[list-item]
    if len(srcs) == 0:
        raise InputError("no images given")
    out = np.empty((len(srcs), 3, input_size, input_size), dtype=np.float32)
    for i, src in enumerate(srcs):
        rgb = load_image(src)
        if detect_face:
            rgb = crop_face(rgb)
        out[i] = to_model_input(rgb, input_size)
    return out


def list_images(folder: str | os.PathLike[str]) -> list[Path]:
    """Image files directly inside ``folder``, sorted; errors if none."""
    d = Path(folder)
    if not d.is_dir():
        raise ImageNotFoundError(f"image folder not found: {d}")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise InputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {d}")
    return files
