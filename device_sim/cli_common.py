"""Arguments and set-up shared by ``fedfs pretrain``, ``fedfs simulate`` and ``fedfs demo``:
the data (``synth`` or an ImageFolder path), its split, ξ, and progress bars."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfs_sdk.nn.backbones import BACKBONES, DEFAULTS, face_alignment
from fedfs_sdk.nn.builtin_models import BUILTIN_MODELS, FACES_INSTALL, builtin_name, default_real_face_model, load_builtin
from fedfs_sdk.cli.progress import progress_bar
from fedfs_sdk.errors import CheckpointError, InputError

from .datasets import IdentityDataset, ImageFolderDataset, SynthDataset
from .folder_split import plan_folder_split, unused_identities
from .image_store import DATA_CACHE_CHOICES
from .pretrain import PretrainConfig, load_xi, pretrain_cached
from .scenarios import SCENARIOS, apply_scenario, scenario_help
from .splits import FaceSplits, UserSplit, make_splits
from .capture_shifts import CAPTURE_SHIFTS, CaptureShiftDataset
from .synth_domains import DOMAINS
from .synthfaces import SynthFaces

SYNTH_UNIVERSE = 1_000_000
"""Identities of the synthetic universe the splits draw from."""

DEFAULT_IMAGE_SIZE = 32
DEFAULT_BACKBONE = "tiny"
"""``--image-size`` / ``--backbone`` when neither they nor a ξ say otherwise."""


def add_data_arguments(p: argparse.ArgumentParser, clients: int = 100, new_users: int = 20,
                       public: int = 300) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default="synth", help="'synth' (SynthFaces, generated) or an ImageFolder root "
                   "(root/<identity>/*.jpg|png|pgm, one client per identity)")
    g.add_argument("--image-size", type=int, default=None, help=f"input side in pixels (default {DEFAULT_IMAGE_SIZE}, "
                   "which suits the tiny backbone; a given ξ's own size: 150 for dlib-resnet)")
    g.add_argument("--difficulty", type=float, default=1.0, help="SynthFaces nuisance strength (0 clean … 1 default)")
    g.add_argument("--synth-seed", type=int, default=0, help="SynthFaces universe seed")
    g.add_argument("--clients", type=int, default=None, help=f"number of clients, one identity each (synth: "
                   f"{clients}; a folder: every identity that is not public / a new user — also --clients 0)")
    g.add_argument("--new-users", type=int, default=None, help="identities never in training (FedUV's third set; "
                   f"synth: {new_users}; a folder: 10%% of its identities)")
    g.add_argument("--public", type=int, default=None, help=f"public identities for pre-training ξ (synth: {public}; "
                   "a folder: 25%% of its identities, 0 with --pretrain-data)")
    g.add_argument("--train-per-client", type=int, default=None, help="local training images per client "
                   "(synth: 20; FedFS uses 57). A folder: 80/20 split of each identity unless given (0: 80/20)")
    g.add_argument("--test-per-client", type=int, default=None, help="held-out test images per client "
                   "(synth: 10; FedFS: 13; a folder: 80/20)")
    g.add_argument("--warmup-per-client", type=int, default=0,
                   help="fresh images per client / new user for FedUV's warm-up threshold, never trained on "
                        "(fixed train/test counts only). 0: the warm-up scores the training images, which a "
                        "personalized model has seen, so τ is optimistic and the warm-up TPR falls below q")
    g.add_argument("--public-images", type=int, default=20, help="images per public identity (synth)")
    g.add_argument("--split-seed", type=int, default=0, help="seed of the identity / image split")
    g.add_argument("--detect-face", action="store_true",
                   help="folders: align the largest face (dlib five-point, the 'faces' extra; Haar crop without it)")
    g.add_argument("--domain", default="none", help="SynthFaces look of the clients' images "
                   f"(synth data): one of {', '.join(DOMAINS)}")
    g.add_argument("--pretrain-data", default=None, help="where ξ is pre-trained when it differs from --data: "
                   "'synth' or an ImageFolder root (every identity public). Default: --data's public identities")
    g.add_argument("--pretrain-domain", default=None, help="SynthFaces look of ξ's images (default: --domain)")
    g.add_argument("--pretrain-difficulty", type=float, default=None,
                   help="SynthFaces nuisance strength of ξ's images (default: --difficulty)")
    g.add_argument("--pretrain-public", type=int, default=300,
                   help="public SynthFaces identities of ξ when --pretrain-data synth differs from --data")
    g.add_argument("--capture-shift", default="none", choices=sorted(CAPTURE_SHIFTS),
                   help="folders: capture conditions applied to the clients' and new users' photos (the phones'), "
                        "seeded by --split-seed (device_sim.capture_shifts); ξ's public identities stay as they are")
    g.add_argument("--scenario", default=None, choices=sorted(SCENARIOS),
                   help="a named setting of the options above: " + scenario_help())
    g.add_argument("--data-cache", default="auto", choices=DATA_CACHE_CHOICES,
                   help="where the clients' images are kept as uint8 once produced (rendered on the training "
                        "device / decoded once): 'device' (GPU memory), 'host' (RAM, page-locked on CUDA), 'none' "
                        "(produce every chunk's images again); auto: device if ≤ 25%% of the free GPU memory, else "
                        "host if ≤ 50%% of the available RAM, else none (N·n·3·S² bytes: 25.2 GB for 10,000 × 67 "
                        "images at 112 px; docs/simulation.md)")
    p.set_defaults(synth_defaults={"clients": clients, "new_users": new_users, "public": public,
                                   "train_per_client": 20, "test_per_client": 10})


def apply_synth_defaults(args: argparse.Namespace) -> None:
    """Fill the split sizes left unset with SynthFaces' defaults (``--data synth`` only: a
    folder's defaults depend on the folder, :mod:`device_sim.folder_split`)."""
    defaults = getattr(args, "synth_defaults", None) or {"clients": 100, "new_users": 20, "public": 300,
                                                          "train_per_client": 20, "test_per_client": 10}
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def build_data(args: argparse.Namespace) -> tuple[IdentityDataset, FaceSplits]:
    """The clients' dataset and the public / client / new-user split the arguments describe
    (``--scenario`` applied first). For a folder the split sizes adapt to it
    (:func:`~device_sim.folder_split.plan_folder_split`); what was chosen and every file,
    folder and identity left out are in ``splits.meta["plan"]`` / ``["skipped"]``."""
    apply_scenario(args)
    real_face_notes = apply_real_face_default(args)
    if args.data == "synth":
        if (getattr(args, "capture_shift", "none") or "none") != "none":
            raise InputError("--capture-shift applies to a folder of real photos (--data PATH); "
                             "SynthFaces renders its looks itself: use --domain")
        apply_synth_defaults(args)
        ds = _synth_dataset(args, args.domain, args.difficulty)
        splits = make_splits(SYNTH_UNIVERSE, args.public, args.clients, args.new_users,
                             args.train_per_client, args.test_per_client, seed=args.split_seed,
                             public_images=args.public_images,
                             warmup_per_user=args.warmup_per_client)
        return ds, splits
    root = Path(args.data)
    if not root.is_dir():
        raise InputError(f"--data must be 'synth' or an ImageFolder directory; {root} is not a directory")
    ds = ImageFolderDataset(root, args.image_size, detect_face=args.detect_face, validate=True, cache_bytes=1 << 30)
    counts = ds.counts
    src = args.pretrain_data
    # a built-in ξ was trained elsewhere, but the folder still keeps its public identities: they are the
    # public impostor set that ships with the model (the do-no-harm check, enroll --far)
    pretrain_here = not src or (src != "synth" and Path(src) == root)
    plan = plan_folder_split(counts, args, pretrain_here)
    plan.notes[:0] = real_face_notes
    splits = make_splits(ds, plan.public, plan.clients, plan.new_users, plan.train, plan.test,
                         seed=args.split_seed, public_images=None, warmup_per_user=args.warmup_per_client or 0)
    skipped = ds.skip_summary()
    skipped["identities"] += [s.to_dict() for s in unused_identities(ds.names, counts, splits, plan.per_user)]
    splits.meta.update({"plan": plan.notes, "skipped": skipped})
    shift = getattr(args, "capture_shift", "none") or "none"
    if shift != "none":
        phones = np.r_[splits.identities("clients"), splits.identities("new_users")]
        ds = CaptureShiftDataset(ds, shift, args.split_seed, phones, cache_bytes=1 << 30)
        splits.meta["plan"] = list(splits.meta["plan"]) + [
            f"capture shift '{shift}' on the {phones.size} clients' and new users' photos (seed {args.split_seed}); "
            f"the {len(splits.public)} public identities' photos as they are"]
    return ds, splits


