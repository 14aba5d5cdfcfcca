"""The ArcFace five-point template and the similarity warp onto it.

Face recognizers of the ArcFace family (Deng et al., 2019; insightface), MobileFaceNet
included, are trained on faces warped so that five landmarks — the two eye centres, the nose
tip and the two mouth corners — land on fixed reference points (:data:`ARCFACE_TEMPLATE`). The
similarity transform (rotation, uniform scale, translation) that maps a photo's five points
onto the template is fitted by OpenCV's ``estimateAffinePartial2D`` and applied with
``warpAffine``. Pure geometry, no detector: finding the points is :mod:`fedfs_sdk.runtime.align`.
"""
from __future__ import annotations

import cv2
import numpy as np

from ..errors import InputError

ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963],    # eye on the image's left (the person's right eye)
                             [73.5318, 51.5014],    # eye on the image's right
                             [56.0252, 71.7366],    # nose tip
                             [41.5493, 92.3655],    # mouth corner on the image's left
                             [70.7299, 92.2041]],   # mouth corner on the image's right
                            dtype=np.float32)
"""insightface's reference landmarks of a 112×112 aligned face, (x, y) in pixels, in the
order left eye, right eye, nose, left mouth corner, right mouth corner (image left/right)."""

TEMPLATE_SIZE = 112


def template(size: int = TEMPLATE_SIZE) -> np.ndarray:
    """:data:`ARCFACE_TEMPLATE` scaled to a ``size``×``size`` output."""
    return ARCFACE_TEMPLATE * (float(size) / TEMPLATE_SIZE)


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 2×3 similarity (rotation, uniform scale, translation) that maps points ``src``
    ``[N, 2]`` onto ``dst`` ``[N, 2]`` (N ≥ 2) in the least-squares sense (OpenCV, LMedS
    outlier rejection then Levenberg–Marquardt refinement)."""
    src = np.asarray(src, np.float32).reshape(-1, 2)
    dst = np.asarray(dst, np.float32).reshape(-1, 2)
    if src.shape != dst.shape or src.shape[0] < 2:
        raise InputError(f"similarity_transform needs two [N, 2] point sets with N ≥ 2, got {src.shape} and {dst.shape}")
    m, _ = cv2.estimateAffinePartial2D(src, dst, method=cv2.LMEDS)
    if m is None:
        raise InputError("landmarks are degenerate (all points coincide): no similarity transform fits them")
    return m


def warp_to_template(rgb: np.ndarray, landmarks: np.ndarray, size: int = TEMPLATE_SIZE) -> np.ndarray:
    """Warp ``rgb`` so that its five ``landmarks`` land on :func:`template` ``(size)``.

    Pixels from outside the photo are black (insightface's convention)."""
    m = similarity_transform(landmarks, template(size))
    return cv2.warpAffine(rgb, m, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                          borderValue=(0, 0, 0))


__all__ = ["ARCFACE_TEMPLATE", "TEMPLATE_SIZE", "template", "similarity_transform", "warp_to_template"]
