"""The persistent face cache and the face search of issue 31 (device_sim.face_cache / face_locate).

Real photos (three Yale faces from ../shared, skipped where absent), real dlib detectors; the
detector calls are counted by wrapping ``align._find_face`` (workers=1: in this process)."""
from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from device_sim.face_cache import FaceCache, entry_key, file_digest
from device_sim.face_locate import CROP_AREA_SHARE, folder_prior, locate_faces
from fedfs_sdk.runtime import align
from fedfs_sdk.runtime.align import FaceFind, chip_available, cut, dlib_chip, fallback_locate
from fedfs_sdk.runtime.preprocess import load_image

from shared_assets import SHARED

YALE = SHARED / "data" / "yalefaces"
needs_faces = pytest.mark.skipif(not (YALE.is_dir() and chip_available()),
                                 reason="../shared/data/yalefaces or dlib (fedfs[faces]) not present")


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "photos" / "subject01"
    d.mkdir(parents=True)
    for f in sorted((YALE / "subject01").iterdir())[:3]:
        shutil.copy(f, d / f.name)
    return tmp_path / "photos"


@pytest.fixture()
def calls(monkeypatch) -> list[int]:
    n = [0]
    real = align._find_face

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(align, "_find_face", counted)
    return n


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*"))


@needs_faces
def test_second_run_detects_nothing_and_gives_the_same_chips(folder, calls, tmp_path):
    cache = FaceCache(tmp_path / "cache")
    first = locate_faces(_files(folder), "dlib-chip", cache=cache)
    assert calls[0] == 3 and first.summary.detected == 3 and len(first.faces) == 3
    again = locate_faces(_files(folder), "dlib-chip", cache=FaceCache(tmp_path / "cache"))
    assert calls[0] == 3 and again.summary.cached == 3 and again.summary.detected == 0
    for i, f in enumerate(_files(folder)):
        rgb = load_image(f)
        direct = dlib_chip(rgb, 150).image          # detect + chip in one go, as before issue 31
        assert np.array_equal(cut(rgb, again.faces[i], 150), direct)   # 5-point shapes are integers: exact


@needs_faces
def test_same_bytes_elsewhere_hit_changed_bytes_and_corrupt_entries_are_redone(folder, calls, tmp_path):
    cache_dir = tmp_path / "cache"
    locate_faces(_files(folder), "dlib-chip", cache=FaceCache(cache_dir))
    assert calls[0] == 3
    moved = tmp_path / "copy"
    shutil.copytree(folder, moved)                  # same bytes at other paths: hits
    locate_faces(_files(moved), "dlib-chip", cache=FaceCache(cache_dir))
    assert calls[0] == 3
    a, b, c = _files(moved)
    rgb = cv2.imread(str(a))
    cv2.imwrite(str(a.with_suffix(".png")), rgb)     # the same picture as other bytes: redone
    a.unlink()
    entry = FaceCache(cache_dir).path(entry_key(file_digest(b.read_bytes()), "dlib-chip|" + align.DEFAULT_DETECT.key()))
    assert entry.is_file()
    entry.write_bytes(entry.read_bytes()[:-20])     # a torn write: detected, redone
    fresh = FaceCache(cache_dir)
    got = locate_faces(_files(moved), "dlib-chip", cache=fresh)
    assert calls[0] == 5 and got.summary.detected == 2 and got.summary.cached == 1 and fresh.corrupt == 1
    assert len(got.faces) == 3
    assert FaceCache(cache_dir).get(entry_key(file_digest(b.read_bytes()),
                                              "dlib-chip|" + align.DEFAULT_DETECT.key())) is not None   # rewritten


def test_a_tampered_entry_is_refused(tmp_path):
    cache = FaceCache(tmp_path)
    cache.put("ab" * 32, {"face": None, "size": [10, 20]})
    assert FaceCache(tmp_path).get("ab" * 32) == {"face": None, "size": [10, 20]}
    p = cache.path("ab" * 32)
    p.write_text(p.read_text().replace("20", "21"))          # valid JSON, wrong checksum
    c = FaceCache(tmp_path)
    assert c.get("ab" * 32) is None and c.corrupt == 1
    p.write_bytes(b"\x00not json")
    assert c.get("ab" * 32) is None and c.corrupt == 2
    assert not list(tmp_path.glob("**/*.tmp"))               # no temporary file left behind


def test_folder_prior_recognises_a_folder_of_crops():
    def face(box):
        return FaceFind("dlib-chip", "dlib-hog", box, np.zeros((5, 2), np.float32))

    # 100×100 frames: boxes 60×60 (area 0.36 ≥ CROP_AREA_SHARE) → the median box as fractions
    crops = [face((20 + k, 25, 80 + k, 85)) for k in range(5)]
    assert folder_prior(crops, [(100, 100)] * 5) == [0.22, 0.25, 0.82, 0.85]
    # a 250×250 LFW-like frame with a 100×100 face: area 0.16 < 0.3 → not a folder of crops
    assert CROP_AREA_SHARE > 0.16
    assert folder_prior([face((75, 75, 175, 175))] * 5, [(250, 250)] * 5) is None
    assert folder_prior(crops[:4], [(100, 100)] * 4) is None    # too few faces to trust