def apply_real_face_default(args: argparse.Namespace) -> list[str]:
    """The ξ of a real-photo run and the input it dictates; returns lines for the notes.

    ``fedfs simulate --data DIR`` with no ξ asked for (no ``--pretrained``, ``--pretrain-data``,
    ``--scenario``, ``--backbone``, ``--width``, ``--embedding-dim``) takes the built-in real face
    recognizer (:func:`fedfs_sdk.nn.builtin_models.default_real_face_model`: ``dlib-resnet`` with
    the ``faces`` extra) as ξ and ϕ's start; without the extra it pre-trains ξ on the folder's
    public identities as before and says, in one line, what to install. A built-in ξ (also when
    named, ``--pretrained dlib-resnet``) fixes the input: its size (150) and its face crop
    (dlib's chip); the folder's public identities are trained on by nobody — they are the public
    impostor set (do-no-harm check, ``enroll --far``). ``--scenario real-phone`` / ``real-night``
    (capture shifts of the folder's own photos) count as "no ξ asked for". Unset
    ``--image-size`` / ``--backbone`` then get their defaults."""
    notes: list[str] = []
    asked = [getattr(args, k, None) for k in ("pretrained", "pretrain_data", "backbone", "width", "embedding_dim")]
    asked.append(getattr(args, "scenario", None) not in (None, "real-phone", "real-night"))
    if hasattr(args, "pretrained") and args.data != "synth" and not any(asked):
        name = default_real_face_model()
        if name is None:
            notes.append(f"ξ: pre-trained on the folder's public identities; for a real face recognizer as ξ "
                         f"(dlib-resnet): {FACES_INSTALL}")
        else:
            args.pretrained = name
    pretrained = getattr(args, "pretrained", None)
    name = builtin_name(pretrained)
    if name is not None:
        backbone = BUILTIN_MODELS[name].backbone
        size = int(DEFAULTS[backbone]["input_size"])
        if args.image_size not in (None, size):
            raise InputError(f"--pretrained {name} takes {size} px inputs; drop --image-size {args.image_size}")
        args.image_size = size
        args.detect_face = face_alignment(backbone) or args.detect_face
        notes.append(f"ξ: the built-in {name} ({BUILTIN_MODELS[name].description}; {args.detect_face} "
                     f"preprocessing); the folder's public identities are not trained on: they are the public impostor set")
    elif pretrained and Path(pretrained).is_file():
        # a ξ checkpoint of a backbone trained on one face crop (an imported dlib-resnet) gets that crop
        from fedfs_sdk.nn.checkpoint import read_checkpoint

        _, cfg, _ = read_checkpoint(pretrained)
        if face_alignment(cfg.backbone):
            args.detect_face = face_alignment(cfg.backbone)
            if args.image_size is None:
                args.image_size = int(cfg.resolved().input_size)
    if args.image_size is None:
        args.image_size = DEFAULT_IMAGE_SIZE
    return notes


