"""``fedfs verify``: accept (exit 0) or reject (exit 1) one image — or every image of a folder.

Exit codes (every ``fedfs`` command): 0 success / accepted, 1 rejected (``verify``: one image
rejected, or any image of a folder), 2 an error (bad input, missing file, unreadable model or
enrollment: one line on stderr says which), 130 interrupted.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import env_default

EPILOG = ("exit status: 0 accepted (a folder: every image accepted), 1 rejected (a folder: at least one), "
          "2 error (the message names it), 130 interrupted")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("image", help="image to verify, or a folder: every image in it is verified (one line each)")
    p.add_argument("--model", default=None,
                   help="verifier (.safetensors, .onnx or a simulation checkpoint); default: the model recorded "
                        "at enrollment — by fedfs enroll, or the device's own verifier next to a "
                        "fedfs device --enroll enrollment (STATE/verifier.safetensors or .onnx)")
    p.add_argument("--client", type=int, default=None,
                   help="with a simulation checkpoint: client N's verifier (default: the one recorded at enrollment)")
    p.add_argument("--enrollment", required=True, help="enrollment file written by `fedfs enroll` or `fedfs device --enroll`")
    p.add_argument("--key-file", default=env_default("FEDFS_KEY_FILE"), required=env_default("FEDFS_KEY_FILE") is None,
                   help="the enrollment's AES key (default: $FEDFS_KEY_FILE; a device's: STATE/enrollment.key)")
    p.add_argument("--detect-face", action="store_true", default=None,
                   help="align the largest face to the 112×112 five-point template (dlib, the 'faces' extra; falls "
                        "back to an OpenCV Haar crop without it). Default: as the enrollment records (an enrollment "
                        "made with --detect-face is verified with it)")


def recorded_model(enrollment_path: str, meta: dict) -> str | None:
    """The model an enrollment was made with: ``meta["model_path"]`` (``fedfs enroll``), else
    the device's verifier in the enrollment's own state folder (``fedfs device --enroll``
    writes ``verifier.safetensors`` with the torch runtime, ``verifier.onnx`` with ONNX
    Runtime, next to ``enrollment.fedfs``)."""
    if meta.get("model_path"):
        return str(meta["model_path"])
    folder = Path(enrollment_path).resolve().parent
    name = {"torch": "verifier.safetensors", "onnx": "verifier.onnx", "ort": "verifier.onnx"}.get(
        str(meta.get("runtime")), "")
    candidates = [folder / name] if name else [folder / "verifier.safetensors", folder / "verifier.onnx"]
    found = [c for c in candidates if c.is_file()]
    return str(found[0]) if len(found) == 1 else None


def run(args: argparse.Namespace) -> int:
    from ..runtime.enrollment import load_enrollment, verify
    from ..errors import InputError
    from ..runtime.operating_point import describe
    from ..runtime.preprocess import list_images
    from .common import load_backend, read_key

    e = load_enrollment(args.enrollment, read_key(args.key_file, create=False))
    model = args.model or recorded_model(args.enrollment, e.meta)
    if not model:
        raise InputError("no --model given and the enrollment does not record one (nor is there a "
                         "verifier.safetensors / verifier.onnx next to it): pass --model")
    client = args.client if args.client is not None else (None if args.model else e.meta.get("model_client"))
    backend = load_backend(model, client=client)
    target = Path(args.image)
    if not target.is_dir():
        r = verify(backend, e, args.image, detect_face=args.detect_face)
        print(f"{'ACCEPT' if r.accepted else 'REJECT'} score={r.score:.4f} threshold={r.threshold:.4f}")
        print(describe(e.meta))
        return 0 if r.accepted else 1
    rejected = 0
    files = list_images(target)
    for f in files:
        r = verify(backend, e, str(f), detect_face=args.detect_face)
        rejected += not r.accepted
        print(f"{'ACCEPT' if r.accepted else 'REJECT'} score={r.score:.4f} threshold={r.threshold:.4f} {f}")
    print(f"{len(files) - rejected} of {len(files)} accepted")
    print(describe(e.meta))
    return 0 if rejected == 0 else 1
