"""torch.distributed for the simulator: a round's participants split across ranks.

``fedfs simulate --distributed`` (under ``torchrun``) and ``fedfs simulate --workers N`` (N
local processes started here) run the same round loop on every rank (pfl-research's
distributed simulation, DESIGN.md "Codebases worth learning from"):

* every rank holds the same global model, samples the same participants (the sampler is
  seeded, not rank-local) and configures the round identically;
* client ``c``'s *home* rank is ``c mod W`` for the whole run: its private weights ``θ_c``
  are kept in that rank's client-store shard (checkpoints, ``collect_private`` and the
  ``.rank<r>`` disk shards rely on it);
* every rank computes the same assignment of the round's participants to *trainer* ranks
  (:func:`device_sim.rank_split.assign_participants`: ``--rank-split balanced``, the
  default, balances the clients' training images across ranks, moving a client off its
  home rank only when that narrows the gap between the busiest and the idlest rank;
  ``--rank-split home`` trains every client on its home rank, the first design, whose
  uneven splits made a round wait for the slowest rank);
* a client trained off its home rank *borrows* ``θ_c``: before training, each home rank
  sends the stored rows of its clients trained elsewhere (those with a row; every rank
  knows which clients have one, so the trainer gives the others the fresh weights as its
  own clients) to their trainers, point to point (:func:`exchange_rows`: ``batch_isend_irecv``
  of pre-allocated buffers, the rows' bytes in the store's dtype and encoding); after
  training, the trainer encodes the updated rows as the home store would
  (:meth:`~device_sim.client_store.ClientStore.encode_rows`) and sends them back, and the
  home rank stores them. Borrowed rows live only in a per-round buffer of the trainer,
  never in its store shard, so each rank's memory stays O(its home clients). Per-client
  constants (FedUV codewords) are regenerated from ``(seed, client)`` on any rank; a
  method whose server reads per-client uploads (``method.receive``) is refused;
* each rank folds its chunks into float64 sums ``Σ n_c·w_c`` and ``Σ n_c`` and the ranks
  combine them with **one all-reduce** per round (:class:`DistributedFedAvg`), so every
  rank ends the round with the same FedAvg (FedFS Eq. 1) result;
* rank 0 gathers the store shards before it evaluates or checkpoints, and is the only rank
  that writes results.

Determinism: each client's local randomness comes from ``(seed, round, client)``
(:func:`device_sim.federation.client_seed`), so a client's update is the same bits on any
rank (same torch thread count). Only the order of the float64 additions depends on the
world size: for the same global model, the averaged float64 value differs by at most
``(K + W)·2⁻⁵²·max_c |w_c|`` (K participants, W ranks), far below float32's resolution, so
after the final cast to float32 a round's average is the same float32 or the adjacent
one (≤ 1 ulp; a weight whose clients' values nearly cancel to 0 may instead differ by that
tiny absolute amount). Later rounds train from that model, so the differences are then those of
local SGD started 1 ulp apart (measured in docs/simulation.md, tested in
tests/test_sim_distributed.py). The same holds for the chunk size (DESIGN: one float64
accumulator, one cast per round).
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from fedfs_sdk.errors import InputError
from server_agg.aggregate import _cast_back  # one rule for float / bool / int tensors, as the server

Weights = dict[str, torch.Tensor]

TIMEOUT = datetime.timedelta(hours=6)
"""Collective timeout: rank 0 pre-trains ξ and evaluates while the others wait."""

_objects: dict[str, Any] = {"group": None}
"""With NCCL, a gloo group for the object collectives (ξ, metric sums, store shards), so
pickled host data is not staged through GPU memory; None with gloo (the default group)."""


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in a distributed simulation."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    rank_split: str = "balanced"
    """How a round's participants are given to trainer ranks (:mod:`device_sim.rank_split`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: NCCL needs CUDA tensors, gloo takes CPU ones."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def owned(self, clients: np.ndarray) -> np.ndarray:
        """The clients of ``clients`` whose ``θ_c`` this rank stores: its home clients
        (``c mod W == rank``)."""
        clients = np.asarray(clients)
        return clients[clients % self.world_size == self.rank]


def cpu_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # macOS, Windows
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """``cores // workers`` (at least 1): N processes share the machine without oversubscribing
    it (torch's threads spin when a core is taken — docs/simulation.md, Determinism)."""
    return max(1, cpu_cores() // max(1, workers))


def current(rank_split: str = "balanced") -> DistContext | None:
    """The context of an initialized process group (None outside a distributed run), with the
    run's ``--rank-split`` (every rank passes the same one: the assignment is computed, not
    agreed by messages)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                       int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), dist.get_backend(),
                       rank_split)


def init_from_env(device: str) -> DistContext:
    """Join the process group ``torchrun`` (or :func:`spawn_workers`) described in the
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL when the
    simulation runs on CUDA, gloo on CPU."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise InputError(f"--distributed needs the process-group environment ({', '.join(missing)} not set): "
                         f"launch with `torchrun --nproc-per-node N -m fedfs_sdk.cli.main simulate --distributed …`, "
                         f"or use --workers N on one machine")
    if not dist.is_available():
        raise InputError("this torch build has no torch.distributed; use a standard torch wheel")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
        _objects["group"] = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
        if cuda:    # NCCL: batch_isend_irecv (exchange_rows) must not be the group's first call
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
    ctx = current()
    assert ctx is not None
    return ctx


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _objects["group"] = None