def skipped_lines(skipped: dict[str, list[dict[str, str]]], limit: int = 20, where: str = "") -> list[str]:
    """The CLI's summary of what a folder dataset left out: one line per kind, then each
    item with its reason (``limit`` per kind; the rest are in results.json). ``where`` names
    the source when it is not ``--data`` (e.g. ``"--pretrain-data DIR"``)."""
    lines: list[str] = []
    of = f" in {where}" if where else ""
    for kind, what in (("files", "unreadable image file(s)"), ("ignored", "file(s)/folder(s) not read"),
                       ("identities", "identity folder(s) not used")):
        items = skipped.get(kind) or []
        if not items:
            continue
        lines.append(f"skipped {len(items)} {what}{of}:")
        for it in items[:limit]:
            lines.append(f"  {it.get('path') or it.get('identity')}: {it['reason']}")
        if len(items) > limit:
            lines.append(f"  … and {len(items) - limit} more (all listed in results.json)")
    return lines


def _synth_dataset(args: argparse.Namespace, domain: str | None, difficulty: float) -> SynthDataset:
    per = (args.train_per_client or 0) + (args.test_per_client or 0) + (args.warmup_per_client or 0)
    faces = SynthFaces(args.synth_seed, args.image_size, difficulty, domain=domain)
    return SynthDataset(faces, images_per_identity=max(per, args.public_images), num_identities=SYNTH_UNIVERSE,
                        cache_bytes=1 << 30)


