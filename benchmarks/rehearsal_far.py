"""``enroll(far=…)`` through a deployment: the FAR-targeted τ each device of a rehearsal would set from the
sums its server's automatic rounds published (``xi.features`` and the check round's ``xi.tail``), and the
FAR measured at it on the other devices' photos — and the FAR of the τ each device actually enrolled with.

    python benchmarks/rehearsal_far.py RUN [--far 1e-3 1e-2 0.1]

``RUN``: a ``benchmarks/deployment_rehearsal.py --out RUN`` folder whose server shipped a public set (the
rehearsal always does): its ``server/stats/published-r*.json``, the devices' states (enrollment, verifier —
a test-bench privilege, :mod:`rehearsal_eval`) and photos. Each device's τ is what
:func:`fedfs_sdk.stats.evidence.in_domain_evidence` gives for its enrolled verifier and template (``τ = m_u +
s_u·z*``, the device functions, its own contribution not subtracted, as a device does); impostors are the
other devices' (training) photos — other people in the federation's capture conditions, ≈ 1,200 for LFW.
Only the τ is computed here (the device's warm-up TPR target q is not applied: a device whose photos
cannot meet both is refused at enrollment, which is counted apart). Prints per target: the mean measured
FAR, mean and median / target, the share of devices above 2× the target.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--far", type=float, nargs="+", default=[1e-3, 1e-2, 0.1])
    args = p.parse_args(argv)

    import torch

    from fedfs_sdk.nn.checkpoint import load_verifier
    from fedfs_sdk.runtime.enrollment_store import load_enrollment
    from fedfs_sdk.runtime.impostors import load_impostors
    from fedfs_sdk.runtime.preprocess import preprocess
    from fedfs_sdk.stats.contributions import StatSum
    from fedfs_sdk.stats.evidence import (FEATURES, drawn_features, in_domain_evidence, tail_directions, torch_top,
                                         xi_verifier)
    from fedfs_sdk.stats.tail import TAIL, calibrated_threshold
    from fedfs_sdk.training.scope import Trunk
    from rehearsal_eval import TRUNK_ATOL, onnx_verifier_net, trunk_deviation

    torch.set_num_threads(2)
    run = args.run
    published = [json.loads(f.read_text()) for f in sorted((run / "server" / "stats").glob("published-r*.json"))]
    xi_round = next((d for d in published if FEATURES in d["sums"]), None)
    tail_round = next((d for d in published if TAIL in d["sums"]), None)
    if xi_round is None or tail_round is None:
        raise SystemExit(f"{run}: the server published no {'xi.features' if xi_round is None else 'xi.tail'} "
                         "(a rehearsal before the tail was in the check round, or no public set)")
    stats = StatSum({FEATURES: np.asarray(xi_round["sums"][FEATURES]), TAIL: np.asarray(tail_round["sums"][TAIL])},
                    int(tail_round["count"]))
    devices = sorted(d for d in (run / "fleet").iterdir() if (d / "state" / "enrollment.fedfs").is_file())
    xi = xi_verifier(devices[0] / "state" / "xi.safetensors")        # ξ's backbone as a VerifierNet
    size = int(xi.backbone.input_size)
    trunk = Trunk(xi.backbone).eval()

    def features(x: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([trunk(torch.from_numpy(np.ascontiguousarray(x[a:a + 64]))) for a in range(0, len(x), 64)])

    photos = {d: sorted(str(q) for q in (d / "photos").glob("*.png")) for d in devices}
    owner = np.concatenate([[i] * len(photos[d]) for i, d in enumerate(devices)])
    all_feats = features(preprocess([q for d in devices for q in photos[d]], size))
    feats_np = all_feats.numpy()
    pub = load_impostors(run / "server" / "impostors.npz")
    pub_feats = features(pub.batch(size)).double().numpy()
    xi_top = torch_top(xi)
    # the tail's directions: public things only, the same for every device (tail_directions)
    directions = tail_directions(pub_feats, pub.identity, lambda f: xi_top(f)["embedding"], stats.sums[FEATURES])
    # the draws too: every device reads the same published sum (its own contribution not subtracted)
    drawn_feats = drawn_features(stats.sums[FEATURES])
    rows: dict[float, list[tuple[float, float]]] = {f: [] for f in args.far}
    enrolled_far, skipped = [], []
    phone_cfg = None
    for i, d in enumerate(devices):
        state = d / "state"
        enr = load_enrollment(state / "enrollment.fedfs", (d / "device.key").read_bytes())
        if enr.mode != "template":
            skipped.append((d.name, f"{enr.mode} enrollment"))
            continue
        if (state / "verifier.onnx").is_file() and not (state / "verifier.safetensors").is_file():
            if phone_cfg is None:
                from fedfs_sdk.nn.model import ModelConfig
                from fedfs_sdk.federation.wire_format import read_header

                raw = (state / "global.safetensors").read_bytes()
                phone_cfg = ModelConfig.from_json(read_header(raw)[1]["model_config"])
            net, _ = onnx_verifier_net(state / "verifier.onnx", phone_cfg)
        else:
            net, _ = load_verifier(state / "verifier.safetensors")
        if trunk_deviation(net, xi.backbone) > TRUNK_ATOL:
            skipped.append((d.name, "verifier not on ξ's trunk"))
            continue
        top = torch_top(net)
        ev = in_domain_evidence(stats, top, lambda f: xi_top(f)["embedding"], pub_feats, pub.identity,
                                directions=directions, features=drawn_feats)
        out = enr.template_output
        t = np.asarray(enr.template, dtype=np.float64)
        drawn = _unit(ev.draws[out]) @ t
        emb = _unit(top(feats_np)[out])
        imp = emb[owner != i] @ t
        enrolled_far.append(float((imp >= enr.threshold).mean()))
        for far in args.far:
            try:
                tau = calibrated_threshold(drawn, ev.z(far))
            except Exception as e:  # noqa: BLE001 — a tail too small for the target: reported, as enroll refuses it
                skipped.append((d.name, f"far {far:g}: {str(e)[:80]}"))
                continue
            rows[far].append((tau, float((imp >= tau).mean())))
    print(f"{len(devices)} devices; tail over {stats.count} devices, {int(stats.sums[TAIL].sum())} scores; "
          f"impostors: the other devices' photos ({len(owner)} in all)")
    print("| target | devices | mean measured FAR | mean / target | median / target | > 2× target |\n|---|---|---|---|---|---|")
    for far, v in rows.items():
        m = np.array([x for _, x in v])
        if m.size:
            print(f"| {far:g} | {m.size} | {m.mean():.4f} | {m.mean() / far:.2f} | {np.median(m) / far:.2f} | "
                  f"{(m > 2 * far).mean():.0%} |")
    e = np.array(enrolled_far)
    print(f"\nthe τ each device enrolled with (warm-up, q): mean FAR {e.mean():.4f}, median {np.median(e):.4f}, "
          f"max {e.max():.4f} over {e.size} devices")
    if skipped:
        print("skipped: " + "; ".join(f"{n} ({why})" for n, why in skipped[:10]) + (" …" if len(skipped) > 10 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
