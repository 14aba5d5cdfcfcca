"""What an artifact-only (ONNX Runtime, torch-free) device pays per round: artifacts that train
every layer (``scope="all"``) against the default ones that train the top on ``trunk.onnx``'s
features (``scope="top"``, :mod:`export.ort_top`), on the same weights, photos and seed.

    python benchmarks/ort_device_round.py --xi xi-paddlex.safetensors --images lfw-112/George_W_Bush --photos 20

Exports ``fedfs+feduv`` artifacts of the server's round-0 model (ξ's backbone, a random FedUV head
and FedFS projection: what ``fedfs serve --xi`` starts from) at both scopes, then times, interleaved
over ``--reps`` repetitions (the machine is shared): a round of the ``all`` artifact, the first round
of the ``top`` artifact (the trunk pass included) and a later one (the device's photos' features
kept, :class:`~fedfs_sdk.federation.device_runtime.OrtRuntime`). Prints the artifacts' size, the
medians, and how far the trunk moved (0 under ``top``: it goes back as received).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--xi", required=True, help="ξ checkpoint (.safetensors; fedfs import-model …)")
    p.add_argument("--images", default=None, help="a folder of one person's aligned photos (default: generated)")
    p.add_argument("--photos", type=int, default=20)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (a phone core: 1)")
    args = p.parse_args(argv)

    import torch

    from export.ort_training import export_training_artifacts
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.nn.model import FaceNet
    from fedfs_sdk.runtime.codes import make_codeword
    from fedfs_sdk.training.objective import ObjectiveConfig
    from fedfs_sdk.training.ort_device import OrtDeviceTrainer
    from fedfs_sdk.training.top_keys import is_top_key
    from fedfs_sdk.training.trainer import initial_global_weights

    torch.set_num_threads(max(1, args.threads))
    xi = load_checkpoint(args.xi)[0].eval()
    size = int(xi.backbone.input_size)
    cfg = replace(xi.config.resolved(), code_length=127,
                  proj_dim=ObjectiveConfig().fedfs.projection_dim(int(xi.backbone.embedding_dim)))
    w0 = initial_global_weights(cfg, xi, seed=0)
    model = FaceNet(cfg)
    model.load_state_dict(w0)
    if args.images:
        from fedfs_sdk.runtime.preprocess import list_images, preprocess

        files = [str(f) for f in list_images(args.images)][: args.photos]
        x = preprocess(files, size)
    else:
        x = np.random.default_rng(0).uniform(-1, 1, (args.photos, 3, size, size)).astype(np.float32)
    codeword = make_codeword(11, 127, rng=np.random.default_rng(0))[0]
    w = {k: v.numpy() for k, v in w0.items()}
    print(f"ξ {args.xi}: {cfg.backbone} {size}px; {len(x)} photos, {args.epochs} epoch(s), batch {args.batch_size}, "
          f"{args.threads} ORT thread(s)")
    trainers, sizes = {}, {}
    with tempfile.TemporaryDirectory(prefix="fedfs-ort-round-") as tmp:
        for scope in ("all", "top"):
            t0 = time.perf_counter()
            out = Path(tmp) / scope
            export_training_artifacts("fedfs+feduv", model, out, xi=xi, scope=scope, local_epochs=args.epochs,
                                      batch_size=args.batch_size)
            sizes[scope] = (_folder_mb(out), time.perf_counter() - t0)
            trainers[scope] = OrtDeviceTrainer(out, intra_op_threads=args.threads)
        times: dict[str, list[float]] = {"all": [], "top, first round": [], "top, later rounds": []}
        results = {}
        for _ in range(args.reps):
            for label in times:
                tr = trainers["all" if label == "all" else "top"]
                feats = None
                t0 = time.perf_counter()
                if label == "top, later rounds":
                    feats = results.get("features")
                    if feats is None:   # kept from the first round, as OrtRuntime keeps them
                        feats = results["features"] = tr.trunk_features(x)
                        t0 = time.perf_counter()
                up = tr.train(w, x, codeword=codeword, seed=1, features=feats)
                times[label].append(time.perf_counter() - t0)
                results[label] = up
    print("| artifacts | folder MB | export s |\n|---|---|---|")
    for scope, (mb, s) in sizes.items():
        print(f"| {scope} | {mb:.1f} | {s:.1f} |")
    print("\n| device round | median s | min s | trunk moved (max abs) | top moved |\n|---|---|---|---|---|")
    for label, ts in times.items():
        up = results[label]
        trunk = max(float(np.abs(up.weights[k] - w[k]).max()) for k in w if not is_top_key(k))
        top = max(float(np.abs(up.weights[k] - w[k]).max()) for k in w if is_top_key(k))
        print(f"| {label} | {statistics.median(ts):.2f} | {min(ts):.2f} | {trunk:.2e} | {top:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
