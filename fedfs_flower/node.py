"""The device's local step on a Flower node (no Flower import: the ClientApp wraps it).

Does what :class:`fedfs_sdk.federation.device_runtime.TorchRuntime` does for a fedfs round task, with
the per-node :class:`~fedfs_sdk.federation.device_state.DeviceState` folder as the device's storage:

* ``b_u`` — the base vector the server assigned to this node — is saved at the node's first
  round (``device.json``) and must not change afterwards: the codeword depends on it;
* ``r_u`` and ``v_u = C(b_u ‖ r_u)`` (FedUV Alg. 2) are drawn and kept, encrypted, by
  :meth:`DeviceState.codeword`, exactly as on a fedfs device;
* ``θ_c`` (FedFS) is read from and written back to ``personal.safetensors``;
* only ``w_c`` and ``|D_c|`` are returned for sending. The digest of what is sent is
  recorded in the state (``device.json`` rounds), so an audit can compare it with what the
  server received.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.methods import check_method, uses_fedfs, uses_feduv

from .settings import NodeSettings

Weights = dict[str, torch.Tensor]

_IMAGES: dict[tuple[str, int, bool], np.ndarray] = {}
"""Preprocessed images per (folder, input size, detect_face): a simulation engine keeps its
worker processes across rounds, so a node's images are decoded once, as a device would."""


@dataclass
class StepResult:
    """What the local step produced; only ``weights`` and ``num_samples`` are sent."""

    weights: Weights
    num_samples: int
    metrics: dict[str, float]
    digest: str


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the keys (sorted), dtypes, shapes and bytes of a state dict — the same on
    the node (what it sent) and the server (what it received), whatever the key order."""
    h = hashlib.sha256()
    for k in sorted(weights):
        t = weights[k].detach().to("cpu").contiguous()
        h.update(f"{k}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def node_images(data_dir: Path, input_size: int, detect_face: bool) -> np.ndarray:
    """The node's images (every image file directly in ``data_dir``) preprocessed for the model."""
    from fedfs_sdk.runtime.preprocess import list_images, preprocess

    key = (str(Path(data_dir).resolve()), int(input_size), bool(detect_face))
    if key not in _IMAGES:
        _IMAGES[key] = preprocess(list_images(data_dir), int(input_size), detect_face=detect_face)
    return _IMAGES[key]


def register_base_vector(state: DeviceState, base_vector: int, node_id: int) -> None:
    """Keep the server's ``b_u`` for this node; a different one later is refused (the codeword
    ``C(b_u ‖ r_u)`` already in use would change)."""
    info = state.info
    if info is None:
        # Flower authenticates SuperNodes itself: no fedfs bearer token exists on this path.
        state.save_registration("flower", f"flower-node-{node_id}", "", int(base_vector))
    elif int(info.base_vector) != int(base_vector):
        raise InputError(f"node state {state.path} holds b_u={info.base_vector}, but the server now assigns "
                         f"{base_vector}: a device's codeword cannot change. Give this node a new state-dir, or "
                         "keep the server's assignments (ServerApp run config 'out-dir' keeps base_vectors.json)")


def local_step(settings: NodeSettings, *, method: str, model_config_json: str, train: Mapping[str, object],
               base_vector: int | None, global_weights: Mapping[str, torch.Tensor], server_round: int,
               node_id: int, run_id: int, neg_codewords: int = 0, images: np.ndarray | None = None) -> StepResult:
    """One round of ``method``'s local training on this node (FedFS Alg. 1 client step;
    FedUV Alg. 2). Returns ``w_c``, ``|D_c|``, the loss metrics and the digest of ``w_c``.
    ``images``: preprocessed float32 ``[N, 3, S, S]`` instead of the node's ``data_dir``."""
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.federation.device_runtime import negative_codewords, round_seed
    from fedfs_sdk.nn.model import ModelConfig
    from fedfs_sdk.training.trainer import LocalTrainer
    from fedfs_sdk.federation.wire import check_finite, encode_weights, train_config_from_json

    method = check_method(method)
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    config = ModelConfig.from_json(model_config_json).resolved()
    train_cfg = train_config_from_json(method, dict(train), "cpu")
    if images is None:
        images = node_images(settings.data_dir, int(config.input_size), settings.detect_face)
    xi = load_checkpoint(settings.xi)[0] if uses_fedfs(method) and settings.xi is not None else None
    with DeviceState(settings.state_dir) as state:
        codeword = neg = None
        if base_vector is not None:
            register_base_vector(state, base_vector, node_id)
        if uses_feduv(method):
            if base_vector is None:
                raise InputError(f"method {method!r} needs the node's base vector b_u from the server; the message "
                                 "carries none (is the ServerApp fedfs_flower.server_app:app?)")
            codeword = state.codeword(int(config.code_length))
            if train_cfg.objective.lambda_neg > 0:
                neg = negative_codewords({"neg_codewords": neg_codewords}, int(config.code_length))
        personal = None
        if uses_fedfs(method):
            loaded = state.load_weights("personal")
            personal = loaded[0] if loaded is not None else None
        result = LocalTrainer(config, train_cfg, xi).train(
            dict(global_weights), images, personal_weights=personal, codeword=codeword, neg_codewords=neg,
            seed=round_seed(train_cfg.seed, server_round))
        check_finite(result.weights, "local result")
        if result.personal_weights is not None:       # θ_c stays here, never in the reply
            state.save_weights_bytes("personal", encode_weights(result.personal_weights))
        digest = weights_digest(result.weights)
        if state.info is not None:
            state.record_round({"round_id": f"flower-{run_id}-{server_round}", "run_id": int(run_id),
                                "server_round": int(server_round), "num_samples": result.num_samples,
                                "sent_sha256": digest})
    return StepResult(result.weights, result.num_samples, dict(result.metrics), digest)


__all__ = ["StepResult", "local_step", "node_images", "register_base_vector", "weights_digest"]
