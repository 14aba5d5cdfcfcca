"""Image preprocessing in one place (numpy + OpenCV only, no torch).

Contract of every fedfs model input (insightface convention): RGB, float32 NCHW,
``(x − 127.5) / 127.5`` so pixels lie in [−1, 1], square ``input_size`` (112 for
MobileFaceNet). Encoded images are decoded upright (EXIF orientation applied), 8- or 16-bit
only, at most :data:`MAX_IMAGE_PIXELS`; a truncated JPEG is an error naming the file (libjpeg
would only print a warning and fill the missing part with grey). Grayscale images are repeated
to 3 channels; an alpha channel is composited over :data:`ALPHA_BACKGROUND` (mid-grey).
Every model input must be at least :data:`MIN_IMAGE_SIDE` pixels on its short side.

Face detection (``detect_face``): ``"align"`` (or ``True``) detects the face and its five
landmarks with dlib and warps it onto the 112×112 ArcFace template (:mod:`fedfs_sdk.runtime.align`;
falls back to the Haar crop, with a logged warning, when dlib is not installed); ``"haar"``
crops the largest face found by OpenCV's bundled Haar cascade (with a margin), no alignment;
``"dlib-chip"`` cuts dlib's own face chip (``dlib.get_face_chip``, 5-point, padding 0.25; the
input of ``dlib-resnet``; needs dlib, no fallback). No face → :class:`NoFaceError`.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Sequence, Union

import cv2
import numpy as np

from ..errors import ImageDecodeError, ImageNotFoundError, InputError, NoFaceError
from .align import align_face, dlib_chip, landmarks_available
from .image_header import image_header_size  # noqa: F401  (re-exported; looked up here at call time)
from .haar import _face_detector, center_square, crop_face  # noqa: F401  (moved down; re-exported here)

MEAN = 127.5
STD = 127.5
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".bmp", ".webp")

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray]


MAX_IMAGE_PIXELS = 1 << 26
"""Largest encoded image (width × height) :func:`load_image` decodes: 2²⁶ ≈ 67.1 megapixels.

Enough for the full-resolution output of 48/50/64 MP phone sensors (9248 × 6936 = 64.1 MP),
while a decompression bomb (a few KB of PNG claiming 100 000 × 100 000 pixels) is refused
from its header before OpenCV allocates anything. OpenCV's own limit
(``OPENCV_IO_MAX_IMAGE_PIXELS``, 2³⁰ by default) is read once when ``cv2`` is imported, so a
library cannot set it; this check is fedfs's own. An app may change the value (e.g.
``fedfs_sdk.runtime.preprocess.MAX_IMAGE_PIXELS = 2**27``); downscale larger photos before passing
them in — a face model looks at 112 × 112 pixels."""

MIN_IMAGE_SIDE = 32
"""Smallest short side (pixels) of an image given to a model (:func:`preprocess`): 32.

