"""Preprocessing: decoding, channels, normalization, face detection, bad input."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedfs_sdk.errors import ImageDecodeError, ImageNotFoundError, InputError, NoFaceError
import fedfs_sdk.runtime.preprocess as pre
from fedfs_sdk.runtime.preprocess import image_header_size, list_images, load_image, preprocess


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


def test_list_images_missing_folder_empty_folder_and_file(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFoundError, match="image folder not found"):
        list_images(tmp_path / "nope")
    (tmp_path / "a.jpg").write_bytes(b"x")
    with pytest.raises(ImageNotFoundError, match="image folder not found"):
        list_images(tmp_path / "a.jpg")                    # a file is not a folder
    d = tmp_path / "empty_dir"
    d.mkdir()
    (d / "notes.txt").write_text("not an image")
    (d / "sub.png").mkdir()                                # a folder named like an image
    with pytest.raises(InputError, match=r"no images \(\.jpg"):
        list_images(d)


def test_no_face_found() -> None:
    noise = np.random.default_rng(1).integers(0, 255, (120, 120, 3), dtype=np.uint8)
    with pytest.raises(NoFaceError, match="no face found"):
        preprocess(noise, 32, detect_face=True)


# ---- EXIF orientation, pixel types, size limit -----------------------------------------------

def _with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """Insert an APP1 Exif segment (little-endian TIFF, one IFD entry: Orientation) after SOI."""
    import struct

    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) \
        + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0)
    payload = b"Exif\x00\x00" + tiff
    assert jpeg[:2] == b"\xff\xd8"
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def test_exif_orientation_is_applied() -> None:
    # stored 40 × 60 (H × W): left half red, right half blue; Orientation 6 = rotate 90° clockwise
    a = np.zeros((40, 60, 3), np.uint8)
    a[:, :30, 0] = 255
    a[:, 30:, 2] = 255
    ok, enc = cv2.imencode(".jpg", cv2.cvtColor(a, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    plain = load_image(enc.tobytes())
    assert plain.shape == (40, 60, 3)                       # no tag: as stored
    data = _with_exif_orientation(enc.tobytes(), 6)
    img = load_image(data)
    assert img.shape == (60, 40, 3)                         # portrait, as the phone shows it
    expected = np.rot90(a, k=-1)                            # clockwise: left half → top half
    assert np.abs(img.astype(int) - expected.astype(int)).mean() < 8
    assert img[:25, :, 0].mean() > 200 and img[35:, :, 2].mean() > 200
    assert image_header_size(data) == (60, 40)             # stored size (rotation keeps the pixel count)


def test_16bit_and_gray_png_still_load() -> None:
    g16 = (np.arange(20 * 30, dtype=np.uint16).reshape(20, 30) * 100)
    ok, enc = cv2.imencode(".png", g16)
    img = load_image(enc.tobytes())
    assert img.shape == (20, 30, 3) and img.dtype == np.uint8
    assert np.array_equal(img[..., 1], (g16 >> 8).astype(np.uint8))
    c16 = np.full((20, 30, 3), 0, np.uint16)
    c16[..., 2] = 0xFF00                                    # BGR: red
    img = load_image(cv2.imencode(".png", c16)[1].tobytes())
    assert (img[..., 0] == 255).all() and (img[..., 1:] == 0).all()


@pytest.mark.parametrize("ext,dtype", [(".tiff", np.float32), (".tiff", np.float64), (".tiff", np.int32),
                                       (".hdr", np.float32)])
def test_unsupported_pixel_types_are_refused_by_name(tmp_path: Path, ext: str, dtype: type) -> None:
    ok, enc = cv2.imencode(ext, np.full((20, 30, 3), 0.5 if ext == ".hdr" else 7, dtype))
    assert ok
    name = np.dtype(dtype).name
    with pytest.raises(ImageDecodeError, match=f"decodes to {name} pixels; only 8-bit and 16-bit"):
        load_image(enc.tobytes())
    p = tmp_path / f"x{ext}"
    p.write_bytes(enc.tobytes())
    with pytest.raises(ImageDecodeError, match=f"x{ext} decodes to {name}"):
        preprocess([p], 16)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int64, np.bool_])
def test_array_dtype_is_checked(dtype: type) -> None:
    with pytest.raises(InputError, match=f"uint8 RGB, got dtype {np.dtype(dtype).name}"):
        load_image(np.zeros((20, 20, 3), dtype))


def test_header_sizes_of_supported_formats() -> None:
    a = np.random.default_rng(0).integers(0, 255, (37, 53, 3), dtype=np.uint8)
    for ext in (".png", ".jpg", ".bmp", ".webp", ".ppm", ".pgm", ".tiff"):
        src = a[..., 0] if ext == ".pgm" else a
        ok, enc = cv2.imencode(ext, src)
        assert ok and image_header_size(enc.tobytes()) == (53, 37), ext
    ok, enc = cv2.imencode(".webp", a, [cv2.IMWRITE_WEBP_QUALITY, 101])      # lossless: VP8L
    assert image_header_size(enc.tobytes()) == (53, 37)
    assert image_header_size(cv2.imencode(".hdr", a.astype(np.float32))[1].tobytes()) == (53, 37)
    assert image_header_size(b"P5\n# comment 9 9\n640 480\n255\n") == (640, 480)
    assert image_header_size(b"not an image") is None
    assert image_header_size(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00") is None   # truncated


def _png_header(width: int, height: int) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def test_oversized_image_is_refused_from_the_header(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert pre.MAX_IMAGE_PIXELS == 1 << 26
    bomb = _png_header(100_000, 100_000)                    # 10 gigapixels claimed by 33 bytes

    def no_decode(*a: object, **k: object) -> None:
        raise AssertionError("cv2.imdecode must not run on an oversized image")

    monkeypatch.setattr(pre.cv2, "imdecode", no_decode)
    with pytest.raises(ImageDecodeError, match=r"is 100000×100000 pixels, over the limit of 67\.1 megapixels"):
        load_image(bomb)
    p = tmp_path / "bomb.png"
    p.write_bytes(bomb)
    with pytest.raises(ImageDecodeError, match=r"bomb.png is 100000×100000 pixels"):
        load_image(p)


def test_size_limit_is_checked_after_decoding_too(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, enc = cv2.imencode(".png", np.zeros((40, 50, 3), np.uint8))
    assert load_image(enc.tobytes()).shape == (40, 50, 3)
    monkeypatch.setattr(pre, "MAX_IMAGE_PIXELS", 40 * 50 - 1)
    with pytest.raises(ImageDecodeError, match="is 50×40 pixels, over the limit"):
        load_image(enc.tobytes())
    monkeypatch.setattr(pre, "image_header_size", lambda data: None)   # a format without a header parser
    with pytest.raises(ImageDecodeError, match="over the limit"):
        load_image(enc.tobytes())
    monkeypatch.setattr(pre, "MAX_IMAGE_PIXELS", 40 * 50)
    assert load_image(enc.tobytes()).shape == (40, 50, 3)
