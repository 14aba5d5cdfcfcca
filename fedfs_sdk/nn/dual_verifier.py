"""The ``verify=both`` verifier of ``fedfs+feduv`` as a file a device keeps and an app loads.

:class:`~fedfs_sdk.nn.model.DualVerifierNet` verifies with both FedFS models through the global
FedUV head: ``unit(W q') ⊕ unit(W r')`` (``q'`` from the personalized ``ϕ(θ_c)``, ``r'``
from the global ``ϕ(w)``), so a cosine template of it averages the two head-space cosines —
the default verification of ``fedfs+feduv`` (:data:`fedfs_sdk.training.methods.DEFAULT_VERIFICATION`,
docs/personalization.md).

The file is a fedfs checkpoint (``fedfs-checkpoint/1``, safetensors, no pickle) whose
``meta.role`` is :data:`DUAL_ROLE` and whose tensors are the DualVerifierNet state dict
(``backbone.*`` = θ_c, ``global_backbone.*`` = w, ``uv_head.weight`` = W). Its model id is
the content hash of those tensors, as for every verifier, and is the id the ONNX export of
the same weights carries (``onnx/verifier-dual.onnx``).
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, InputError
from .model import DualVerifierNet, FaceNet, ModelConfig

DUAL_ROLE = "dual-verifier"


def dual_config(config: ModelConfig) -> ModelConfig:
    """The architecture of each half: the global model's backbone and head, no projection."""
    cfg = config.resolved()
    if not cfg.code_length:
        raise InputError("verify=both verifies through the FedUV head: the model has none (code_length)")
    return replace(cfg, proj_dim=None)


def build_dual_verifier(config: ModelConfig) -> DualVerifierNet:
    """An (untrained) DualVerifierNet of ``config``'s architecture."""
    cfg = dual_config(config)
    personal, glob = FaceNet(cfg), FaceNet(cfg)
    return DualVerifierNet(personal.backbone, glob.backbone, glob.uv_head)


def dual_verifier_in_memory(personal_backbone: torch.nn.Module, global_backbone: torch.nn.Module,
                            uv_head: torch.nn.Module, config: ModelConfig) -> tuple[DualVerifierNet, str]:
    """``(DualVerifierNet, model_id)`` of θ_c's backbone, w's backbone and ``W`` (the modules
    themselves): what :func:`load_dual_verifier` returns for the file :func:`save_dual_verifier`
    writes."""
    from .checkpoint import model_id_of

    net = DualVerifierNet(personal_backbone, global_backbone, uv_head).eval()   # the modules themselves
    return net, model_id_of(net.state_dict(), config.backbone)


def save_dual_verifier(path: str | os.PathLike[str], personal_backbone: torch.nn.Module,
                       global_backbone: torch.nn.Module, uv_head: torch.nn.Module, config: ModelConfig,
                       meta: dict[str, Any] | None = None) -> str:
    """Save the dual verifier of θ_c's backbone, w's backbone and the global head ``W``.
    Returns its model id."""
    from .checkpoint import save_checkpoint

    net, mid = dual_verifier_in_memory(personal_backbone, global_backbone, uv_head, config)
    save_checkpoint(path, net, dual_config(config), {**(meta or {}), "role": DUAL_ROLE, "model_id": mid})
    return mid


def is_dual_verifier(meta: dict[str, Any]) -> bool:
    return meta.get("role") == DUAL_ROLE


def dual_verifier_from_state(state: dict[str, torch.Tensor], config: ModelConfig, meta: dict[str, Any],
                             name: str | os.PathLike[str] = "dual verifier") -> tuple[DualVerifierNet, str]:
    """``(DualVerifierNet, model_id)`` from a dual verifier file's tensors and header; the
    recorded model id must be the one the weights hash to."""
    from .checkpoint import model_id_of

    try:
        net = build_dual_verifier(config)
        net.load_state_dict(state, strict=True)
    except (RuntimeError, InputError, KeyError, ValueError) as e:
        raise CheckpointError(f"{name} is not a usable dual verifier (verify=both): {e}") from e
    mid = model_id_of(net.state_dict(), config.backbone)
    if meta.get("model_id") not in (None, mid):
        raise CheckpointError(f"{name} records model_id {meta['model_id']!r} but its weights hash to {mid!r} "
                              "(tampered or mislabelled verifier)")
    return net.eval(), mid


def load_dual_verifier(path: str | os.PathLike[str]) -> tuple[DualVerifierNet, str]:
    """``(DualVerifierNet, model_id)`` of a file written by :func:`save_dual_verifier`."""
    from .checkpoint import read_checkpoint

    state, config, meta = read_checkpoint(path)
    if not is_dual_verifier(meta):
        raise CheckpointError(f"{Path(path)} is not a dual verifier (meta.role={meta.get('role')!r})")
    return dual_verifier_from_state(state, config, meta, path)


__all__ = ["DUAL_ROLE", "build_dual_verifier", "dual_verifier_in_memory", "save_dual_verifier", "load_dual_verifier", "is_dual_verifier",
           "dual_verifier_from_state", "dual_config"]
