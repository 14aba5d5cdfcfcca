"""The paper's simulation setting, timed phase by phase, and its full run extrapolated.

FedFS Table 2's setting: 10,000 single-identity clients with 57 training images each (DigiFace-1M
counts; 10 test images here), participation p = 0.7, 5 rounds, 2 local epochs, batch 10, a
MobileFaceNet at 112 px — 35,000 client updates. This script builds that population (SynthFaces
rendered on the training device), then for each method runs a bounded *slice*: one round with
``--slice`` participants (all of the round's machinery: client store, ξ cache, calibration,
chunks, FedAvg) and an evaluation of ``--eval-clients`` clients. It prints, per method:

* seconds per phase (data, ξ, calibration, training, FedAvg, client store, evaluation), each
  device-synchronized at its edges so GPU time lands in its own phase;
* the GPU's busy share per phase (NVML samples every 0.1 s), peak GPU memory, the chunk size
  the calibration chose and why;
* client-updates/s of the training phase and of the whole round;
* the full setting's time extrapolated from the per-update phase times (× 35,000) plus the
  evaluation scaled to its client count (``--eval-full-clients``, 1,000 by default as in
  ``fedfs simulate``).

``--compile off auto`` runs each method once per mode of the folded trunk's ``torch.compile``
(``device_sim/executors/compiled.py``; ``auto`` = compiled on CUDA with Triton): the eager and the
compiled path side by side in one call. Compilation is timed apart (``compile`` line: the first
forward + backward of each chunk shape) and left out of the training rate and the extrapolation
(it is paid once per run, not per update). A method whose path is not folded (``scope=top``:
vmap over the top) runs once — compilation does not apply to it.

``--full`` runs the whole setting (5 rounds at p = 0.7) instead of the slice and reports the
measured total. On CPU the same table comes out at small sizes, showing Python and launch
overhead: ``python benchmarks/gpu_paper_scale.py --device cpu --backbone tiny --image-size 32
--clients 200 --slice 16 --eval-clients 8``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_sim.datasets import SynthDataset  # noqa: E402
from device_sim.evaluate import EvalConfig, evaluate  # noqa: E402
from device_sim.executors import LocalConfig  # noqa: E402
from device_sim.federation import Federation, FederationConfig  # noqa: E402
from device_sim.image_store import plan_data_cache  # noqa: E402
from device_sim.methods import parse_method  # noqa: E402
from device_sim.phases import PhaseTimer, UtilizationSampler  # noqa: E402
from device_sim.population import Population  # noqa: E402
from device_sim.splits import make_splits  # noqa: E402
from device_sim.synthfaces import SynthFaces  # noqa: E402
from fedfs_sdk.nn.model import FaceNet, ModelConfig  # noqa: E402

PHASES = ("prepare", "data", "xi", "calibrate", "compile", "train", "fedavg", "store", "eval")


def build_population(args: argparse.Namespace, dev: torch.device) -> Population:
    per = args.images + args.test_images
    faces = SynthFaces(seed=0, image_size=args.image_size)
    ds = SynthDataset(faces, images_per_identity=per, num_identities=args.clients, device=dev, cache_bytes=0)
    splits = make_splits(args.clients, 0, args.clients, 0, train_per_client=args.images,
                         test_per_client=args.test_images, seed=0)
    pop = Population(ds, splits)
    pop.use_image_store(plan_data_cache(args.data_cache, pop.image_store_bytes(), dev))
    return pop


def load_xi(args: argparse.Namespace, dev: torch.device) -> FaceNet:
    torch.manual_seed(0)
    mc = ModelConfig(args.backbone, input_size=args.image_size)
    if args.pretrained:
        from fedfs_sdk.nn.checkpoint import load_checkpoint
        return load_checkpoint(args.pretrained)[0].eval().requires_grad_(False)
    return FaceNet(mc).eval().requires_grad_(False)


def run_method(spec: str, pop: Population, xi: FaceNet, args: argparse.Namespace, dev: torch.device,
               compile_mode: str = "auto") -> dict:
    rounds = args.rounds if args.full else 1
    participation = args.participation if args.full else min(1.0, args.slice / args.clients)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    fed = Federation(parse_method(spec), pop, xi, FederationConfig(
        rounds=rounds, participation=participation, seed=0, device=str(dev), executor="batched",
        chunk_size=args.chunk_size, store_dtype=args.store_dtype, store_location=args.store_location,
        compile=compile_mode, local=LocalConfig(batch_size=args.batch_size, local_epochs=args.local_epochs, amp=args.amp)))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    prepare_s = time.perf_counter() - t0      # method.prepare: e.g. fedfs+feduv's pooled ξ statistics
    for k, v in executor_options(args).items():
        setattr(fed.executor, k, v)
    fed.phases = PhaseTimer(sync=dev)
    fed.phases.seconds["prepare"] = prepare_s
    sampler = UtilizationSampler(dev, lambda: fed.phases.current) if dev.type == "cuda" else None
    with (sampler if sampler is not None else _Null()):
        records = fed.run()
        with fed.phases("eval"):
            ev = evaluate(fed.method, fed.global_weights, fed.private_weights, pop,
                          EvalConfig(max_clients=args.eval_clients, impostor_pool=args.impostor_pool), device=str(dev))
    wall = time.perf_counter() - t0
    updates = sum(r.participants for r in records)
    distinct = len(fed.feature_caches[0]) if fed.feature_caches else updates     # clients whose features were computed
    ph = dict(fed.phases.seconds)
    compile_s = float(getattr(fed.executor, "compile_s", 0.0))
    if compile_s:           # paid once per run: its own line, out of the per-update training time
        ph["train"] = max(ph.get("train", 0.0) - compile_s, 0.0)
        ph["compile"] = compile_s
    out = {"method": spec if compile_mode == "auto" else f"{spec} compile={compile_mode}", "label": fed.method.label,
           "compile_mode": compile_mode, "compiled": bool(getattr(fed.executor, "compile", False)) and compile_s > 0,
           "rounds": rounds, "updates": updates, "wall_s": wall,
           "distinct_clients": distinct,
           "phases_s": ph, "executor_path": fed.executor.path, "executor_note": fed.executor.path_note,
           "chunk_size": fed.executor.chunk_size, "oom_splits": fed.executor.oom_splits,
           "memory_plan": fed.executor.memory_plan.describe() if fed.executor.memory_plan else None,
           "train_updates_per_s": updates / max(ph.get("train", 0.0), 1e-9),
           "round_updates_per_s": updates / max(sum(ph.get(p, 0.0) for p in PHASES if p != "eval"), 1e-9),
           "pairwise_auroc": ev.get("pairwise", {}).get("auroc"), "eval_clients": len(ev.get("clients", []))}
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        out["gpu_busy_pct"] = {p: sampler.mean(p) for p in PHASES if sampler.mean(p) is not None}
        out["gpu_busy_error"] = sampler.error
    out["extrapolated_s"] = extrapolate(out, args)
    print_table([out], args, dev)
    sys.stdout.flush()
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def executor_options(args: argparse.Namespace) -> dict:
    opts = {}
    if args.fold:
        opts["fold"] = args.fold
    if args.pointwise:
        opts["pointwise"] = args.pointwise
    return opts


def distinct_clients(clients: int, participation: float, rounds: int) -> float:
    """Expected clients that take part at least once: ``N·(1 − (1 − p)^T)`` (9,976 of 10,000 at
    p = 0.7, T = 5)."""
    return clients * (1.0 - (1.0 - participation) ** rounds)


def extrapolate(res: dict, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of the full setting. Training, FedAvg and the client store cost per update:
    × the setting's updates. The data (the image store fills a client's images on its first
    participation) and ξ (cached per client for the run) cost per client once: × the clients
    expected to take part at least once, over the slice's distinct participants. Calibration and
    ``prepare`` once; evaluation scaled to ``--eval-full-clients``."""
    full_updates = args.full_rounds * round(args.full_participation * args.full_clients)
    per_update = {p: res["phases_s"].get(p, 0.0) / max(res["updates"], 1) for p in ("train", "fedavg", "store")}
    out = {p: v * full_updates for p, v in per_update.items()}
    seen = distinct_clients(args.full_clients, args.full_participation, args.full_rounds)
    for p in ("data", "xi"):
        out[p] = res["phases_s"].get(p, 0.0) * seen / max(res["distinct_clients"], 1)
    out["calibrate"] = res["phases_s"].get("calibrate", 0.0)
    out["compile"] = res["phases_s"].get("compile", 0.0)      # once per run (each chunk shape once)
    out["prepare"] = res["phases_s"].get("prepare", 0.0)   # ≤ 1,000 clients' images whatever the population
    ev = res["phases_s"].get("eval", 0.0)
    out["eval"] = ev * min(args.eval_full_clients, args.full_clients) / max(res["eval_clients"], 1)
    out["total"] = sum(out.values())
    out["updates"] = full_updates
    return out