def _all_public(ds: IdentityDataset) -> FaceSplits:
    """Every identity of ``ds`` public, with all its images (ξ's own pre-training folder)."""
    counts = [ds.count(i) for i in range(ds.num_identities)]
    public = [UserSplit(i, np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)) for i, n in enumerate(counts) if n]
    return FaceSplits(public=public, clients=[], new_users=[], seed=0, meta={"mode": "all-public"})


def build_pretrain_data(args: argparse.Namespace, ds: IdentityDataset,
                        splits: FaceSplits) -> tuple[IdentityDataset, FaceSplits]:
    """ξ's dataset and the split whose ``public`` group it trains on.

    * no ``--pretrain-data`` (or the same source) and the same look: the clients' dataset
      and its public identities;
    * ``synth`` clients with another ``--pretrain-domain`` / ``--pretrain-difficulty``: the
      same public identities rendered in ξ's look (one universe, so ξ never sees a client);
    * ``synth`` ξ for folder clients: ``--pretrain-public`` SynthFaces identities;
    * a folder: every identity of that folder.
    """
    src = args.pretrain_data or args.data
    dom = args.pretrain_domain or args.domain
    diff = args.pretrain_difficulty if args.pretrain_difficulty is not None else args.difficulty
    if src == "synth" and args.data == "synth":
        if dom == args.domain and diff == args.difficulty:
            return ds, splits
        return _synth_dataset(args, dom, diff), splits
    if src == "synth":
        pub = make_splits(SYNTH_UNIVERSE, args.pretrain_public, 1, 0, args.public_images, 1,
                          seed=args.split_seed, public_images=args.public_images)
        return _synth_dataset(args, dom, diff), FaceSplits(pub.public, [], [], pub.seed, {"mode": "synth-public"})
    if args.data != "synth" and Path(src) == Path(args.data):
        return ds, splits
    root = Path(src)
    if not root.is_dir():
        raise InputError(f"--pretrain-data must be 'synth' or an ImageFolder directory; {root} is not a directory")
    src_ds = ImageFolderDataset(root, args.image_size, detect_face=args.detect_face, validate=True,
                                cache_bytes=1 << 30)
    pub = _all_public(src_ds)
    pub.meta["skipped"] = src_ds.skip_summary()
    return src_ds, pub


