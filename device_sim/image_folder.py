"""Photos on disk as an :class:`~device_sim.identity_dataset.IdentityDataset`:
``root/<identity>/<image>`` (:class:`ImageFolderDataset`), with nothing dropped unnamed — files
and identity folders it did not use are listed with the reason (:class:`SkippedFile`,
:class:`SkippedIdentity`). Decoding, face detection and alignment go through
:func:`fedfs_sdk.runtime.preprocess.preprocess`; with ``detect_face`` ``"align"`` / ``"dlib-chip"``
every face is located once up front (:mod:`device_sim.face_locate`) and cut from that record.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fedfs_sdk.errors import FedFSError, ImageNotFoundError, InputError
from fedfs_sdk.runtime.align import DEFAULT_DETECT, DetectSettings, FaceFind, cut, landmarks_available
from fedfs_sdk.runtime.preprocess import (IMAGE_EXTENSIONS, check_size, face_mode, face_mode_key, load_image, preprocess,
                                          to_model_input)

from .face_cache import FaceCache
from .face_locate import FaceSummary, locate_faces
from .identity_dataset import IndexLike
from .image_cache import LRUImageCache, normalize
from .synthfaces import broadcast_pairs


@dataclass(frozen=True)
class SkippedFile:
    """A file or folder a dataset did not use, and why (listed by the CLI and in results.json)."""

    path: Path
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": str(self.path), "reason": self.reason}


@dataclass(frozen=True)
class SkippedIdentity:
    """An identity folder a dataset or a split did not use, and why."""

    name: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"identity": self.name, "reason": self.reason}


class ImageFolderDataset:
    """:class:`IdentityDataset` over ``root/<identity>/*.{jpg,jpeg,png,pgm,bmp,webp}``.

    The layout of DigiFace-1M, VGGFace2, CelebA-by-identity and ``write_image_folder``.
    Identity ``i`` is the ``i``-th non-empty sub-folder in sorted order (``names[i]``);
    images are sorted by file name. Decoding, optional face detection (OpenCV Haar cascade,
    ``detect_face=True``), centre-square crop and resize go through
    :func:`fedfs_sdk.runtime.preprocess.preprocess`.

    Bad data — nothing is dropped without being named (:meth:`skip_summary`):
      * sub-folders with fewer than ``min_images`` image files are skipped, listed in
        ``empty_folders`` and, with the reason, in ``skipped_identities``; a root with no
        usable identity raises :class:`InputError`;
      * files that are not images (by extension), files directly under the root and folders
        nested inside an identity folder (only ``root/<identity>/<image>`` is read) are
        listed in ``ignored`` with the reason;
      * with ``validate=True`` (implied by ``preload=True``) every image is decoded at
        construction; unreadable files (corrupt, truncated, too small, and with
        ``detect_face`` faceless ones — whatever :func:`preprocess` refuses) are dropped
        and listed in ``skipped_files`` with the decoder's message, so indices refer only
        to good images; identities left with too few images are skipped as above;
      * without validation a bad file raises :class:`~fedfs_sdk.errors.ImageDecodeError`
        (or :class:`~fedfs_sdk.errors.NoFaceError`) naming it when first loaded.

    Faces (``detect_face`` ``"align"`` / ``"dlib-chip"`` with dlib, validated or preloaded):
    every photo's face is located once up front (:func:`~device_sim.face_locate.locate_faces`:
    from ``face_cache`` where it has the photo's bytes, else in ``face_workers`` processes;
    ``face_progress(done, total)``), and each chip is then cut from that record; photos with
    no usable face are skipped by name and counted in ``face_summary`` (failure-to-acquire).
    """

    def __init__(self, root: str | os.PathLike[str], image_size: int, detect_face: bool | str = False,
                 preload: bool = False, validate: bool = False, cache_bytes: int = 256 << 20,
                 min_images: int = 1, face_cache: FaceCache | None = None, face_workers: int = 1,
                 face_progress=None, detect_settings: DetectSettings = DEFAULT_DETECT) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ImageNotFoundError(f"dataset root is not a directory: {self.root}")
        if not isinstance(image_size, int) or image_size < 8:
            raise InputError(f"image_size must be an int ≥ 8, got {image_size!r}")
        self.image_size = image_size
        self.detect_face = detect_face
        self.empty_folders: list[Path] = []
        self.skipped_files: list[SkippedFile] = []
        self.skipped_identities: list[SkippedIdentity] = []
        self.ignored: list[SkippedFile] = []
        self.cache = LRUImageCache(cache_bytes)
        self.decoded = 0
        """Image files decoded so far (validation and preloading included)."""
        self.decode_threads = max(1, min(8, os.cpu_count() or 1))
        self._preloaded: torch.Tensor | None = None
        need = max(1, min_images)

        def too_few(d: Path, n: int, what: str) -> None:
            self.empty_folders.append(d)
            self.skipped_identities.append(SkippedIdentity(
                d.name, f"{n} {what}image(s), fewer than the {need} needed" if n else f"no {what}images"))

        files_by_id: list[list[Path]] = []
        names: list[str] = []
        for entry in sorted(self.root.iterdir()):
            if not entry.is_dir():
                self.ignored.append(SkippedFile(entry, "not inside an identity folder (layout: root/<identity>/<image>)"))
                continue
            files = []
            for f in sorted(entry.iterdir()):
                if f.is_dir():
                    self.ignored.append(SkippedFile(f, "nested folder: only images directly in root/<identity>/ "
                                                       "are read"))
                elif f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file():
                    files.append(f)
                else:
                    self.ignored.append(SkippedFile(f, f"not an image file (extensions: {', '.join(IMAGE_EXTENSIONS)})"))
            if len(files) < need:
                too_few(entry, len(files), "")
                continue
            files_by_id.append(files)
            names.append(entry.name)

        self.detect_settings = detect_settings
        self.face_summary: FaceSummary | None = None
        self._faces: dict[Path, FaceFind] | None = None
        self._face_errors: dict[Path, str] = {}
        if (preload or validate) and face_mode(detect_face) in ("align", "dlib-chip") and landmarks_available():
            flat = [f for files in files_by_id for f in files]
            got = locate_faces(flat, face_mode(detect_face), detect_settings, face_cache, face_workers, face_progress)
            self._faces = {flat[i]: f for i, f in got.faces.items()}
            self._face_errors = {flat[i]: e for i, e in got.errors.items()}
            self.face_summary = got.summary
            self.identity_photos = {name: len(files) for name, files in zip(names, files_by_id)}
            """Readable or not, every photo of each identity folder (the denominator of failure-to-acquire)."""
        if preload or validate:
            kept_files, kept_names, arrays = [], [], []
            pool = ThreadPoolExecutor(self._threads()) if self._threads() > 1 else None
            for name, files in zip(names, files_by_id):
                good, imgs = [], []
                self.decoded += len(files)
                for f, (img, err) in zip(files, (pool.map if pool else map)(self._try_decode, files)):
                    if err is None:
                        imgs.append(img)
                        good.append(f)
                    else:       # ImageDecodeError, NoFaceError, too small, …
                        self.skipped_files.append(SkippedFile(f, str(err)))
                if len(good) < need:
                    too_few(self.root / name, len(good), "readable ")
                    continue
                kept_files.append(good)
                kept_names.append(name)
                if preload:
                    arrays.append(torch.cat(imgs))
                elif self._faces is not None:   # hand the chips to the first batch_uint8 instead of cutting them again
                    for j, img in enumerate(imgs):
                        self.cache.put((len(kept_files) - 1, j), img[0])
            if pool is not None:
                pool.shutdown()
            files_by_id, names = kept_files, kept_names
            if preload and arrays:
                self._preloaded = torch.cat(arrays)

        if not files_by_id:
            raise InputError(f"no identity folders with images ({', '.join(IMAGE_EXTENSIONS)}) under {self.root}"
                             + (f"; {len(self.empty_folders)} empty folder(s) skipped" if self.empty_folders else "")
                             + (f"; {len(self.skipped_files)} unreadable file(s), e.g. {self.skipped_files[0].path}: "
                                f"{self.skipped_files[0].reason}" if self.skipped_files else ""))
        self.names = names
        self.files = files_by_id
        self.num_identities = len(names)
        self._counts = np.array([len(f) for f in files_by_id], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._counts)[:-1]])

    def skip_summary(self) -> dict[str, list[dict[str, str]]]:
        """Everything under the root that is not used, with the reason: ``files`` (unreadable
        images), ``ignored`` (non-images, stray files, nested folders) and ``identities``
        (folders with too few usable images)."""
        return {"files": [s.to_dict() for s in self.skipped_files],
                "ignored": [s.to_dict() for s in self.ignored],
                "identities": [s.to_dict() for s in self.skipped_identities]}

    def __repr__(self) -> str:
        return (f"ImageFolderDataset({str(self.root)!r}, image_size={self.image_size}, "
                f"identities={self.num_identities}, images={int(self._counts.sum())})")

    def identity_names(self, identities: IndexLike) -> list[str]:
        """The folder names of ``identities`` (positions shift when folders are added or
        removed; names do not)."""
        ids = np.asarray(identities, dtype=np.int64).reshape(-1)
        self._check_ids(ids)
        return [self.names[int(i)] for i in ids]

    def fingerprint(self) -> str:
        """sha256 of the identity folders, their image file names and the preprocessing
        (not of the pixels: cheap for a million files; see ``Population.fingerprint``)."""
        fp = {"image_size": self.image_size, "detect_face": face_mode_key(self.detect_face)}
        if self._faces is not None:     # another search finds other boxes for some photos: other chips
            fp["detect"] = self.detect_settings.key()
        h = hashlib.sha256(json.dumps(fp).encode())
        for name, files in zip(self.names, self.files):
            h.update(json.dumps([name, [f.name for f in files]]).encode())
        return h.hexdigest()

    @property
    def counts(self) -> np.ndarray:
        """Images per identity, ``[num_identities]``."""
        return self._counts.copy()

    def count(self, identity: int) -> int:
        self._check_ids(np.asarray([identity]))
        return int(self._counts[identity])

    def path(self, identity: int, index: int) -> Path:
        self._check(np.asarray([identity]), np.asarray([index]))
        return self.files[identity][index]

    def images(self, identity: int, indices: IndexLike) -> torch.Tensor:
        return self.batch(identity, indices)

    def batch(self, identities: IndexLike, indices: IndexLike) -> torch.Tensor:
        return normalize(self.batch_uint8(identities, indices))

    def batch_uint8(self, identities: IndexLike, indices: IndexLike, device: str | torch.device | None = None,
                    cache: bool = True) -> torch.Tensor:
        """uint8 ``[N, 3, S, S]`` decoded on the CPU (``decode_threads`` at a time for large
        batches), on ``device``. ``cache=False`` bypasses the LRU (the image store keeps
        the images itself, so each file is decoded once)."""
        ids, idx = broadcast_pairs(identities, indices)
        self._check(ids, idx)
        S = self.image_size
        if self._preloaded is not None:
            out = self._preloaded[torch.as_tensor(self._offsets[ids] + idx)]
        elif not cache or self.cache.max_bytes <= 0:
            out = torch.empty((ids.size, 3, S, S), dtype=torch.uint8)
            missing = self.cache.take_into(ids, idx, out)       # images validation left in the LRU: handed over
            if missing:
                out[torch.as_tensor(missing)] = self._load_u8([self.files[ids[i]][idx[i]] for i in missing])
        else:
            out = torch.empty((ids.size, 3, S, S), dtype=torch.uint8)
            missing = self.cache.fetch_into(ids, idx, out)
            if missing:
                u8 = self._load_u8([self.files[ids[i]][idx[i]] for i in missing])
                out[torch.as_tensor(missing)] = u8
                self.cache.put_many(ids, idx, missing, u8)
        return out if device is None else out.to(device)

    def _load_u8(self, paths: Sequence[Path]) -> torch.Tensor:
        """Decode ``paths`` (OpenCV releases the GIL: large lists go to a few threads)."""
        self.decoded += len(paths)
        per = 64
        if len(paths) <= per or self._threads() <= 1:
            return self._decode(paths)
        parts = [paths[a:a + per] for a in range(0, len(paths), per)]
        with ThreadPoolExecutor(self._threads()) as pool:
            return torch.cat(list(pool.map(self._decode, parts)))

    def _threads(self) -> int:
        # face detectors (dlib, OpenCV's cascade) are not documented thread-safe: one thread then; faces
        # already located (cut from the record, no detector) decode in threads
        return 1 if self.detect_face and self._faces is None else self.decode_threads

    def _try_decode(self, path: Path) -> tuple[torch.Tensor | None, FedFSError | None]:
        if path in self._face_errors:
            from fedfs_sdk.errors import NoFaceError

            return None, NoFaceError(self._face_errors[path])
        try:
            return self._decode([path]), None
        except FedFSError as e:
            return None, e

    def _decode(self, paths: Sequence[Path]) -> torch.Tensor:
        if self._faces is None:
            x = preprocess([str(p) for p in paths], self.image_size, detect_face=self.detect_face)
        else:       # the face was located once (cached): cut the chip from the record
            S = self.image_size
            x = np.empty((len(paths), 3, S, S), dtype=np.float32)
            for k, p in enumerate(paths):
                face = self._faces.get(Path(p))
                if face is None:
                    x[k] = preprocess([str(p)], S, detect_face=self.detect_face)[0]
                    continue
                rgb = load_image(p)
                check_size(rgb, S, f"image file {p}")
                x[k] = to_model_input(cut(rgb, face, S), S)
        return torch.from_numpy(np.rint(x * 127.5 + 127.5)).to(torch.uint8)

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_identities):
            raise InputError(f"identity out of range [0, {self.num_identities}): {int(ids.min())}..{int(ids.max())}")

    def _check(self, ids: np.ndarray, idx: np.ndarray) -> None:
        self._check_ids(ids)
        if idx.size:
            bad = (idx < 0) | (idx >= self._counts[ids])
            if bad.any():
                j = int(np.argmax(bad))
                raise InputError(f"image index {int(idx[j])} out of range for identity {int(ids[j])} "
                                 f"({self.names[ids[j]]!r} has {int(self._counts[ids[j]])} images)")


__all__ = ["ImageFolderDataset", "SkippedFile", "SkippedIdentity"]