@needs_faces
def test_the_crop_fallback_keeps_a_dark_tight_crop_and_refuses_a_blank(tmp_path):
    rgb = load_image(sorted((YALE / "subject02").iterdir())[0])
    face = align.locate(rgb)
    assert face is not None
    l, t, r, b = face.box
    crop = np.ascontiguousarray(rgb[max(0, t - 5):b + 5, max(0, l - 5):r + 5])
    h, w = crop.shape[:2]
    prior = (5 / w, 5 / h, 1 - 5 / w, 1 - 5 / h)
    dark = np.clip(crop.astype(np.float32) * 0.25, 0, 255).astype(np.uint8)
    found = fallback_locate(dark, prior)
    assert found is not None and found.method == "crop-fallback"
    # the eyes land inside the frame's upper half, the nose below them
    eyes_y, nose_y = found.points[:4, 1].mean(), found.points[4, 1]
    assert 0 < eyes_y < h * 0.6 and eyes_y < nose_y < h
    assert fallback_locate(np.full_like(crop, 90), prior) is None
    rng = np.random.default_rng(0)          # nearly black blanks are refused too (the histogram pass)
    assert fallback_locate(np.zeros_like(crop), prior) is None
    assert fallback_locate(rng.integers(0, 12, crop.shape).astype(np.uint8), prior) is None


LFW = SHARED / "data" / "lfw"


@pytest.mark.skipif(not (LFW.is_dir() and chip_available()), reason="needs ../shared/data/lfw and fedfs[faces]")
def test_the_crop_fallback_keeps_a_nearly_black_crop_clahe_cannot_lift():
    from benchmarks.make_hard_faces import hard

    # one of benchmarks/make_hard_faces.py's photos (grey levels 0–16): CLAHE's clip limit leaves
    # HOG nothing; the global histogram pass finds the face inside the folder's prior box
    src = LFW / "Arnold_Schwarzenegger" / "Arnold_Schwarzenegger_0003.jpg"
    rgb = load_image(src)
    l, t, r, b = align.locate(rgb, "dlib-chip", align.DetectSettings(equalize=False, cnn=False)).box
    m = int(0.1 * (r - l))
    l, t, r, b = max(0, l - m), max(0, t - m), min(rgb.shape[1], r + m), min(rgb.shape[0], b + m)
    img = hard(cv2.resize(rgb[t:b, l:r], (92, 112), interpolation=cv2.INTER_AREA), f"lfw/{src.parent.name}/{src.name}")
    assert img.max() <= 20
    found = fallback_locate(img, (0.11, 0.15, 0.96, 0.86))       # the generated folder's median box
    assert found is not None and found.method == "crop-fallback"
    eyes_y, nose_y = found.points[:4, 1].mean(), found.points[4, 1]
    assert 0 < eyes_y < nose_y < 112


@needs_faces
def test_worker_processes_find_what_one_process_finds(tmp_path):
    files = sorted((YALE / "subject03").iterdir())[:9]      # ≥ 8 photos: the process pool runs
    one = locate_faces(files, "dlib-chip", cache=FaceCache(tmp_path / "a"), workers=1)
    two = locate_faces(files, "dlib-chip", cache=FaceCache(tmp_path / "b"), workers=2)
    assert two.summary.workers == 2 and set(one.faces) == set(two.faces)
    for i, f in one.faces.items():
        assert f.method == two.faces[i].method and f.box == two.faces[i].box
        assert np.array_equal(f.points, two.faces[i].points)
    seen = []
    locate_faces(files, "dlib-chip", cache=FaceCache(tmp_path / "b"), workers=2, progress=lambda d, n: seen.append((d, n)))
    assert seen[-1] == (9, 9)


@needs_faces
def test_the_dataset_cuts_chips_from_the_cache_and_decodes_each_photo_once(folder, tmp_path):
    from device_sim.datasets import ImageFolderDataset

    (folder / "subject01" / "blank.png").write_bytes(cv2.imencode(".png", np.full((120, 100, 3), 90, np.uint8))[1])
    ds = ImageFolderDataset(folder, 150, detect_face="dlib-chip", validate=True, cache_bytes=1 << 26,
                            face_cache=FaceCache(tmp_path / "c"))
    s = ds.face_summary
    assert s.photos == 4 and s.none == 1 and abs(s.fta - 0.25) < 1e-12 and ds.identity_photos == {"subject01": 4}
    assert [x.path.name for x in ds.skipped_files] == ["blank.png"] and "no face found" in ds.skipped_files[0].reason
    decoded = ds.decoded
    u8 = ds.batch_uint8([0, 0, 0], [0, 1, 2], cache=False)    # the image store's request: handed over, not decoded
    assert ds.decoded == decoded
    for j, f in enumerate(ds.files[0]):
        direct = dlib_chip(load_image(f), 150).image
        assert np.array_equal(u8[j].permute(1, 2, 0).numpy(), direct)


def test_acquisition_counts_unacquired_probes_as_rejected_owners():
    from types import SimpleNamespace

    from device_sim.acquisition import acquisition, acquisition_line
    from device_sim.splits import UserSplit

    z = np.zeros(0, np.int64)
    splits = SimpleNamespace(clients=[UserSplit(0, z, z), UserSplit(1, z, z)])
    ds = SimpleNamespace(identity_names=lambda ids: [["a", "b"][i] for i in ids], count=lambda i: [8, 10][i])
    faces = {"identity_photos": {"a": 10, "b": 10}, "fta": 0.1}
    ev = {"clients": [0, 1], "verification": {"per_client_tar_at_far": {"0.001": [1.0, 0.5]}}}
    a = acquisition(faces, ev, ds, splits)
    # a: 2 of 10 photos lost → FTA 0.2, TAR 1.0 · 0.8; b: none lost, 0.5 · 1 → mean 0.65
    assert a["fta"] == 0.1 and a["fta_per_client"] == [0.2, 0.0] and abs(a["tar_all_at_far"]["0.001"] - 0.65) < 1e-12
    line = acquisition_line([{"label": "fedfs", "eval": {"acquisition": a}}])
    assert "10.0%" in line and "fedfs 0.6500" in line
