"""Local training on one device (FedFS Alg. 1 client step, FedUV Alg. 2 training).

Input: the server's global weights ``w`` and the device's own images. Output: the new
global weights ``w_c`` and ``|D_c|`` — the only things that leave the device. The
personalized weights ``θ_c`` and the codeword stay in the device's state.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np
import torch
from torch import nn

from ..errors import InputError, TrainingError
from ..nn.model import FaceNet, ModelConfig, personal_config
from .methods import DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS, DEFAULT_HEAD_LR, DEFAULT_LR  # noqa: F401 (re-exported)
from .methods import DEFAULT_SCOPE
from .objective import ObjectiveConfig, check_method, local_objective, uses_fedfs, uses_feduv
from .scope import TopFaceNet, Trunk, check_scope, check_splittable, is_top_key

Weights = dict[str, torch.Tensor]


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class TrainConfig:
    """Local SGD settings. ``None`` means the paper's default for the method.

    ``head_lr`` is the learning rate of the FedUV head ``W`` (``feduv``, ``fedfs+feduv``);
    ``None`` = :data:`DEFAULT_HEAD_LR`. Set it equal to ``lr`` for FedUV's single rate.
    """

    method: str = "fedfs+feduv"
    lr: float | None = None
    head_lr: float | None = None
    local_epochs: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    scope: str | None = None
    """Which layers train (:mod:`fedfs_sdk.training.scope`): ``all``, ``top`` (the embedding
    layer, FedFS projection and FedUV head on a frozen trunk); None: :data:`DEFAULT_SCOPE`."""

    def __post_init__(self) -> None:
        check_method(self.method)
        for name in ("lr", "head_lr"):
            v = getattr(self, name)
            if v is not None and not (_is_real(v) and math.isfinite(v) and v > 0):
                raise InputError(f"{name} must be a finite number > 0 (or None for the default), got {v!r}")
        if self.local_epochs is not None and not (_is_int(self.local_epochs) and self.local_epochs >= 1):
            raise InputError(f"local_epochs must be an integer ≥ 1 (or None for the default), got {self.local_epochs!r}")
        if not (_is_int(self.batch_size) and self.batch_size >= 1):
            raise InputError(f"batch_size must be an integer ≥ 1, got {self.batch_size!r}")
        if self.batch_size < 2 and uses_fedfs(self.method):
            raise InputError("FedFS needs batches of ≥ 2 images (F_insub contrasts within the batch)")
        if not (_is_real(self.momentum) and 0 <= self.momentum < 1):
            raise InputError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if not (_is_real(self.weight_decay) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise InputError(f"weight_decay must be a finite number ≥ 0, got {self.weight_decay!r}")
        if not _is_int(self.seed):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        if self.scope is not None:
            check_scope(self.scope)
        if not isinstance(self.objective, ObjectiveConfig):
            raise InputError(f"objective must be an ObjectiveConfig, got {type(self.objective).__name__}")

    @property
    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.method]

    @property
    def effective_head_lr(self) -> float:
        return self.head_lr if self.head_lr is not None else DEFAULT_HEAD_LR

    @property
    def effective_scope(self) -> str:
        return self.scope if self.scope is not None else DEFAULT_SCOPE[self.method]

    @property
    def effective_epochs(self) -> int:
        return self.local_epochs if self.local_epochs is not None else DEFAULT_EPOCHS[self.method]


@dataclass
class LocalResult:
    """What a local step produced. Only ``weights`` and ``num_samples`` are uploaded."""

    weights: Weights
    num_samples: int
    personal_weights: Weights | None
    metrics: dict[str, float]


def as_image_batch(images: torch.Tensor | np.ndarray, input_size: int) -> torch.Tensor:
    """Validate a preprocessed batch: float32 ``[N, 3, S, S]`` (see ``preprocess.py``)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor):
        raise InputError(f"images must be a tensor or ndarray, got {type(images).__name__}")
    if images.dtype != torch.float32:
        raise InputError(f"images must be float32 normalized by preprocess(), got dtype {images.dtype}")
    if images.dim() != 4 or images.shape[1] != 3 or tuple(images.shape[2:]) != (input_size, input_size):
        raise InputError(f"images must have shape [N, 3, {input_size}, {input_size}], got {list(images.shape)}")
    if images.shape[0] == 0:
        raise InputError("no images to train on")
    if not torch.isfinite(images).all():
        raise InputError("images contain NaN or Inf")
    return images


