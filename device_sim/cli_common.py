"""Arguments shared by ``fedfs pretrain``, ``fedfs simulate`` and ``fedfs demo`` (the data,
its split, ξ, the device) and the CLI's device set-up and summaries.

The parsed :class:`argparse.Namespace` goes no further than a command's ``run``: it becomes a
resolved :class:`~device_sim.experiment.ExperimentConfig` there
(:func:`~device_sim.experiment_resolve.experiment_from_args`), which the data
(:mod:`device_sim.experiment_data`) and ξ (:mod:`device_sim.xi_source`) builders take."""
from __future__ import annotations

import argparse

import torch

from fedfs_sdk.cli.progress import progress_bar
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.backbones import BACKBONES

from .capture_shifts import CAPTURE_SHIFTS
from .experiment import SYNTH_DEFAULTS, RuntimeConfig
from .experiment_data import SYNTH_UNIVERSE, build_data, build_pretrain_data, public_impostor_images
from .experiment_resolve import DEFAULT_BACKBONE, DEFAULT_IMAGE_SIZE, experiment_from_args
from .image_store import DATA_CACHE_CHOICES
from .scenarios import SCENARIOS, scenario_help
from .synth_domains import DOMAINS
from .xi_source import check_xi_disjoint, pretrain_config, resolve_xi, run_pretrain


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
    g.add_argument("--face-workers", type=int, default=None,
                   help="processes that find the faces of a folder's photos (default: the machine's cores); each "
                        "photo's face is kept in the face cache ($FEDFS_CACHE_DIR/faces, or --cache-dir/faces), "
                        "keyed by its bytes, so a second run detects nothing (docs/real-faces.md)")
    g.add_argument("--data-cache", default="auto", choices=DATA_CACHE_CHOICES,
                   help="where the clients' images are kept as uint8 once produced (rendered on the training "
                        "device / decoded once): 'device' (GPU memory), 'host' (RAM, page-locked on CUDA), 'none' "
                        "(produce every chunk's images again); auto: device if ≤ 25%% of the free GPU memory, else "
                        "host if ≤ 50%% of the available RAM, else none (N·n·3·S² bytes: 25.2 GB for 10,000 × 67 "
                        "images at 112 px; docs/simulation.md)")
    p.set_defaults(synth_defaults={**dict(SYNTH_DEFAULTS), "clients": clients, "new_users": new_users,
                                   "public": public})


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


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def setup_device(runtime: RuntimeConfig) -> None:
    """Check ``--device``, apply ``--threads`` and keep NumPy's BLAS on one thread."""
    if runtime.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda was requested but no CUDA device is available")
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    single_thread_blas()


def single_thread_blas() -> None:
    """NumPy's BLAS (OpenBLAS) on one thread for the rest of the process. The simulator's NumPy
    linear algebra is small (256-d covariances, their ``eigh``, [8192, 256] draws: the do-no-harm
    check) and OpenBLAS's threads busy-wait: on the 2-core machine, loaded, a 256×256 ``eigh``
    took 0.19–0.77 s on two threads and 0.03 s on one (issue 31). Torch's threads (OpenMP,
    ``--threads``) are not OpenBLAS's and are left alone."""
    try:
        from threadpoolctl import threadpool_limits     # scikit-learn's dependency (the sim extra)
    except ImportError:         # pragma: no cover — without it NumPy keeps its own default
        return
    threadpool_limits(limits=1, user_api="blas")


__all__ = ["add_data_arguments", "add_pretrain_arguments", "add_device_argument", "setup_device", "single_thread_blas",
           "skipped_lines",
           "experiment_from_args", "progress_bar", "DEFAULT_IMAGE_SIZE", "DEFAULT_BACKBONE",
           # the builders' old home (scripts import them from here)
           "build_data", "build_pretrain_data", "public_impostor_images", "SYNTH_UNIVERSE", "pretrain_config",
           "run_pretrain", "resolve_xi", "check_xi_disjoint"]
