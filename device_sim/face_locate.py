"""Find the face of every photo of a folder once, on every core (issue 31).

:func:`locate_faces` gives each photo's :class:`~fedfs_sdk.runtime.align.FaceFind` (or why
there is none): first from the :class:`~device_sim.face_cache.FaceCache` (content-addressed,
so a second run, another seed or another scenario of the same folder detects nothing), the
rest in ``workers`` processes (decode + :func:`~fedfs_sdk.runtime.align.locate`). The chip —
and a capture shift after it — is cut from the record later
(:func:`~fedfs_sdk.runtime.align.cut`: milliseconds).

A folder of face crops (recognised from the detected photos: their median face box covers at
least :data:`CROP_AREA_SHARE` of the frame) gets a second pass over the photos no detector
found: :func:`~fedfs_sdk.runtime.align.fallback_locate` with the folder's median box as the
prior, accepted only where its quality test passes. What remains is failure-to-acquire
(ISO/IEC 19795-1): the photos are dropped by the dataset, named, and counted in the run's
figures.

No torch here: the worker processes import this module and :mod:`fedfs_sdk.runtime.align` only.
"""
from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fedfs_sdk.runtime.align import DEFAULT_DETECT, DetectSettings, FaceFind

from .face_cache import FaceCache, entry_key, file_digest

__all__ = ["locate_faces", "Located", "FaceSummary", "folder_prior", "CROP_AREA_SHARE", "METHODS"]

CROP_AREA_SHARE = 0.3
"""A folder is a folder of face crops when the median detected face box covers at least this
share of its photo's frame (LFW 250×250: ≈ 0.18; Yale 320×243: ≈ 0.15; a face filling a
92×112 crop: ≈ 0.5)."""
MIN_PRIOR_FACES = 5
"""Detected photos needed before the folder's median box is trusted as a prior."""
METHODS = ("dlib-hog", "dlib-hog-eq", "dlib-cnn", "crop-fallback")
FALLBACK_VERSION = "fb2"
"""In the crop fallback's cache key only: bumped when :func:`~fedfs_sdk.runtime.align.fallback_locate`
changes (fb2: a global histogram equalization after CLAHE), so its few entries are redone and
the detectors' entries stay."""


@dataclass
class FaceSummary:
    """What :func:`locate_faces` did: the one line the CLI prints and ``results.json`` keeps."""

    photos: int = 0
    found: dict[str, int] = field(default_factory=lambda: {m: 0 for m in METHODS})
    none: int = 0
    unreadable: int = 0
    cached: int = 0
    detected: int = 0
    """Photos run through the detectors in this call (cache misses)."""
    seconds: float = 0.0
    workers: int = 1
    crop_folder: bool = False
    prior: list[float] | None = None

    @property
    def fta(self) -> float:
        """Failure-to-acquire: the share of readable photos with no usable face."""
        n = self.photos - self.unreadable
        return self.none / n if n else 0.0

    def line(self) -> str:
        f = self.found
        return (f"faces: {self.photos} photos in {self.seconds:.1f} s ({self.workers} worker(s), "
                f"{self.cached} from the face cache, {self.detected} detected): HOG {f['dlib-hog']}, "
                f"equalized HOG {f['dlib-hog-eq']}, CNN {f['dlib-cnn']}, crop fallback {f['crop-fallback']}, "
                f"none {self.none} (failure-to-acquire {self.fta:.1%})"
                + (f", unreadable {self.unreadable}" if self.unreadable else "")
                + ("; a folder of face crops" if self.crop_folder else ""))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fta": self.fta, "line": self.line()}


@dataclass
class Located:
    """Per photo (by position in the list given): its face, or why none (``errors``: no usable
    face; ``unreadable``: the file could not be read or decoded)."""

    faces: dict[int, FaceFind]
    errors: dict[int, str]
    summary: FaceSummary
    unreadable: dict[int, str] = field(default_factory=dict)


def _work(task: tuple[str, str, tuple, list[float] | None]) -> tuple[dict | None, list[int] | None, str | None]:
    """One photo in a worker: ``(face dict | None, [w, h], decode error)``."""
    from fedfs_sdk.errors import FedFSError
    from fedfs_sdk.runtime.align import fallback_locate, locate
    from fedfs_sdk.runtime.preprocess import load_image

    path, kind, settings, prior = task
    try:
        rgb = load_image(path)
    except FedFSError as e:
        return None, None, str(e)
    size = [int(rgb.shape[1]), int(rgb.shape[0])]
    if prior is None:
        face = locate(rgb, kind, DetectSettings(*settings))
    else:
        face = fallback_locate(rgb, tuple(prior), kind)
    return (face.to_dict() if face is not None else None), size, None


def _init_worker() -> None:
    import cv2

    cv2.setNumThreads(1)     # one process per core: no nested thread pools


def folder_prior(faces: Sequence[FaceFind], sizes: Sequence[Sequence[int]]) -> list[float] | None:
    """The folder's median face box as fractions of the frame ``[l, t, r, b]`` when it is a
    folder of face crops (median box area ≥ :data:`CROP_AREA_SHARE` of the frame, at least
    :data:`MIN_PRIOR_FACES` faces), else None."""
    if len(faces) < MIN_PRIOR_FACES:
        return None
    fr = np.array([[f.box[0] / w, f.box[1] / h, f.box[2] / w, f.box[3] / h] for f, (w, h) in zip(faces, sizes)])
    area = (fr[:, 2] - fr[:, 0]) * (fr[:, 3] - fr[:, 1])
    if float(np.median(area)) < CROP_AREA_SHARE:
        return None
    return [round(float(v), 2) for v in np.median(fr, axis=0)]