def print_table(results: list[dict], args: argparse.Namespace, dev: torch.device) -> None:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}: {args.backbone}@{args.image_size}, {args.clients} clients × "
          f"{args.images} train + {args.test_images} test images, batch {args.batch_size}, {args.local_epochs} local "
          f"epochs, amp {args.amp}; {'full run' if args.full else f'slice of {args.slice} participants'}")
    cols = [r["method"] for r in results]
    print("| phase | " + " | ".join(f"{c} s" for c in cols) + (" | " + " | ".join(f"{c} GPU busy %" for c in cols)
                                                            if dev.type == "cuda" else "") + " |")
    print("|---" * (1 + len(cols) * (2 if dev.type == "cuda" else 1)) + "|")
    for p in PHASES:
        row = [f"{r['phases_s'].get(p, 0.0):.2f}" for r in results]
        if dev.type == "cuda":
            row += [("%.0f" % r["gpu_busy_pct"][p]) if r.get("gpu_busy_pct", {}).get(p) is not None else "–"
                    for r in results]
        print(f"| {p} | " + " | ".join(row) + " |")
    for r in results:
        ex = r["extrapolated_s"]
        print(f"{r['method']}: {r['updates']} updates, training {r['train_updates_per_s']:.1f} client-updates/s, "
              f"round {r['round_updates_per_s']:.1f}/s; executor {r['executor_path']} ({r['executor_note']}), chunk "
              f"{r['chunk_size']}, OOM splits {r['oom_splits']}" + (f", peak {r['peak_gib']:.1f} GiB" if 'peak_gib' in r else "")
              + (f"; {r['memory_plan']}" if r["memory_plan"] else ""))
        print(f"  full setting ({ex['updates']} updates + evaluation of {min(args.eval_full_clients, args.full_clients)} "
              f"clients), extrapolated: {ex['total'] / 60:.1f} min = " +
              " + ".join(f"{p} {ex[p]:.0f} s" for p in PHASES))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", nargs="+", default=["fedfs:scope=all", "fedfs+feduv:scope=all"],
                   help="method specs (default: the papers' setting, every layer of ϕ trained; the SDK default trains the top only, scope=top)")
    p.add_argument("--backbone", default="mobilefacenet")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--pretrained", default=None, help="ξ checkpoint (default: random weights — timing only)")
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--images", type=int, default=57, help="training images per client")
    p.add_argument("--test-images", type=int, default=10)
    p.add_argument("--participation", type=float, default=0.7)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--amp", default=None, help="off|bf16|fp16 (default: bf16 on CUDA, off on CPU)")
    p.add_argument("--chunk-size", type=int, default=0, help="0: calibrated from free memory")
    p.add_argument("--fold", default=None, help="executor fold mode (auto|off)")
    p.add_argument("--pointwise", default=None, help="folded 1×1 convolutions: conv|matmul")
    p.add_argument("--compile", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                   help="torch.compile of the folded trunk, one run per mode (e.g. off auto: eager and compiled)")
    p.add_argument("--data-cache", default="auto", help="auto|device|host|none (device_sim.image_store)")
    p.add_argument("--store-dtype", default="fp16")
    p.add_argument("--store-location", default=None, help="client store: cuda|cpu (default: the device)")
    p.add_argument("--slice", type=int, default=512, help="participants of the timed round (not with --full)")
    p.add_argument("--eval-clients", type=int, default=64)
    p.add_argument("--impostor-pool", type=int, default=2000)
    p.add_argument("--eval-full-clients", type=int, default=1000, help="clients the full run evaluates")
    p.add_argument("--full", action="store_true", help="run the whole setting (all rounds at --participation)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    args.amp = args.amp or ("bf16" if dev.type == "cuda" else "off")
    args.store_location = args.store_location or ("cuda" if dev.type == "cuda" else "cpu")
    args.full_clients, args.full_rounds, args.full_participation = args.clients, args.rounds, args.participation
    xi = load_xi(args, dev)
    t0 = time.perf_counter()
    pop = build_population(args, dev)
    print(f"population of {args.clients} clients: {time.perf_counter() - t0:.1f} s; data cache: "
          f"{pop.store.plan.reason if pop.store is not None else 'none'}", flush=True)
    results = []
    for spec in args.methods:
        for mode in args.compile:
            res = run_method(spec, pop, xi, args, dev, mode)
            results.append(res)
            if res["executor_path"] != "folded":      # nothing to compile (scope=top): one run
                break
    if len(results) > 1:
        print_table(results, args, dev)
    out = {"config": vars(args), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
