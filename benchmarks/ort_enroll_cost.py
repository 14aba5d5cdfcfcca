"""What a phone's enrollment pays to score the public impostor set (ONNX Runtime, one thread): the full
verifier forward over every photo — twice the trunk for the default dual verifier (θ_c ⊕ w) — against
ξ's trunk features of the set once (the export's ``trunk.onnx``) and each verifier's top on them
(``onnx/top.onnx``; :meth:`fedfs_sdk.federation.ort_runtime.OrtRuntime.impostor_outputs`).

    python benchmarks/ort_enroll_cost.py --export RUN/phone-export --model RUN/server-v1.safetensors \\
        --xi xi-paddlex.safetensors --impostors RUN/impostors.npz

(``RUN``: a ``benchmarks/deployment_rehearsal.py --phones`` output folder: the export of the server's
model, the model and the public set it shipped.) θ_c is the global model's top moved as a round would
move it. Interleaved over ``--reps`` repetitions, a fresh runtime each time (the phone's first
enrollment: no features kept). Prints thread CPU and wall per candidate and route, and the largest
|Δ| between the two routes' outputs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(f):
    c0, t0 = time.thread_time(), time.perf_counter()
    out = f()
    return out, time.thread_time() - c0, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, type=Path, help="fedfs export --formats onnx,ort-training output")
    p.add_argument("--model", required=True, type=Path, help="the server's model the export was made from")
    p.add_argument("--xi", required=True, type=Path, help="ξ checkpoint (the export's trunk)")
    p.add_argument("--impostors", required=True, type=Path, help="the public impostor set (.npz)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--candidates", nargs="+", default=["personalized", "global"])
    args = p.parse_args(argv)

    from safetensors.numpy import load_file

    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.ort_runtime import OrtRuntime
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.federation.wire_format import sha256_hex
    from fedfs_sdk.runtime.impostor_outputs import impostor_outputs
    from fedfs_sdk.runtime.impostors import load_impostors
    from fedfs_sdk.training.top_keys import is_top_key

    model = args.model.read_bytes()
    rng = np.random.default_rng(0)
    personal = {k: (v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype) * np.abs(v).mean()
                    if is_top_key(k) and v.dtype.kind == "f" else v)
                for k, v in load_file(str(args.model)).items() if k.startswith("backbone.")}
    pub = load_impostors(args.impostors)
    xi_sha = sha256_hex(args.xi.read_bytes())
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        from fedfs_sdk.federation.wire import encode_weights
        import torch

        import cv2

        photo = Path(tmp) / "owner.png"      # the owner's photos do not enter this cost
        cv2.imwrite(str(photo), np.ascontiguousarray(pub.images[0][..., ::-1]))
        state = DeviceState(Path(tmp) / "phone")
        state.save_weights_bytes("personal", encode_weights({k: torch.from_numpy(v.copy()) for k, v in personal.items()}))
        for rep in range(args.reps):
            for cand in args.candidates:
                rt = OrtRuntime(args.export, intra_op_threads=1)
                agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), state, [str(photo)], DeviceConfig(xi_path=args.xi),
                                    runtime=rt)
                backend = rt.verifier("fedfs+feduv", model, agent, 1, "both", candidate=cand)
                full, c_full, w_full = _timed(lambda: impostor_outputs(backend, pub))
                compute = rt.impostor_outputs(backend, pub, xi_sha)
                if compute is None:
                    raise SystemExit(f"{cand}: the verifier does not run on ξ's trunk (export with --xi and scope top)")
                fast, c_fast, w_fast = _timed(compute)
                rows.setdefault((cand, "full forward"), []).append((c_full, w_full))
                rows.setdefault((cand, "trunk once + top"), []).append((c_fast, w_fast))
                worst[cand] = max(worst.get(cand, 0.0), max(float(np.abs(a[k] - b[k]).max())
                                                            for a, b in zip(fast, full) for k in a))
    print(f"public set: {len(pub)} photos; outputs of the two routes differ by ≤ "
          + ", ".join(f"{c} {v:.1e}" for c, v in worst.items()))
    print("| candidate | route | thread CPU s (median) | wall s (median) |\n|---|---|---|---|")
    for (cand, route), v in rows.items():
        print(f"| {cand} | {route} | {statistics.median(c for c, _ in v):.2f} | {statistics.median(w for _, w in v):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
