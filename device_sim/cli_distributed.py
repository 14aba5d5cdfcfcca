"""``fedfs simulate --distributed`` (under ``torchrun``) and ``--workers N`` (N local processes).

Both run the same command body on every rank inside one torch.distributed process group
(:mod:`device_sim.distributed`); rank 0 prints, evaluates and writes ``--out``, the other
ranks train their share of each round and stay silent. Each rank uses
``cores // processes-on-this-machine`` torch threads unless ``--threads`` is given.
``--rank-split`` picks how a round's participants are given to ranks
(:mod:`device_sim.rank_split`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from fedfs_sdk.errors import FedFSError, InputError

from . import distributed
from .experiment import ExperimentConfig
from .federation import check_distributable
from .methods import parse_method
from .rank_split import SPLITS

Body = Callable[[ExperimentConfig], int]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="join the torch.distributed process group torchrun set up (gloo on CPU, NCCL with "
                        "--device cuda): each rank trains its share of a round's clients, one all-reduce of "
                        "the FedAvg sums per round, rank 0 evaluates and writes --out")
    p.add_argument("--workers", type=int, default=1,
                   help="train with N local processes (the --distributed mechanism on 127.0.0.1), each with "
                        "cores/N torch threads (unless --threads); default 1: 2 workers were not faster than 1 "
                        "on a busy shared 2-core CPU (docs/simulation.md)")
    p.add_argument("--rank-split", choices=SPLITS, default="balanced",
                   help="with --distributed / --workers: 'balanced' (default) gives each round's participants "
                        "to ranks so their training images are balanced, borrowing a client's private weights "
                        "from its home rank (client mod ranks) for the round; 'home' trains every client on "
                        "its home rank (uneven splits: the round waits for the busiest rank)")


def run_distributed(cfg: ExperimentConfig, body: Body) -> int:
    """Run ``body(cfg)`` as one rank of a process group (``--distributed``) or in
    ``--workers`` spawned processes; the exit status of rank 0's body (2 when a worker failed)."""
    rt = cfg.runtime
    if rt.workers < 1:
        raise InputError(f"--workers must be ≥ 1, got {rt.workers}")
    if rt.distributed and rt.workers > 1:
        raise InputError("--workers N starts its own processes; under torchrun use --distributed with "
                         "torchrun's --nproc-per-node instead of --workers")
    if any(v is not None for v in (cfg.dp.dp_epsilon, cfg.dp.dp_noise, cfg.dp.dp_clip)):
        raise InputError("--dp-* (DP-FedAvg's clipped, noised sum) runs in one process: drop --workers / --distributed")
    for spec in cfg.train.method:       # fail before any process starts
        check_distributable(parse_method(spec))
    if rt.distributed:
        return _rank_main(cfg, body)
    try:
        distributed.spawn_workers(_worker, (cfg, body), rt.workers)
    except Exception as e:          # noqa: BLE001 — torch.multiprocessing's ProcessExitedException et al.
        code = getattr(e, "exit_code", None)
        if code == 2:               # the worker printed its error line
            return 2
        raise
    return 0


def _worker(cfg: ExperimentConfig, body: Body) -> None:
    """One spawned ``--workers`` process: a rank of the local process group."""
    cfg = cfg.with_fields(distributed=True, workers=1)
    try:
        code = _rank_main(cfg, body)
    except FedFSError as e:
        print(f"fedfs simulate: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if code:
        sys.exit(code)


def _rank_main(cfg: ExperimentConfig, body: Body) -> int:
    ctx = distributed.init_from_env(cfg.runtime.device)
    if cfg.runtime.threads is None:
        cfg = cfg.with_fields(threads=distributed.threads_per_worker(ctx.local_world_size))
    try:
        code = body(cfg)
        distributed.barrier()       # the others wait while rank 0 evaluates and writes, then all leave
        return code
    finally:
        distributed.shutdown()


__all__ = ["add_arguments", "run_distributed"]