def public_impostor_images(args: argparse.Namespace, ds: IdentityDataset, splits: FaceSplits,
                           limit: int = 1000) -> torch.Tensor:
    """The public impostor set a simulated device ships with: up to ``limit`` photos (a seeded
    sample, ``--split-seed``) of ξ's public identities as ξ saw them (:func:`build_pretrain_data`:
    ``--pretrain-data``'s look; a folder's public identities without any capture shift). Never a
    client's or new user's photo. Empty when there are no public identities."""
    src_ds, src_splits = build_pretrain_data(args, ds, splits)
    ids, idx, _ = src_splits.pairs("public", "train")
    if ids.size > limit:
        keep = np.sort(np.random.default_rng([args.split_seed, 0x1A90]).choice(ids.size, limit, replace=False))
        ids, idx = ids[keep], idx[keep]
    if ids.size == 0:
        return torch.zeros(0, 3, ds.image_size, ds.image_size)
    if isinstance(src_ds, CaptureShiftDataset) and src_ds.shifted[ids].any():
        raise InputError("the public impostor set would hold a phone's photos")    # a split bug: never ship them
    return src_ds.batch(ids, idx)


def add_pretrain_arguments(p: argparse.ArgumentParser, epochs: int = 10) -> None:
    g = p.add_argument_group("pre-training of ξ")
    g.add_argument("--backbone", default=None, choices=sorted(BACKBONES),
                   help=f"backbone of a ξ pre-trained here and of the federated models (default {DEFAULT_BACKBONE}; "
                        "a real-photo folder with no ξ asked for uses the built-in dlib-resnet where installed)")
    g.add_argument("--width", type=int, default=None, help="backbone width multiplier (tiny, feduv_cnn)")
    g.add_argument("--embedding-dim", type=int, default=None, help="embedding size (backbone default)")
    g.add_argument("--margin-loss", default="cosface", choices=["cosface", "arcface"], help="pre-training loss of ξ")
    g.add_argument("--margin", type=float, default=None, help="CosFace m (default 0.2) / ArcFace angle (0.5)")
    g.add_argument("--scale", type=float, default=16.0, help="logit scale s")
    g.add_argument("--pretrain-epochs", type=int, default=epochs, help="epochs over the public identities")
    g.add_argument("--pretrain-optimizer", default="adamw", choices=["adamw", "sgd"], help="optimizer of ξ")
    g.add_argument("--pretrain-lr", type=float, default=5e-3, help="learning rate of ξ")
    g.add_argument("--pretrain-batch-size", type=int, default=128, help="batch size of ξ")
    g.add_argument("--cache-dir", default=None, help="ξ cache (default $FEDFS_CACHE_DIR/pretrained or ~/.cache/fedfs/pretrained)")


def pretrain_config(args: argparse.Namespace) -> PretrainConfig:
    margin = args.margin if args.margin is not None else (0.2 if args.margin_loss == "cosface" else 0.5)
    return PretrainConfig(backbone=args.backbone or DEFAULT_BACKBONE, width=args.width, embedding_dim=args.embedding_dim,
                          loss=args.margin_loss, scale=args.scale, margin=margin, epochs=args.pretrain_epochs, optimizer=args.pretrain_optimizer,
                          batch_size=args.pretrain_batch_size, lr=args.pretrain_lr, seed=args.split_seed)


def run_pretrain(args: argparse.Namespace, ds: IdentityDataset, splits: FaceSplits, out: str | None = None,
                 force: bool = False, quiet: bool = False):
    """Pre-train ξ on the split's public identities (cached) with a progress bar."""
    ids, idx, labels = splits.pairs("public", "train")
    if ids.size == 0:
        raise InputError("no public identities to pre-train ξ on: set --public N (≥ 2), or --pretrain-data "
                         "synth|PATH, or --pretrained CKPT")
    with progress_bar("pre-training ξ", unit="step", disable=quiet) as bar:
        def cb(step: int, total: int, m: dict[str, float]) -> None:
            bar.total = total
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.2f}")
        res = pretrain_cached(ds, ids, idx, labels, pretrain_config(args), device=args.device,
                              cache_dir=args.cache_dir, out=out, force=force, progress=cb)
    return res


