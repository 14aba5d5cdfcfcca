"""Preprocessing: decoding, channels, normalization, face detection, bad input."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedfs_sdk.errors import ImageDecodeError, ImageNotFoundError, InputError, NoFaceError
from fedfs_sdk.preprocess import list_images, load_image, preprocess


def test_normalization_constants_and_layout() -> None:
    img = np.zeros((32, 32, 3), np.uint8)
    img[..., 0] = 255                       # pure red in RGB
    x = preprocess(img, 32)
    assert x.shape == (1, 3, 32, 32) and x.dtype == np.float32
    assert np.allclose(x[0, 0], 1.0) and np.allclose(x[0, 1], -1.0) and np.allclose(x[0, 2], -1.0)


def test_path_bytes_and_grayscale(tmp_path: Path) -> None:
    rgb = np.random.default_rng(0).integers(0, 255, (50, 60, 3), dtype=np.uint8)
    p = tmp_path / "a.png"
    cv2.imwrite(str(p), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert np.array_equal(load_image(p), rgb)                          # BGR→RGB handled
    assert np.array_equal(load_image(p.read_bytes()), rgb)
    gray = rgb[..., 0]
    cv2.imwrite(str(tmp_path / "g.pgm"), gray)
    g3 = load_image(tmp_path / "g.pgm")
    assert g3.shape == (50, 60, 3) and np.array_equal(g3[..., 0], g3[..., 2])
    assert preprocess([p, tmp_path / "g.pgm"], 16).shape == (2, 3, 16, 16)
    assert [f.name for f in list_images(tmp_path)] == ["a.png", "g.pgm"]


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFoundError, match="image not found"):
        load_image(tmp_path / "missing.jpg")
    with pytest.raises(ImageDecodeError, match="could not decode"):
        load_image(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(ImageDecodeError, match="empty image file"):
        load_image(tmp_path / "empty.jpg")
    with pytest.raises(InputError, match="uint8"):
        load_image(np.zeros((20, 20, 3), np.float32))
    with pytest.raises(InputError, match="shape"):
        load_image(np.zeros((20, 20, 5), np.uint8))
    with pytest.raises(InputError, match="too small"):
        load_image(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(InputError, match="no images given"):
        preprocess([], 32)
    with pytest.raises(InputError, match="no images"):
        list_images(tmp_path / "nope") if False else list_images(_empty_dir(tmp_path))


def _empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "empty_dir"
    d.mkdir()
    return d


def test_no_face_found() -> None:
    noise = np.random.default_rng(1).integers(0, 255, (120, 120, 3), dtype=np.uint8)
    with pytest.raises(NoFaceError, match="no face found"):
        preprocess(noise, 32, detect_face=True)
