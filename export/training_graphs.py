"""Torch modules whose ``forward`` *is* a device's local loss — exported to ONNX as the
forward graph of the ORT on-device training artifacts.

They compute exactly :func:`fedfs_sdk.training.objective.local_objective` (the reference the
parity tests compare against), rearranged for what ONNX can express:

* **No stop-gradient in ONNX.** FedFS's soft labels ``α`` (Eq. 5–6) are labels: torch
  computes them under ``no_grad``. ORT would differentiate the same branch inside a
  training graph. So ``α`` is a graph *input* of the loss (Eq. 7), and the graph also
  *outputs* ``alpha_next`` — ``α`` recomputed from the current ``z``, ``v`` — which is
  connected to nothing the loss depends on, so ORT builds no gradient for it. The device
  runs the eval graph (same parameters, no gradient) to get ``alpha_next``, then feeds it
  to the training step: two forwards, one backward, gradients identical to torch's.
* **Dynamic batch.** Top-K membership of Eq. 6 is computed by counting, per column, the
  entries strictly greater than each entry (``in top-K ⟺ count < K``, ties included exactly
  like ``x ≥ kth-largest``), so ``K`` needs no batch-size-specific ``TopK`` constant and the
  same graph trains any batch size ≥ 2.
* **One learning rate per optimizer.** ORT's SGD has a single learning rate; the combined
  method trains the FedUV head ``W`` with ``head_lr``. The head is reparametrized as
  ``W = a·W̃`` with ``a = √(head_lr/lr)``: an SGD step of size ``lr`` on ``W̃`` moves ``W``
  by ``lr·a²·∇_W = head_lr·∇_W`` — torch's update exactly. The checkpoint stores ``W̃``;
  the device runtime converts on the way in and out (``param_scales`` in ``artifact.json``).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from fedfs_sdk.training.losses.fedfs import FedFSLossConfig, combine, f_reg, insub_logits, k_threshold
from fedfs_sdk.training.losses.feduv import feduv_neg_loss, feduv_pos_loss
from fedfs_sdk.nn.model import FaceNet, FedUVHead, scale_to_sqrt_c
from fedfs_sdk.training.objective import ObjectiveConfig, uses_fedfs, uses_feduv

PREFIX_GLOBAL = "global_model."
PREFIX_PERSONAL = "personal_model."
PREFIX_XI = "xi."


class ScaledFedUVHead(nn.Module):
    """``σ((a·W̃) g)`` — a :class:`~fedfs_sdk.nn.model.FedUVHead` whose stored weight is ``W/a``."""

    def __init__(self, head: FedUVHead, scale: float) -> None:
        super().__init__()
        self.code_length = head.code_length
        self.scale = float(scale)
        self.weight = nn.Parameter(head.weight.detach().clone() / self.scale)

    @property
    def effective_weight(self) -> torch.Tensor:
        return self.weight * self.scale

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return scale_to_sqrt_c(g @ self.effective_weight.t())


def soft_labels_graph(z: torch.Tensor, v: torch.Tensor, cfg: FedFSLossConfig) -> torch.Tensor:
    """Adaptive soft labels ``α`` (FedFS Eq. 5–6) in exportable, batch-size-free form.

    Same values as :func:`fedfs_sdk.training.losses.fedfs.adaptive_soft_labels` (without mask):
    ``ass = z vᵀ``; ``β_ij = γ·ass_ij`` on the diagonal, ``ass_ij`` if it is in the top-K of
    column ``j`` (``#{l : ass_lj > ass_ij} < K``), else 0; ``α = (softmax_i β)ᵀ``.
    """
    if cfg.soft_score == "cosine":
        z = z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-12)
        v = v / torch.sqrt((v * v).sum(-1, keepdim=True) + 1e-12)
    ass = z @ v.t()                                                   # [i, j]
    greater = (ass.unsqueeze(0) > ass.unsqueeze(1)).to(ass.dtype)      # [i, l, j] = ass_lj > ass_ij
    count = greater.sum(1)                                            # [i, j]
    k = k_threshold(cfg.top_k, torch.ones_like(ass[:, 0]).sum())   # n without a batch constant
    in_top = count < k if isinstance(k, float) else count.to(torch.float64) < k
    idx = torch.cumsum(torch.ones_like(ass[:, 0]), 0)                 # 1..n without a batch constant
    eye = idx.unsqueeze(1) == idx.unsqueeze(0)
    beta = torch.where(eye, cfg.gamma * ass, torch.where(in_top, ass, torch.zeros_like(ass)))
    return torch.softmax(beta, dim=0).t()


def insub_from_labels(z: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                      cfg: FedFSLossConfig) -> torch.Tensor:
    """``F_insub = −Σ_j α_ij log softmax_j(cos_ij)`` (FedFS Eq. 7), mean over anchors, with
    ``α`` given (a label: no gradient reaches it)."""
    logits = insub_logits(z, v, cfg.logits, cfg.logit_scale)
    return (-(alpha * F.log_softmax(logits, dim=-1)).sum(-1)).mean()


class FedUVStep(nn.Module):
    """FedUV local loss ``ℓ_pos`` (+ ``λ_neg ℓ_neg``) on the global model (FedUV Eq. 4).

    Inputs ``x`` ``[B,3,S,S]``, ``codeword`` ``[c]`` (±1 as float), and ``neg_codewords``
    ``[U, c]`` when ``λ_neg > 0``. Outputs ``loss``, ``l_pos`` (and ``l_neg``).
    """

    x_name = "x"
    """The first input: images ``x``, or ``features`` — the trunk's output — for a ``scope="top"``
    step over :class:`~fedfs_sdk.training.scope.TopFaceNet` models (:mod:`export.ort_top`)."""

    def __init__(self, global_model: FaceNet, objective: ObjectiveConfig, head_scale: float = 1.0) -> None:
        super().__init__()
        if global_model.uv_head is None:
            raise ValueError("FedUV artifacts need a model with a FedUV head (code_length)")
        self.global_model = copy.deepcopy(global_model)
        self.global_model.uv_head = ScaledFedUVHead(self.global_model.uv_head, head_scale)
        self.lambda_neg = float(objective.lambda_neg)

    @property
    def input_names(self) -> list[str]:
        return [self.x_name, "codeword"] + (["neg_codewords"] if self.lambda_neg > 0 else [])

    @property
    def output_names(self) -> list[str]:
        return ["loss", "l_pos"] + (["l_neg"] if self.lambda_neg > 0 else [])

    def forward(self, x: torch.Tensor, codeword: torch.Tensor,
                neg_codewords: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        uv = self.global_model(x).uv
        l_pos = feduv_pos_loss(uv, codeword)
        if self.lambda_neg > 0:
            l_neg = feduv_neg_loss(uv, neg_codewords)
            return l_pos + self.lambda_neg * l_neg, l_pos, l_neg
        return l_pos, l_pos


class FedFSStep(nn.Module):
    """FedFS ``F_total`` (Eq. 9) over global ``ϕ(w)``, personalized ``ϕ(θ)`` and frozen ``ξ``;
    for ``fedfs+feduv`` plus ``μ·½(ℓ_pos(σ(W r')) + ℓ_pos(σ(W q')))``.

    Inputs ``x``, ``alpha`` ``[B, B]`` (the soft labels, see module docstring), and
    ``codeword`` for the combined method. Outputs ``loss``, ``alpha_next`` and the parts.
    """

    x_name = "x"
    """As :attr:`FedUVStep.x_name` (``features`` under ``scope="top"``: ξ is then its top alone)."""

    def __init__(self, method: str, global_model: FaceNet, personal_model: FaceNet, xi: nn.Module,
                 objective: ObjectiveConfig, head_scale: float = 1.0) -> None:
        super().__init__()
        if not uses_fedfs(method):
            raise ValueError(f"FedFSStep is for FedFS methods, got {method!r}")
        self.method = method
        self.cfg = objective.fedfs
        self.uv_weight = float(objective.uv_weight)
        self.global_model = copy.deepcopy(global_model)
        self.personal_model = copy.deepcopy(personal_model)
        self.xi = copy.deepcopy(xi.backbone if isinstance(xi, FaceNet) else xi).requires_grad_(False)
        if self.global_model.proj is None or self.personal_model.proj is None:
            raise ValueError("FedFS artifacts need models with the extra linear layer (proj_dim)")
        if uses_feduv(method):
            if self.global_model.uv_head is None:
                raise ValueError("fedfs+feduv artifacts need a model with a FedUV head (code_length)")
            if objective.lambda_neg > 0:
                raise ValueError("ℓ_neg is only exported for the feduv method")
            self.global_model.uv_head = ScaledFedUVHead(self.global_model.uv_head, head_scale)

    @property
    def input_names(self) -> list[str]:
        return [self.x_name, "alpha"] + (["codeword"] if uses_feduv(self.method) else [])

    @property
    def output_names(self) -> list[str]:
        names = ["loss", "alpha_next", "F_insub", "F_reg", "F_total"]
        return names + (["l_pos", "l_pos_personal"] if uses_feduv(self.method) else [])

    def forward(self, x: torch.Tensor, alpha: torch.Tensor,
                codeword: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        g = self.global_model(x)
        p = self.personal_model(x)
        v = self.xi(x)
        z = combine(g.projection, p.projection, self.cfg.combine)
        alpha_next = soft_labels_graph(z, v, self.cfg)
        insub = insub_from_labels(z, v, alpha, self.cfg)
        reg = f_reg(g.embedding, p.embedding)
        f_total = self.cfg.lam * insub + (1.0 - self.cfg.lam) * reg
        if not uses_feduv(self.method):
            return f_total, alpha_next, insub, reg, f_total
        w = self.global_model.uv_head.effective_weight
        l_pos_p = feduv_pos_loss(scale_to_sqrt_c(p.embedding @ w.t()), codeword)
        # parts named as in local_objective: l_pos is the mean over the global (r') and
        # personalized (q') embeddings
        l_pos = 0.5 * (feduv_pos_loss(g.uv, codeword) + l_pos_p)
        return f_total + self.uv_weight * l_pos, alpha_next, insub, reg, f_total, l_pos, l_pos_p


def head_scale_for(lr: float, head_lr: float | None) -> float:
    """``a = √(head_lr / lr)`` of the head reparametrization (1 when no separate head lr)."""
    if head_lr is None or head_lr == lr:
        return 1.0
    if not (lr > 0 and head_lr > 0):
        raise ValueError(f"learning rates must be > 0, got lr={lr}, head_lr={head_lr}")
    return math.sqrt(head_lr / lr)
