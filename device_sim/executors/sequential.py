"""One client after the other: ``torch.autograd.grad`` on the method's objective.

Fastest on CPU: convolutions of one client's batch already use the cores, and batching clients
only adds gather/scatter work (``benchmarks/sim_throughput.py`` measures it).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..methods.base import FederatedMethod, Params, RoundPlan
from .common import (FP16_LOSS_SCALE, ChunkResult, ClientTask, LocalConfig, Metrics, autocast, check_tasks,
                     client_batches, learning_rates, moving, normalized, sgd_update)


class SequentialExecutor:
    """One client after the other, ``torch.autograd.grad`` on the method's objective."""

    name = "sequential"

    def __init__(self, device: str | torch.device = "cpu", chunk_size: int = 64) -> None:
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size)

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig) -> ChunkResult:
        check_tasks(tasks)
        per_client: list[Params] = []
        metrics = Metrics(len(tasks), torch.device("cpu"))
        steps = 0
        for i, task in enumerate(tasks):
            params, parts_hist, n_steps = self._train_one(method, plan, task, cfg)
            per_client.append(params)
            steps += n_steps
            onehot = torch.zeros(len(tasks), dtype=torch.bool)
            onehot[i] = True
            for parts in parts_hist:
                metrics.add({k: torch.full((len(tasks),), v) for k, v in parts.items()}, onehot)
        stacked = {g: {k: _stack([p[g][k] for p in per_client]) for k in per_client[0][g]}
                   for g in per_client[0]}
        return ChunkResult([t.client for t in tasks], torch.tensor([t.num_samples for t in tasks]),
                           stacked, metrics.result(), steps, metrics.steps())

    def _train_one(self, method: FederatedMethod, plan: RoundPlan, task: ClientTask,
                   cfg: LocalConfig) -> tuple[Params, list[dict[str, float]], int]:
        dev = self.device
        trained = method.trained_groups()
        moves = moving(method, task.params)
        # scope=top with the federation's cached stem outputs: the objective trains the top on them
        # (without them it runs the trunk itself, through its cache)
        stem = task.stem_features if method.frozen_stem() is not None else None
        # With those outputs the frozen trunk is never run nor stepped: its tensors are the round's
        # own, shared by every client of the chunk instead of copied per client (a dlib-resnet trunk
        # is 22 MB per group; the copies, their stacking and averaging were ~20 % of a warm
        # whole-folder run). Anything the objective may touch is still a private copy.
        shared = (lambda g, k: not moves[g][k]) if stem is not None else (lambda g, k: False)
        params = {g: {k: (v.detach().to(dev, torch.float32) if shared(g, k) else
                          v.detach().to(dev, torch.float32).clone().requires_grad_(moves[g][k]))
                      for k, v in w.items()} for g, w in task.params.items()}
        leaves = [(g, k) for g, w in params.items() for k in w if moves[g][k]]
        consts = {k: v.to(dev) for k, v in task.consts.items()}
        lrs = learning_rates(method, params, cfg)
        bufs: dict[str, dict[str, torch.Tensor]] = {g: {} for g in params}
        scale = FP16_LOSS_SCALE if (cfg.amp == "fp16" and dev.type == "cuda") else 1.0
        images = task.images if stem is None else stem.to(dev)
        xi = task.xi_features.to(dev) if task.xi_features is not None else None
        history: list[dict[str, float]] = []
        batches = client_batches(task.num_samples, cfg.batch_size, cfg.epochs_for(method), task.seed,
                                 method.min_batch())
        for idx in batches:
            x = normalized(images[idx].to(dev, non_blocking=True))
            feats = {} if xi is None else {"xi": xi[idx.to(dev)]}
            if stem is not None:
                feats["trunk"], x = x, None
            with autocast(dev, cfg.amp):
                loss, parts = method.objective(plan, params, consts, x, None, **({"features": feats} if feats else {}))
            loss = loss.float()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"client {task.client}: local loss became {loss.item()} "
                                         f"(lr={cfg.lr_for(method)} too high?)")
            # materialize_grads: a trained tensor the objective does not read this step gets a zero
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


def _stack(per_client: list[torch.Tensor]) -> torch.Tensor:
    """``[K, …]`` of the clients' tensors; one tensor every client shares (a frozen trunk's) is
    broadcast, not copied K times (``fedavg_stacked`` averages it as the value it is)."""
    first = per_client[0]
    if all(t.data_ptr() == first.data_ptr() and t.shape == first.shape and t.stride() == first.stride()
           for t in per_client[1:]):
        return first.unsqueeze(0).expand(len(per_client), *first.shape)
    return torch.stack(per_client)
