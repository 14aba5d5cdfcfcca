"""Accept/reject parity of the exported FedUV verifier with torch when ‖W g‖² ≫ fp16's range.

Issue 13: after one round of MobileFaceNet fedfs+feduv, ‖W g‖² had median 2.6e6 (> 65504);
the Core ML fp16 program computed Σ (W g)² in fp16, got inf, returned ``uv = 0`` and accepted
everyone. This builds a MobileFaceNet fedfs+feduv verifier (c = 127) whose head is scaled so
every image has ‖W g‖² ≥ 1e6 (``--head-norm2``, the minimum over the images), and replays a
device (``export.parity``): owner codeword, warm-up τ (q = 0.9) computed with each backend's
own scores, then accept/reject on ``--genuine`` owner images and ``--impostors`` images of
other identities (SynthFaces). Backends: torch fp32 (reference), Core ML fp16 (the saved
``.mlpackage`` run by ``export.coreml_reference``), ONNX fp32 and ONNX int8 (ONNX Runtime),
and the pre-fix σ formula in Core ML fp16 — which ``export_coreml`` refuses (shown).

The backbone is random-init unless ``--backbone-checkpoint`` names a trained one (no face
model can be downloaded here; ``fedfs pretrain`` trains MobileFaceNet on SynthFaces in ~10 min
on one core, docs/export.md). So that scores separate as after FedUV training, ``W`` is fitted by
ridge regression to FedUV's targets on the frozen embeddings — the owner's training images →
the owner's codeword ``v``, ``--train-identities`` other identities → their own random
codewords (FedUV's ℓ_pos/ℓ_neg pull ``σ(W g)`` to ``v``) — on images disjoint from the
evaluation images, then scaled. "differ" counts decisions unlike torch's; "outside band"
counts those whose torch score is farther than the backend's max |Δscore| from τ (must be 0:
a flip inside the band is the rounding the precision allows).

Usage: PYTHONPATH=. python benchmarks/export_fp16_parity.py [--backbone mobilefacenet]
       [--genuine 100] [--impostors 100] [--warmup 20] [--head-norm2 1e6]
Prints one line per backend: τ, TPR, FPR, decisions that differ from torch, max |Δscore|.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fedfs_sdk.nn.model as model_mod
from device_sim.synthfaces import SynthFaces
from export.coreml import CoreMLNumericsError, check_coreml_numerics, export_coreml
from export.coreml_reference import CoreMLReference
from export.onnx_inference import export_onnx
from export.parity import decide, disagreements
from export.quantize import Int8NumericsError, quantize_int8, synthetic_calibration
from fedfs_sdk.nn.checkpoint import load_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.onnx_backend import OnnxBackend


def _old_l2_normalize(x: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="mobilefacenet")
    ap.add_argument("--code-length", type=int, default=127)
    ap.add_argument("--genuine", type=int, default=100)
    ap.add_argument("--impostors", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--head-norm2", type=float, default=1e6, help="minimum ‖W g‖² over all images")
    ap.add_argument("--train-identities", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backbone-checkpoint", metavar="XI.safetensors",
                    help="a trained backbone (e.g. `fedfs pretrain --backbone mobilefacenet --image-size 112 "
                         "--out XI.safetensors`, SynthFaces universe 0 — disjoint from the images here, universe "
                         "seed+1); default: random init")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    m = FaceNet(ModelConfig(args.backbone, code_length=args.code_length)).eval()
    source = "random-init backbone"
    if args.backbone_checkpoint:
        xi = load_checkpoint(args.backbone_checkpoint)[0]
        if xi.config.backbone != args.backbone or xi.input_size != m.input_size:
            raise SystemExit(f"{args.backbone_checkpoint} holds {xi.config.backbone}@{xi.input_size}, "
                             f"not {args.backbone}@{m.input_size}")
        m.backbone.load_state_dict(xi.backbone.state_dict())
        source = f"backbone {Path(args.backbone_checkpoint).name}"
    s = m.input_size
    faces = SynthFaces(seed=args.seed + 1, image_size=s)
    n_own = args.warmup + args.genuine
    ids = np.concatenate([np.zeros(n_own, int), 1 + np.arange(args.impostors) // 2])
    idx = np.concatenate([np.arange(n_own), np.arange(args.impostors) % 2])
    x = faces.render(ids, idx).float()
    warm, gen, imp = slice(0, args.warmup), slice(args.warmup, n_own), slice(n_own, None)
    # FedUV-like head: ridge fit of W on disjoint training images (owner: images 1000+, others:
    # identities 10_000+), targets = each identity's codeword (owner: v = its random codeword).
    rng = np.random.default_rng(args.seed)
    t_ids = np.concatenate([np.zeros(20, int), 10_000 + np.repeat(np.arange(args.train_identities), 4)])
    t_idx = np.concatenate([1000 + np.arange(20), np.tile(np.arange(4), args.train_identities)])
    codes = rng.choice([-1.0, 1.0], size=(args.train_identities + 1, args.code_length))
    targets = torch.tensor(codes[np.where(t_ids == 0, 0, t_ids - 10_000 + 1)], dtype=torch.float64)
    with torch.no_grad():
        g = m.backbone(faces.render(t_ids, t_idx).float()).double()
        w = torch.linalg.solve(g.T @ g + 1e-2 * torch.eye(g.shape[1], dtype=torch.float64), g.T @ targets).T
        m.uv_head.weight.copy_(w.float())
        wg = m.backbone(x) @ m.uv_head.weight.t()
        m.uv_head.weight.mul_(float((args.head_norm2 / (wg * wg).sum(1).min()).sqrt()))
        wg = m.backbone(x) @ m.uv_head.weight.t()
    n2 = (wg * wg).sum(1)
    print(f"{args.backbone} fedfs+feduv verifier ({source}), c={args.code_length}, {s}x{s}: ‖W g‖² min {float(n2.min()):.3g}, "
          f"median {float(n2.median()):.3g} (fp16 max 65504); {args.warmup} warm-up + {args.genuine} genuine "
          f"+ {args.impostors} impostor images ({args.impostors // 2 + args.impostors % 2} identities)")
    verifier = VerifierNet(m.backbone, m.uv_head).eval()
    with torch.no_grad():
        uv = {"torch fp32": verifier(x)[1].numpy().astype(np.float64)}
    pixels = (x.numpy() * 127.5 + 127.5).astype(np.float32)
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = export_coreml(verifier, Path(tmp) / "v.fp16.mlpackage", precision="fp16")   # checks numerics
        uv["coreml fp16 (reference)"] = CoreMLReference(path).run(pixels)["uv"].astype(np.float64)
        times["coreml fp16"] = time.perf_counter() - t
        t = time.perf_counter()
        onnx_path = export_onnx(verifier, Path(tmp) / "v.onnx")
        uv["onnx fp32"] = OnnxBackend(onnx_path).run(x.numpy())["uv"].astype(np.float64)
        calib = synthetic_calibration(s)
        try:                                               # what `fedfs export --formats onnx-int8` does
            info = quantize_int8(onnx_path, Path(tmp) / "v.int8.onnx", calib)
            int8_verdict = f"exported (decisions unlike fp32 on held-out calibration images: {info['check']['decision_flip_rate']})"
        except Int8NumericsError as e:
            int8_verdict = f"REFUSED: {e}"
            quantize_int8(onnx_path, Path(tmp) / "v.int8.onnx", calib, max_flip_rate=1.0)   # to show why
        uv["onnx int8"] = OnnxBackend(Path(tmp) / "v.int8.onnx").run(x.numpy())["uv"].astype(np.float64)
        times["onnx fp32+int8"] = time.perf_counter() - t
        t = time.perf_counter()
        real = model_mod.l2_normalize
        model_mod.l2_normalize = _old_l2_normalize        # the pre-fix σ: x / sqrt(Σ x² + ε)
        try:
            old = export_coreml(verifier, Path(tmp) / "old.fp16.mlpackage", precision="fp16", check_numerics=False)
            uv["pre-fix σ, coreml fp16"] = CoreMLReference(old).run(pixels)["uv"].astype(np.float64)
            try:
                check_coreml_numerics(old, verifier)          # what export_coreml runs on every package
                refused = "NOT refused"
            except CoreMLNumericsError as e:
                refused = f"refused: {str(e).split(': ', 1)[1][:110]}…"
        finally:
            model_mod.l2_normalize = real
        times["pre-fix"] = time.perf_counter() - t
    code = torch.tensor(codes[0]).numpy()
    ref = decide(uv["torch fp32"][warm], uv["torch fp32"][gen], uv["torch fp32"][imp], code)
    ref_scores = uv["torch fp32"] @ code / code.size
    print(f"{'backend':26s} {'tau':>7s} {'TPR':>6s} {'FPR':>6s} {'differ':>8s} {'outside band':>12s} "
          f"{'max|Δscore|':>11s} {'‖uv‖/√c':>8s}")
    for name, u in uv.items():
        d = decide(u[warm], u[gen], u[imp], code)
        dscore = np.abs((u - uv["torch fp32"]) @ code / code.size).max()
        norm = np.linalg.norm(u, axis=1).mean() / np.sqrt(code.size)
        flips = np.concatenate([ref.genuine != d.genuine, ref.impostor != d.impostor])
        far = np.abs(np.concatenate([ref_scores[gen], ref_scores[imp]]) - ref.tau) > dscore + abs(d.tau - ref.tau)
        print(f"{name:26s} {d.tau:7.4f} {d.tpr:6.2f} {d.fpr:6.2f} {disagreements(ref, d):4d}/{flips.size}"
              f" {int((flips & far).sum()):12d} {dscore:11.2e} {norm:8.4f}")
    print(f"export_coreml of the pre-fix σ (fp16): {refused}")
    print(f"fedfs export int8 of this model: {int8_verdict}")
    print("'outside band' = decisions that differ although torch's score is farther from τ than max|Δscore| + |Δτ|:"
          " 0 means every difference is a score within that precision's rounding of τ (export.score_bounds)")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