A 4×4 or 20×20 thumbnail upscaled to 112×112 is a blur that still embeds somewhere; added
to an enrollment it drags the threshold τ down (measured: 0.8385 → 0.3967). Models whose
input is smaller than 32 (e.g. 16 px test models) accept images down to their input size.
An app may change the value (``fedfs_sdk.runtime.preprocess.MIN_IMAGE_SIDE = 64``)."""

ALPHA_BACKGROUND: tuple[int, int, int] = (128, 128, 128)
"""RGB colour that transparent pixels (PNG/WebP/TIFF alpha, ``[H, W, 4]`` arrays) are
composited over: mid-grey, i.e. ≈ 0 after ``(x − 127.5)/127.5``, so a cut-out face sits on
a neutral background instead of whatever colour the invisible pixels happen to store."""

# Decode flags: keep the bit depth (so unsupported depths are refused by name, not silently
# rescaled), 1 or 3 channels (alpha dropped), and — unlike IMREAD_UNCHANGED — apply the EXIF
# orientation, so a portrait phone JPEG (Orientation = 6) comes in upright.
_DECODE_FLAGS = cv2.IMREAD_ANYDEPTH | cv2.IMREAD_ANYCOLOR


def load_image(src: ImageSource) -> np.ndarray:
    """Decode a path, encoded bytes or an array into an RGB ``uint8`` ``[H, W, 3]`` array.

    Arrays are taken as RGB (``[H,W]``, ``[H,W,1]``, ``[H,W,3]`` or ``[H,W,4]``, uint8).
    Encoded images are decoded with their EXIF orientation applied; 8-bit and 16-bit images
    are accepted (16-bit keeps the high byte), other pixel types (float HDR/TIFF, 32-bit
    integer TIFF) raise :class:`ImageDecodeError` naming the type. Images larger than
    :data:`MAX_IMAGE_PIXELS` are refused — from the header, before decoding, for PNG, JPEG,
    BMP, WebP, PNM, TIFF and Radiance HDR; after decoding for other formats OpenCV reads.
    """
    if isinstance(src, np.ndarray):
        return _as_rgb(src, "array")
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise ImageDecodeError("empty image bytes")
        return _decode(data, f"{len(data)} bytes")
    if isinstance(src, (str, os.PathLike)):
        p = Path(src)
        if not p.is_file():
            raise ImageNotFoundError(f"image not found: {p}")
        data = p.read_bytes()
        if not data:
            raise ImageDecodeError(f"empty image file: {p}")
        return _decode(data, f"image file {p}")
    raise InputError(f"unsupported image source type {type(src).__name__}")


def _decode(data: bytes, what: str) -> np.ndarray:
    size = image_header_size(data)
    if size is not None:
        _check_pixels(size[0], size[1], what)
    if data[:2] == b"\xff\xd8":
        _check_jpeg_complete(data, what)
    try:
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), _DECODE_FLAGS)
    except cv2.error as e:  # pragma: no cover - imdecode reports failures as None
        raise ImageDecodeError(f"could not decode {what} as an image ({e})") from None
    if img is None or img.size == 0:
        raise ImageDecodeError(f"could not decode {what} as an image")
    _check_pixels(img.shape[1], img.shape[0], what)
    if _may_have_alpha(data):
        raw = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
        if raw is not None and raw.ndim == 3 and raw.shape[2] == 4:
            # colours and alpha from one decode: OpenCV applies EXIF orientation only when it
            # drops alpha, so an image with alpha is used as stored (not rotated)
            img = raw
    if img.dtype == np.uint16:  # 16-bit PNG/TIFF: keep the high byte
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise ImageDecodeError(f"{what} decodes to {img.dtype} pixels; only 8-bit and 16-bit images are "
                               "supported (convert HDR / floating-point / 32-bit images to 8-bit first)")
    if img.ndim == 2:
        rgb = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    elif img.shape[2] == 4:
        rgb = composite_alpha(cv2.cvtColor(img, cv2.COLOR_BGRA2RGB), img[:, :, 3])
    else:
        rgb = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return rgb


def _check_jpeg_complete(data: bytes, what: str) -> None:
    """Refuse a truncated JPEG, by name. Depending on the OpenCV build, libjpeg either only
    prints "Premature end of JPEG file" and fills the missing rows with grey, or the decode
    fails without a reason; Pillow raises a clear error instead. ``draft`` makes
    libjpeg decode at 1/8 scale, which still reads the whole entropy-coded stream (so a
    missing tail is found) at a fraction of the cost; data after the end-of-image marker
    (e.g. the video of a "motion photo") is ignored, as by every JPEG reader."""
    from PIL import Image, ImageFile

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except (OSError, SyntaxError, ValueError) as e:
        if ImageFile.LOAD_TRUNCATED_IMAGES:   # pragma: no cover - an app turned the check off
            return
        raise ImageDecodeError(f"{what} is a damaged or truncated JPEG ({e}); re-export or re-copy the "
                               "file (its missing part would otherwise be filled with grey)") from None


def _may_have_alpha(d: bytes) -> bool:
    if d[:8] == b"\x89PNG\r\n\x1a\n":
        return d[25:26] in (b"\x04", b"\x06") or b"tRNS" in d[:1 << 16]   # grey+alpha, RGBA, palette alpha
    if d[:4] == b"RIFF" and d[8:12] == b"WEBP":
        return True
    return d[:4] in (b"II*\x00", b"MM\x00*")


def composite_alpha(rgb: np.ndarray, alpha: np.ndarray,
                    background: tuple[int, int, int] | None = None) -> np.ndarray:
    """``rgb · α + background · (1 − α)`` (straight alpha) as uint8; ``background``
    defaults to :data:`ALPHA_BACKGROUND`."""
    bg = np.asarray(ALPHA_BACKGROUND if background is None else background, np.float32)
    a = alpha.astype(np.float32)[:, :, None]
    if alpha.dtype == np.uint8:
        a = a / 255.0
    out = rgb.astype(np.float32) * a + bg * (1.0 - a)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _check_pixels(width: int, height: int, what: str) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageDecodeError(
            f"{what} is {width}×{height} pixels, over the limit of {MAX_IMAGE_PIXELS / 1e6:.1f} megapixels "
            f"(fedfs_sdk.runtime.preprocess.MAX_IMAGE_PIXELS); downscale it first")


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
    if a.shape[2] == 4:
        return composite_alpha(a[:, :, :3], a[:, :, 3])
    return np.ascontiguousarray(a)


def to_model_input(rgb: np.ndarray, input_size: int) -> np.ndarray:
    """RGB uint8 ``[H,W,3]`` → float32 ``[3, S, S]`` normalized to [−1, 1]."""
    sq = center_square(rgb)
    interp = cv2.INTER_AREA if sq.shape[0] > input_size else cv2.INTER_LINEAR
    resized = cv2.resize(sq, (input_size, input_size), interpolation=interp)
    return ((resized.astype(np.float32) - MEAN) / STD).transpose(2, 0, 1)


def preprocess(images: ImageSource | Sequence[ImageSource], input_size: int,
               detect_face: bool | str = False) -> np.ndarray:
    """Decode, (optionally) detect and align / crop, resize and normalize images.

    Accepts one source, a list of sources, or a uint8 batch ``[N, H, W, C]``.
    ``detect_face``: ``False`` (centre square), ``True`` / ``"align"`` (five-point alignment,
    :func:`fedfs_sdk.runtime.align.align_face`), ``"haar"`` (Haar crop, no alignment) or
    ``"dlib-chip"`` (dlib's face chip at ``input_size``, :func:`fedfs_sdk.runtime.align.dlib_chip`).
    Returns float32 ``[N, 3, input_size, input_size]``. A file that cannot be used raises
    an :class:`~fedfs_sdk.errors.InputError` subclass whose message names it (see
    :func:`check_image` to test one file and skip it by name).
    """
    if not isinstance(input_size, int) or input_size < 8:
        raise InputError(f"input_size must be an int ≥ 8, got {input_size!r}")
    mode = face_mode(detect_face)
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
        out[i] = _one(src, input_size, mode, _label(src, i, len(srcs)))
    return out


def _label(src: ImageSource, i: int, n: int) -> str:
    if isinstance(src, (str, os.PathLike)):
        return f"image file {Path(src)}"
    return "image" if n == 1 else f"image #{i}"


def _one(src: ImageSource, input_size: int, mode: str | None, what: str) -> np.ndarray:
    rgb = load_image(src)
    check_size(rgb, input_size, what)
    if mode == "haar":
        try:
            rgb = crop_face(rgb)
        except NoFaceError as e:
            raise NoFaceError(f"{what}: {e}") from None
    elif mode in ("align", "dlib-chip"):
        res = (align_face if mode == "align" else dlib_chip)(rgb, input_size)
        if res.image is None:
            raise NoFaceError(f"{what}: {res.reason} (drop the file, or pass a photo with one frontal face)")
        rgb = res.image
    return to_model_input(rgb, input_size)


FACE_MODES = ("align", "haar", "dlib-chip")
"""What ``detect_face`` may name besides ``False``/``True``/``"none"``."""


def face_mode(detect_face: bool | str | None) -> str | None:
    """Normalize a ``detect_face`` argument: ``None`` (no detection), ``"align"``, ``"haar"`` or
    ``"dlib-chip"``."""
    if detect_face is None or detect_face is False or detect_face == "none":
        return None
    if detect_face is True or detect_face == "align":
        return "align"
    if detect_face in FACE_MODES:
        return str(detect_face)
    raise InputError(f"detect_face must be False, True, 'align', 'haar' or 'dlib-chip', got {detect_face!r}")


def model_face_mode(detect_face: bool | str | None, model_alignment: str | None) -> str | None:
    """The face mode to feed a model: the crop it was trained on (``model_alignment``, e.g.
    ``"dlib-chip"`` for ``dlib-resnet``: a backend's ``alignment``) whatever ``detect_face``
    asks for, else :func:`face_mode` of ``detect_face``."""
    if model_alignment:
        return face_mode(model_alignment)
    return face_mode(detect_face)


def face_mode_key(detect_face: bool | str | None) -> str:
    """What ``detect_face`` really does here, for cache keys and reports: ``"none"``,
    ``"haar"``, ``"align-dlib"``, ``"align-haar-fallback"`` (dlib not installed) or ``"dlib-chip"``.
    A cache keyed on the bare ``True`` would mix Haar crops and aligned faces."""
    mode = face_mode(detect_face)
    if mode == "align":
        return "align-dlib" if landmarks_available() else "align-haar-fallback"
    return mode or "none"


def check_size(rgb: np.ndarray, input_size: int, what: str = "image") -> None:
    """Refuse an image whose short side is below ``min(MIN_IMAGE_SIDE, input_size)``."""
    need = min(MIN_IMAGE_SIDE, input_size)
    h, w = rgb.shape[:2]
    if min(h, w) < need:
        raise InputError(f"{what} is {w}×{h} pixels, smaller than the minimum of {need} pixels per side "
                         f"(fedfs_sdk.runtime.preprocess.MIN_IMAGE_SIDE): an upscaled thumbnail would blur the face and "
                         f"lower the enrollment threshold; use the original photo (≥ {input_size}×{input_size} "
                         "is best) or drop the file")


def check_image(src: ImageSource, input_size: int = 112, detect_face: bool | str = False) -> None:
    """Raise what :func:`preprocess` would raise for this one image, else return.

    For callers that skip bad files by name (a dataset folder)::

        try:
            check_image(path, 112)
        except FedFSError as e:          # ImageDecodeError, NoFaceError, InputError (too small)
            skipped.append((path, str(e)))

    The message already names the file. enroll/verify do not skip: they raise the same error.
    """
    _one(src, input_size, face_mode(detect_face), _label(src, 0, 1))


def list_images(folder: str | os.PathLike[str]) -> list[Path]:
    """Image files directly inside ``folder``, sorted; errors if none."""
    d = Path(folder)
    if not d.is_dir():
        raise ImageNotFoundError(f"image folder not found: {d}")
    try:
        files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    except OSError as e:
        raise InputError(f"image folder {d} cannot be read: {e.strerror or e}") from None
    if not files:
        raise InputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {d}")
    return files