def codeword_tensor(codeword: torch.Tensor | np.ndarray | None, code_length: int | None) -> torch.Tensor | None:
    if codeword is None:
        return None
    v = torch.as_tensor(np.asarray(codeword), dtype=torch.float32)
    if code_length is None or v.shape != (code_length,):
        raise InputError(f"codeword must have shape [{code_length}], got {list(v.shape)}")
    if not torch.all((v == 1) | (v == -1)):
        raise InputError("codeword entries must be ±1")
    return v


def neg_codeword_tensor(neg_codewords: torch.Tensor | np.ndarray, code_length: int | None) -> torch.Tensor:
    """Validate the other users' codewords of FedUV's ``ℓ_neg``: ``[m, c]``, ``m ≥ 1``, ±1."""
    try:
        v = torch.as_tensor(np.asarray(neg_codewords, dtype=np.float64), dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise InputError(f"neg_codewords must be a numeric [m, {code_length}] array: {e}") from None
    if v.dim() != 2 or v.shape[0] < 1 or code_length is None or v.shape[1] != code_length:
        raise InputError(f"neg_codewords must have shape [m, {code_length}] with m ≥ 1, got {list(v.shape)}")
    if not torch.isfinite(v).all():
        raise InputError("neg_codewords contain NaN or Inf")
    if not torch.all((v == 1) | (v == -1)):
        raise InputError("neg_codewords entries must be ±1")
    return v


class LocalTrainer:
    """Runs the local epochs of one device for ``config.method``.

    Args:
        model_config: architecture of the global model (with ``proj_dim`` for FedFS and
            ``code_length`` for FedUV).
        config: SGD and loss settings.
        xi: the frozen pre-trained model ``ξ(ψ)`` (FedFS methods); never updated.
    """

    def __init__(self, model_config: ModelConfig, config: TrainConfig = TrainConfig(),
                 xi: nn.Module | None = None) -> None:
        self.model_config = model_config.resolved()
        self.config = config
        m = config.method
        if uses_fedfs(m) and (xi is None or not self.model_config.proj_dim):
            raise InputError(f"method {m!r} needs ξ and a model_config with proj_dim")
        if uses_feduv(m) and not self.model_config.code_length:
            raise InputError(f"method {m!r} needs a model_config with code_length")
        dev = torch.device(config.device)
        self.device = dev
        self.global_model = FaceNet(self.model_config).to(dev)
        self.personal_model = FaceNet(personal_config(self.model_config)).to(dev) if uses_fedfs(m) else None
        self.xi = xi.to(dev).eval().requires_grad_(False) if xi is not None else None
        self.scope = config.effective_scope
        if self.scope == "top":     # the trunk stays as received; one trunk pass feeds ξ, global and personal
            check_splittable(self.global_model.backbone)
            self._trunk = Trunk(self.global_model.backbone)
            self._tops = (TopFaceNet(self.global_model),
                          TopFaceNet(self.personal_model) if self.personal_model is not None else None,
                          TopFaceNet(self.xi) if isinstance(self.xi, FaceNet) else None)

    def train(self, global_weights: Mapping[str, torch.Tensor], images: torch.Tensor | np.ndarray, *,
              personal_weights: Mapping[str, torch.Tensor] | None = None,
              codeword: torch.Tensor | np.ndarray | None = None,
              neg_codewords: torch.Tensor | np.ndarray | None = None,
              seed: int | None = None, trunk_features: torch.Tensor | None = None) -> LocalResult:
        """One local update. ``personal_weights=None`` starts ``θ_c`` from the global weights.

        ``trunk_features`` (``scope="top"``): ξ's trunk output ``[n, F]`` of ``images``, row for row,
        computed once by the caller (a device keeps them across rounds: its photos and ξ do not change)
        — the same top updates without a trunk pass per step. Used only where the trunk is shared
        (the global model's, θ_c's and ξ's trunks equal bit for bit); the first row is recomputed and
        compared, so features of other photos (or another trunk) are refused, not trained on."""
        cfg = self.config
        x_all = as_image_batch(images, self.model_config.input_size)
        v = codeword_tensor(codeword, self.model_config.code_length) if uses_feduv(cfg.method) else None
        if uses_feduv(cfg.method) and v is None:
            raise InputError(f"method {cfg.method!r} needs the device's codeword")
        neg = None if neg_codewords is None else neg_codeword_tensor(neg_codewords, self.model_config.code_length).to(self.device)
        n = x_all.shape[0]
        if uses_fedfs(cfg.method) and n < 2:
            raise InputError(f"FedFS needs at least 2 images per batch/device (F_insub contrasts images "
                             f"within a batch), got {n}")
        self._load(self.global_model, global_weights, "global weights")
        if self.personal_model is not None:
            src = personal_weights if personal_weights is not None else {
                k: t for k, t in global_weights.items() if not k.startswith("uv_head.")}
            self._load(self.personal_model, src, "personalized weights")
        # one trunk pass for all three models when their trunks agree (always, in a federation whose round
        # tasks name scope='top': the server keeps the trunk exact, server_agg/frozen_trunk.py); otherwise (e.g. a fleet with ONNX Runtime devices that train every layer)
        # each model runs its own frozen trunk: slower, the same gradients
        shared = self.scope == "top" and all(self._same_trunk(m) for m in (self.xi, self.personal_model) if m is not None)
        feats = self._check_features(trunk_features, x_all) if shared and trunk_features is not None else None
        params = self._param_groups()
        opt = torch.optim.SGD(params, lr=cfg.effective_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)
        bs = min(cfg.batch_size, n)
        metrics: dict[str, list[float]] = {}
        self.global_model.train()
        if self.personal_model is not None:
            self.personal_model.train()
        vd = v.to(self.device) if v is not None else None
        for _epoch in range(cfg.effective_epochs):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                if uses_fedfs(cfg.method) and idx.numel() < 2:
                    continue  # a lone leftover image has nothing to contrast with
                if shared:
                    if feats is not None:
                        f = feats[idx]
                    else:
                        with torch.no_grad():
                            f = self._trunk(x_all[idx].to(self.device))
                    g_top, p_top, xi_top = self._tops
                    loss, parts = local_objective(cfg.method, cfg.objective, f, g_top, personal_model=p_top,
                                                  xi=xi_top, codeword=vd, neg_codewords=neg)
                else:
                    x = x_all[idx].to(self.device)
                    loss, parts = local_objective(cfg.method, cfg.objective, x, self.global_model,
                                                  personal_model=self.personal_model, xi=self.xi,
                                                  codeword=vd, neg_codewords=neg)
                if not torch.isfinite(loss):
                    raise TrainingError(f"local loss became {loss.item()} (lr={cfg.effective_lr} too high?)")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                for k, t in parts.items():
                    metrics.setdefault(k, []).append(float(t.detach()))
        for what, model in (("global", self.global_model), ("personalized", self.personal_model)):
            bad = [] if model is None else [k for k, t in model.state_dict().items() if not torch.isfinite(t).all()]
            if bad:
                raise TrainingError(f"local training made the {what} weights non-finite ({bad[:3]}; "
                                    f"lr={cfg.effective_lr} too high?)")
        summary = {f"{k}_first": vals[0] for k, vals in metrics.items()}
        summary.update({f"{k}_last": vals[-1] for k, vals in metrics.items()})
        summary.update({f"{k}_mean": float(np.mean(vals)) for k, vals in metrics.items()})
        return LocalResult(
            weights=_cpu_state(self.global_model),
            num_samples=int(n),
            personal_weights=_cpu_state(self.personal_model) if self.personal_model is not None else None,
            metrics=summary,
        )

    def _check_features(self, features: torch.Tensor, x_all: torch.Tensor) -> torch.Tensor:
        """``features`` on the device, after checking they are this trunk's output of ``x_all``: the
        shape, finiteness, and the first image's features recomputed (a per-sample trunk: the batch
        does not change a row beyond float rounding)."""
        f = torch.as_tensor(features)
        if f.dim() != 2 or f.shape[0] != x_all.shape[0] or not f.is_floating_point():
            raise InputError(f"trunk_features must be a float [{x_all.shape[0]}, F] tensor (one row per image), "
                             f"got {f.dtype} {list(f.shape)}")
        f = f.to(self.device, torch.float32)
        with torch.no_grad():
            ref = self._trunk(x_all[:1].to(self.device))
        if ref.shape[1:] != f.shape[1:] or not torch.allclose(f[:1], ref, rtol=1e-4, atol=1e-4):
            raise InputError("trunk_features are not this model's trunk output of these images (the first row "
                             "differs): recompute them with ξ's trunk on the same photos, in the same order")
        return f

    def _same_trunk(self, other: nn.Module) -> bool:
        """Whether ``other`` (ξ, θ_c) has the global model's trunk, bit for bit."""
        if not isinstance(other, FaceNet):
            return False
        mine, theirs = self.global_model.backbone.state_dict(), other.backbone.state_dict()
        return all(torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine if not is_top_key("backbone." + k))

    def _param_groups(self) -> list[dict]:
        cfg = self.config
        top = self.scope == "top"
        for model in (self.global_model, self.personal_model):
            for n_, p in ([] if model is None else model.named_parameters()):
                p.requires_grad_(not top or is_top_key(n_))
        head = [p for n_, p in self.global_model.named_parameters() if n_.startswith("uv_head.")]
        rest = [p for n_, p in self.global_model.named_parameters() if not n_.startswith("uv_head.") and p.requires_grad]
        if self.personal_model is not None:
            rest += [p for p in self.personal_model.parameters() if p.requires_grad]
        groups = [{"params": rest}]
        if head:
            groups.append({"params": head, "lr": cfg.effective_head_lr})
        return groups

    @staticmethod
    def _load(model: nn.Module, weights: Mapping[str, torch.Tensor], what: str) -> None:
        expected = model.state_dict()
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise InputError(f"{what} do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for k, t in expected.items():
            if tuple(weights[k].shape) != tuple(t.shape):
                raise InputError(f"{what}: {k} has shape {list(weights[k].shape)}, model expects {list(t.shape)}")
            w = torch.as_tensor(weights[k])
            if w.is_floating_point() and not torch.isfinite(w).all():
                raise InputError(f"{what}: {k} contains NaN or Inf")
        model.load_state_dict({k: torch.as_tensor(w) for k, w in weights.items()}, strict=True)


def _cpu_state(model: nn.Module) -> Weights:
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}


def initial_global_weights(model_config: ModelConfig, xi: nn.Module | None = None, seed: int = 0) -> Weights:
    """Round-0 global weights: random init, with the backbone copied from ``ξ`` when the
    architectures match (FedFS starts the global and personalized models pre-trained)."""
    torch.manual_seed(seed)
    model = FaceNet(model_config)
    if xi is not None:
        src = xi.backbone if isinstance(xi, FaceNet) else xi
        try:
            model.backbone.load_state_dict(src.state_dict(), strict=True)
        except RuntimeError as e:
            raise InputError(f"ξ's backbone does not match the global model's: {e}") from e
    return _cpu_state(model)


__all__ = ["TrainConfig", "LocalTrainer", "LocalResult", "initial_global_weights", "as_image_batch", "neg_codeword_tensor",
           "DEFAULT_LR", "DEFAULT_EPOCHS", "replace"]
