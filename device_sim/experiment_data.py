"""The data an :class:`~device_sim.experiment.ExperimentConfig` describes: the clients'
dataset and its public / client / new-user split, ξ's pre-training data, and the public
impostor set a simulated device ships with."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .capture_shifts import CaptureShiftDataset
from .datasets import IdentityDataset, ImageFolderDataset, SynthDataset
from .experiment import DataConfig, ExperimentConfig
from .face_cache import FaceCache, default_face_cache_dir
from .folder_split import plan_folder_split, unused_identities
from .splits import FaceSplits, UserSplit, make_splits
from .synthfaces import SynthFaces

SYNTH_UNIVERSE = 1_000_000
"""Identities of the synthetic universe the splits draw from."""


def face_options(cfg: ExperimentConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """How a folder's faces are found for ``cfg``: the face cache under the run cache directory
    and ``--face-workers`` processes (default: the machine's cores)."""
    n = cfg.runtime.face_workers
    if n is not None and n < 1:
        raise InputError(f"--face-workers must be ≥ 1, got {n}")
    return {"face_cache": FaceCache(default_face_cache_dir(cfg.xi.cache_dir)),
            "face_workers": n or os.cpu_count() or 1, "face_progress": progress}


def build_data(cfg: ExperimentConfig,
               face_progress: Callable[[int, int], None] | None = None) -> tuple[IdentityDataset, FaceSplits]:
    """The clients' dataset and the public / client / new-user split of a resolved config
    (:func:`device_sim.experiment_resolve.resolve_experiment`: scenario and defaults applied).
    For a folder the split sizes adapt to it (:func:`~device_sim.folder_split.plan_folder_split`);
    what was chosen and every file, folder and identity left out are in ``splits.meta["plan"]``
    / ``["skipped"]``; how the faces were found in ``splits.meta["faces"]``
    (``face_progress(done, total)`` while they are)."""
    cfg.require_resolved("build_data")
    d = cfg.data
    if d.data == "synth":
        ds = _synth_dataset(d, d.domain, d.difficulty)
        splits = make_splits(SYNTH_UNIVERSE, d.public, d.clients, d.new_users, d.train_per_client,
                             d.test_per_client, seed=d.split_seed, public_images=d.public_images,
                             warmup_per_user=d.warmup_per_client)
        return ds, splits
    root = Path(d.data)
    if not root.is_dir():
        raise InputError(f"--data must be 'synth' or an ImageFolder directory; {root} is not a directory")
    ds = ImageFolderDataset(root, d.image_size, detect_face=d.detect_face, validate=True, cache_bytes=1 << 30,
                            **face_options(cfg, face_progress))
    counts = ds.counts
    src = d.pretrain_data
    # a built-in ξ was trained elsewhere, but the folder still keeps its public identities: they are the
    # public impostor set that ships with the model (the do-no-harm check, enroll --far)
    pretrain_here = not src or (src != "synth" and Path(src) == root)
    plan = plan_folder_split(counts, d, pretrain_here)
    plan.notes[:0] = cfg.notes
    splits = make_splits(ds, plan.public, plan.clients, plan.new_users, plan.train, plan.test,
                         seed=d.split_seed, public_images=None, warmup_per_user=d.warmup_per_client or 0)
    skipped = ds.skip_summary()
    skipped["identities"] += [s.to_dict() for s in unused_identities(ds.names, counts, splits, plan.per_user)]
    splits.meta.update({"plan": plan.notes, "skipped": skipped})
    if ds.face_summary is not None:
        splits.meta["faces"] = {**ds.face_summary.to_dict(), "identity_photos": ds.identity_photos}
    shift = d.capture_shift or "none"
    if shift != "none":
        phones = np.r_[splits.identities("clients"), splits.identities("new_users")]
        ds = CaptureShiftDataset(ds, shift, d.split_seed, phones, cache_bytes=1 << 30)
        splits.meta["plan"] = list(splits.meta["plan"]) + [
            f"capture shift '{shift}' on the {phones.size} clients' and new users' photos (seed {d.split_seed}); "
            f"the {len(splits.public)} public identities' photos as they are"]
    return ds, splits


def _synth_dataset(d: DataConfig, domain: str | None, difficulty: float) -> SynthDataset:
    per = (d.train_per_client or 0) + (d.test_per_client or 0) + (d.warmup_per_client or 0)
    faces = SynthFaces(d.synth_seed, d.image_size, difficulty, domain=domain)
    return SynthDataset(faces, images_per_identity=max(per, d.public_images), num_identities=SYNTH_UNIVERSE,
                        cache_bytes=1 << 30)


def _all_public(ds: IdentityDataset) -> FaceSplits:
    """Every identity of ``ds`` public, with all its images (ξ's own pre-training folder)."""
    counts = [ds.count(i) for i in range(ds.num_identities)]
    public = [UserSplit(i, np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)) for i, n in enumerate(counts) if n]
    return FaceSplits(public=public, clients=[], new_users=[], seed=0, meta={"mode": "all-public"})


