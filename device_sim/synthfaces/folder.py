"""Write SynthFaces identities to an ImageFolder (``root/<identity>/<index>.png``)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fedfs_sdk.errors import InputError

if TYPE_CHECKING:
    from .generator import SynthFaces

__all__ = ["write_image_folder"]


def write_image_folder(faces: "SynthFaces", root: str | Path, identities: Sequence[int],
                       images_per_identity: int, ext: str = ".png", start_index: int = 0) -> Path:
    """Render ``identities × images_per_identity`` images to ``root/<identity>/<index>.png``.

    The ImageFolder layout that :class:`device_sim.datasets.ImageFolderDataset` reads: a disk
    cache of a synthetic population, or a stand-in for a real dataset in tests. PNG is
    lossless, so reading back through ``preprocess`` reproduces ``faces.render`` exactly.
    """
    import cv2

    root = Path(root)
    idx = np.arange(start_index, start_index + images_per_identity)
    for ident in identities:
        folder = root / f"{int(ident):06d}"
        folder.mkdir(parents=True, exist_ok=True)
        imgs = faces.render_uint8(int(ident), idx)
        for i, im in zip(idx, imgs):
            path = folder / f"{int(i):04d}{ext}"
            if not cv2.imwrite(str(path), cv2.cvtColor(im, cv2.COLOR_RGB2BGR)):
                raise InputError(f"could not write {path}")
    return root
