"""Local training of many simulated clients: one loop per client, or all at once.

Both executors run the same math as :class:`fedfs_sdk.training.trainer.LocalTrainer` — for each
local epoch a ``torch.randperm`` of the client's images (generator seeded with the
client's seed), batches of ``min(batch_size, n)``, batches smaller than the method's
minimum skipped, and plain SGD (``p ← p − lr·(g + wd·p)``, optional momentum, as
``torch.optim.SGD``) — on the method's pure objective:

* :class:`SequentialExecutor` loops over clients (``torch.autograd.grad``). Fastest on CPU:
  convolutions of one client's batch already use the cores, and batching clients only adds
  gather/scatter work (``benchmarks/sim_throughput.py`` measures it).
* :class:`BatchedExecutor` trains a chunk of K clients in one step: their weights are
  stacked (``[K, ...]`` per tensor) and ``torch.func.vmap(grad(objective))`` runs through
  ``functional_call``. Clients with fewer images are padded and masked (the losses take a
  ``mask``), clients with fewer batches sit out the extra steps (``active`` mask), so every
  client gets exactly its sequential updates. Chunks bound memory; on CUDA ``amp`` runs
  the forward/backward in bf16 (or fp16 with a static loss scale) while weights and the
  SGD step stay float32. There is no Python loop over clients in the hot path — only
  over the (few) local steps.

``make_executor("auto", device)`` picks the batched executor on CUDA and the sequential
one on CPU.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
from torch.func import grad_and_value, vmap

from fedfs_sdk.errors import InputError

from .methods.base import FederatedMethod, Params, RoundPlan

AMP_MODES = ("off", "bf16", "fp16")
FP16_LOSS_SCALE = 2.0 ** 10
"""Static loss scale of ``amp="fp16"`` (steps with a non-finite gradient are skipped per client)."""


@dataclass(frozen=True)
class LocalConfig:
    """Local SGD settings shared by all clients of a run (``None`` = the method's default).

    ``head_lr``: learning rate of a randomly started head (FedUV's ``W``, the baselines'
    class embeddings); ``None`` = :meth:`FederatedMethod.default_head_lr`.
    """

    lr: float | None = None
    head_lr: float | None = None
    local_epochs: int | None = None
    batch_size: int = 10
    momentum: float = 0.0
    weight_decay: float = 0.0
    amp: str = "off"

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise InputError(f"lr must be > 0, got {self.lr}")
        if self.local_epochs is not None and self.local_epochs < 1:
            raise InputError(f"local_epochs must be ≥ 1, got {self.local_epochs}")
        if self.batch_size < 1:
            raise InputError(f"batch_size must be ≥ 1, got {self.batch_size}")
        if self.amp not in AMP_MODES:
            raise InputError(f"amp must be one of {AMP_MODES}, got {self.amp!r}")

    def lr_for(self, method: FederatedMethod) -> float:
        return self.lr if self.lr is not None else method.default_lr()

    def epochs_for(self, method: FederatedMethod) -> int:
        return self.local_epochs if self.local_epochs is not None else method.default_local_epochs()


@dataclass
class ClientTask:
    """One participant's local job: its images, starting weights and constants."""

    client: int
    images: torch.Tensor                 # float32 [n, 3, S, S]
    params: Params                       # starting weights per group (global + private)
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    seed: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.images.shape[0])


@dataclass
class ChunkResult:
    """The trained weights of a chunk of clients, stacked ``[K, ...]`` per tensor.

    ``metrics`` maps ``<part>_first|_last|_mean`` to a ``[K]`` tensor (objective parts of
    the client's first / last / all local steps; 0 for a client that took no step).
    ``client_steps`` ``[K]`` counts the SGD steps each client applied (0: too few images
    for one batch, or every step skipped on fp16 overflow).
    """

    clients: list[int]
    num_samples: torch.Tensor
    params: Params
    metrics: dict[str, torch.Tensor]
    steps: int
    client_steps: torch.Tensor


class Executor(Protocol):
    device: torch.device
    chunk_size: int
    name: str

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig) -> ChunkResult: ...


# ---- shared pieces ---------------------------------------------------------------------------

def client_batches(n: int, batch_size: int, epochs: int, seed: int, min_batch: int = 1) -> list[torch.Tensor]:
    """The index batches of one client's local epochs, exactly as ``LocalTrainer`` draws them."""
    gen = torch.Generator().manual_seed(int(seed))
    bs = min(batch_size, n)
    out: list[torch.Tensor] = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, bs):
            idx = order[start:start + bs]
            if idx.numel() >= min_batch:
                out.append(idx)
    return out


