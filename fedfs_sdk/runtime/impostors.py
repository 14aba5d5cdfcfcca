"""The public impostor set: photos of public identities that ship with a model.

A device needs impostors for two decisions that its owner's photos alone cannot make: how
often a threshold lets *other people* in (``enroll(..., far=…)``,
:mod:`fedfs_sdk.runtime.operating_point`), and whether a personalized model verifies better
than the pre-trained one (:mod:`fedfs_sdk.training.selection`). The phone holds no one else's
photos, so the app ships a small set with the model — **never user data**: photos of public
identities, e.g. the public split ξ was pre-trained on (``fedfs simulate`` / ``fedfs pretrain``
use the folder's public identities), or any folder of public-figure photos the developer
points at (``fedfs impostors --images DIR``).

The set stores the photos already preprocessed for one model input (aligned crops at the
model's input size, uint8 RGB — the exact inputs :func:`~fedfs_sdk.runtime.preprocess.preprocess`
gives the model), not embeddings: a personalized model embeds them itself, and embeddings of
one model mean nothing to another. Storage is ``.npz`` (deflate-compressed), numpy only, read
without pickle; 1,000 faces at 112 px take ≈ 30 MB.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import FedFSError, InputError

IMPOSTOR_FORMAT = "fedfs-impostors/1"


@dataclass
class ImpostorSet:
    """Preprocessed photos of public identities (``images`` uint8 ``[N, S, S, 3]`` RGB, ``identity``
    ``[N]`` indices into ``names``) and how they were made (``meta``: ``input_size``,
    ``detect_face``, ``source``, ``skipped``)."""

    images: np.ndarray
    identity: np.ndarray
    names: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 4 or self.images.shape[3] != 3 \
                or self.images.shape[1] != self.images.shape[2]:
            raise InputError(f"impostor images must be uint8 [N, S, S, 3], got {self.images.dtype} "
                             f"{list(self.images.shape)}")
        if self.identity.shape != (self.images.shape[0],):
            raise InputError("impostor set: one identity per image")
        if self.images.shape[0] and (self.identity.min() < 0 or self.identity.max() >= len(self.names)):
            raise InputError("impostor set: identity index out of range")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def input_size(self) -> int:
        return int(self.images.shape[1])

    @property
    def num_identities(self) -> int:
        return int(np.unique(self.identity).size)

    def digest(self) -> str:
        """sha256 of the pixels and identities (enrollments record which set set their τ)."""
        h = hashlib.sha256(np.ascontiguousarray(self.images).tobytes())
        h.update(np.ascontiguousarray(self.identity.astype("<i4")).tobytes())
        return h.hexdigest()

    def batch(self, input_size: int) -> np.ndarray:
        """float32 ``[N, 3, S, S]``, ``(x − 127.5)/127.5`` — what a backend runs. The set was made
        for one input size; another is refused (thresholds do not carry over between models)."""
        if int(input_size) != self.input_size:
            raise InputError(f"the impostor set holds {self.input_size}px faces but the model takes {input_size}px: "
                             "build one for this model (`fedfs impostors --images DIR --model CKPT`)")
        return ((self.images.astype(np.float32) - 127.5) / 127.5).transpose(0, 3, 1, 2).copy()


def build_impostor_set(folder: str | os.PathLike[str], input_size: int, detect_face: bool | str = False,
                       per_identity: int | None = None, limit: int | None = None, seed: int = 0,
                       exclude: Sequence[str] = ()) -> ImpostorSet:
    """Preprocess a folder of public identities (``folder/<person>/<photo>``) into a set.

    ``per_identity`` / ``limit`` cap the photos per person / in all (a seeded sample);
    ``exclude`` names people to leave out (e.g. the owner, if a developer's folder might hold
    them). Unreadable photos and, with ``detect_face``, faceless ones are skipped and listed in
    ``meta["skipped"]`` — nothing silently.
    """
    from .preprocess import IMAGE_EXTENSIONS, preprocess

    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"impostor folder {root} is not a directory (layout: DIR/<person>/<photo>)")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x1D])
    people = [d for d in sorted(root.iterdir()) if d.is_dir() and d.name not in set(exclude)]
    chosen: list[tuple[str, Path]] = []
    for d in people:
        files = [f for f in sorted(d.iterdir()) if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS]
        if per_identity is not None and len(files) > per_identity:
            files = [files[i] for i in np.sort(rng.choice(len(files), per_identity, replace=False))]
        chosen += [(d.name, f) for f in files]
    if limit is not None and len(chosen) > limit:
        chosen = [chosen[i] for i in np.sort(rng.choice(len(chosen), limit, replace=False))]
    names = sorted({n for n, _ in chosen})
    pos = {n: i for i, n in enumerate(names)}
    imgs, ids, skipped = [], [], []
    for name, f in chosen:
        try:
            x = preprocess([str(f)], input_size, detect_face=detect_face)[0]
        except FedFSError as e:
            skipped.append({"path": str(f), "reason": str(e)})
            continue
        imgs.append(np.rint(x.transpose(1, 2, 0) * 127.5 + 127.5).clip(0, 255).astype(np.uint8))
        ids.append(pos[name])
    if not imgs:
        raise InputError(f"no usable photo of a public identity under {root}"
                         + (f" ({len(skipped)} skipped, e.g. {skipped[0]['path']}: {skipped[0]['reason']})" if skipped else ""))
    used = sorted({names[i] for i in ids})
    remap = {names.index(n): k for k, n in enumerate(used)}
    meta = {"format": IMPOSTOR_FORMAT, "source": str(root), "input_size": int(input_size),
            "detect_face": str(detect_face), "created_at": time.time(), "skipped": skipped, "seed": int(seed)}
    return ImpostorSet(np.stack(imgs), np.array([remap[i] for i in ids], dtype=np.int32), used, meta)


def save_impostors(path: str | os.PathLike[str], imp: ImpostorSet) -> Path:
    """Write ``imp`` as a compressed ``.npz`` (atomically)."""
    import io

    from ..fileio import atomic_write_bytes

    buf = io.BytesIO()
    meta = {**imp.meta, "format": IMPOSTOR_FORMAT, "names": imp.names}
    np.savez_compressed(buf, images=imp.images, identity=imp.identity.astype(np.int32),
                        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    p = Path(path)
    atomic_write_bytes(p, buf.getvalue())
    return p


def load_impostors(path: str | os.PathLike[str]) -> ImpostorSet:
    """Read a set written by :func:`save_impostors`; a clear error for anything else."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"impostor set not found: {p} (make one with `fedfs impostors --images DIR --out {p.name}`)")
    try:
        with np.load(p, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            images, identity = z["images"], z["identity"]
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise InputError(f"{p} is not a fedfs impostor set ({type(e).__name__}: {e}); "
                         "make one with `fedfs impostors --images DIR`") from None
    if meta.get("format") != IMPOSTOR_FORMAT:
        raise InputError(f"{p} is not a fedfs impostor set (format {meta.get('format')!r})")
    names = list(meta.pop("names", []))
    return ImpostorSet(images, identity.astype(np.int64), names, meta)


__all__ = ["IMPOSTOR_FORMAT", "ImpostorSet", "build_impostor_set", "save_impostors", "load_impostors"]
