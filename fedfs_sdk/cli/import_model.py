"""``fedfs import-model``: turn a pre-trained face recognizer into a fedfs checkpoint.

Example::

    fedfs import-model recognizer.onnx --out xi.safetensors          # insightface-style ONNX, RGB
    fedfs import-model recognizer.onnx --bgr --out xi.safetensors    # a graph that wants BGR
    fedfs import-model mobilefacenet.pth --out phi0.safetensors --partial
    fedfs import-model w600k_mbf.onnx --out xi.safetensors          # BatchNorm graph → mobilefacenet-affine

The checkpoint is usable as ``--xi`` / ``--pretrained`` and by ``fedfs enroll --model``;
the mapping report (every unmapped key, the BatchNorm layers folded into per-channel affines)
is printed and stored in the checkpoint's meta. A BatchNorm network (BatchNormalization
nodes, running statistics or BN-folded biased convs) imports onto ``mobilefacenet-affine``.
See docs/real-faces-alignment.md. Until ``fedfs`` lists this command, run it as
``python -m fedfs_sdk.cli.import_model …``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="an ONNX model (.onnx) or a torch state dict (.pt, .pth, .safetensors)")
    p.add_argument("--out", required=True, help="where to write the fedfs checkpoint (.safetensors)")
    p.add_argument("--bgr", action="store_true", help="the ONNX graph takes BGR input (default: RGB, as insightface)")
    p.add_argument("--embedding-dim", type=int, default=None, help="embedding size (default: read from the weights)")
    p.add_argument("--partial", action="store_true",
                   help="state dict: keep a partial mapping (a starting point for ϕ) instead of refusing it")
    p.add_argument("--backbone", choices=("mobilefacenet", "mobilefacenet-affine"), default=None,
                   help="state dict: target backbone (default: mobilefacenet-affine when the weights have "
                        "BatchNorm statistics or biased convs, else mobilefacenet)")
    p.add_argument("--bn-eps", type=float, default=1e-5,
                   help="state dict: the BatchNorm ε (a state dict does not record it; torch's default 1e-5)")
    p.add_argument("--atol", type=float, default=1e-4,
                   help="ONNX: largest embedding difference to the source graph that is accepted")


def run(args: argparse.Namespace) -> int:
    from ..face_import import import_onnx, import_state_dict, read_state_dict, save_imported, state_dict_backbone
    from ..model import ModelConfig

    src = Path(args.source)
    if src.suffix.lower() == ".onnx":
        model, report = import_onnx(src, rgb=not args.bgr, embedding_dim=args.embedding_dim, atol=args.atol)
    else:
        state = read_state_dict(src)
        cfg = (ModelConfig(args.backbone or state_dict_backbone(state), embedding_dim=args.embedding_dim, input_size=112)
               if args.embedding_dim or args.backbone else None)
        model, report = import_state_dict(state, cfg, require_complete=not args.partial, bn_eps=args.bn_eps)
    out = save_imported(args.out, model, report, str(src))
    print(report.summary())
    print(f"wrote {out} ({model.config.backbone}, {model.config.embedding_dim}-d, "
          f"{model.config.input_size}×{model.config.input_size} RGB, (x − 127.5)/127.5)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..errors import FedFSError

    p = argparse.ArgumentParser(prog="fedfs import-model", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except FedFSError as e:
        print(f"fedfs import-model: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
