"""``fedfs import-model``: turn a pre-trained face recognizer into a fedfs checkpoint.

Example::

    fedfs import-model recognizer.onnx --out xi.safetensors          # insightface-style ONNX, RGB
    fedfs import-model recognizer.onnx --bgr --out xi.safetensors    # a graph that wants BGR
    fedfs import-model mobilefacenet.pth --out phi0.safetensors --partial
    fedfs import-model w600k_mbf.onnx --out xi.safetensors          # insightface buffalo_s → insightface-mbf
    fedfs import-model raw.onnx --input-mean 0 --input-std 1 --out xi.safetensors   # a graph fed raw 0–255 pixels
    fedfs import-model 068.ckpt --input-std 128 --out xi.safetensors   # Xiaoccer's 112×96 MobileFaceNet ({'net_state_dict': …})
    fedfs import-model dlib-resnet --out xi.safetensors              # the built-in dlib ResNet (the 'faces' extra)

The checkpoint is usable as ``--xi`` / ``--pretrained`` and by ``fedfs enroll --model``;
the mapping report (every unmapped key, the BatchNorm layers folded into per-channel affines)
is printed and stored in the checkpoint's meta. A BatchNorm network (BatchNormalization
nodes, running statistics or BN-folded biased convs) imports onto ``mobilefacenet-affine`` or,
for insightface's ``w600k_mbf`` / arcface_torch's mbf, ``insightface-mbf``; the source's input
convention (BGR, its normalization) is folded into the first convolution. See
docs/real-faces.md ("Bring your own face model").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

IMPORTABLE_BACKBONES = ("mobilefacenet", "mobilefacenet-affine", "mobilefacenet-affine-112x96", "mobilefacenet-relu6",
                        "insightface-mbf")
"""Backbones a state dict can be mapped onto (fedfs_sdk.nn.face_import)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="an ONNX model (.onnx), a torch state dict (.pt, .pth, .ckpt, .safetensors; "
                   "training-script wrappers such as {'net_state_dict': …} are opened), or a built-in model's "
                   "name (dlib-resnet)")
    p.add_argument("--out", required=True, help="where to write the fedfs checkpoint (.safetensors)")
    p.add_argument("--bgr", action="store_true", help="the ONNX graph takes BGR input (default: RGB, as insightface)")
    p.add_argument("--embedding-dim", type=int, default=None, help="embedding size (default: read from the weights)")
    p.add_argument("--partial", action="store_true",
                   help="state dict: keep a partial mapping (a starting point for ϕ) instead of refusing it")
    p.add_argument("--backbone", choices=IMPORTABLE_BACKBONES, default=None,
                   help="state dict: target backbone (default: the first the weights fill — mobilefacenet, "
                        "or with BatchNorm statistics / biased convs mobilefacenet-affine, then insightface-mbf)")
    p.add_argument("--input-mean", type=float, default=None,
                   help="ONNX: the source's normalization (x − mean)/std applied before its graph (default: "
                        "127.5, or 0 when the graph normalizes its input itself)")
    p.add_argument("--input-std", type=float, default=None,
                   help="ONNX: see --input-mean (default: 127.5, or 1 when the graph normalizes itself); state dict: "
                        "the source's (x − 127.5)/std, e.g. 128 for SphereFace-era models (default 127.5)")
    p.add_argument("--bn-eps", type=float, default=1e-5,
                   help="state dict: the BatchNorm ε (a state dict does not record it; torch's default 1e-5)")
    p.add_argument("--atol", type=float, default=1e-4,
                   help="ONNX: largest embedding difference to the source graph that is accepted")


def run(args: argparse.Namespace) -> int:
    from ..nn.face_import import import_onnx, import_state_dict, read_state_dict, save_imported, state_dict_backbone
    from ..nn.model import ModelConfig

    from ..nn.builtin_models import builtin_name

    name = builtin_name(args.source)
    if name is not None:
        return _builtin(name, args.out)
    src = Path(args.source)
    if src.suffix.lower() == ".onnx":
        model, report = import_onnx(src, rgb=not args.bgr, embedding_dim=args.embedding_dim, atol=args.atol,
                                    input_mean=args.input_mean, input_std=args.input_std)
    else:
        from ..errors import InputError

        if args.input_mean not in (None, 127.5):
            raise InputError(f"--input-mean {args.input_mean:g}: a state dict's input can only be rescaled at import "
                             "(--input-std), not shifted (the first convolution's zero padding would change meaning)")
        state = read_state_dict(src)
        cfg = (ModelConfig(args.backbone or state_dict_backbone(state), embedding_dim=args.embedding_dim, input_size=112)
               if args.embedding_dim or args.backbone else None)
        model, report = import_state_dict(state, cfg, require_complete=not args.partial, bn_eps=args.bn_eps,
                                          input_std=args.input_std or 127.5)
    out = save_imported(args.out, model, report, str(src))
    print(report.summary())
    print(f"wrote {out} ({model.config.backbone}, {model.config.embedding_dim}-d, "
          f"{model.config.input_size}×{model.config.input_size} RGB, (x − 127.5)/127.5)")
    return 0


def _builtin(name: str, out: str) -> int:
    """``fedfs import-model dlib-resnet``: the built-in model as a checkpoint file."""
    from ..nn.builtin_models import load_builtin, save_builtin

    path = save_builtin(name, out)
    _, meta = load_builtin(name)
    print(f"wrote {path} (built-in {name}: {meta['imported_from']}, sha256 {meta['source_sha256'][:16]}…, "
          f"model_id {meta['model_id']}; input: {meta['face_alignment']} 150×150 RGB, (x − 127.5)/127.5)")
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
