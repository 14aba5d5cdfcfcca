"""Central pre-training of the frozen model ``ξ(ψ)`` on public identities (FedFS §4.1).

FedFS pre-trains ξ on public data (MS-Celeb-1M) with a margin softmax; here ξ is a
:class:`~fedfs_sdk.nn.model.FaceNet` (backbone only) trained with a **CosFace** margin
``s·(cos θ_y − m)`` by default — ``cos θ`` is a normalized dot product, so the whole loss
is made of ops that ONNX Runtime training differentiates (ArcFace's ``cos(θ + m)`` needs
``acos``, which it does not; the optional ``arcface`` margin builds it from
``sqrt(1 − cos²)`` instead).

The trained checkpoint is cached under a key that hashes the pre-training config and the
exact public data (dataset description + identities + image indices), so re-running a
demo or a sweep reuses it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfs_sdk.nn.backbones.layers import l2_normalize
from fedfs_sdk.nn.checkpoint import load_checkpoint, save_checkpoint
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.model import FaceNet, ModelConfig

from .datasets import IdentityDataset
from .memory import inference_batch, train_micro_batch

MARGINS = ("cosface", "arcface")


@dataclass(frozen=True)
class PretrainConfig:
    """Architecture of ξ and its margin-softmax training.

    ``scale``/``margin``: CosFace ``s``/``m``. CosFace uses s = 64, m = 0.35 on large models;
    for the small demo backbones on SynthFaces s = 16, m = 0.2 generalizes best to new
    identities (pairwise AUROC 0.880 vs 0.860 for s = 30, m = 0.2; measured, 300 public
    identities × 20 images, 10 epochs). For ArcFace ``margin`` is the additive angle.
    ``optimizer``: ``adamw`` (default) or ``sgd`` (with ``momentum``). Measured on SynthFaces
    with the ``tiny`` backbone: SGD (lr 0.1, momentum 0.9) with a normalized margin head
    stays at chance for 10 epochs, AdamW (lr 5e-3, warm-up + cosine decay) learns.
    """

    backbone: str = "tiny"
    embedding_dim: int | None = None
    input_size: int | None = None
    width: int | None = None
    loss: str = "cosface"
    scale: float = 16.0
    margin: float = 0.2
    epochs: int = 10
    batch_size: int = 128
    optimizer: str = "adamw"
    lr: float = 5e-3
    momentum: float = 0.9
    weight_decay: float = 5e-4
    flip: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise InputError(f"pretrain optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.loss not in MARGINS:
            raise InputError(f"pretrain loss must be one of {MARGINS}, got {self.loss!r}")
        if self.epochs < 1 or self.batch_size < 2 or not self.lr > 0:
            raise InputError("pretrain needs epochs ≥ 1, batch_size ≥ 2 and lr > 0")

    def model_config(self, image_size: int) -> ModelConfig:
        cfg = ModelConfig(self.backbone, self.embedding_dim, self.input_size or image_size, width=self.width)
        return cfg.resolved()


class MarginHead(nn.Module):
    """Class centres ``W ∈ R^{K×D}`` and a CosFace / ArcFace margin on the target logit."""

    def __init__(self, embedding_dim: int, num_classes: int, loss: str, scale: float, margin: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_dim))
        nn.init.normal_(self.weight)  # only directions matter: the head normalizes W
        self.loss, self.scale, self.margin = loss, scale, margin

    def cosine(self, emb: torch.Tensor) -> torch.Tensor:
        return l2_normalize(emb) @ l2_normalize(self.weight).t()

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos = self.cosine(emb)
        onehot = F.one_hot(labels, cos.shape[1]).to(cos.dtype)
        if self.loss == "cosface":
            target = cos - self.margin                        # CosFace: cos θ − m
        else:                                                 # ArcFace: cos(θ + m) without acos
            sin = torch.sqrt((1.0 - cos * cos).clamp_min(1e-7))
            target = cos * math.cos(self.margin) - sin * math.sin(self.margin)
            # beyond θ > π − m, cos(θ + m) is no longer decreasing: fall back to CosFace form
            target = torch.where(cos > math.cos(math.pi - self.margin), target,
                                 cos - math.sin(math.pi - self.margin) * self.margin)
        return self.scale * (onehot * target + (1.0 - onehot) * cos)


@dataclass
class PretrainResult:
    model: FaceNet
    path: Path | None
    cached: bool
    stats: dict[str, Any]


def data_key(dataset: IdentityDataset, identities: np.ndarray, indices: np.ndarray) -> str:
    """A hash of the exact pre-training images."""
    h = hashlib.sha256(repr(dataset).encode())
    h.update(np.ascontiguousarray(identities, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()


def cache_key(config: PretrainConfig, dkey: str) -> str:
    blob = json.dumps({"config": asdict(config), "data": dkey}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDFS_CACHE_DIR", Path.home() / ".cache" / "fedfs")) / "pretrained"


def train_xi(dataset: IdentityDataset, identities: np.ndarray, indices: np.ndarray, labels: np.ndarray,
             config: PretrainConfig, device: str = "cpu",
             progress: Callable[[int, int, dict[str, float]], None] | None = None,
             micro_batch: int | None = None) -> tuple[FaceNet, dict[str, Any]]:
    """Train ξ on the images ``(identities[i], indices[i])`` with class ``labels[i]``.

    ``progress(step, total_steps, {"loss", "acc"})`` is called after every step.
    Each batch of ``config.batch_size`` runs as micro-batches of ``micro_batch`` images
    with accumulated gradients (default: what fits :data:`device_sim.memory.TRAIN_BUDGET_BYTES`,
    e.g. 11 for MobileFaceNet at 112 px; the whole batch for small backbones). The step is
    the same as one full-batch step: the backbones normalize per sample (no BatchNorm) and
    the loss is the batch mean, so only the float summation order differs.
    """
    identities, indices, labels = (np.asarray(a, dtype=np.int64) for a in (identities, indices, labels))
    if not identities.size == indices.size == labels.size or identities.size < 2:
        raise InputError("pre-training needs ≥ 2 images with one identity, index and label each")
    num_classes = int(labels.max()) + 1
    if num_classes < 2:
        raise InputError("pre-training a margin softmax needs ≥ 2 public identities")
    torch.manual_seed(config.seed)
    dev = torch.device(device)
    model = FaceNet(config.model_config(int(dataset.image_size))).to(dev)
    head = MarginHead(int(model.config.embedding_dim), num_classes, config.loss, config.scale, config.margin).to(dev)
    params = list(model.parameters()) + list(head.parameters())
    if config.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    n = identities.size
    bs = min(config.batch_size, n)
    steps_per_epoch = max(1, n // bs)                       # drop the last partial batch
    total = steps_per_epoch * config.epochs
    warm = max(1, steps_per_epoch // 2)     # linear warm-up, then cosine decay to 0
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    mb = micro_batch or train_micro_batch(model, int(model.config.input_size))
    mb = max(1, min(int(mb), bs))
    rng = np.random.default_rng([config.seed, 0x9E7])
    y_all = torch.from_numpy(labels)
    step, ema_loss, ema_acc = 0, None, None
    model.train()
    for _ in range(config.epochs):
        order = rng.permutation(n)
        for b in range(steps_per_epoch):
            sel = order[b * bs:(b + 1) * bs]
            flips = rng.random(sel.size) < 0.5 if config.flip else None
            opt.zero_grad(set_to_none=True)
            loss_sum, correct = 0.0, 0
            for m0 in range(0, sel.size, mb):
                part = sel[m0:m0 + mb]
                x = dataset.batch(identities[part], indices[part]).to(dev)
                if flips is not None:
                    flip = torch.from_numpy(flips[m0:m0 + mb]).to(dev)
                    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
                y = y_all[part].to(dev)
                emb = model(x).embedding
                # sum / |batch|: the micro-batch losses add up to the batch-mean loss
                loss = F.cross_entropy(head(emb, y), y, reduction="sum") / sel.size
                loss.backward()
                loss_sum += float(loss.detach())
                correct += int((head.cosine(emb.detach()).argmax(1) == y).sum())   # nearest class centre
                del x, emb, loss
            opt.step()
            sched.step()
            step += 1
            acc = correct / sel.size
            lv = loss_sum
            ema_loss = lv if ema_loss is None else 0.9 * ema_loss + 0.1 * lv
            ema_acc = acc if ema_acc is None else 0.9 * ema_acc + 0.1 * acc
            if not math.isfinite(ema_loss):
                raise FloatingPointError(f"pre-training loss became {ema_loss} (lr={config.lr} too high?)")
            if progress is not None:
                progress(step, total, {"loss": ema_loss, "acc": ema_acc})
    model.eval().requires_grad_(False)
    stats = {"steps": total, "num_classes": num_classes, "num_images": int(n),
             "final_loss": ema_loss, "final_train_acc": ema_acc}
    return model.cpu(), stats


def pretrain_cached(dataset: IdentityDataset, identities: np.ndarray, indices: np.ndarray, labels: np.ndarray,
                    config: PretrainConfig, device: str = "cpu", cache_dir: str | Path | None = None,
                    out: str | Path | None = None, force: bool = False,
                    progress: Callable[[int, int, dict[str, float]], None] | None = None) -> PretrainResult:
    """Pre-train ξ, or load it from the cache if the same config and data were trained before.

    The checkpoint is ``<cache_dir>/xi-<key>.safetensors`` (also copied to ``out`` if given);
    its meta holds the config, the data key, the training stats and the public identities —
    as dataset positions (``public_identities``) and as names (``public_identity_names``:
    folder names, ``synthfaces-<seed>/<index>``), which ``simulate --pretrained`` compares
    with its clients' and new users' names to refuse a ξ that saw them.
    """
    dkey = data_key(dataset, identities, indices)
    key = cache_key(config, dkey)
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cdir / f"xi-{key}.safetensors"
    public = np.unique(np.asarray(identities, dtype=np.int64))
    names = dataset.identity_names(public)
    if path.is_file() and not force:
        model, meta = load_checkpoint(path)
        if out is not None and Path(out) != path:
            # same data key ⇒ same identities: a ξ cached by an older version gets its names here
            save_checkpoint(out, model, model.config, {**meta, "public_identity_names": names})
        return PretrainResult(model.requires_grad_(False), Path(out) if out else path, True, meta.get("stats", {}))
    model, stats = train_xi(dataset, identities, indices, labels, config, device, progress)
    meta = {"kind": "xi", "pretrain": asdict(config), "data_key": dkey, "cache_key": key, "stats": stats,
            # lets `simulate` refuse a ξ that saw its clients' identities
            "public_identities": public.tolist(), "public_identity_names": names}
    save_checkpoint(path, model, model.config, meta)
    if out is not None:
        save_checkpoint(out, model, model.config, meta)
    return PretrainResult(model, Path(out) if out else path, False, stats)


@torch.no_grad()
def embed_images(model: nn.Module, dataset: IdentityDataset, identities: np.ndarray, indices: np.ndarray,
                 batch_size: int | None = None) -> torch.Tensor:
    """``model(x).embedding`` of the images ``(identities[i], indices[i])``, decoded and run
    ``batch_size`` at a time (default :func:`device_sim.memory.inference_batch`: 83 for
    MobileFaceNet at 112 px) — one 2000-image forward of MobileFaceNet peaked at 6 GB."""
    identities, indices = np.asarray(identities, np.int64), np.asarray(indices, np.int64)
    size = int(getattr(getattr(model, "config", None), "input_size", 0) or dataset.image_size)
    bs = batch_size or inference_batch(model, size)
    dev = next(model.parameters()).device
    out = [model(dataset.batch(identities[s:s + bs], indices[s:s + bs]).to(dev)).embedding.float().cpu()
           for s in range(0, identities.size, bs)]
    return torch.cat(out) if out else torch.zeros(0)


def load_xi(path: str | Path) -> FaceNet:
    """Load a pre-trained ξ checkpoint (any FaceNet checkpoint; projection/head are dropped)."""
    model, _ = load_checkpoint(path)
    cfg = replace(model.config, proj_dim=None, code_length=None)
    if cfg != model.config:
        bare = FaceNet(cfg)
        bare.backbone.load_state_dict(model.backbone.state_dict())
        model = bare
    return model.eval().requires_grad_(False)


__all__ = ["PretrainConfig", "PretrainResult", "MarginHead", "train_xi", "pretrain_cached", "load_xi", "embed_images",
           "cache_key", "data_key", "default_cache_dir", "MARGINS"]
