"""Where a chunk's time goes: the batched executor's local training of K clients, profiled.

Prints, for MobileFaceNet (or any backbone) at the paper's local setting (n images per client,
batch 10, 2 epochs), interleaved over ``--repeats``:

* client-updates/s and peak memory per client of ``BatchedExecutor.train`` for each variant
  (``--variants``: the executor's switches, e.g. ``pointwise=matmul``);
* the rate of the same backbone trained as ONE shared model on ``K·B`` images per step
  (``reference``): what the card does when weights are not per client — the ceiling the
  per-client (vmapped) step is measured against;
* a ``torch.profiler`` summary of one chunk: the top kernels by device time, the device's busy
  share of the wall time (launch gaps = wall − busy), and copies.

CPU: ``python benchmarks/gpu_step_profile.py --device cpu --backbone tiny --image-size 32 --clients 4``
(seconds). GPU: ``python benchmarks/gpu_step_profile.py --device cuda --clients 32``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_sim.executors import ClientTask, LocalConfig, BatchedExecutor  # noqa: E402
from device_sim.methods import SimContext, parse_method  # noqa: E402
from fedfs_sdk.nn.model import FaceNet, ModelConfig  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args: argparse.Namespace, dev: torch.device):
    torch.manual_seed(0)
    mc = ModelConfig(args.backbone, input_size=args.image_size).resolved()
    xi = FaceNet(mc).eval().requires_grad_(False)
    method = parse_method(args.method)
    method.setup(SimContext(mc, xi, args.clients, 0, str(dev)))
    g = method.init_global()
    priv = method.init_private(g)
    plan = method.configure_round(1, np.arange(args.clients))
    s = int(mc.input_size)
    gen = torch.Generator().manual_seed(1)
    tasks = []
    for c in range(args.clients):
        x = torch.randint(0, 256, (args.images, 3, s, s), generator=gen, dtype=torch.uint8)
        x = ((x.float() - 127.5) / 127.5).to(dev)
        tasks.append(ClientTask(c, x, {"global": {k: v.to(dev) for k, v in g.items()},
                                       **{k: {n: t.to(dev) for n, t in w.items()} for k, w in priv.items()}},
                                method.client_consts(plan, method.client_state_init(c)), seed=c))
    local = LocalConfig(batch_size=args.batch_size, local_epochs=args.local_epochs, amp=args.amp)
    return mc, method, plan, tasks, local


def parse_variant(spec: str) -> dict[str, object]:
    """``fold=off,xi_once=false`` → BatchedExecutor keyword arguments."""
    if spec in ("", "default"):
        return {}
    out: dict[str, object] = {}
    for kv in spec.split(","):
        k, v = kv.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def time_chunk(ex: BatchedExecutor, method, plan, tasks, local, dev) -> tuple[float, int]:
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    ex.train(method, plan, tasks, local)
    sync(dev)
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else 0
    return dt, peak


def reference_rate(mc: ModelConfig, args, dev: torch.device, steps: int = 6) -> dict[str, float]:
    """Images/s of one shared backbone trained on K·B images per step (two models' worth per
    image-step is what FedFS needs: global + personal), plain and channels_last."""
    out = {}
    net = FaceNet(mc).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    bsz = args.clients * args.batch_size
    x = torch.randn(bsz, 3, mc.input_size, mc.input_size, device=dev)
    for layout in ("nchw", "channels_last"):
        m = net.to(memory_format=torch.channels_last) if layout == "channels_last" else net
        xin = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x
        amp = dev.type == "cuda" and args.amp == "bf16"
        for i in range(steps + 2):
            if i == 2:
                sync(dev)
                t0 = time.perf_counter()
            with torch.autocast(dev.type, torch.bfloat16, enabled=amp):
                loss = m(xin).embedding.float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(dev)
        out[layout] = steps * bsz / (time.perf_counter() - t0)
    return out


def profile_chunk(ex, method, plan, tasks, local, dev, top: int, steps: int = 2) -> dict:
    """``torch.profiler`` over the first ``steps`` local steps of the chunk (a whole chunk's trace
    takes minutes to post-process)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        ex.train(method, plan, tasks, local, max_steps=steps)
        sync(dev)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    dev_attr = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    rows = []
    for e in events:
        if dev.type == "cuda":
            # kernels only: an aten op's device time is its kernels' again (summing both counts twice)
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.self_device_time_total
        else:
            t = e.self_cpu_time_total
        if t:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows) / 1e6 if dev.type == "cuda" else float("nan")
    copies = sum(r[0] for r in rows if any(w in r[2].lower() for w in ("memcpy", "copy", "nchwtonhwc",
                                                                          "nhwctonchw"))) / 1e6
    return {"wall_s": wall, "device_busy_s": busy, "copy_s": copies, "attr": dev_attr, "steps": steps,
            "top": [{"ms": r[0] / 1e3, "calls": r[1], "name": r[2][:110]} for r in rows[:top]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--method", default="fedfs:scope=all")   # every layer trained: the paper's setting
    p.add_argument("--backbone", default="mobilefacenet")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--clients", type=int, default=16, help="K: clients in the chunk")
    p.add_argument("--images", type=int, default=57)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--amp", default="bf16")
    p.add_argument("--variants", nargs="*", default=["default"],
                   help="BatchedExecutor options per variant, e.g. default fold=off pointwise=matmul")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--profile", action="store_true", help="also profile one chunk of the first variant")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        args.amp = "off"
    mc, method, plan, tasks, local = build(args, dev)
    k = len(tasks)
    result: dict = {"config": vars(args), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "variants": {}}
    exs = {v: BatchedExecutor(dev, chunk_size=k, **parse_variant(v)) for v in args.variants}
    warm: dict[str, float] = {}
    for v, ex in exs.items():       # warm-up (cuDNN autotuning, allocator, compilation) outside the timings
        warm[v] = time_chunk(ex, method, plan, tasks, local, dev)[0]
    times: dict[str, list[float]] = {v: [] for v in exs}
    peaks: dict[str, int] = {}
    for _ in range(args.repeats):
        for v, ex in exs.items():   # interleaved: the machine's drift hits every variant alike
            dt, peak = time_chunk(ex, method, plan, tasks, local, dev)
            times[v].append(dt)
            peaks[v] = max(peaks.get(v, 0), peak)
    img_steps = sum(len(t.images) for t in tasks) * args.local_epochs
    for v in exs:
        med = float(np.median(times[v]))
        result["variants"][v] = {"seconds": times[v], "client_updates_per_s": k / med,
                                 "image_steps_per_s": img_steps / med, "peak_mb_per_client": peaks[v] / 2**20 / k,
                                 "warm_up_chunk_s": warm[v], "compile_s": exs[v].compile_s}
    if not args.no_reference:
        result["reference_images_per_s_one_model"] = reference_rate(mc, args, dev)
    print(f"{result['device_name']}, torch {torch.__version__}: {args.method}, {args.backbone}@{args.image_size}, "
          f"K={k} clients × {args.images} images, batch {args.batch_size}, {args.local_epochs} epochs, amp {args.amp}")
    print("| variant | client-updates/s | image-steps/s | peak MB/client | seconds | warm-up chunk s | compile s |")
    print("|---|---|---|---|---|---|---|")
    for v, r in result["variants"].items():
        print(f"| {v} | {r['client_updates_per_s']:.2f} | {r['image_steps_per_s']:.0f} | "
              f"{r['peak_mb_per_client']:.0f} | {' '.join(f'{s:.2f}' for s in r['seconds'])} | "
              f"{r['warm_up_chunk_s']:.1f} | {r['compile_s']:.1f} |")
    if "reference_images_per_s_one_model" in result:
        ref = result["reference_images_per_s_one_model"]
        print("one shared model, K·B images per step (images/s): " + ", ".join(f"{a} {b:.0f}" for a, b in ref.items()))
    for v, ex in exs.items():
        print(f"{v}: path {ex.path} ({ex.path_note})")
    sys.stdout.flush()
    if args.profile:
        result["profile"] = profile_chunk(exs[args.variants[0]], method, plan, tasks, local, dev, args.top)
        pr = result["profile"]
        print(f"profile of {pr['steps']} steps of the chunk ({args.variants[0]}): wall {pr['wall_s']:.2f} s, "
              f"kernels {pr['device_busy_s']:.2f} s, of which copies and layout transposes {pr['copy_s']:.3f} s")
        for r in pr["top"]:
            print(f"  {r['ms']:9.1f} ms {r['calls']:6d}×  {r['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
