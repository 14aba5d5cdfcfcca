"""Width and height of an encoded image read from its header, without decoding it.

Lets :func:`fedfs_sdk.runtime.preprocess.load_image` refuse a decompression bomb (a few KB of PNG
claiming 100 000 × 100 000 pixels) before OpenCV allocates anything.
"""
from __future__ import annotations

import struct


def image_header_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` read from the header of a PNG, JPEG, BMP, WebP, PNM, TIFF or
    Radiance HDR image without decoding it; ``None`` for other or unparsable data (EXIF
    rotation is ignored: it does not change the pixel count)."""
    try:
        return _header_size(data)
    except (IndexError, ValueError, struct.error):
        return None


def _header_size(d: bytes) -> tuple[int, int] | None:
    if d[:8] == b"\x89PNG\r\n\x1a\n" and d[12:16] == b"IHDR":
        w, h = struct.unpack(">II", d[16:24])
        return w, h
    if d[:2] == b"\xff\xd8":
        return _jpeg_size(d)
    if d[:2] == b"BM":
        (hdr,) = struct.unpack("<I", d[14:18])
        if hdr == 12:
            w, h = struct.unpack("<HH", d[18:22])
        else:
            w, h = struct.unpack("<ii", d[18:26])
        return abs(w), abs(h)
    if d[:4] == b"RIFF" and d[8:12] == b"WEBP":
        chunk = d[12:16]
        if chunk == b"VP8 ":
            w, h = struct.unpack("<HH", d[26:30])
            return w & 0x3FFF, h & 0x3FFF
        if chunk == b"VP8L":
            (b,) = struct.unpack("<I", d[21:25])
            return (b & 0x3FFF) + 1, ((b >> 14) & 0x3FFF) + 1
        if chunk == b"VP8X":
            return int.from_bytes(d[24:27], "little") + 1, int.from_bytes(d[27:30], "little") + 1
        return None
    if d[:1] == b"P" and d[1:2] in b"123456":
        return _pnm_size(d)
    if d[:4] in (b"II*\x00", b"MM\x00*"):
        return _tiff_size(d)
    if d[:2] == b"#?":
        return _hdr_size(d)
    return None


def _jpeg_size(d: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 4 <= len(d):
        if d[i] != 0xFF:
            return None
        marker = d[i + 1]
        if marker == 0xFF:               # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):   # TEM, RSTn: no length
            i += 2
            continue
        (length,) = struct.unpack(">H", d[i + 2:i + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # SOFn
            h, w = struct.unpack(">HH", d[i + 5:i + 9])
            return w, h
        if marker in (0xD9, 0xDA):       # EOI / SOS before any SOF
            return None
        i += 2 + length
    return None


def _pnm_size(d: bytes) -> tuple[int, int] | None:
    fields: list[int] = []
    i = 2
    while len(fields) < 2 and i < min(len(d), 4096):
        c = d[i:i + 1]
        if c == b"#":
            while i < len(d) and d[i:i + 1] not in (b"\n", b"\r"):
                i += 1
        elif c.isdigit():
            j = i
            while j < len(d) and d[j:j + 1].isdigit():
                j += 1
            fields.append(int(d[i:j]))
            i = j
            continue
        elif not c.isspace():
            return None
        i += 1
    return (fields[0], fields[1]) if len(fields) == 2 else None


def _tiff_size(d: bytes) -> tuple[int, int] | None:
    e = "<" if d[:2] == b"II" else ">"
    (off,) = struct.unpack(e + "I", d[4:8])
    (count,) = struct.unpack(e + "H", d[off:off + 2])
    found: dict[int, int] = {}
    for k in range(count):
        tag, typ, _n = struct.unpack(e + "HHI", d[off + 2 + 12 * k:off + 10 + 12 * k])
        if tag in (256, 257):
            val = d[off + 10 + 12 * k:off + 14 + 12 * k]
            found[tag] = struct.unpack(e + "H", val[:2])[0] if typ == 3 else struct.unpack(e + "I", val)[0]
    return (found[256], found[257]) if len(found) == 2 else None


def _hdr_size(d: bytes) -> tuple[int, int] | None:
    for line in d[:4096].split(b"\n")[1:]:
        parts = line.split()
        if len(parts) == 4 and parts[0] in (b"-Y", b"+Y", b"-X", b"+X"):
            a, b = int(parts[1]), int(parts[3])
            return (b, a) if parts[0].endswith(b"Y") else (a, b)
    return None
