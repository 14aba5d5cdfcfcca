"""SynthDataset, ImageFolderDataset (on generated files) and the papers' splits."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from device_sim.datasets import IdentityDataset, ImageFolderDataset, SynthDataset
from device_sim.splits import FaceSplits, make_splits
from device_sim.synthfaces import SynthFaces, write_image_folder
from fedfs_sdk.errors import ImageDecodeError, ImageNotFoundError, InputError


@pytest.fixture(scope="module")
def faces() -> SynthFaces:
    return SynthFaces(seed=5, image_size=32, num_threads=1)


@pytest.fixture()
def folder(tmp_path: Path, faces: SynthFaces) -> Path:
    """3 identities × 4 PNGs, one corrupt JPEG in identity 1, one empty identity folder, a
    grayscale PGM and a stray non-image file."""
    root = write_image_folder(faces, tmp_path / "ds", [10, 11, 12], 4)
    (root / "000011" / "9999.jpg").write_bytes(b"not a jpeg at all")
    (root / "000013_empty").mkdir()
    (root / "000012" / "notes.txt").write_text("ignored")
    gray = cv2.cvtColor(faces.render_uint8(12, 7)[0], cv2.COLOR_RGB2GRAY)
    cv2.imwrite(str(root / "000012" / "0007.pgm"), gray)
    return root


def test_synth_dataset_protocol_and_cache(faces: SynthFaces) -> None:
    ds = SynthDataset(faces, images_per_identity=10, num_identities=50)
    assert isinstance(ds, IdentityDataset)
    x = ds.batch([1, 2, 1], [0, 3, 0])
    assert x.shape == (3, 3, 32, 32)
    assert torch.equal(x, faces.render([1, 2, 1], [0, 3, 0]))
    assert torch.equal(ds.images(2, [3]), x[1:2])
    assert ds.cache.hits >= 1 and len(ds.cache) == 2
    with pytest.raises(InputError, match="index out of range"):
        ds.batch(1, 10)
    with pytest.raises(InputError, match="identity out of range"):
        ds.batch(50, 0)


def test_synth_dataset_cache_is_bounded(faces: SynthFaces) -> None:
    ds = SynthDataset(faces, images_per_identity=10, num_identities=50, cache_bytes=3 * 32 * 32 * 3)
    ds.batch(np.arange(10), 0)
    assert len(ds.cache) == 3 and ds.cache.nbytes <= 3 * 32 * 32 * 3
    off = SynthDataset(faces, images_per_identity=10, num_identities=50, cache_bytes=0)
    off.batch([0, 1], 0)
    assert len(off.cache) == 0


def test_image_folder_lazy(folder: Path, faces: SynthFaces) -> None:
    ds = ImageFolderDataset(folder, 32)
    assert isinstance(ds, IdentityDataset)
    assert ds.num_identities == 3 and ds.names == ["000010", "000011", "000012"]
    assert [p.name for p in ds.empty_folders] == ["000013_empty"]
    assert ds.count(1) == 5 and ds.count(2) == 5          # corrupt jpg and pgm are listed
    # PNG round trip reproduces the renderer exactly
    assert torch.equal(ds.batch([0, 2], [3, 1]), faces.render([10, 12], [3, 1]))
    # the PGM is grayscale → 3 equal channels
    g = ds.images(2, [4])[0]
    assert torch.equal(g[0], g[1]) and torch.equal(g[1], g[2])
    with pytest.raises(ImageDecodeError, match="9999.jpg"):
        ds.batch(1, 4)
    with pytest.raises(InputError, match="out of range"):
        ds.batch(0, 4)


def test_image_folder_validate_skips_with_count(folder: Path) -> None:
    ds = ImageFolderDataset(folder, 32, validate=True)
    assert ds.count(1) == 4
    assert len(ds.skipped_files) == 1 and ds.skipped_files[0].path.name == "9999.jpg"
    pre = ImageFolderDataset(folder, 32, preload=True)
    assert torch.equal(pre.batch([0, 1, 2], [0, 3, 4]), ds.batch([0, 1, 2], [0, 3, 4]))


def test_image_folder_resizes(folder: Path) -> None:
    ds = ImageFolderDataset(folder, 16)
    assert ds.batch(0, [0, 1]).shape == (2, 3, 16, 16)


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFoundError):
        ImageFolderDataset(tmp_path / "missing", 32)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(InputError, match="no identity folders.*2 empty"):
        ImageFolderDataset(tmp_path, 32)


def test_splits_synthetic_universe() -> None:
    s = make_splits(10_000, num_public=50, num_clients=20, num_new=5, train_per_client=57, test_per_client=13, seed=1)
    assert len(s.public) == 50 and s.num_clients == 20 and len(s.new_users) == 5
    s.check_disjoint()
    c = s.clients[0]
    assert np.array_equal(c.train, np.arange(57)) and np.array_equal(c.test, np.arange(57, 70))
    assert all(len(p.train) == 70 for p in s.public)
    ids, idx, owner = s.pairs("clients", "test")
    assert ids.size == 20 * 13 and set(owner.tolist()) == set(range(20))
    assert s == s  # dataclass equality is cheap to call; JSON round trip preserves content
    t = FaceSplits.from_json(s.to_json())
    assert [u.identity for u in t.clients] == [u.identity for u in s.clients]
    assert np.array_equal(t.new_users[2].test, s.new_users[2].test)
    # deterministic in the seed, different across seeds
    assert make_splits(10_000, 50, 20, 5, seed=1).identities("clients").tolist() == s.identities("clients").tolist()
    assert make_splits(10_000, 50, 20, 5, seed=2).identities("clients").tolist() != s.identities("clients").tolist()


def test_splits_errors() -> None:
    with pytest.raises(InputError, match="need 30 identities"):
        make_splits(20, num_public=10, num_clients=15, num_new=5)
    with pytest.raises(InputError, match="fraction"):
        make_splits(100, 10, 10, 0, None, None)


def test_splits_image_folder_80_20(tmp_path: Path, faces: SynthFaces) -> None:
    root = tmp_path / "r"
    write_image_folder(faces, root, [0, 1, 2], 10)
    write_image_folder(faces, root, [3], 1)                # a 1-image identity: public only
    ds = ImageFolderDataset(root, 32)
    s = make_splits(ds, num_public=1, num_clients=2, num_new=1, train_per_client=None, test_per_client=None, seed=0)
    assert s.identities("public").tolist() == [3]
    for u in s.clients + s.new_users:
        assert len(u.train) == 8 and len(u.test) == 2
        assert np.intersect1d(u.train, u.test).size == 0
    # fixed counts need enough images per user
    with pytest.raises(InputError, match="≥ 57\\+13"):
        make_splits(ds, 1, 2, 1, 57, 13)


def test_splits_warmup_images_are_fresh() -> None:
    s = make_splits(1000, 5, 4, 2, train_per_client=8, test_per_client=3, warmup_per_user=10, seed=0)
    c = s.clients[1]
    assert np.array_equal(c.warmup, np.arange(11, 21)) and np.array_equal(c.warmup_or_train, c.warmup)
    assert all(len(p.train) == 11 for p in s.public)
    ids, idx, _ = s.pairs("new_users", "warmup")
    assert idx.size == 20 and idx.min() == 11
    assert np.array_equal(make_splits(1000, 5, 4, 2, 8, 3).clients[0].warmup_or_train, np.arange(8))
    assert FaceSplits.from_json(s.to_json()).clients[1].warmup.tolist() == c.warmup.tolist()
    with pytest.raises(InputError, match="warmup_per_user"):
        make_splits(1000, 5, 4, 2, None, None, warmup_per_user=3)