def check_xi_disjoint(xi_meta: dict[str, Any], splits: FaceSplits, dataset: IdentityDataset) -> None:
    """Refuse a ξ pre-trained on identities that are clients or new users here.

    Compares identity *names* (``public_identity_names`` in ξ's metadata against the folder
    names / ``synthfaces-<seed>/<index>`` of this split's clients and new users), so a
    folder added or removed since pre-training — which shifts every position — neither
    hides an overlap nor invents one. A ξ written before names were recorded has only the
    positions (``public_identities``): those are compared as before, which is exact for
    SynthFaces and for an unchanged folder (re-running ``fedfs pretrain`` records names).
    A ξ with neither (not from ``fedfs pretrain``) is not checked.
    """
    users = np.r_[splits.identities("clients"), splits.identities("new_users")]
    names = xi_meta.get("public_identity_names")
    if names is not None:
        overlap = sorted(set(map(str, names)) & set(dataset.identity_names(users)))
        if overlap:
            raise CheckpointError(f"ξ was pre-trained on {len(overlap)} identities that are clients/new users in "
                                  f"this split (e.g. {overlap[:3]}); pre-train on this split's public identities")
        return
    public = xi_meta.get("public_identities")
    if public is None:
        return
    overlap_pos = np.intersect1d(np.asarray(public), users)
    if overlap_pos.size:
        raise CheckpointError(f"ξ was pre-trained on {overlap_pos.size} identities that are clients/new users in "
                              f"this split (dataset positions, e.g. {overlap_pos[:3].tolist()}; this ξ predates "
                              f"identity names); pre-train on this split's public identities")


def resolve_xi(args: argparse.Namespace, ds: IdentityDataset, splits: FaceSplits, quiet: bool = False):
    """ξ from ``--pretrained`` or pre-trained (cached) on the public identities of
    :func:`build_pretrain_data` (``--pretrain-data``, ``--pretrain-domain``)."""
    name = builtin_name(getattr(args, "pretrained", None))
    if name is not None:
        xi, meta = load_builtin(name)
        return xi.requires_grad_(False), {"path": f"builtin:{name}", "builtin": name, "cached": True, "stats": {},
                                          "model_id": meta["model_id"], "source_sha256": meta["source_sha256"]}
    if getattr(args, "pretrained", None):
        from fedfs_sdk.nn.checkpoint import read_checkpoint
        _, _, meta = read_checkpoint(args.pretrained)
        check_xi_disjoint(meta, splits, ds)
        xi = load_xi(args.pretrained)
        if xi.input_size != ds.image_size:
            raise InputError(f"ξ expects {xi.input_size}px inputs but --image-size is {ds.image_size}")
        return xi, {"path": str(args.pretrained), "cached": True, "stats": meta.get("stats", {})}
    src_ds, src_splits = build_pretrain_data(args, ds, splits)
    res = run_pretrain(args, src_ds, src_splits, quiet=quiet)
    info = {"path": str(res.path), "cached": res.cached, "stats": res.stats}
    if src_ds is not ds and src_splits.meta.get("skipped"):
        info["skipped"] = src_splits.meta["skipped"]      # what ξ's own folder left out
    return res.model, info


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def setup_device(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda was requested but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)


__all__ = ["public_impostor_images", "add_data_arguments", "apply_synth_defaults", "skipped_lines", "build_data", "add_pretrain_arguments", "pretrain_config", "run_pretrain",
           "resolve_xi", "check_xi_disjoint", "build_pretrain_data", "add_device_argument", "setup_device", "progress_bar", "SYNTH_UNIVERSE"]
