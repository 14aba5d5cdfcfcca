"""Simulator throughput: client-updates/s and peak memory of the sequential and batched
executors, per device (the measurement behind ``make_executor("auto")``).

One *client update* is a participant's whole local training (``E`` epochs over its
images) plus its share of the FedAvg reduction. Every configuration runs in a fresh
subprocess so that peak memory is its own: peak RSS above the process's resident size
after set-up on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BenchConfig:
    method: str = "fedfs"
    backbone: str = "tiny"
    width: int | None = None
    image_size: int | None = None
    clients: int = 32
    images_per_client: int = 20
    uneven: bool = True
    batch_size: int = 16
    local_epochs: int = 1
    chunk_size: int = 0
    amp: str = "off"
    repeats: int = 2
    threads: int | None = None
    seed: int = 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _measure(cfg: BenchConfig, device: str, executor: str) -> dict[str, Any]:
    """Run in the current process: set up, warm up, time ``repeats`` rounds of ``clients``."""
    import torch

    from fedfs_sdk.nn.model import FaceNet, ModelConfig
    from server_agg.aggregate import fedavg_stacked

    from .executors import ClientTask, LocalConfig, make_executor, train_splitting
    from .methods import SimContext, parse_method

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mc = ModelConfig(cfg.backbone, input_size=cfg.image_size, width=cfg.width).resolved()
    xi = FaceNet(mc).eval().requires_grad_(False)
    method = parse_method(cfg.method)
    method.setup(SimContext(mc, xi, cfg.clients, cfg.seed, device))
    g = method.init_global()
    priv = method.init_private(g)
    kind, _, variant = executor.partition("-")          # "batched-vmap": the batched executor without folding
    ex = make_executor(kind, device, cfg.chunk_size, **({"fold": "off"} if variant == "vmap" else {}))
    plan = method.configure_round(1, np.arange(cfg.clients))
    rng = np.random.default_rng(cfg.seed)
    s = int(mc.input_size)
    tasks = []
    for c in range(cfg.clients):
        n = int(rng.integers(cfg.images_per_client // 2, cfg.images_per_client + 1)) if cfg.uneven else cfg.images_per_client
        x = torch.randn(n, 3, s, s, device=device)
        tasks.append(ClientTask(c, x, {"global": {k: v.to(device) for k, v in g.items()},
                                       **{k: {n_: t.to(device) for n_, t in w.items()} for k, w in priv.items()}},
                                method.client_consts(plan, method.client_state_init(c)), seed=c))
    local = LocalConfig(batch_size=cfg.batch_size, local_epochs=cfg.local_epochs, amp=cfg.amp)

    if getattr(ex, "needs_calibration", False):
        ex.calibrate(method, plan, tasks[:2], local)

    def one_round() -> None:
        a = 0
        while a < len(tasks):
            chunk = tasks[a:a + ex.chunk_size]
            res = train_splitting(ex, method, plan, chunk, local)
            fedavg_stacked(res.params["global"], res.num_samples)
            a += len(chunk)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    cuda = device.startswith("cuda")
    one_round()                                   # warm-up (and CUDA chunk calibration)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = _rss_bytes()
    t0 = time.perf_counter()
    for _ in range(cfg.repeats):
        one_round()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    params = sum(v.numel() for v in g.values()) + sum(v.numel() for w in priv.values() for v in w.values())
    return {"device": device, "executor": executor, "chunk_size": ex.chunk_size, "path": getattr(ex, "path", None),
            "client_updates_per_s": cfg.clients * cfg.repeats / dt, "seconds": dt,
            "peak_memory_mb": max(peak, 0) / 2**20, "trainable_params_per_client": int(params),
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "threads": torch.get_num_threads()}


def _child(cfg: BenchConfig, device: str, executor: str, q) -> None:
    try:
        q.put(_measure(cfg, device, executor))
    except Exception as e:  # reported by the parent, with the configuration that failed
        q.put({"device": device, "executor": executor, "error": f"{type(e).__name__}: {e}"})


def measure(cfg: BenchConfig, device: str, executor: str, isolate: bool = True) -> dict[str, Any]:
    """One configuration, in a fresh subprocess unless ``isolate=False``."""
    if not isolate:
        return _measure(cfg, device, executor)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(cfg, device, executor, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not p.is_alive():   # killed (e.g. out of memory) before it could report
                out = {"device": device, "executor": executor,
                       "error": f"benchmark process died with exit code {p.exitcode} (out of memory?)"}
                break
    p.join()
    return out


EXECUTORS = ("sequential", "batched", "batched-vmap")
"""``batched``: client-folded trunk where the method allows (else vmap); ``batched-vmap``: vmap only."""


def run_benchmark(cfg: BenchConfig, devices: list[str], executors: tuple[str, ...] = ("sequential", "batched"),
                  isolate: bool = True) -> dict[str, Any]:
    rows = [measure(cfg, d, e, isolate) for d in devices for e in executors]
    winners: dict[str, str] = {}
    for d in devices:
        ok = [r for r in rows if r["device"] == d and "error" not in r]
        if ok:
            winners[d] = max(ok, key=lambda r: r["client_updates_per_s"])["executor"]
    return {"config": asdict(cfg), "rows": rows, "winner": winners, "store_10k": store_estimate(cfg)}


def store_estimate(cfg: BenchConfig, num_clients: int = 10_000) -> dict[str, float]:
    """GiB to hold ``num_clients`` personalized models of this method/backbone (client store)."""
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    from .client_store import estimate_memory
    from .methods import SimContext, parse_method

    mc = ModelConfig(cfg.backbone, input_size=cfg.image_size, width=cfg.width).resolved()
    method = parse_method(cfg.method)
    method.setup(SimContext(mc, FaceNet(mc), num_clients, cfg.seed))
    priv = method.init_private(method.init_global())
    # what the store keeps per client: the tensors local training moves (scope=top: the top only)
    params = sum(v.numel() for g, w in priv.items() for k, v in w.items() if method.trains_tensor(g, k))
    return {"params_per_client": params, **{dt: estimate_memory(num_clients, params, dt).gib for dt in ("fp32", "fp16")}}


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    head = (f"method {cfg['method']}, backbone {cfg['backbone']}, {cfg['clients']} clients × "
            f"~{cfg['images_per_client']} images, batch {cfg['batch_size']}, {cfg['local_epochs']} local epoch(s)")
    lines = [head, "", "| device | executor | chunk | client-updates/s | peak memory MB | params/client |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['device']} | {r['executor']} | – | error: {r['error']} | – | – |")
            continue
        name = r['executor'] + (f" ({r['path']})" if r.get("path") else "")
        lines.append(f"| {r['device_name']} | {name} | {r['chunk_size']} | {r['client_updates_per_s']:.2f} | "
                     f"{r['peak_memory_mb']:.0f} | {r['trainable_params_per_client']:,} |")
    lines.append("")
    lines += [f"winner on {d}: {e}" for d, e in result["winner"].items()]
    st = result.get("store_10k") or {}
    if st.get("params_per_client"):
        lines.append(f"client store for 10,000 clients' personalized models ({st['params_per_client']:,} params each): "
                     f"{st['fp32']:.2f} GiB fp32, {st['fp16']:.2f} GiB fp16")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="all", help="cpu, cuda or all (cuda only where available)")
    p.add_argument("--method", default="fedfs:scope=all",
                   help="method spec (see fedfs simulate --method; default: FedFS training every layer, the paper's setting)")
    p.add_argument("--backbone", default="tiny", choices=["tiny", "mobilefacenet", "feduv_cnn"])
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--clients", type=int, default=32, help="clients per timed round")
    p.add_argument("--images", type=int, default=20, help="max images per client (uneven: n/2..n)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=0, help="batched executor chunk (0: auto)")
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--executors", nargs="+", default=["sequential", "batched"], choices=EXECUTORS,
                   help="executors to compare (batched-vmap: the batched executor without the client-folded trunk)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(method=args.method, backbone=args.backbone, width=args.width, image_size=args.image_size,
                       clients=args.clients, images_per_client=args.images, batch_size=args.batch_size,
                       local_epochs=args.local_epochs, chunk_size=args.chunk_size, amp=args.amp,
                       repeats=args.repeats, threads=args.threads)


def devices_from_arg(arg: str) -> list[str]:
    import torch

    if arg == "all":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [arg]

