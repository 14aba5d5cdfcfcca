"""The device's local objective for each method — one function used by the single-device
trainer, the batched simulator (through ``torch.func.functional_call``/``vmap``) and as the
reference for the ONNX training graphs.

Methods:
    ``fedfs``       — FedFS ``F_total`` (Eq. 9) on global ``ϕ(w_c)``, personalized
                      ``ϕ(θ_c)`` and frozen ``ξ(ψ)``.
    ``feduv``       — FedUV ``ℓ_pos`` (+ ``λ_neg ℓ_neg``) on the global model's head.
    ``fedfs+feduv`` — ``F_total + μ · ½(ℓ_pos(σ(W r')) + ℓ_pos(σ(W q')))``: FedFS trains the
                      personalized extractor, the shared head ``W`` learns to map both the
                      global and the personalized embedding to the device's codeword, so
                      the verifier ``σ(W q')`` is trained directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch
from torch import nn
from torch.func import functional_call

from ..errors import InputError
from ..exact import as_written
from .methods import DEFAULT_UV_WEIGHT, METHODS, check_method, uses_fedfs, uses_feduv  # noqa: F401 (re-exported)
from .losses.fedfs import FedFSLossConfig, f_total
from .losses.feduv import feduv_neg_loss, feduv_pos_loss
from ..nn.model import FaceOutputs, scale_to_sqrt_c

Method = Literal["fedfs", "feduv", "fedfs+feduv"]


@dataclass(frozen=True)
class ObjectiveConfig:
    """Loss options of all methods. ``uv_weight`` is μ of the combined method;
    ``lambda_neg`` weighs FedUV's ``ℓ_neg`` (0 disables it)."""

    fedfs: FedFSLossConfig = FedFSLossConfig()
    uv_weight: float = DEFAULT_UV_WEIGHT
    lambda_neg: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.fedfs, FedFSLossConfig):
            raise InputError(f"fedfs must be a FedFSLossConfig, got {type(self.fedfs).__name__}")
        for name in ("uv_weight", "lambda_neg"):
            if not as_written(getattr(self, name), name) >= 0:
                raise InputError(f"{name} must be a finite number ≥ 0, got {getattr(self, name)!r}")


def _call(model: nn.Module, params: Mapping[str, torch.Tensor] | None, x: torch.Tensor | None,
          embedding: torch.Tensor | None = None):
    kwargs = {} if embedding is None else {"embedding": embedding}
    return model(x, **kwargs) if params is None else functional_call(model, dict(params), (x,), kwargs)


def local_objective(
    method: str,
    cfg: ObjectiveConfig,
    x: torch.Tensor,
    global_model: nn.Module,
    *,
    personal_model: nn.Module | None = None,
    xi: nn.Module | None = None,
    codeword: torch.Tensor | None = None,
    neg_codewords: torch.Tensor | None = None,
    global_params: Mapping[str, torch.Tensor] | None = None,
    personal_params: Mapping[str, torch.Tensor] | None = None,
    xi_params: Mapping[str, torch.Tensor] | None = None,
    mask: torch.Tensor | None = None,
    features: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one batch ``x`` of one device. Returns ``(loss, parts)``.

    With ``*_params`` the models are called functionally (for ``vmap`` over clients);
    ``mask`` marks real (vs padded) samples.

    ``features`` holds what was computed outside for this batch, so it is not computed again:
    ``"xi"`` — ``v = ξ(x)`` (Eq. 2; ξ is frozen, so its outputs for a client's images are the
    same at every local step and are computed once); ``"global"`` / ``"personal"`` — the
    backbone outputs ``r'`` / ``q'`` (the simulator's client-folded trunk computes them for a
    whole chunk and back-propagates the gradient this function returns for them). With all
    three given, ``x`` is not read (may be None).
    """
    feats = dict(features or {})
    g: FaceOutputs = _call(global_model, global_params, x, feats.get("global"))
    parts: dict[str, torch.Tensor] = {}
    loss = g.embedding.new_zeros((), dtype=x.dtype if x is not None else torch.float32)
    if uses_fedfs(method):
        if personal_model is None or (xi is None and "xi" not in feats):
            raise InputError(f"method {method!r} needs the personalized model and ξ")
        p: FaceOutputs = _call(personal_model, personal_params, x, feats.get("personal"))
        if "xi" in feats:
            v = feats["xi"].detach()
        else:
            with torch.no_grad():
                v_out = _call(xi, xi_params, x)
                v = (v_out.embedding if isinstance(v_out, FaceOutputs) else v_out).detach()
        if g.projection is None or p.projection is None:
            raise InputError("FedFS needs the extra linear layer: build the models with proj_dim")
        ft, fparts = f_total(g.embedding, p.embedding, g.projection, p.projection, v, cfg.fedfs, mask)
        loss = loss + ft
        parts.update(fparts, F_total=ft)
    if uses_feduv(method):
        if codeword is None or g.uv is None:
            raise InputError(f"method {method!r} needs a codeword and a model with a FedUV head")
        lpos = feduv_pos_loss(g.uv, codeword, mask)
        if method == "fedfs+feduv":
            w = global_model.uv_head.weight if global_params is None else global_params["uv_head.weight"]
            s_personal = scale_to_sqrt_c(p.embedding @ w.t())
            lpos_p = feduv_pos_loss(s_personal, codeword, mask)
            parts["l_pos_personal"] = lpos_p
            lpos = 0.5 * (lpos + lpos_p)
            weight = cfg.uv_weight
        else:
            weight = 1.0
        parts["l_pos"] = lpos
        loss = loss + weight * lpos
        if cfg.lambda_neg > 0:
            if neg_codewords is None:
                raise InputError("lambda_neg > 0 needs neg_codewords (FedUV Eq. 4 ℓ_neg)")
            lneg = feduv_neg_loss(g.uv, neg_codewords, mask)
            parts["l_neg"] = lneg
            loss = loss + cfg.lambda_neg * lneg
    parts["loss"] = loss
    return loss, parts