def build_pretrain_data(cfg: ExperimentConfig, ds: IdentityDataset,
                        splits: FaceSplits) -> tuple[IdentityDataset, FaceSplits]:
    """ξ's dataset and the split whose ``public`` group it trains on.

    * no ``--pretrain-data`` (or the same source) and the same look: the clients' dataset
      and its public identities;
    * ``synth`` clients with another ``--pretrain-domain`` / ``--pretrain-difficulty``: the
      same public identities rendered in ξ's look (one universe, so ξ never sees a client);
    * ``synth`` ξ for folder clients: ``--pretrain-public`` SynthFaces identities;
    * a folder: every identity of that folder.
    """
    d = cfg.data
    src = d.pretrain_data or d.data
    dom = d.pretrain_domain or d.domain
    diff = d.pretrain_difficulty if d.pretrain_difficulty is not None else d.difficulty
    if src == "synth" and d.data == "synth":
        if dom == d.domain and diff == d.difficulty:
            return ds, splits
        return _synth_dataset(d, dom, diff), splits
    if src == "synth":
        pub = make_splits(SYNTH_UNIVERSE, d.pretrain_public, 1, 0, d.public_images, 1,
                          seed=d.split_seed, public_images=d.public_images)
        return _synth_dataset(d, dom, diff), FaceSplits(pub.public, [], [], pub.seed, {"mode": "synth-public"})
    if d.data != "synth" and Path(src) == Path(d.data):
        return ds, splits
    root = Path(src)
    if not root.is_dir():
        raise InputError(f"--pretrain-data must be 'synth' or an ImageFolder directory; {root} is not a directory")
    src_ds = ImageFolderDataset(root, d.image_size, detect_face=d.detect_face, validate=True,
                                cache_bytes=1 << 30, **face_options(cfg))
    pub = _all_public(src_ds)
    pub.meta["skipped"] = src_ds.skip_summary()
    return src_ds, pub


def public_impostor_images(cfg: ExperimentConfig, ds: IdentityDataset, splits: FaceSplits,
                           limit: int = 1000) -> torch.Tensor:
    """The public impostor set a simulated device ships with: up to ``limit`` photos (a seeded
    sample, ``--split-seed``) of ξ's public identities as ξ saw them (:func:`build_pretrain_data`:
    ``--pretrain-data``'s look; a folder's public identities without any capture shift). Never a
    client's or new user's photo. Empty when there are no public identities."""
    src_ds, src_splits = build_pretrain_data(cfg, ds, splits)
    ids, idx, _ = src_splits.pairs("public", "train")
    if ids.size > limit:
        keep = np.sort(np.random.default_rng([cfg.data.split_seed, 0x1A90]).choice(ids.size, limit, replace=False))
        ids, idx = ids[keep], idx[keep]
    if ids.size == 0:
        return torch.zeros(0, 3, ds.image_size, ds.image_size)
    if isinstance(src_ds, CaptureShiftDataset) and src_ds.shifted[ids].any():
        raise InputError("the public impostor set would hold a phone's photos")    # a split bug: never ship them
    return src_ds.batch(ids, idx)


__all__ = ["build_data", "build_pretrain_data", "public_impostor_images", "SYNTH_UNIVERSE"]
