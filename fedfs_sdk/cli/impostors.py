"""``fedfs impostors``: the public impostor set that ships with a model.

Photos of public identities (never an owner's), preprocessed for one model's input, written
as one file (:mod:`fedfs_sdk.runtime.impostors`). ``fedfs enroll --far`` sets τ on it and
``fedfs device --impostors`` uses it to check that personalization did no harm.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", required=True, help="folder of public identities: DIR/<person>/<photo> "
                   "(e.g. the public split ξ was pre-trained on) — never a user's photos")
    p.add_argument("--out", required=True, help="the set to write (.npz)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="the model the set is for (its input size): .safetensors or .onnx")
    src.add_argument("--image-size", type=int, help="input size in pixels, instead of --model")
    p.add_argument("--per-identity", type=int, default=None, help="at most this many photos per person")
    p.add_argument("--limit", type=int, default=None, help="at most this many photos in all (a seeded sample)")
    p.add_argument("--exclude", nargs="*", default=(), help="people (folder names) to leave out")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples")
    p.add_argument("--detect-face", action="store_true", help="align each face as enroll/verify --detect-face do")


def run(args: argparse.Namespace) -> int:
    from ..runtime.impostors import build_impostor_set, save_impostors
    from ..runtime.operating_point import min_impostors

    size, detect = args.image_size, args.detect_face
    if size is None:
        from ..runtime.preprocess import model_face_mode
        from .common import load_backend
        backend = load_backend(args.model)
        size = backend.input_size
        # a model trained on one crop (dlib-resnet: dlib's face chip) is fed that crop, as on the device
        detect = model_face_mode(args.detect_face, getattr(backend, "alignment", None)) or False
    imp = build_impostor_set(args.images, size, detect_face=detect, per_identity=args.per_identity,
                             limit=args.limit, seed=args.seed, exclude=args.exclude)
    path = save_impostors(args.out, imp)
    for s in imp.meta["skipped"][:20]:
        print(f"skipped {s['path']}: {s['reason']}")
    if len(imp.meta["skipped"]) > 20:
        print(f"… and {len(imp.meta['skipped']) - 20} more skipped")
    lowest = 1 / (len(imp) + 1)
    print(f"wrote {path}: {len(imp)} photos of {imp.num_identities} public identities at {size}px "
          f"({path.stat().st_size / 1e6:.1f} MB); smallest FAR it can bound: {lowest:.2g} "
          f"(far=1e-3 needs ≥ {min_impostors(1e-3)} photos)")
    return 0