def _run(tasks: list[tuple], workers: int, progress: Callable[[int], None] | None) -> list[tuple]:
    out: list[Any] = [None] * len(tasks)
    if workers <= 1 or len(tasks) < 8:
        for i, t in enumerate(tasks):
            out[i] = _work(t)
            if progress:
                progress(1)
        return out
    per = max(1, min(16, len(tasks) // (workers * 4)))
    chunks = [list(range(a, min(a + per, len(tasks)))) for a in range(0, len(tasks), per)]
    # spawn, not fork: the parent may hold torch's thread pools and a prefetch thread's locks
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
        futs = {pool.submit(_work_many, [tasks[i] for i in c]): c for c in chunks}
        for fut in as_completed(futs):
            for i, r in zip(futs[fut], fut.result()):
                out[i] = r
            if progress:
                progress(len(futs[fut]))
    return out


def _work_many(tasks: list[tuple]) -> list[tuple]:
    return [_work(t) for t in tasks]


def locate_faces(paths: Sequence[str | Path], kind: str = "dlib-chip", settings: DetectSettings = DEFAULT_DETECT,
                 cache: FaceCache | None = None, workers: int = 1,
                 progress: Callable[[int, int], None] | None = None, fallback: bool = True) -> Located:
    """The face of each of ``paths`` (``kind``: ``"dlib-chip"`` or ``"align"``), from ``cache``
    where it has the photo's bytes, else found in ``workers`` processes (and stored).
    ``progress(done, total)`` after each batch. Never prints; the summary says what happened."""
    t0 = time.perf_counter()
    n = len(paths)
    s = FaceSummary(photos=n, workers=max(1, int(workers)))
    what = f"{kind}|{settings.key()}"
    digests: list[str | None] = [None] * n
    payloads: list[dict | None] = [None] * n
    errors: dict[int, str] = {}
    done = 0

    def tick(k: int) -> None:
        nonlocal done
        done += k
        if progress:
            progress(done, n)

    todo = []
    for i, p in enumerate(paths):
        try:
            digests[i] = file_digest(Path(p).read_bytes())
        except OSError as e:
            errors[i] = f"image file {p} cannot be read ({e.strerror or e})"
            continue
        hit = cache.get(entry_key(digests[i], what)) if cache is not None else None
        if hit is not None and _valid(hit):
            payloads[i] = hit
            s.cached += 1
        else:
            todo.append(i)
    tick(n - len(todo))
    st = (settings.equalize, settings.cnn, settings.cnn_max_side)
    res = _run([(str(paths[i]), kind, st, None) for i in todo], s.workers, tick)
    s.detected = len(todo)
    for i, (face, size, err) in zip(todo, res):
        if err is not None:
            errors[i] = err
            continue
        payloads[i] = {"face": face, "size": size}
        if cache is not None:
            cache.put(entry_key(digests[i], what), payloads[i])

    faces: dict[int, FaceFind] = {}
    for i, pl in enumerate(payloads):
        if pl is not None and pl["face"] is not None:
            faces[i] = FaceFind.from_dict(pl["face"])
    prior = folder_prior([faces[i] for i in faces], [payloads[i]["size"] for i in faces])
    s.crop_folder, s.prior = prior is not None, prior
    missing = [i for i, pl in enumerate(payloads) if pl is not None and pl["face"] is None]
    if prior is not None and fallback and missing:
        fwhat = f"{what}|fallback {prior}|{FALLBACK_VERSION}"
        todo2 = []
        for i in missing:
            hit = cache.get(entry_key(digests[i], fwhat)) if cache is not None else None
            if hit is not None and _valid(hit):
                if hit["face"] is not None:
                    faces[i] = FaceFind.from_dict(hit["face"])
            else:
                todo2.append(i)
        res = _run([(str(paths[i]), kind, st, prior) for i in todo2], s.workers, None)
        for i, (face, size, err) in zip(todo2, res):
            if err is None and cache is not None:
                cache.put(entry_key(digests[i], fwhat), {"face": face, "size": size})
            if face is not None:
                faces[i] = FaceFind.from_dict(face)
    for i, pl in enumerate(payloads):
        if pl is not None and i not in faces:
            errors[i] = (f"image file {paths[i]}: no face found in a {pl['size'][0]}×{pl['size'][1]} image "
                         "(dlib HOG, equalized HOG and CNN detectors"
                         + (", crop fallback" if prior is not None and fallback else "") + ")")
    for f in faces.values():
        s.found[f.method] = s.found.get(f.method, 0) + 1
    bad = {i: e for i, e in errors.items() if payloads[i] is None}
    none = {i: e for i, e in errors.items() if payloads[i] is not None}
    s.unreadable, s.none = len(bad), len(none)
    s.seconds = time.perf_counter() - t0
    return Located(faces, none, s, bad)


def _valid(payload: Any) -> bool:
    try:
        if payload["face"] is not None:
            FaceFind.from_dict(payload["face"])
        return len(payload["size"]) == 2
    except (KeyError, TypeError, ValueError):
        return False
