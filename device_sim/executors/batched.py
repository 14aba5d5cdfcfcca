"""K clients per step: stacked ``[K, …]`` weights, one step for the whole chunk.

Two ways to run a step, the same math (tested against :class:`SequentialExecutor`):

* ``vmap`` — ``torch.func.vmap(grad_and_value(objective))`` through ``functional_call``: any
  method, any model.
* ``folded`` — for methods whose models are a backbone plus a head (:meth:`FederatedMethod.trunks`):
  the chunk's backbones run as ONE client-folded network (:mod:`.folding`) with plain autograd,
  and only the small head and loss are vmapped; the gradient of the loss with respect to each
  backbone output is then back-propagated through the folded network. No per-layer layout
  copies, so it is several times faster on a GPU (docs/simulation.md has the figures).

Clients with fewer images are padded and masked (the losses take a ``mask``), clients with fewer
batches sit out the extra steps (``active`` mask), so every client gets exactly its sequential
updates. ``ξ(x)`` of a method that reads it (:meth:`FederatedMethod.xi_model`) is computed once
per chunk for every image (ξ is frozen), not at every step — or taken from the task when the
federation cached it for the run. On CUDA ``amp`` runs the forward/backward in bf16 (or fp16
with a static loss scale) while weights and the SGD step stay float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.func import grad_and_value, vmap

from fedfs_sdk.errors import InputError

from ..memory import forward_batch
from ..methods.base import FederatedMethod, Params, RoundPlan
from .common import (FP16_LOSS_SCALE, ChunkResult, ClientTask, LocalConfig, Metrics, autocast, check_tasks,
                     client_batches, learning_rates, moving, normalized, sgd_update)
from .compiled import TrunkCall, compile_choice
from .folding import POINTWISE_MODES, NotFoldable, check_folding, fold_module
from .memory import MemoryPlan, cuda_memory_probe

FOLD_MODES = ("auto", "off")
BACKBONE = "backbone."


@dataclass
class _Chunk:
    """A chunk's tensors on the executor's device."""

    k: int
    ns: list[int]
    idx: torch.Tensor          # [T, K, B] image indices per step
    valid: torch.Tensor        # [T, K, B] real (vs padded) samples
    active: torch.Tensor       # [T, K] clients with a batch at step t
    all_active: list[bool]     # per step, on the host: every client steps (unmasked SGD)
    images: torch.Tensor       # [K, n_max, 3, S, S] uint8 or float32; with a frozen stem its outputs [K, n_max, …]
    xi: torch.Tensor | None    # [K, n_max, D] ξ features, or None
    params: Params             # stacked [K, …] per tensor
    consts: dict[str, torch.Tensor]
    stem: bool = False         # images hold the method's frozen-stem outputs (FederatedMethod.frozen_stem)


def _merged(fixed: Params, trained: Params) -> Params:
    """One parameter dict from the frozen and the differentiated entries of every group."""
    return {g: {**fixed.get(g, {}), **trained.get(g, {})} for g in fixed.keys() | trained.keys()}


def xi_features(xi: torch.nn.Module, images: torch.Tensor, device: torch.device, amp: str,
                batch: int | None = None) -> torch.Tensor:
    """``ξ(x)`` float32 ``[N, D]`` of ``images`` ``[N, 3, S, S]`` (uint8 or normalized), in
    batches, under the run's autocast (the precision the per-step ξ call used). ``batch``: images
    per forward; None = 1024, or on CPU :func:`device_sim.memory.forward_batch` (faster there)."""
    if batch is None:
        batch = 1024
        if (torch.device(device).type == "cpu" and isinstance(xi, torch.nn.Module) and images.dim() == 4
                and images.shape[1] == 3):
            batch = forward_batch(xi, int(images.shape[-1]), device, batch)
    out = []
    with torch.no_grad():
        for a in range(0, images.shape[0], batch):
            x = normalized(images[a:a + batch].to(device, non_blocking=True))
            with autocast(device, amp):
                v = xi(x)
            out.append((v.embedding if hasattr(v, "embedding") else v).float())
    return torch.cat(out) if out else torch.zeros(0)


class BatchedExecutor:
    """K clients per step over stacked weights (``vmap``, or the client-folded trunk).

    Args:
        device: ``cuda`` (the intended use) or ``cpu``.
        chunk_size: clients per step; ``0`` = sized from free CUDA memory by
            :meth:`calibrate` (the federation calls it before it builds the first chunk),
            32 on CPU.
        memory_fraction: share of the free CUDA memory a chunk may use (the margin covers
            allocator fragmentation and what the round holds besides the chunk).
        fold: ``auto`` — the client-folded trunk where the method has trunks and the folded
            backbone passes :func:`~.folding.check_folding`; ``off`` — always vmap.
        pointwise: folded 1×1 convolutions as grouped convolutions (``conv``) or batched
            matrix products (``matmul``); ``auto``: matmul on CUDA (19.9 vs 15.4 client-updates/s
            for MobileFaceNet@112 at K = 48 on an H200, docs/simulation.md), conv on CPU.
        xi_once: compute ``ξ(x)`` once per image per chunk (False: at every step, inside the
            objective, as before — kept to test that both give the same updates).
        channels_last: run the folded trunk in NHWC memory (cuDNN's grouped convolutions
            transpose NCHW inputs to NHWC and back otherwise).
        compile: the folded trunk through ``torch.compile`` (:mod:`.compiled`): ``auto`` — on
            CUDA where Triton is installed, eager on CPU; ``on``; ``off``. A failed compilation
            falls back to eager and ``path_note`` says why; ``compile_s`` is the first compiled
            step's time (compilation included), kept apart from training throughput.
    """

    name = "batched"

    def __init__(self, device: str | torch.device = "cuda", chunk_size: int = 0, memory_fraction: float = 0.8,
                 fold: str = "auto", pointwise: str = "auto", xi_once: bool = True, channels_last: bool = False,
                 compile: str = "auto") -> None:
        if fold not in FOLD_MODES:
            raise InputError(f"fold must be one of {FOLD_MODES}, got {fold!r}")
        if pointwise not in POINTWISE_MODES + ("auto",):
            raise InputError(f"pointwise must be auto or one of {POINTWISE_MODES}, got {pointwise!r}")
        if pointwise == "auto":       # measured: matmul 1.29× conv on an H200 (K = 48), conv 1.1× matmul on CPU
            pointwise = "matmul" if torch.device(device).type == "cuda" else "conv"
        if not 0 < memory_fraction <= 1:
            raise InputError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.device = torch.device(device)
        self.fold, self.pointwise, self.xi_once, self.channels_last = fold, pointwise, xi_once, bool(channels_last)
        self.compile, self.compile_note = compile_choice(compile, self.device)
        self.chunk_size = int(chunk_size) if chunk_size > 0 else (256 if self.device.type == "cuda" else 32)
        self.memory_fraction = memory_fraction
        self.needs_calibration = chunk_size <= 0 and self.device.type == "cuda"
        self.memory_plan: MemoryPlan | None = None
        self.path: str | None = None
        """``folded`` or ``vmap``: the path of the last chunk; ``path_note`` says why."""
        self.path_note = ""
        self.oom_splits = 0
        """Chunks split in half after an out-of-memory error (:func:`.splitting.train_splitting`)."""
        self._folded: dict[int, dict[str, TrunkCall]] = {}
        self._probing = False
        self.probe: Callable[[Callable[[], None]], tuple[int, int]] = cuda_memory_probe(self.device)

    # ---- the path --------------------------------------------------------------------------
    @property
    def compile_s(self) -> float:
        """Seconds the compiled trunks' first steps took (compilation included), all methods."""
        return sum(c.compile_s for calls in self._folded.values() for c in calls.values())

    def _trunks(self, method: FederatedMethod) -> dict[str, TrunkCall]:
        """Folded backbones of the method's trained trunk groups, as calls, or {} (vmap)."""
        key = id(method)
        if key in self._folded:
            return self._folded[key]
        trunks, trained = method.trunks() if self.fold == "auto" else {}, method.trained_groups()
        out: dict[str, TrunkCall] = {}
        note = "fold=off" if self.fold == "off" else (
            "scope=top: the frozen stem runs once per image, vmap over the top" if method.frozen_stem() is not None
            else "the method has no backbone/head split")
        try:
            for g, backbone in trunks.items():
                if trained is not None and g not in trained:
                    continue
                folded = fold_module(backbone, self.pointwise)
                check_folding(backbone, folded, int(getattr(backbone, "input_size", 32)), self.device)
                out[g] = TrunkCall(folded.to(self.device), self.channels_last, self.compile)
            if out:
                note = f"client-folded trunks: {', '.join(out)}; {self.compile_note}"
        except NotFoldable as e:
            out, note = {}, f"vmap: {e}"
        self._folded[key] = out
        self.path_note = note
        return out

    # ---- one chunk -------------------------------------------------------------------------
    def _prepare(self, method: FederatedMethod, tasks: Sequence[ClientTask], cfg: LocalConfig) -> _Chunk:
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
        all_active = active.all(1).tolist()
        nmax = max(ns)
        stem = method.frozen_stem()
        stems = [t.stem_features for t in tasks]
        if stem is not None and all(v is not None for v in stems):
            # scope=top with the run's cached stem outputs: the images are not needed on the device
            images, inputs = None, self._stacked(stems, ns, nmax)
        else:
            images = self._images(tasks, ns, nmax)
            # scope=top: the trunk is ξ's and frozen — its outputs are computed once here, and the
            # local steps train only the small top on them
            inputs = images if stem is None else self._features(stem, images, cfg)
        xi = None
        if method.xi_model() is not None and self.xi_once:
            given = [t.xi_features for t in tasks]
            after = method.xi_after_stem() if stem is not None else None
            if all(v is not None for v in given):
                xi = self._stacked(given, ns, nmax)
            elif after is not None:     # ξ = ξ's top on the stem's outputs: no second trunk pass
                xi = self._features(after, inputs, cfg)
            else:
                xi = self._features(method.xi_model(), images if images is not None else self._images(tasks, ns, nmax),
                                    cfg)
        params = {g: {name: torch.stack([t.params[g][name].to(dev, torch.float32) for t in tasks])
                      for name in w} for g, w in tasks[0].params.items()}
        consts = {name: torch.stack([t.consts[name].to(dev) for t in tasks]) for name in tasks[0].consts}
        return _Chunk(k, ns, idx.to(dev), valid.to(dev), active.to(dev), all_active, inputs, xi, params, consts,
                      stem is not None)

    def _images(self, tasks: Sequence[ClientTask], ns: list[int], nmax: int) -> torch.Tensor:
        """The chunk's images ``[K, n_max, 3, S, S]`` on the device, uint8 where every task's is."""
        dtype = torch.uint8 if all(t.images.dtype == torch.uint8 for t in tasks) else torch.float32
        images = torch.zeros((len(tasks), nmax) + tuple(tasks[0].images.shape[1:]), dtype=dtype, device=self.device)
        for c, (t, n) in enumerate(zip(tasks, ns)):
            images[c, :n] = (t.images if dtype == torch.uint8 else normalized(t.images)).to(self.device,
                                                                                             non_blocking=True)
        return images

    def _stacked(self, given: list[torch.Tensor], ns: list[int], nmax: int) -> torch.Tensor:
        """Per-client ``[n_c, …]`` tensors as one zero-padded float32 ``[K, n_max, …]`` on the device."""
        out = torch.zeros((len(given), nmax) + tuple(given[0].shape[1:]), dtype=torch.float32, device=self.device)
        for c, (v, n) in enumerate(zip(given, ns)):
            out[c, :n] = v.to(self.device, torch.float32, non_blocking=True)
        return out

    def _features(self, model: torch.nn.Module, inputs: torch.Tensor, cfg: LocalConfig) -> torch.Tensor:
        """``[K, n_max, …]`` outputs of a frozen ``model`` on the chunk's ``inputs`` ``[K, n_max, …]``,
        in one batched pass (padding included)."""
        k, nmax = inputs.shape[:2]
        flat = xi_features(model, inputs.reshape((k * nmax,) + tuple(inputs.shape[2:])), self.device, cfg.amp)
        return flat.reshape((k, nmax) + tuple(flat.shape[1:]))

    def train(self, method: FederatedMethod, plan: RoundPlan, tasks: Sequence[ClientTask],
              cfg: LocalConfig, max_steps: int | None = None) -> ChunkResult:
        """Train the chunk ``tasks`` (``max_steps``: stop early — the memory probe's one step)."""
        check_tasks(tasks)
        ch = self._prepare(method, tasks, cfg)
        trunks = self._trunks(method)
        self.path = "folded" if trunks else "vmap"
        dev = self.device
        lrs = learning_rates(method, tasks[0].params, cfg)
        bufs: dict[str, dict[str, torch.Tensor]] = {g: {} for g in ch.params}
        started = torch.zeros(ch.k, dtype=torch.bool, device=dev)
        scale = FP16_LOSS_SCALE if (cfg.amp == "fp16" and dev.type == "cuda") else 1.0
        step = self._folded_step(method, plan, cfg, ch, trunks, scale) if trunks else \
            self._vmap_step(method, plan, cfg, ch, scale)
        metrics = Metrics(ch.k, dev)
        n_steps = ch.idx.shape[0] if max_steps is None else min(max_steps, ch.idx.shape[0])
        for t in range(n_steps):
            grads, parts = step(t)
            act = ch.active[t]
            masked = not ch.all_active[t]
            if scale != 1.0:
                grads = {g: {n_: gr / scale for n_, gr in w.items()} for g, w in grads.items()}
                finite = torch.stack([torch.isfinite(gr).flatten(1).all(1) for w in grads.values()
                                      for gr in w.values()]).all(0)
                act, masked = act & finite, True
            if masked or cfg.momentum:
                sgd_update(ch.params, grads, lrs, cfg, bufs, active=act, started=started)
            else:
                sgd_update(ch.params, grads, lrs, cfg, bufs)
            started |= act
            metrics.add(parts, act)
        failed = [c.note for c in trunks.values() if c.note.startswith("compile failed")]
        if failed:
            self.path_note = f"client-folded trunks: {', '.join(trunks)}; {failed[0]}"
        params = {g: {k: v.detach() for k, v in w.items()} for g, w in ch.params.items()}
        bad = ~torch.stack([torch.isfinite(v).flatten(1).all(1) for w in params.values() for v in w.values()]).all(0)
        if bool(bad.any()):
            who = [tasks[i].client for i in torch.nonzero(bad).flatten().tolist()][:10]
            raise FloatingPointError(f"clients {who}: weights became non-finite (lr={cfg.lr_for(method)} too high?)")
        return ChunkResult([t.client for t in tasks], torch.tensor(ch.ns), params, metrics.result(),
                           int(ch.active[:n_steps].sum()), metrics.steps())

    def _batch(self, ch: _Chunk, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = torch.arange(ch.k, device=self.device)[:, None]
        x = normalized(ch.images[rows, ch.idx[t]])                          # [K, B, 3, S, S]
        v = ch.xi[rows, ch.idx[t]] if ch.xi is not None else None          # [K, B, D]
        return x, v

    def _split(self, method: FederatedMethod, params: Params) -> tuple[Params, Params]:
        """(differentiated, fixed) entries: groups the objective trains, less their frozen tensors."""
        moves = moving(method, params)
        train = {g: {n: p for n, p in w.items() if moves[g][n]} for g, w in params.items()}
        fixed = {g: {n: p for n, p in w.items() if not moves[g][n]} for g, w in params.items()}
        return {g: w for g, w in train.items() if w}, {g: w for g, w in fixed.items() if w}

    def _vmap_step(self, method: FederatedMethod, plan: RoundPlan, cfg: LocalConfig, ch: _Chunk, scale: float):
        # Only the groups the objective trains are differentiated (FederatedMethod.trained_groups);
        # the others ride along with the constants, so no [K, …] zero gradients are built for them.
        trainable, fixed = self._split(method, ch.params)
        dev = self.device

        def loss_fn(p: Params, aux, x: torch.Tensor, v: torch.Tensor | None, m: torch.Tensor):
            with autocast(dev, cfg.amp):
                feats = {} if v is None else {"xi": v}
                if ch.stem:         # x holds the frozen stem's outputs, not images
                    feats["trunk"], x = x, None
                loss, parts = method.objective(plan, _merged(aux[0], p), aux[1], x, m,
                                               **({"features": feats} if feats else {}))
            return loss.float() * scale, {n_: val.float() for n_, val in parts.items()}

        fn = vmap(grad_and_value(loss_fn, has_aux=True), in_dims=(0, 0, 0, 0 if ch.xi is not None else None, 0))

        def step(t: int):
            x, v = self._batch(ch, t)
            grads, (_, parts) = fn(trainable, (fixed, ch.consts), x, v, ch.valid[t])
            return grads, parts
        return step

    def _folded_step(self, method: FederatedMethod, plan: RoundPlan, cfg: LocalConfig, ch: _Chunk,
                     trunks: dict[str, TrunkCall], scale: float):
        trainable, fixed = self._split(method, ch.params)
        dev = self.device
        trunk_params = {g: {n[len(BACKBONE):]: p.requires_grad_(True) for n, p in trainable[g].items()
                            if n.startswith(BACKBONE)} for g in trunks}
        head = {g: {n: p for n, p in w.items() if not (g in trunks and n.startswith(BACKBONE))}
                for g, w in trainable.items()}
        leaves = [(g, n) for g in trunks for n in trunk_params[g]]

        def head_fn(p: Params, feats: dict[str, torch.Tensor], aux, x: torch.Tensor, v: torch.Tensor | None,
                    m: torch.Tensor):
            f = dict(feats) if v is None else {**feats, "xi": v}
            with autocast(dev, cfg.amp):
                # x is read only by models without a trunk (a trained group that is not folded)
                loss, parts = method.objective(plan, _merged(aux[0], p), aux[1], x, m, features=f)
            return loss.float() * scale, {n_: val.float() for n_, val in parts.items()}

        fn = vmap(grad_and_value(head_fn, argnums=(0, 1), has_aux=True),
                  in_dims=(0, 0, 0, 0, 0 if ch.xi is not None else None, 0))

        # the memory probe runs eager: compiling the probe's 1- and 2-client shapes would cost two
        # compilations no chunk uses, and eager's activation memory bounds the compiled one's
        calls = {g: (c.eager if self._probing else c) for g, c in trunks.items()}

        def step(t: int):
            x, v = self._batch(ch, t)
            with autocast(dev, cfg.amp):
                outs = {g: call(trunk_params[g], x) for g, call in calls.items()}   # [K, B, D]
            feats = {g: o.detach().float() for g, o in outs.items()}
            (g_head, g_feats), (_, parts) = fn(head, feats, (fixed, ch.consts), x, v, ch.valid[t])
            trunk_grads = torch.autograd.grad([outs[g] for g in trunks],
                                              [trunk_params[g][n] for g, n in leaves],
                                              [g_feats[g].to(outs[g].dtype) for g in trunks])
            grads: Params = {g: dict(w) for g, w in g_head.items()}
            for (g, n), gr in zip(leaves, trunk_grads):
                grads.setdefault(g, {})[BACKBONE + n] = gr.float()
            return grads, parts
        return step

    # ---- chunk size ------------------------------------------------------------------------
    def calibrate(self, method: FederatedMethod, plan: RoundPlan, probe_tasks: Sequence[ClientTask],
                  cfg: LocalConfig) -> MemoryPlan:
        """Size chunks before the first one is built: one training step of 1 and of 2 of the
        round's real clients (their image count, batch size and epochs), whose peak memory
        above the baseline gives a fixed part and a per-client part; the chunk is what fits in
        ``memory_fraction`` of the free memory (``MemoryPlan`` states the numbers)."""
        if len(probe_tasks) < 1:
            raise InputError("calibration needs at least one client task")
        peaks = []
        self._probing = True
        try:
            for k in (1, min(2, len(probe_tasks))):
                free, peak = self.probe(lambda k=k: self.train(method, plan, probe_tasks[:k], cfg, max_steps=1))
                peaks.append((k, peak, free))
        finally:
            self._probing = False
        plan_ = MemoryPlan.from_probes(peaks, self.memory_fraction)
        self.chunk_size = plan_.chunk_size
        self.memory_plan = plan_
        self.needs_calibration = False
        return plan_


__all__ = ["BatchedExecutor", "FOLD_MODES", "xi_features"]
