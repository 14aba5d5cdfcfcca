"""Honest reference rows for personalization: what a user gets without FedFS.

* ``local-compact`` — a positives-only fine-tune of ξ on each client's own images, no
  federation: every image is pulled towards the (detached) mean direction of its batch,
  ``L = mean_i (1 − cos(e_i, sg(ē)))``. It is the trivial thing a phone could do alone.
* ``norm-adapt`` — no learning and no labels: the embedding layer's normalization affine
  (``embed_norm``, a per-sample ``GroupNormP(1, D)``) is re-fitted to the clients' domain
  so the pooled embedding is centred (``center``) or standardized per channel (``standardize``):
  ``γ' = γ/s``, ``β' = (β − μ)/s``. The statistics are the sum of per-client contributions
  (:mod:`fedfs_sdk.stats`, the statistics round); the model keeps its architecture.
* ``oracle`` — a supervised CosFace fine-tune of ξ with every client's identity label and
  every other client as a negative. Only a simulation can do this (it pools all clients'
  images): it is an upper bound, the headroom a scenario leaves for personalization.

All three verify with a cosine template of their embedding, like ``pretrained``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

import torch
import torch.nn.functional as F

from fedfs_sdk.nn.backbones.layers import l2_normalize
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.losses.common import masked_mean
from fedfs_sdk.training.scope import check_scope, top_state

from .base import (ClientState, FederatedMethod, Params, SimContext, VerifierSpec, Weights, backbone_weights, frozen,
                   verifier_net)


def compact_loss(e: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_i (1 − cos(e_i, sg(ē)))`` with ``ē`` the mean unit embedding of the (real)
    batch, detached: positives only, each image pulled to its own client's centre."""
    u = l2_normalize(e)
    w = torch.ones(u.shape[0], dtype=u.dtype, device=u.device) if mask is None else mask.to(u.dtype)
    centre = l2_normalize((u * w[:, None]).sum(0) / w.sum().clamp_min(1.0)).detach()
    return masked_mean(1.0 - u @ centre, mask)


class LocalCompact(FederatedMethod):
    """Per-client positives-only fine-tune of ξ (no federation); see module docstring.

    Args:
        lr: SGD learning rate (CLI ``--lr`` overrides).
        epochs: local epochs (CLI ``--local-epochs`` overrides); 10 epochs of 20 images at
            batch 10 are 20 steps.
    """

    name = "local-compact"
    private_groups = ("personal",)
    local_only = True

    def __init__(self, lr: float = 0.05, epochs: int = 10, scope: str = "all") -> None:
        super().__init__()
        if not lr > 0 or epochs < 1:
            raise InputError(f"local-compact needs lr > 0 and epochs ≥ 1, got lr={lr}, epochs={epochs}")
        self.lr, self.epochs, self.scope = float(lr), int(epochs), check_scope(scope)

    @property
    def label(self) -> str:
        return self.name if self.scope == "all" else f"{self.name} (scope={self.scope})"

    def options(self) -> dict[str, Any]:
        return {"lr": self.lr, "epochs": self.epochs, "scope": self.scope}

    def default_lr(self) -> float:
        return self.lr

    def default_local_epochs(self) -> int:
        return self.epochs

    def min_batch(self) -> int:
        return 2

    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        self._net = verifier_net(ctx.model_config.resolved(), with_head=False)
        self._skeleton = frozen(verifier_net(ctx.model_config.resolved(), with_head=False)).to(ctx.device)
        if self.scope == "top":     # the positives-only fine-tune of ξ's embedding layer alone, on its cached trunk
            from .selection import top_verifier
            from ..trunk_cache import trunk_cache
            self._trunk = trunk_cache(frozen(ctx.xi).to(ctx.device).backbone)
            self._skeleton = top_verifier(self._skeleton)

    def init_global(self) -> Weights:
        return backbone_weights({k: v.detach().clone() for k, v in self.context.xi.state_dict().items()})

    def init_private(self, global_weights: Weights) -> Params:
        return {"personal": {k: v.detach() for k, v in global_weights.items()}}

    def trained_groups(self) -> tuple[str, ...]:
        return ("personal",)

    def objective(self, plan, params: Params, consts, x: torch.Tensor, mask: torch.Tensor | None):
        from torch.func import functional_call

        if self.scope == "top":
            e = functional_call(self._skeleton, top_state(params["personal"]), (self._trunk(x),))[0]
        else:
            e = functional_call(self._skeleton, dict(params["personal"]), (x,))[0]
        loss = compact_loss(e, mask)
        return loss, {"loss": loss}

    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        from .split_top import split_spec

        if private is None or "personal" not in private:
            return split_spec(VerifierSpec(self._net, backbone_weights(global_weights), None, shared_key="xi"),
                              self.context.xi)
        spec = VerifierSpec(self._net, backbone_weights(private["personal"]), None)
        return split_spec(spec, self.context.xi) if self.scope == "top" else spec


