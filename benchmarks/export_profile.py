"""Where the exported verifier's time goes: ONNX Runtime's own profile, per op type.

Three graphs of one MobileFaceNet@112 verifier (FedUV head c = 127), each a single-thread,
batch-1 ORT session with ``enable_profiling``:

* ``fp32 primitives``: the graph as the ORT training artifacts have it (GroupNormP and
  PReLUP built from ReduceMean/Sub/Mul/Sqrt/Div and Relu/Neg/Mul/Sub);
* ``fp32 fused``: what ``export_onnx`` writes (``export.inference_graph``:
  InstanceNormalization + BatchNormalization affine, PRelu);
* ``int8``: ``export.quantize`` of the fused graph (static QDQ; QLinearConv after ORT's fusion).

Runs are interleaved (one run of each graph in turn) so the shared machine's load hits all
three alike. Kernel times come from the profile's ``*_kernel_time`` events, averaged per run;
``model_run`` is the session's whole run (kernels + ORT's per-node overhead). The load
(``/proc/loadavg``) is printed before and after: with more runnable processes than cores
every number stretches.

Usage: PYTHONPATH=. python benchmarks/export_profile.py [--runs 50] [--backbone mobilefacenet]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from export.onnx_inference import export_onnx
from export.quantize import quantize_int8, synthetic_calibration
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.onnx_backend import import_onnxruntime


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def profile(paths: dict[str, Path], runs: int, workdir: Path) -> dict[str, dict]:
    ort = import_onnxruntime()
    sessions = {}
    for tag, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        so.enable_profiling = True
        so.profile_file_prefix = str(workdir / tag.replace(" ", "_"))
        sessions[tag] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    s = int(next(iter(sessions.values())).get_inputs()[0].shape[2])
    x = np.random.default_rng(0).uniform(-1, 1, size=(1, 3, s, s)).astype(np.float32)
    warm = 10
    for _ in range(warm + runs):
        for sess in sessions.values():
            sess.run(None, {"input": x})
    out = {}
    for tag, sess in sessions.items():
        events = json.loads(Path(sess.end_profiling()).read_text())
        per_op: collections.Counter = collections.Counter()
        nodes: collections.Counter = collections.Counter()
        model_runs = []
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per_op[e["args"]["op_name"]] += e["dur"]
                nodes[e["args"]["op_name"]] += 1
            elif e.get("cat") == "Session" and e["name"] == "model_run":
                model_runs.append(e["dur"])
        total_runs = warm + runs
        out[tag] = {"ms": {k: v / total_runs / 1000 for k, v in per_op.items()},
                    "nodes": {k: v // total_runs for k, v in nodes.items()},
                    "model_run_ms": float(np.median(model_runs[warm:])) / 1000}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--backbone", default="mobilefacenet")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = FaceNet(ModelConfig(a.backbone, code_length=127)).eval()
    v = VerifierNet(m.backbone, m.uv_head).eval()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        paths = {"fp32 primitives": export_onnx(v, t / "prim.onnx", fused=False),
                 "fp32 fused": export_onnx(v, t / "fused.onnx")}
        # timing only: keep the int8 model even if its decision check would refuse it (random init)
        quantize_int8(paths["fp32 fused"], t / "int8.onnx", synthetic_calibration(v.input_size), max_flip_rate=1.0)
        paths["int8"] = t / "int8.onnx"
        before = load()
        res = profile(paths, a.runs, t)
        after = load()
    print(f"{a.backbone}@{v.input_size}, 1 thread, batch 1, {a.runs} interleaved runs; load average "
          f"{before} before, {after} after, {os.cpu_count()} CPUs; ORT {import_onnxruntime().__version__}")
    print("ms per run in each op type's kernels (nodes); model_run: median of the whole run incl. ORT overhead")
    tags = list(res)
    ops = sorted({o for r in res.values() for o in r["ms"]}, key=lambda o: -max(r["ms"].get(o, 0) for r in res.values()))
    print("| op | " + " | ".join(tags) + " |")
    print("|---|" + "---|" * len(tags))
    for o in ops:
        cells = [f"{res[t]['ms'][o]:.3f} ({res[t]['nodes'][o]})" if o in res[t]["ms"] else "" for t in tags]
        if max(res[t]["ms"].get(o, 0) for t in tags) >= 0.005:
            print(f"| {o} | " + " | ".join(cells) + " |")
    print("| **kernels total** | " + " | ".join(f"{sum(res[t]['ms'].values()):.2f}" for t in tags) + " |")
    print("| **model_run** | " + " | ".join(f"{res[t]['model_run_ms']:.2f}" for t in tags) + " |")
    conv = ("Conv", "QLinearConv")
    for t in tags:
        ms = res[t]["ms"]
        c = sum(ms.get(o, 0) for o in conv)
        print(f"{t}: convolutions {c:.2f} ms = {100 * c / sum(ms.values()):.0f} % of kernel time; "
              f"the rest (normalization, PReLU, layout/quantize conversions) {sum(ms.values()) - c:.2f} ms")


if __name__ == "__main__":
    main()
