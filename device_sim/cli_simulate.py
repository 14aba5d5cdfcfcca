"""``fedfs simulate``: run federations of single-identity clients and report the papers' metrics.

Example::

    fedfs simulate --method pretrained fedfs feduv:c=255 fedfs+feduv --data synth \\
        --clients 100 --rounds 10 --participation 0.5 --out runs/exp1

    fedfs simulate --method fedfs --data /data/digiface --image-size 112 --backbone mobilefacenet \\
        --pretrained xi.safetensors --clients 0 --device cuda --out runs/digiface

Writes ``DIR/results.json`` (settings, per-round history, all metrics), ``DIR/results.md``
(the table) and ``DIR/roc.png``; checkpoints under ``DIR/checkpoints/<method>/`` resume
with ``--resume``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedfs_sdk.fileio import atomic_write_bytes
from fedfs_sdk.errors import InputError
from fedfs_sdk.runtime.preprocess import face_mode

from . import cli_distributed, distributed, dp_sim
from .cli_common import (add_data_arguments, add_device_argument, add_pretrain_arguments, progress_bar, setup_device,
                         skipped_lines)
from .experiment import ExperimentConfig
from .experiment_data import build_data, public_impostor_images
from .experiment_resolve import experiment_from_args
from .evaluate import EvalConfig, evaluate
from .executors import COMPILE_MODES, LocalConfig
from .folder_split import auto_warmup_q
from .federation import Federation, FederationConfig, checkpoint_path, latest_checkpoint
from .methods import REGISTRY, parse_method
from .image_store import plan_data_cache
from .methods.selection import HoldoutView
from .population import Population
from .prefetch import PREFETCH_MODES
from .trunk_cache import persistent_trunk_cache
from .acquisition import acquisition, acquisition_line, run_timing, timing_line
from .report import (combine_seeds, headroom_line, markdown_table, notes_lines, seeds_markdown_table, slug,
                     write_results)
from .xi_source import resolve_xi


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", nargs="+", default=["pretrained", "fedfs", "feduv", "fedfs+feduv"],
                   help=f"one or more of {sorted(REGISTRY)}, with options as name:key=value,… "
                        "(e.g. feduv:c=511,neg=early,neg_rounds=5)")
    p.add_argument("--rounds", type=int, default=10, help="federated rounds T")
    p.add_argument("--participation", type=float, default=0.5, help="fraction p of clients per round")
    p.add_argument("--local-epochs", type=int, default=None, help="local epochs E (default: the method's paper value)")
    p.add_argument("--lr", type=float, default=None,
                   help="local SGD lr for every method (default: each method preset's: fedfs 5e-3, feduv 0.1, fedfs+feduv 0.02, "
                        "fedfs+feduv:paper 5e-3)")
    p.add_argument("--head-lr", type=float, default=None, help="lr of a randomly started head (default: the "
                   "method's — 20 for the FedUV head W, which σ makes scale-invariant; 0.1 for class embeddings)")
    p.add_argument("--batch-size", type=int, default=10, help="local batch size")
    p.add_argument("--momentum", type=float, default=0.0, help="local SGD momentum")
    p.add_argument("--weight-decay", type=float, default=0.0, help="local SGD weight decay")
    p.add_argument("--seed", type=int, default=0, help="federation seed (sampling, init, local shuffles)")
    p.add_argument("--seeds", type=int, default=1, help="repeat the whole experiment K times with seed and "
                   "--split-seed advanced by 0 … K−1 (other clients, other ξ) and report mean ± sd and "
                   "each seed's paired Δ vs pretrained")
    p.add_argument("--pretrained", default=None, help="ξ checkpoint (default: pre-train on the public identities, cached)")
    p.add_argument("--executor", default="auto", choices=["auto", "sequential", "batched"],
                   help="auto: batched (vmap) on CUDA, sequential on CPU")
    p.add_argument("--chunk-size", type=int, default=0, help="clients per executor call (0: auto)")
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"], help="autocast on CUDA")
    p.add_argument("--store-dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="precision of stored θ_c")
    p.add_argument("--store-location", default="cpu", choices=["cpu", "pinned", "cuda", "disk"], help="where θ_c lives")
    p.add_argument("--prefetch", default="auto", choices=list(PREFETCH_MODES),
                   help="prepare the next chunk's images while a chunk trains (auto: on CUDA); changes no result")
    p.add_argument("--compile", default="auto", choices=list(COMPILE_MODES),
                   help="the batched executor's client-folded trunk through torch.compile (auto: on CUDA with "
                        "Triton, eager on CPU); a failed compilation falls back to eager and says why")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K rounds (and at the end) when > 0")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in DIR")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every K rounds (history) when > 0")
    p.add_argument("--eval-clients", type=int, default=1000, help="evaluate at most this many clients")
    p.add_argument("--impostor-pool", type=int, default=2000, help="at most this many impostor images per client")
    p.add_argument("--q", type=float, default=None, help="FedUV warm-up target TPR (default 0.9; for a folder "
                   "whose identities have fewer than the 10 warm-up images 0.9 needs: the largest q they allow, "
                   "stated under the table)")
    p.add_argument("--out", default="runs/simulate", help="output directory (a relative path is relative to the "
                   "current directory)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    _add_dp_arguments(p)
    cli_distributed.add_arguments(p)
    add_device_argument(p)
    add_data_arguments(p)
    add_pretrain_arguments(p)


def _add_dp_arguments(p: argparse.ArgumentParser) -> None:
    """User-level DP-FedAvg (McMahan et al. 2018; device_sim.dp_sim, docs/privacy.md)."""
    g = p.add_argument_group("user-level differential privacy (DP-FedAvg)")
    g.add_argument("--dp-epsilon", type=float, default=None, help="target ε after --rounds rounds: σ is "
                   "calibrated (RDP accountant, dp-accounting); 'inf' clips without noise")
    g.add_argument("--dp-noise", type=float, default=None, help="noise multiplier σ (instead of --dp-epsilon)")
    g.add_argument("--dp-clip", type=float, default=None, help="C: L2 bound on a client's update of the global weights")
    g.add_argument("--dp-delta", type=float, default=None, help="δ of the reported ε (default N^-1.1)")


def experiment_from_argv(argv: list[str], command: str | None = None) -> ExperimentConfig:
    """The resolved config of ``fedfs simulate ARGV`` (for scripts and tests)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return replace(experiment_from_args(p.parse_args(argv)), command=command)