from fedfs_sdk.stats.in_domain import embedding_norm_prefix, fold_standardization  # noqa: E402 (moved to the SDK: the device folds norm-adapt too)


NORM_STATS_CLIENTS = 1000
"""Clients whose training images give the pooled embedding statistics (a seeded sample above
it): per-channel means and deviations of ≥ 1,000 × n_c embeddings are settled, and at the
paper's 10,000 clients the full pass would embed 570,000 images before round 1."""


def stats_clients(num_clients: int, seed: int = 0, limit: int = NORM_STATS_CLIENTS) -> np.ndarray:
    """Every client up to ``limit``, else a seeded sample of ``limit`` (sorted)."""
    if num_clients <= limit:
        return np.arange(num_clients)
    return np.sort(np.random.default_rng([seed, 0x57A7]).choice(num_clients, limit, replace=False))


@torch.no_grad()
def pooled_embedding_stats(net: torch.nn.Module, weights: Weights, data: Any, clients: Sequence[int],
                           batch_size: int = 512, device: str | torch.device = "cpu",
                           clients_per_load: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(μ, s, n)``: per-channel mean and standard deviation of the embeddings of the
    ``clients``' training images — the FedAvg (weighted by ``n_c``) of per-client sums, which
    equals the pooled statistic exactly. Runs on ``device``; images come a group of clients at
    a time (``data.train_chunk`` where the data have it: one gather from the image store)."""
    from torch.func import functional_call

    from ..executors import normalized

    dev = torch.device(device)
    w = {k: v.to(dev) for k, v in weights.items()}
    net = net.to(dev)
    total, total_sq, n = None, None, 0
    ids = np.asarray(list(clients), dtype=np.int64)
    chunk_fn = getattr(data, "train_chunk", None)
    for a in range(0, ids.size, clients_per_load):
        group = ids[a:a + clients_per_load]
        xs = chunk_fn(group, dev) if callable(chunk_fn) else [data.train_images(int(c), dev) for c in group]
        x = torch.cat([xi.to(dev) for xi in xs])
        for b in range(0, x.shape[0], batch_size):
            e = functional_call(net, w, (normalized(x[b:b + batch_size]),))[0].double()
            total = e.sum(0) if total is None else total + e.sum(0)
            total_sq = (e * e).sum(0) if total_sq is None else total_sq + (e * e).sum(0)
            n += e.shape[0]
    if n == 0 or total is None or total_sq is None:
        raise InputError("norm-adapt needs at least one client image")
    mu = total / n
    var = (total_sq / n - mu * mu).clamp_min(0.0)
    return mu.float().cpu(), var.sqrt().float().cpu(), n


def norm_fold(net: torch.nn.Module, weights: Weights, data: Any, mode: str, seed: int = 0,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(μ, s)`` that :func:`fold_standardization` folds in: the statistics round's sum of every
    sampled client's embedding moments (:mod:`.client_stats` — the device's function per client,
    the server's sum; all clients up to :data:`NORM_STATS_CLIENTS`, a seeded sample beyond) turned
    into per-channel means and deviations (:func:`fedfs_sdk.stats.norm_fold_from_sum`); ``s`` is
    None for ``mode="center"``. Equal, within float rounding, to :func:`pooled_embedding_stats`."""
    from fedfs_sdk.stats import norm_fold_from_sum

    from .client_stats import EMBEDDING, client_statistics

    stats = client_statistics(net, weights, data, stats_clients(int(data.num_clients), seed), device=device)
    mu, sd = norm_fold_from_sum(stats.total.sums[EMBEDDING], mode)
    return torch.from_numpy(mu).float(), None if sd is None else torch.from_numpy(sd).float()


def mismatch(mu: torch.Tensor, sd: torch.Tensor | None) -> float:
    """norm-adapt's own loss: ``‖μ‖² (+ ‖log s‖²)`` — 0 once the pooled embedding is centred
    (and standardized)."""
    loss = float((mu.double() ** 2).sum())
    if sd is not None:
        loss += float((sd.double().clamp_min(1e-12).log() ** 2).sum())
    return loss


class FittedReference(FederatedMethod):
    """A reference whose one shared model is fitted in :meth:`prepare` (from ξ) instead of
    trained in rounds; every client verifies with it and a cosine template."""

    trains = False

    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        self._net = frozen(verifier_net(ctx.model_config.resolved(), with_head=False))
        self._weights = backbone_weights({k: v.detach().clone() for k, v in ctx.xi.state_dict().items()})

    def init_global(self) -> Weights:
        return dict(self._weights)

    def objective(self, plan, params, consts, x, mask):
        raise RuntimeError(f"{self.name} is fitted in prepare(), it does not train per client")

    top_only = True
    """The fitted model differs from ξ in its embedding layer at most (its trunk is ξ's): evaluate
    it on ξ's cached trunk features."""

    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        from .split_top import split_spec

        spec = VerifierSpec(self._net, backbone_weights(global_weights), None, shared_key=self.name)
        return split_spec(spec, self.context.xi) if self.top_only else spec


class NormAdapt(FittedReference):
    """Label-free normalization adaptation of ξ to the clients' domain (module docstring).

    Args:
        mode: ``center`` (subtract the pooled mean) or ``standardize`` (also divide by the
            per-channel standard deviation).
    """

    name = "norm-adapt"

    def __init__(self, mode: str = "standardize") -> None:
        super().__init__()
        if mode not in ("center", "standardize"):
            raise InputError(f"norm-adapt mode must be 'center' or 'standardize', got {mode!r}")
        self.mode = mode
        self.loss_before: float | None = None
        self.loss_after: float | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.mode})"

    def options(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def prepare(self, data: Any) -> None:
        fold = norm_fold(self._net, self._weights, data, self.mode, self.context.seed, self.context.device)
        self.loss_before = mismatch(*fold)
        self._weights = fold_standardization(self._weights, *fold)
        self.loss_after = mismatch(*norm_fold(self._net, self._weights, data, self.mode, self.context.seed,
                                              self.context.device))


class Oracle(FittedReference):
    """Supervised CosFace fine-tune of ξ on all clients' labelled images (an upper bound).

    Args:
        epochs: passes over all clients' training images.
        lr: AdamW learning rate.
        scale, margin: CosFace ``s`` and ``m`` (ξ's pre-training values).
        batch_size: images per step.
    """

    name = "oracle"

    def __init__(self, epochs: int = 10, lr: float = 2e-3, scale: float = 16.0, margin: float = 0.2,
                 batch_size: int = 64, scope: str = "all") -> None:
        super().__init__()
        if epochs < 1 or not lr > 0 or batch_size < 2:
            raise InputError("oracle needs epochs ≥ 1, lr > 0 and batch_size ≥ 2")
        self.epochs, self.lr, self.scale, self.margin, self.batch_size = int(epochs), float(lr), float(scale), \
            float(margin), int(batch_size)
        self.scope = check_scope(scope)
        self.top_only = self.scope == "top"
        self.losses: list[float] = []

    @property
    def label(self) -> str:
        return f"{self.name} (supervised, all labels{', scope=top' if self.top_only else ''})"

    def options(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "lr": self.lr, "scale": self.scale, "margin": self.margin,
                "batch_size": self.batch_size, "scope": self.scope}

    def prepare(self, data: Any) -> None:
        from device_sim.pretrain import MarginHead

        ctx = self.context
        xs = [data.train_images(c) for c in range(int(data.num_clients))]
        x = torch.cat(xs)
        y = torch.cat([torch.full((len(t),), c, dtype=torch.long) for c, t in enumerate(xs)])
        model = verifier_net(ctx.model_config.resolved(), with_head=False)
        model.load_state_dict(self._weights)
        model.train().requires_grad_(True)
        if self.top_only:       # ξ's trunk frozen: its embedding layer alone learns, on the cached trunk features
            from .selection import top_verifier
            from ..trunk_cache import trunk_cache
            cache = trunk_cache(ctx.xi.backbone)
            x = torch.cat([cache(x[a:a + 512]) for a in range(0, len(x), 512)])
            full, model = model, top_verifier(model)
        head = MarginHead(int(ctx.model_config.resolved().embedding_dim), len(xs), "cosface", self.scale, self.margin)
        with torch.no_grad():   # class centres start at each client's ξ template
            e = l2_normalize(torch.cat([model(x[a:a + 512])[0] for a in range(0, len(x), 512)]))
            head.weight.copy_(l2_normalize(torch.zeros_like(head.weight).index_add_(0, y, e)))
        opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=self.lr, weight_decay=5e-4)
        gen = torch.Generator().manual_seed(int(ctx.seed))
        self.losses = []
        for _ in range(self.epochs):
            order = torch.randperm(len(x), generator=gen)
            total, steps = 0.0, 0
            for a in range(0, len(x), self.batch_size):
                i = order[a:a + self.batch_size]
                loss = F.cross_entropy(head(model(x[i])[0], y[i]), y[i])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, steps = total + float(loss.detach()), steps + 1
            self.losses.append(total / max(steps, 1))
            if not math.isfinite(self.losses[-1]):
                raise FloatingPointError(f"oracle loss became {self.losses[-1]} (lr={self.lr} too high?)")
        if self.top_only:
            model = full
        self._weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


REFERENCE_METHODS = {"local-compact": LocalCompact, "norm-adapt": NormAdapt, "oracle": Oracle}

__all__ = ["LocalCompact", "FittedReference", "NormAdapt", "Oracle", "compact_loss", "pooled_embedding_stats", "stats_clients", "fold_standardization",
           "norm_fold", "mismatch", "embedding_norm_prefix", "REFERENCE_METHODS"]