def learning_rates(method: FederatedMethod, params: Params, cfg: LocalConfig) -> dict[str, dict[str, float]]:
    base = cfg.lr_for(method)
    head = cfg.head_lr if cfg.head_lr is not None else method.default_head_lr()
    return {g: {k: method.learning_rate(g, k, base, head) for k in w} for g, w in params.items()}


def _bcast(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape + (1,) * (like.dim() - mask.dim()))


@torch.no_grad()
def sgd_update(params: Params, grads: Params, lrs: Mapping[str, Mapping[str, float]], cfg: LocalConfig,
               bufs: dict[str, dict[str, torch.Tensor]] | None, active: torch.Tensor | None = None,
               started: torch.Tensor | None = None) -> None:
    """In-place SGD step as ``torch.optim.SGD`` (dampening 0, no Nesterov).

    Batched form: ``active`` [K] leaves clients without a batch at this step untouched;
    ``started`` [K] tells which clients already have a momentum buffer.
    """
    for g, weights in params.items():
        if g not in grads:      # a group the objective does not train (FederatedMethod.trained_groups)
            continue
        for k, p in weights.items():
            d = grads[g][k]
            if cfg.weight_decay:
                d = d.add(p, alpha=cfg.weight_decay)
            if cfg.momentum and bufs is not None:
                prev = bufs[g].get(k)
                if prev is None:
                    buf = d.clone()
                elif started is None:
                    buf = prev.mul_(cfg.momentum).add_(d)
                else:
                    buf = torch.where(_bcast(started, d), prev * cfg.momentum + d, d)
                if active is not None and prev is not None:
                    buf = torch.where(_bcast(active, d), buf, prev)
                bufs[g][k] = buf
                d = buf
            if active is None:
                p.add_(d, alpha=-lrs[g][k])
            else:
                p.copy_(torch.where(_bcast(active, p), p - lrs[g][k] * d, p))


class _Metrics:
    """Per-client first/last/mean of each objective part over its active steps."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k, self.device = k, device
        self.first: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.sum: dict[str, torch.Tensor] = {}
        self.count = torch.zeros(k, device=device)
        self.seen = torch.zeros(k, dtype=torch.bool, device=device)

    def add(self, parts: Mapping[str, torch.Tensor], active: torch.Tensor) -> None:
        a = active.to(self.device)
        for name, v in parts.items():
            v = v.detach().float().reshape(self.k).to(self.device)
            z = torch.zeros_like(v)
            self.first[name] = torch.where(a & ~self.seen, v, self.first.get(name, z))
            self.last[name] = torch.where(a, v, self.last.get(name, z))
            self.sum[name] = self.sum.get(name, z) + torch.where(a, v, z)
        self.count += a.float()
        self.seen |= a

    def steps(self) -> torch.Tensor:
        """``[K]`` int64: the steps each client applied."""
        return self.count.round().long().cpu()

    def result(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.sum:
            out[f"{name}_first"] = self.first[name].cpu()
            out[f"{name}_last"] = self.last[name].cpu()
            out[f"{name}_mean"] = (self.sum[name] / self.count.clamp_min(1)).cpu()
        return out


def _autocast(device: torch.device, amp: str):
    if amp == "off" or device.type != "cuda":
        return nullcontext()
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def _check_tasks(tasks: Sequence[ClientTask]) -> None:
    if not tasks:
        raise InputError("no clients to train")
    for t in tasks:
        if t.images.dim() != 4 or t.images.shape[0] == 0:
            raise InputError(f"client {t.client}: images must be a non-empty [n, 3, S, S] batch, "
                             f"got {list(t.images.shape)}")


# ---- sequential ------------------------------------------------------------------------------

class SequentialExecutor:
    """One client after the other, ``torch.autograd.grad`` on the method's objective."""

    name = "sequential"

    def __init__(self, device: str | torch.device = "cpu", chunk_size: int = 64) -> None:
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size)

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig) -> ChunkResult:
        _check_tasks(tasks)
        per_client: list[Params] = []
        metrics = _Metrics(len(tasks), torch.device("cpu"))
        steps = 0
        for i, task in enumerate(tasks):
            params, parts_hist, n_steps = self._train_one(method, plan, task, cfg)
            per_client.append(params)
            steps += n_steps
            onehot = torch.zeros(len(tasks), dtype=torch.bool)
            onehot[i] = True
            for parts in parts_hist:
                metrics.add({k: torch.full((len(tasks),), v) for k, v in parts.items()}, onehot)
        stacked = {g: {k: torch.stack([p[g][k] for p in per_client]) for k in per_client[0][g]}
                   for g in per_client[0]}
        return ChunkResult([t.client for t in tasks], torch.tensor([t.num_samples for t in tasks]),
                           stacked, metrics.result(), steps, metrics.steps())

    def _train_one(self, method: FederatedMethod, plan: RoundPlan, task: ClientTask,
                   cfg: LocalConfig) -> tuple[Params, list[dict[str, float]], int]:
        dev = self.device
        trained = method.trained_groups()
        params = {g: {k: v.detach().to(dev, torch.float32).clone().requires_grad_(trained is None or g in trained)
                      for k, v in w.items()} for g, w in task.params.items()}
        leaves = [(g, k) for g, w in params.items() for k in w if trained is None or g in trained]
        consts = {k: v.to(dev) for k, v in task.consts.items()}
        lrs = learning_rates(method, params, cfg)
        bufs: dict[str, dict[str, torch.Tensor]] = {g: {} for g in params}
        scale = FP16_LOSS_SCALE if (cfg.amp == "fp16" and dev.type == "cuda") else 1.0
        images = task.images
        history: list[dict[str, float]] = []
        batches = client_batches(task.num_samples, cfg.batch_size, cfg.epochs_for(method), task.seed,
                                 method.min_batch())
        for idx in batches:
            x = images[idx].to(dev, non_blocking=True)
            with _autocast(dev, cfg.amp):
                loss, parts = method.objective(plan, params, consts, x, None)
            loss = loss.float()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"client {task.client}: local loss became {loss.item()} "
                                         f"(lr={cfg.lr_for(method)} too high?)")
            # materialize_grads: a tensor the objective does not use (scope=top's frozen trunk) gets a zero
            grads_flat = torch.autograd.grad(loss * scale, [params[g][k] for g, k in leaves], allow_unused=True,
                                             materialize_grads=True)
            grads: Params = {g: {} for g in params if trained is None or g in trained}
            for (g, k), gr in zip(leaves, grads_flat):
                grads[g][k] = gr.float() / scale
            if scale != 1.0 and not all(torch.isfinite(gr).all() for gr in grads_flat):
                continue  # fp16 overflow: skip the step, as a GradScaler would
            sgd_update(params, grads, lrs, cfg, bufs)
            history.append({k: float(v.detach()) for k, v in parts.items()})
        out = {g: {k: v.detach() for k, v in w.items()} for g, w in params.items()}
        return out, history, len(batches)


