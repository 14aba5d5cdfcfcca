"""Where one photo's face is (:class:`FaceFind`: box and five points, as
:func:`fedfs_sdk.runtime.align.locate` finds it) and cutting its crop from that record
(:func:`cut`): dlib's face chip (``dlib.get_face_chip``, 150 px, padding 0.25) or the warp onto
the ArcFace template. Kept apart from finding, so a simulator stores what was found per photo and
cuts chips from it (``device_sim.face_cache``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .face_template import warp_to_template

CHIP_SIZE = 150
CHIP_PADDING = 0.25
"""dlib's face chip (what ``face_recognition`` and dlib's ResNet recognizer use): ``size`` 150,
``padding`` 0.25 of the face's size on each side (``dlib.get_face_chip``'s defaults)."""


@dataclass(frozen=True)
class FaceFind:
    """Where the face of one photo is: what :func:`~fedfs_sdk.runtime.align.locate` found, cut by :func:`cut` (the part a
    face cache keeps, so the chip and any capture shift are applied after it).

    ``kind``: ``"dlib-chip"`` (``points``: dlib's 5-point shape, integer pixels) or ``"align"``
    (``points``: the five template landmarks from the 68-point shape); ``method``: the detector
    (``dlib-hog``, ``dlib-hog-eq``, ``dlib-cnn``, ``crop-fallback``); ``box``: ``(left, top,
    right, bottom)`` in the photo's pixels (may reach outside it)."""

    kind: str
    method: str
    box: tuple[int, int, int, int]
    points: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "method": self.method, "box": [int(v) for v in self.box],
                "points": np.asarray(self.points, np.float64).round(4).tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaceFind":
        pts = np.asarray(d["points"], np.float32)
        if d["kind"] not in ("dlib-chip", "align") or pts.shape != (5, 2) or len(d["box"]) != 4:
            raise ValueError(f"not a face record: {d!r}")
        return cls(str(d["kind"]), str(d["method"]), tuple(int(v) for v in d["box"]), pts)


def cut(rgb: np.ndarray, face: FaceFind, size: int, padding: float = CHIP_PADDING) -> np.ndarray:
    """The face crop of ``face`` in ``rgb``: dlib's chip (``kind="dlib-chip"``,
    ``dlib.get_face_chip`` of the 5-point shape) or the warp onto the ArcFace template
    (``"align"``). Cheap: what a face cache leaves to do."""
    img = np.ascontiguousarray(rgb)
    if face.kind == "align":
        return warp_to_template(img, face.points, size)
    import dlib

    rect = dlib.rectangle(*[int(v) for v in face.box])
    shape = dlib.full_object_detection(rect, [dlib.point(int(round(x)), int(round(y))) for x, y in face.points])
    return dlib.get_face_chip(img, shape, size=size, padding=padding)


__all__ = ["CHIP_SIZE", "CHIP_PADDING", "FaceFind", "cut"]