def federation_config(cfg: ExperimentConfig) -> FederationConfig:
    t, rt = cfg.train, cfg.runtime
    local = LocalConfig(lr=t.lr, head_lr=t.head_lr, local_epochs=t.local_epochs, batch_size=t.batch_size,
                        momentum=t.momentum, weight_decay=t.weight_decay, amp=rt.amp)
    return FederationConfig(rounds=t.rounds, participation=t.participation, local=local, seed=t.seed,
                            device=rt.device, executor=rt.executor, chunk_size=rt.chunk_size,
                            store_dtype=rt.store_dtype, store_location=rt.store_location, prefetch=rt.prefetch,
                            compile=rt.compile)


def run_method(spec: str, pop: Population, xi, cfg: ExperimentConfig, out: Path,
               eval_cfg: EvalConfig, keep: dict[str, Federation] | None = None) -> dict[str, Any]:
    """Train (or resume) one method's federation, evaluate it, return its result row
    (and put the federation in ``keep[spec]`` when given)."""
    method = parse_method(spec)
    fcfg = federation_config(cfg)
    ckdir = out / "checkpoints" / slug(method.label)
    dist = distributed.current(cfg.runtime.rank_split)
    data = pop
    if getattr(method, "scope", "all") == "top" and cfg.train.weight_decay:
        raise InputError(f"{method.label}: scope=top keeps the trunk at ξ's weights; --weight-decay would shrink it")
    if getattr(method, "select", "off") != "off":    # do no harm: train without the hold-out, choose after
        imp = public_impostors(cfg, pop)
        if imp.shape[0] >= 2:
            data = HoldoutView(pop, imp, method.holdout, seed=cfg.train.seed)
        elif method.select != "auto":   # auto: no public identities, no check (said in the method's options)
            raise InputError(f"{method.label}: select={method.select} needs a public impostor set, i.e. public "
                             "identities (--public N ≥ 1, or --pretrain-data); or pass select=off")
    fed = Federation(method, data, xi, fcfg, store_path=ckdir / "store.mmap", dist=dist)
    fed.dp = dp_sim.from_experiment(cfg, pop.num_clients) if method.trains else None
    if fed.dp is not None:
        dp_sim.check_dp_method(method)
    quiet, every, ck_every = cfg.output.quiet, cfg.evaluation.eval_every, cfg.output.checkpoint_every
    if cfg.output.resume and (ck := latest_checkpoint(ckdir)) is not None:
        fed.load(ck)
    planned = fed.planned_rounds          # one pass for a per-client baseline (local_only)
    t0 = time.perf_counter()
    if method.trains and fed.round < planned:
        with progress_bar(f"{method.label}", total=planned, unit="round", disable=quiet) as bar:
            bar.update(fed.round)

            def on_round(f: Federation, rec) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec.metrics.get('loss_mean', float('nan')):.4f}",
                                upd_s=f"{rec.client_updates_per_s:.1f}")
                # evaluate first, so a checkpoint of this round holds its eval in the history
                if every and f.round % every == 0 and f.round < planned:
                    f.collect_private()             # distributed: the shards to rank 0, which evaluates
                    rec.eval = _summary(_evaluate(f, pop, eval_cfg, cfg, quiet=True)) if f.is_main else None
                if ck_every and (f.round % ck_every == 0 or f.round == planned):
                    f.save(checkpoint_path(ckdir, f.round))

            fed.run(planned, on_round=on_round)
    train_s = time.perf_counter() - t0
    fed.collect_private()
    t1 = time.perf_counter()
    result = _evaluate(fed, pop, eval_cfg, cfg, quiet=quiet) if fed.is_main else None
    eval_s = time.perf_counter() - t1
    if keep is not None:
        keep[spec] = fed
    selection = None
    if getattr(method, "selection", None) is not None and result is not None:
        selection = {"counts": method.selection.counts(result["clients"]),
                     "per_client": [method.selection.choices.get(c) for c in result["clients"]],
                     "checks": [method.selection.details.get(c) for c in result["clients"]],
                     "verdicts": {k: v.to_dict() for k, v in method.selection.verdicts.items()}}
    return {"method": method.name, "label": method.label, "options": method.options(), "rounds": fed.round,
            **({"selection": selection} if selection is not None else {}),
            "seconds": train_s, "eval_seconds": eval_s, "touched_clients": int(fed.store.touched().size) if fed.store is not None else None,
            "history": [vars(h) for h in fed.history], "eval": result,
            **({"dp": fed.dp.record(fed.round)} if fed.dp is not None and method.trains else {})}


