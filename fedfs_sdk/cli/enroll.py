"""``fedfs enroll``: warm-up enrollment of the device owner (FedUV Alg. 2)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import env_default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="verifier: a fedfs .safetensors checkpoint or an exported .onnx")
    p.add_argument("--images", required=True, help="folder of the owner's warm-up images")
    p.add_argument("--out", required=True, help="enrollment file to write (encrypted)")
    p.add_argument("--key-file", default=env_default("FEDFS_KEY_FILE"), required=env_default("FEDFS_KEY_FILE") is None,
                   help="32-byte AES key; created (0600) if missing (default: $FEDFS_KEY_FILE)")
    p.add_argument("--q", type=float, default=0.9, help="target true-positive rate (default 0.9)")
    p.add_argument("--device-state", default=None,
                   help="device state dir holding the FedUV codeword (codeword mode); template mode without it")
    p.add_argument("--detect-face", action="store_true", help="crop the largest face (OpenCV Haar cascade)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing enrollment")


def run(args: argparse.Namespace) -> int:
    from ..enrollment import enroll, save_enrollment
    from ..preprocess import list_images
    from .common import load_backend, read_key

    backend = load_backend(args.model)
    codeword = None
    if args.device_state:
        from ..device_state import DeviceState
        codeword = DeviceState(args.device_state).load_codeword()
    files = list_images(args.images)
    key = read_key(args.key_file, create=True)
    e = enroll(backend, [str(f) for f in files], q=args.q, codeword=codeword, detect_face=args.detect_face,
               meta={"model_path": str(Path(args.model).resolve())})
    save_enrollment(args.out, e, key, overwrite=args.overwrite)
    print(f"enrolled from {e.n_warmup} images: mode={e.mode} τ={e.threshold:.4f} (q={e.q}) model={e.model_id} → {args.out}")
    return 0
