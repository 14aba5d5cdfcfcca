"""``fedfs verify``: accept (exit 0) or reject (exit 1) one image."""
from __future__ import annotations

import argparse

from .common import env_default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("image", help="image to verify")
    p.add_argument("--model", default=None,
                   help="verifier (.safetensors or .onnx); default: the model recorded at enrollment")
    p.add_argument("--enrollment", required=True, help="enrollment file written by `fedfs enroll`")
    p.add_argument("--key-file", default=env_default("FEDFS_KEY_FILE"), required=env_default("FEDFS_KEY_FILE") is None,
                   help="the enrollment's AES key (default: $FEDFS_KEY_FILE)")
    p.add_argument("--detect-face", action="store_true", help="crop the largest face (OpenCV Haar cascade)")


def run(args: argparse.Namespace) -> int:
    from ..enrollment import load_enrollment, verify
    from .common import load_backend, read_key

    e = load_enrollment(args.enrollment, read_key(args.key_file, create=False))
    model = args.model or e.meta.get("model_path")
    if not model:
        from ..errors import InputError
        raise InputError("no --model given and the enrollment does not record one")
    r = verify(load_backend(model), e, args.image, detect_face=args.detect_face)
    print(f"{'ACCEPT' if r.accepted else 'REJECT'} score={r.score:.4f} threshold={r.threshold:.4f}")
    return 0 if r.accepted else 1
