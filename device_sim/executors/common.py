"""What every executor shares: the local settings, one client's task, a chunk's result, the
batch schedule, the SGD step, per-client metrics.

All executors run the same math as :class:`fedfs_sdk.training.trainer.LocalTrainer` — for each
local epoch a ``torch.randperm`` of the client's images (generator seeded with the client's
seed), batches of ``min(batch_size, n)``, batches smaller than the method's minimum skipped, and
plain SGD (``p ← p − lr·(g + wd·p)``, optional momentum, as ``torch.optim.SGD``) — on the
method's pure objective.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch

from fedfs_sdk.errors import InputError

from ..image_cache import normalize
from ..methods.base import FederatedMethod, Params, RoundPlan

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
    """One participant's local job: its images, starting weights and constants.

    ``images``: ``[n, 3, S, S]``, float32 normalized ``(x − 127.5)/127.5`` or uint8 pixel levels
    (normalized on the executor's device: 4× fewer bytes to hold and to move).
    ``xi_features``: ``[n, D]`` ``ξ(x)`` of those images when the method reads ξ
    (:meth:`FederatedMethod.xi_model`), computed once by the federation; None = the objective
    runs ξ itself. ``stem_features``: ``[n, …]`` outputs of the method's frozen stem
    (:meth:`FederatedMethod.frozen_stem`, ``scope="top"``'s trunk), cached the same way.
    """

    client: int
    images: torch.Tensor
    params: Params                       # starting weights per group (global + private)
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    seed: int = 0
    xi_features: torch.Tensor | None = None
    stem_features: torch.Tensor | None = None

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

    @staticmethod
    def concat(parts: Sequence["ChunkResult"]) -> "ChunkResult":
        """One result for the clients of ``parts`` in order (a chunk trained in pieces)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return ChunkResult(
            [c for p in parts for c in p.clients], torch.cat([p.num_samples for p in parts]),
            {g: {k: torch.cat([p.params[g][k] for p in parts]) for k in w} for g, w in first.params.items()},
            {k: torch.cat([p.metrics[k] for p in parts]) for k in first.metrics},
            sum(p.steps for p in parts), torch.cat([p.client_steps for p in parts]))


class Executor(Protocol):
    device: torch.device
    chunk_size: int
    name: str

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig) -> ChunkResult: ...


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


def moving(method: FederatedMethod, params: Params) -> dict[str, dict[str, bool]]:
    """Which tensors local training differentiates and steps: those of the groups the objective
    trains (:meth:`FederatedMethod.trained_groups`) less their frozen ones
    (:meth:`FederatedMethod.trains_tensor`, e.g. ``scope="top"``'s trunk)."""
    trained = method.trained_groups()
    return {g: {k: (trained is None or g in trained) and method.trains_tensor(g, k) for k in w}
            for g, w in params.items()}


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
    ``started`` [K] tells which clients already have a momentum buffer. With neither
    (every client steps) and no momentum or decay, the step is one ``torch._foreach_add_`` per
    learning rate: the same arithmetic in a handful of kernel launches instead of one per tensor.
    """
    if active is None and started is None and not cfg.momentum and not cfg.weight_decay:
        by_lr: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for g, gw in grads.items():
            for k, d in gw.items():
                ps, ds = by_lr.setdefault(lrs[g][k], ([], []))
                ps.append(params[g][k])
                ds.append(d)
        for lr, (ps, ds) in by_lr.items():
            torch._foreach_add_(ps, ds, alpha=-lr)
        return
    # only what has a gradient steps: a group the objective does not train (FederatedMethod.trained_groups)
    # and a frozen tensor of a trained one (FederatedMethod.trains_tensor) are left as they are
    for g, gw in grads.items():
        for k, d in gw.items():
            p = params[g][k]
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


class Metrics:
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


def autocast(device: torch.device, amp: str):
    if amp == "off" or device.type != "cuda":
        return nullcontext()
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def normalized(images: torch.Tensor) -> torch.Tensor:
    """float32 ``(x − 127.5)/127.5`` of uint8 pixel levels (:func:`device_sim.image_cache.normalize`);
    float images only cast to float32."""
    return normalize(images).to(torch.float32)


def check_tasks(tasks: Sequence[ClientTask]) -> None:
    if not tasks:
        raise InputError("no clients to train")
    for t in tasks:
        if t.images.dim() != 4 or t.images.shape[0] == 0:
            raise InputError(f"client {t.client}: images must be a non-empty [n, 3, S, S] batch, "
                             f"got {list(t.images.shape)}")
        if t.images.dtype not in (torch.uint8, torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise InputError(f"client {t.client}: images must be uint8 pixel levels or normalized floats, "
                             f"got {t.images.dtype}")
        if t.xi_features is not None and t.xi_features.shape[0] != t.images.shape[0]:
            raise InputError(f"client {t.client}: {t.xi_features.shape[0]} ξ features for "
                             f"{t.images.shape[0]} images")


def unstack(params: Params, i: int) -> Params:
    """Client ``i``'s weights from a stacked :class:`ChunkResult`."""
    return {g: {k: v[i] for k, v in w.items()} for g, w in params.items()}
