"""``fedfs export``: a checkpoint → ONNX, ORT on-device training artifacts, Core ML, int8.

    fedfs export --checkpoint global.safetensors --formats onnx,ort-training,coreml,onnx-int8 \\
                 --xi xi.safetensors --out build/phone

Writes ``manifest.json`` (files, sha256, input contract, threshold semantics) next to the
artifacts. Bad input (missing checkpoint, unknown format, a checkpoint that does not fit
what was asked) fails before anything is written, and a failure midway leaves ``--out``
untouched.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="fedfs .safetensors checkpoint (the global model), a built-in "
                   "model's name (dlib-resnet), or a "
                   "simulation checkpoint (fedfs simulate … --checkpoint-every K: "
                   "DIR/checkpoints/<method>/round_N.safetensors) — its global model, or --client N's verifier")
    p.add_argument("--client", type=int, default=None,
                   help="with a simulation checkpoint: export simulated client N's personalized verifier "
                        "(results.json 'clients'[N] names its identity) instead of the global model")
    p.add_argument("--formats", default="onnx",
                   help="comma-separated: onnx, onnx-int8, coreml, ort-training")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent unless --overwrite)")
    p.add_argument("--xi", default=None, help="frozen pre-trained model ξ (.safetensors, or a built-in model's name: "
                   "dlib-resnet), needed for FedFS training artifacts")
    p.add_argument("--methods", default=None,
                   help="training artifacts to build: feduv, fedfs, fedfs+feduv (default: all the checkpoint supports)")
    p.add_argument("--train", default=None,
                   help="local-training settings as JSON or a JSON file: the 'train' object of a server round "
                        "(lr, head_lr, local_epochs, batch_size, objective, scope); default: the papers' values and "
                        "scope 'top' (the artifacts train the top on the exported trunk's features, as the "
                        "server's default rounds ask); '{\"scope\": \"all\"}' trains every layer")
    p.add_argument("--coreml-precision", default="fp16,fp32", help="fp16 and/or fp32, comma-separated")
    p.add_argument("--calibration", default=None,
                   help="folder of aligned face images for int8 calibration (default: generated SynthFaces)")
    p.add_argument("--evaluate-int8", action="store_true", help="report the int8 AUROC change on SynthFaces")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once the new export is complete")
    p.add_argument("--quiet", action="store_true", help="no progress display (the summary is still printed)")


def _read_train(text: str | None) -> dict | None:
    from fedfs_sdk.errors import InputError

    if text is None:
        return None
    raw = Path(text).read_text() if Path(text).is_file() else text
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InputError(f"--train is neither a JSON object nor a JSON file: {e}") from None
    if not isinstance(value, dict):
        raise InputError("--train must be a JSON object")
    return value


def _export(args: argparse.Namespace, options, progress) -> dict:
    """:func:`run_export` of ``--checkpoint``; a simulation checkpoint is first turned into a
    fedfs checkpoint of its global model or of ``--client N``'s verifier (in a scratch
    folder that is removed afterwards)."""
    import tempfile

    from fedfs_sdk.cli.common import is_simulation_checkpoint
    from fedfs_sdk.errors import InputError

    from .pipeline import run_export

    from dataclasses import replace

    from fedfs_sdk.nn.builtin_models import builtin_name, save_builtin

    if builtin_name(args.checkpoint) or builtin_name(options.xi):
        # a built-in model (dlib-resnet) as --checkpoint / --xi: written to a scratch checkpoint first
        with tempfile.TemporaryDirectory() as tmp:
            if builtin_name(options.xi):
                options = replace(options, xi=str(save_builtin(options.xi, Path(tmp) / f"{options.xi}.safetensors")))
            if builtin_name(args.checkpoint):
                ck = save_builtin(args.checkpoint, Path(tmp) / f"{args.checkpoint}.safetensors")
                args = argparse.Namespace(**{**vars(args), "checkpoint": str(ck)})
            return _export(args, options, progress)
    if not is_simulation_checkpoint(args.checkpoint):
        if args.client is not None:
            raise InputError(f"--client picks a client of a simulation checkpoint; {args.checkpoint} is a single model")
        return run_export(args.checkpoint, args.out, options, progress=progress)
    from device_sim.sim_export import export_federation_model

    with tempfile.TemporaryDirectory() as tmp:
        name = "global" if args.client is None else f"client_{args.client}"
        ckpt = Path(tmp) / f"{Path(args.checkpoint).stem}_{name}.safetensors"
        info = export_federation_model(args.checkpoint, ckpt, args.client)
        if info.get("verifies_with") == "both":     # fedfs+feduv's default: θ_c and w through W
            from .sim_client import export_dual_client
            return export_dual_client(ckpt, args.out, options.formats, options.overwrite, progress=progress)
        return run_export(ckpt, args.out, options, progress=progress)


def run(args: argparse.Namespace) -> int:
    from fedfs_sdk.cli.progress import progress_bar

    from .pipeline import ExportOptions, parse_formats

    formats = parse_formats(args.formats)
    options = ExportOptions(
        formats=formats, xi=args.xi,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else None,
        train=_read_train(args.train),
        coreml_precisions=tuple(p.strip() for p in args.coreml_precision.split(",") if p.strip()),
        calibration=args.calibration, evaluate_int8=args.evaluate_int8, overwrite=args.overwrite)
    with progress_bar("export", unit="step", disable=args.quiet) as bar:   # steps: checkpoint, each artifact, manifest
        def progress(msg: str) -> None:
            bar.set_postfix_str(msg)
            bar.update(1)

        manifest = _export(args, options, progress)
    out = Path(args.out)
    print(f"exported model {manifest['model_id']} (version {manifest['model_version']}) → {out}")
    for rel, entry in manifest["files"].items():
        if rel.endswith((".onnx", "checkpoint", "weight.bin")):
            print(f"  {rel:60s} {entry['bytes'] / 1024:9.1f} KiB  sha256 {entry['sha256'][:12]}")
    art = manifest["artifacts"]
    if "onnx" in art:
        print(f"  ONNX vs torch max |Δ|: {art['onnx']['max_abs_diff_vs_torch']}")
    ev = art.get("onnx-int8", {}).get("evaluation_synthfaces")
    if ev:
        print(f"  int8 AUROC {ev['auroc_int8']:.4f} vs fp32 {ev['auroc_fp32']:.4f} (Δ {ev['auroc_change']:+.4f})")
    print(f"  manifest: {out / 'manifest.json'}")
    return 0