# ---- batched ---------------------------------------------------------------------------------

class BatchedExecutor:
    """K clients per step with ``vmap(grad_and_value(objective))`` over stacked weights.

    Args:
        device: ``cuda`` (the intended use) or ``cpu``.
        chunk_size: clients per vmapped step; ``0`` = calibrate on CUDA from free memory
            (a probe step measures the peak per client), 32 on CPU.
        memory_fraction: share of free CUDA memory a chunk may use when calibrating.
    """

    name = "batched"

    def __init__(self, device: str | torch.device = "cuda", chunk_size: int = 0,
                 memory_fraction: float = 0.6) -> None:
        self.device = torch.device(device)
        self._requested_chunk = int(chunk_size)
        self.chunk_size = int(chunk_size) if chunk_size > 0 else (256 if self.device.type == "cuda" else 32)
        self.memory_fraction = memory_fraction
        self._calibrated = chunk_size > 0 or self.device.type != "cuda"

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig) -> ChunkResult:
        _check_tasks(tasks)
        dev = self.device
        k = len(tasks)
        ns = [t.num_samples for t in tasks]
        epochs = cfg.epochs_for(method)
        schedules = [client_batches(n, cfg.batch_size, epochs, t.seed, method.min_batch()) for n, t in zip(ns, tasks)]
        n_steps = max((len(s) for s in schedules), default=0)
        bsz = max((int(b.numel()) for s in schedules for b in s), default=1)
        idx = torch.zeros(n_steps, k, bsz, dtype=torch.long)
        valid = torch.zeros(n_steps, k, bsz, dtype=torch.bool)
        active = torch.zeros(n_steps, k, dtype=torch.bool)
        for c, sched in enumerate(schedules):
            for t, b in enumerate(sched):
                idx[t, c, :b.numel()] = b
                valid[t, c, :b.numel()] = True
                active[t, c] = True
        idx, valid, active = idx.to(dev), valid.to(dev), active.to(dev)

        nmax = max(ns)
        shape = tasks[0].images.shape[1:]
        images = torch.zeros((k, nmax) + tuple(shape), dtype=torch.float32, device=dev)
        for c, t in enumerate(tasks):
            images[c, :t.num_samples] = t.images.to(dev, torch.float32, non_blocking=True)
        params = {g: {name: torch.stack([t.params[g][name].to(dev, torch.float32) for t in tasks])
                      for name in w} for g, w in tasks[0].params.items()}
        consts = {name: torch.stack([t.consts[name].to(dev) for t in tasks]) for name in tasks[0].consts}
        lrs = learning_rates(method, tasks[0].params, cfg)
        bufs: dict[str, dict[str, torch.Tensor]] = {g: {} for g in params}
        started = torch.zeros(k, dtype=torch.bool, device=dev)
        scale = FP16_LOSS_SCALE if (cfg.amp == "fp16" and dev.type == "cuda") else 1.0

        # Only the groups the objective trains are differentiated (FederatedMethod.trained_groups);
        # the others ride along with the constants, so no [K, …] zero gradients are built for them.
        trained = method.trained_groups()
        train_groups = [g for g in params if trained is None or g in trained]
        fixed = {g: w for g, w in params.items() if g not in train_groups}

        def loss_fn(p: Params, aux: tuple[Params, dict[str, torch.Tensor]], x: torch.Tensor, m: torch.Tensor):
            with _autocast(dev, cfg.amp):
                loss, parts = method.objective(plan, {**aux[0], **p}, aux[1], x, m)
            return loss.float() * scale, {n_: v.float() for n_, v in parts.items()}

        step_fn = vmap(grad_and_value(loss_fn, has_aux=True))
        trainable = {g: params[g] for g in train_groups}       # the same tensors: sgd_update writes into them
        metrics = _Metrics(k, dev)
        rows = torch.arange(k, device=dev)[:, None]
        if not self._calibrated:
            self._calibrate(step_fn, (trainable, (fixed, consts), images[:, :1].expand(-1, bsz, *shape), valid[0]))
        for t in range(n_steps):
            x = images[rows, idx[t]]                                   # [K, B, 3, S, S]
            grads, (_, parts) = step_fn(trainable, (fixed, consts), x, valid[t])
            act = active[t]
            if scale != 1.0:
                grads = {g: {n_: gr / scale for n_, gr in w.items()} for g, w in grads.items()}
                finite = torch.stack([torch.isfinite(gr).flatten(1).all(1) for w in grads.values()
                                      for gr in w.values()]).all(0)
                act = act & finite
            sgd_update(params, grads, lrs, cfg, bufs, active=act, started=started)
            started |= act
            metrics.add(parts, act)
        bad = ~torch.stack([torch.isfinite(v).flatten(1).all(1) for w in params.values() for v in w.values()]).all(0)
        if bool(bad.any()):
            who = [tasks[i].client for i in torch.nonzero(bad).flatten().tolist()][:10]
            raise FloatingPointError(f"clients {who}: weights became non-finite (lr={cfg.lr_for(method)} too high?)")
        return ChunkResult([t.client for t in tasks], torch.tensor(ns), params, metrics.result(),
                           int(active.sum()), metrics.steps())

    def _calibrate(self, step_fn, args: tuple) -> None:
        """Measure one step's peak CUDA memory for 2 clients (``step_fn(*args)`` on the first
        two of every stacked tensor) and size chunks to fit."""
        from torch.utils._pytree import tree_map

        k = min(2, args[2].shape[0])
        sub = tree_map(lambda v: v[:k], args)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step_fn(*sub)
        torch.cuda.synchronize(self.device)
        per_client = max(1, (torch.cuda.max_memory_allocated(self.device) - base) // k)
        free, _ = torch.cuda.mem_get_info(self.device)
        self.chunk_size = int(max(1, min(4096, self.memory_fraction * free // per_client)))
        self._calibrated = True


def make_executor(kind: str, device: str, chunk_size: int = 0) -> SequentialExecutor | BatchedExecutor:
    """``sequential`` | ``batched`` | ``auto`` (batched on CUDA, sequential on CPU — see
    ``benchmarks/sim_throughput.py`` for the measurement behind the choice)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was requested but torch.cuda.is_available() is False")
    if kind == "auto":
        kind = "batched" if dev.type == "cuda" else "sequential"
    if kind == "sequential":
        return SequentialExecutor(dev, chunk_size or 64)
    if kind == "batched":
        return BatchedExecutor(dev, chunk_size)
    raise InputError(f"unknown executor {kind!r}; choose auto, sequential or batched")


def unstack(params: Params, i: int) -> Params:
    """Client ``i``'s weights from a stacked :class:`ChunkResult`."""
    return {g: {k: v[i] for k, v in w.items()} for g, w in params.items()}


__all__ = ["LocalConfig", "ClientTask", "ChunkResult", "Executor", "SequentialExecutor", "BatchedExecutor",
           "make_executor", "client_batches", "sgd_update", "unstack", "AMP_MODES"]