_IMPOSTORS: dict[int, Any] = {}


def public_impostors(cfg: ExperimentConfig, pop: Population):
    """The run's public impostor set (:func:`public_impostor_images`), built once per population."""
    key = id(pop)
    if key not in _IMPOSTORS:
        _IMPOSTORS.clear()
        _IMPOSTORS[key] = public_impostor_images(cfg, pop.dataset, pop.splits)
    return _IMPOSTORS[key]


def _evaluate(fed: Federation, pop: Population, eval_cfg: EvalConfig, cfg: ExperimentConfig, quiet: bool) -> dict:
    with progress_bar(f"evaluating {fed.method.label}", unit="client", disable=quiet) as bar:
        def cb(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        return evaluate(fed.method, fed.global_weights, fed.private_weights, pop, eval_cfg, cfg.runtime.device,
                        client_state=fed.client_state, progress=cb)


def _summary(ev: dict) -> dict:
    return {"auroc": ev["verification"]["auroc"]["mean"],
            "warmup_tpr": ev["warmup"]["tpr"]["mean"], "warmup_fpr": ev["warmup"]["fpr_participants"]["mean"]}


def run_simulation(cfg: ExperimentConfig, title: str = "fedfs simulate",
                   keep: dict[str, Federation] | None = None) -> dict[str, Any] | None:
    """Everything ``fedfs simulate`` does for a resolved config; returns the results dict (also
    written to ``--out``). ``keep`` receives the trained federations by method spec. In a
    distributed run only rank 0 evaluates, writes and returns the results; the other ranks
    return None."""
    cfg.require_resolved("run_simulation")
    setup_device(cfg.runtime)
    dctx = distributed.current()
    main = dctx is None or dctx.is_main
    if not main:
        cfg = cfg.with_fields(quiet=True)
    quiet, t = cfg.output.quiet, cfg.train
    if t.rounds < 0:
        raise InputError(f"--rounds must be ≥ 0, got {t.rounds}")
    for spec in t.method:  # fail fast on a typo before any pre-training
        parse_method(spec)
    out = Path(cfg.output.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    if main:
        out.mkdir(parents=True, exist_ok=True)      # an unwritable --out fails now, not after training
    t0 = time.perf_counter()
    ds, splits = _build_data(cfg, quiet)
    data_s = time.perf_counter() - t0
    faces = splits.meta.get("faces")
    notes = list(splits.meta.get("plan", []))
    q = cfg.evaluation.q
    if q is None:
        q, why = auto_warmup_q(splits) if cfg.data.data != "synth" else (0.9, None)
        notes += [why] if why else []
    if not quiet:      # before training, so a long run shows at once what it runs on
        for line in ([faces["line"]] if faces else []) + notes + skipped_lines(splits.meta.get("skipped") or {}):
            print(line, file=sys.stderr, flush=True)
    pop = Population(ds, splits)
    cache = plan_data_cache(cfg.runtime.data_cache, pop.image_store_bytes(), cfg.runtime.device)
    pop.use_image_store(cache)
    if not quiet:
        print(cache.reason, file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    xi, xi_info = resolve_xi(cfg, ds, splits, quiet=quiet) if main else (None, None)
    xi_s = time.perf_counter() - t1
    if dctx is not None:        # ξ pre-trained (or read) once, on rank 0: every rank the same weights
        xi, xi_info = distributed.broadcast((xi, xi_info), dctx)
    eval_cfg = EvalConfig(q=q, max_clients=cfg.evaluation.eval_clients, impostor_pool=cfg.evaluation.impostor_pool,
                          seed=t.seed)
    # ξ's trunk features kept between runs ($FEDFS_CACHE_DIR/trunk): a second run on the same photos
    # runs ξ's trunk on none of them; written after each method, so a stopped run keeps what it did.
    # A folder of photos only: its size bounds the file; SynthFaces populations (10⁴ clients on a GPU,
    # rendered again in seconds) would make it hundreds of MB, rewritten after every method
    folder = cfg.data.data != "synth"
    trunk = persistent_trunk_cache(xi, cfg.xi.cache_dir, cfg.runtime.device) if main and folder else None
    rows = []
    for spec in t.method:
        rows.append(run_method(spec, pop, xi, cfg, out, eval_cfg, keep))
        if trunk is not None:
            trunk.flush()
    if not main:
        return None
    results = {"title": title, "settings": cfg.to_settings(), "xi": xi_info, "eval_config": vars(eval_cfg),
               "population": {"clients": pop.num_clients, "new_users": pop.num_new_users,
                              "public": len(splits.public), "image_size": pop.image_size, "data": repr(ds)},
               "notes": notes, "skipped": splits.meta.get("skipped"),
               "data_cache": {**cache.to_dict(), **pop.store.stats()},
               "clients": _client_names(ds, splits),
               "wall_seconds": time.perf_counter() - t0, "methods": rows}
    if trunk is not None:
        results["trunk_cache"] = {"file": str(trunk.file), "read": trunk.loaded, "computed": trunk.misses,
                                  "hits": trunk.hits}
    if faces is not None:
        results["faces"] = faces
        for r in rows:
            if r.get("eval") is not None:
                r["eval"]["acquisition"] = acquisition(faces, r["eval"], ds, splits)
    results["timing"] = run_timing(data_s, faces, xi_s, rows, results["wall_seconds"])
    results["files"] = {k: str(v) for k, v in write_results(out, results, title).items()}
    return results


def _build_data(cfg: ExperimentConfig, quiet: bool):
    """:func:`build_data` with the progress bar of finding a folder's faces."""
    if cfg.data.data == "synth" or face_mode(cfg.data.detect_face) not in ("align", "dlib-chip"):
        return build_data(cfg)
    with progress_bar("finding faces", unit="photo", disable=quiet) as bar:
        def cb(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        return build_data(cfg, face_progress=cb)


def _client_names(ds, splits) -> list[str]:
    """Identity name of each client (client ``c`` ↔ ``names[c]``: what ``--client c`` of
    ``fedfs export`` / ``fedfs enroll`` refers to). Empty for SynthFaces' large populations."""
    if splits.num_clients > 10_000:
        return []
    return ds.identity_names(splits.identities("clients"))


def run_seeds(cfg: ExperimentConfig, title: str = "fedfs simulate") -> dict[str, Any] | None:
    """``--seeds K``: :func:`run_simulation` K times (seed and split seed ``+k``) into
    ``--out/seed_k``, then the combined table (mean ± sd over seeds, each seed's paired Δ)
    in ``--out/results.md`` and ``--out/results.json``."""
    t = cfg.train
    if t.seeds < 1:
        raise InputError(f"--seeds must be ≥ 1, got {t.seeds}")
    out = Path(cfg.output.out)
    per_seed = []
    for k in range(t.seeds):
        c = cfg.with_fields(seed=t.seed + k, split_seed=cfg.data.split_seed + k, out=str(out / f"seed_{k}"))
        per_seed.append(run_simulation(c, title=f"{title} (seed {c.train.seed})"))
    if per_seed[0] is None:         # a distributed rank other than 0: rank 0 writes
        return None
    rows = combine_seeds(per_seed)
    head = f"{title}: {per_seed[0]['population']['clients']} clients, {t.rounds} rounds, " \
           f"p = {t.participation}, {t.seeds} seeds"
    table = seeds_markdown_table(rows, head)
    # cells a seed could not measure (FAR below 1/n_impostor, empty warm-ups): said once, from every seed
    foot = notes_lines([r for res in per_seed for r in res["methods"]])
    notes = list(dict.fromkeys(n for res in per_seed for n in res.get("notes") or []))
    if foot or notes:
        table += "\n" + "\n".join(notes + (["Per seed (seed_*/results.md marks the cells):"] + foot if foot else [])) + "\n"
    combined = {"title": title, "seeds": [r["settings"]["seed"] for r in per_seed], "methods": rows, "notes": notes,
                "per_seed": [str(out / f"seed_{k}" / "results.json") for k in range(t.seeds)]}
    atomic_write_bytes(out / "results.json", json.dumps(combined, indent=1, default=str).encode())
    atomic_write_bytes(out / "results.md", table.encode())
    return {"table": table, "combined": combined, "per_seed": per_seed,
            "files": {"json": str(out / "results.json"), "md": str(out / "results.md")}}


def run(args: argparse.Namespace) -> int:
    """``fedfs simulate``: the command line becomes a resolved :class:`ExperimentConfig` here, once."""
    cfg = experiment_from_args(args)
    if cfg.runtime.distributed or cfg.runtime.workers > 1:
        return cli_distributed.run_distributed(cfg, run_here)
    return run_here(cfg)


def run_here(cfg: ExperimentConfig) -> int:
    """``fedfs simulate`` in this process (one rank of it when distributed: rank 0 prints)."""
    t = cfg.train
    if t.seeds > 1:
        res = run_seeds(cfg)
        if res is None:
            return 0
        print(res["table"])
        print(f"wrote {', '.join(res['files'].values())} and seed_*/")
        return 0
    results = run_simulation(cfg)
    if results is None:
        return 0
    print(markdown_table(results["methods"], f"{results['population']['clients']} clients, "
                                             f"{t.rounds} rounds, p = {t.participation}"))
    print(headroom_line(results["methods"]))
    for line in results["notes"] + skipped_lines(results.get("skipped") or {}) + \
            skipped_lines(results["xi"].get("skipped") or {}, where=f"--pretrain-data {cfg.data.pretrain_data}"):
        print(line)
    acq = acquisition_line(results["methods"])
    if acq:
        print(acq)
    print(timing_line(results["timing"]))
    if results.get("trunk_cache"):
        tc = results["trunk_cache"]
        print(f"ξ trunk features: {tc['read']} read from the trunk cache, {tc['computed']} computed "
              f"({tc['file']})")
    print(f"wrote {', '.join(results['files'].values())} ({results['wall_seconds']:.0f} s)")
    return 0


__all__ = ["add_arguments", "run", "run_simulation", "run_seeds", "run_method", "federation_config",
           "experiment_from_argv"]