class DistributedFedAvg:
    """``StreamingFedAvg``'s float64 sums, combined across ranks by one all-reduce.

    Same interface as :class:`server_agg.aggregate.StreamingFedAvg` (``add`` / ``result``)
    and the same arithmetic: ``Σ n·w`` and ``Σ n`` in float64, one division and one cast to
    the reference dtypes at the end. :meth:`result` is a collective: every rank calls it
    once per round, also a rank that trained nobody this round (it contributes zeros).
    """

    def __init__(self, reference: Mapping[str, torch.Tensor], ctx: DistContext) -> None:
        self.ctx = ctx
        self._dtypes = {k: t.dtype for k, t in reference.items()}
        self._sums = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in reference.items()}
        self.total_samples = 0
        self.count = 0

    def add(self, weights: Mapping[str, torch.Tensor], num_samples: int) -> None:
        if set(weights) != set(self._sums):
            raise InputError(f"update keys differ from the model: {sorted(set(weights) ^ set(self._sums))[:5]}")
        n = int(num_samples)
        for k, s in self._sums.items():
            s.add_(weights[k].detach().to(device=s.device), alpha=n)
        self.total_samples += n
        self.count += 1

    def result(self) -> Weights:
        """The all-ranks FedAvg, identical on every rank (the all-reduced buffer is)."""
        flat = torch.cat([s.reshape(-1) for s in self._sums.values()]
                         + [torch.tensor([float(self.total_samples)], dtype=torch.float64)])
        buf = flat.to(self.ctx.comm_device)
        dist.all_reduce(buf)                         # the one all-reduce of the round
        flat = buf.cpu()
        total = float(flat[-1])
        if total <= 0:
            raise InputError("cannot average zero updates (no rank trained a client this round)")
        self.total_samples = int(total)
        out: Weights = {}
        off = 0
        for k, s in self._sums.items():
            avg = flat[off:off + s.numel()].reshape(s.shape) / total
            off += s.numel()
            out[k] = _cast_back(avg, self._dtypes[k])
        return out


def all_gather(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj`` (small picklable values: a round's metric sums), in rank order."""
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=_objects["group"])
    return out


def broadcast(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank (ξ and its description, pre-trained once on rank 0)."""
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=_objects["group"])
    return box[0]


def gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (rank order); None on the other ranks."""
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0, group=_objects["group"])
    return out


def exchange_rows(sends: Mapping[int, torch.Tensor], counts: Mapping[int, int], width: int, dtype: torch.dtype,
                  ctx: DistContext) -> dict[int, torch.Tensor]:
    """Point-to-point exchange of client-store rows between ranks, bit for bit.

    ``sends[dst]``: ``[k, width]`` rows of ``dtype`` for rank ``dst``; ``counts[src]``: how
    many rows this rank receives from ``src`` (every rank computes it, so the buffers are
    pre-allocated and no sizes are exchanged). Returns ``{src: [counts[src], width]}`` on the
    CPU. Rows travel as their raw bytes (``uint8`` views: any storage dtype, bf16 included,
    on gloo and NCCL) in one ``batch_isend_irecv``; pairs with nothing to send post nothing,
    which both ends know. A collective in effect: every rank calls it at the same point."""
    dev = ctx.comm_device
    ops: list[dist.P2POp] = []
    bufs: dict[int, torch.Tensor] = {}
    for src, k in sorted(counts.items()):
        if k and width and src != ctx.rank:
            bufs[src] = torch.empty((int(k), width), dtype=dtype, device=dev)
            ops.append(dist.P2POp(dist.irecv, bufs[src].view(torch.uint8), src))
    for dst, rows in sorted(sends.items()):
        if rows.numel() and dst != ctx.rank:
            if tuple(rows.shape[1:]) != (width,) or rows.dtype != dtype:
                raise InputError(f"rows for rank {dst} are {list(rows.shape)} {rows.dtype}, "
                                 f"expected [k, {width}] {dtype}")
            ops.append(dist.P2POp(dist.isend, rows.to(dev).contiguous().view(torch.uint8), dst))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return {src: b.cpu() for src, b in bufs.items()}


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---- --workers N: N local processes -----------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_entry(local_rank: int, fn: Callable[..., Any], args: tuple, world: int, port: int) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    fn(*args)


def spawn_workers(fn: Callable[..., Any], args: tuple, workers: int) -> None:
    """Run ``fn(*args)`` in ``workers`` fresh processes on this machine that form one
    process group on 127.0.0.1 (the environment ``torchrun`` would set). Blocks until all
    end; if one fails the others are terminated and
    ``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException`` is raised."""
    import torch.multiprocessing as mp

    if workers < 1:
        raise InputError(f"--workers must be ≥ 1, got {workers}")
    mp.start_processes(_worker_entry, args=(fn, args, workers, _free_port()), nprocs=workers,
                       join=True, start_method="spawn")


__all__ = ["DistContext", "DistributedFedAvg", "current", "init_from_env", "shutdown", "all_gather",
           "broadcast", "exchange_rows", "gather_to_main", "barrier", "spawn_workers",
           "threads_per_worker", "cpu_cores"]
