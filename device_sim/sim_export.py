"""Take a model out of a simulation checkpoint, for ``fedfs export`` / ``enroll`` / ``verify``.

``fedfs simulate --checkpoint-every K`` writes ``DIR/checkpoints/<method>/round_NNNNN.safetensors``
in the federation format (``fedfs-federation/1``, :meth:`device_sim.federation.Federation.save`):
``global/*`` holds the global model ``w`` (a FaceNet state dict: backbone, the FedFS
projection when the method has one, the FedUV head ``W``), ``store/rows`` + ``store/data``
the client store (each trained client's ``θ_c`` as one flat row, in the key order of the
method's private template) and ``identity`` the method, its options, ξ's architecture and
the run settings.

From it this module writes an ordinary fedfs checkpoint (``fedfs-checkpoint/1``):

* the **global model** (no ``client``): ``w`` as a FaceNet — what the server would ship;
  ``fedfs export`` builds ONNX / training artifacts from it;
* **client ``c``'s verifier** (``client=c``): what that simulated device verifies with, as
  the device runtime builds it (:class:`fedfs_sdk.federation.device_runtime.TorchRuntime`): FedFS — the
  personalized backbone of ``θ_c``; FedUV — the global backbone and head; FedFS+FedUV —
  ``θ_c``'s backbone with the global head ``W`` (``verify=personal``), the global model
  (``verify=global``) or both (``verify=both``, :mod:`fedfs_sdk.nn.dual_verifier`).

Client ``c`` is the simulation's client number: ``results.json``'s ``clients[c]`` names its
identity folder.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fedfs_sdk.nn.checkpoint import read_safetensors, save_checkpoint, save_verifier
from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.nn.model import FaceNet, ModelConfig

FEDERATION_FORMAT = "fedfs-federation/1"      # = device_sim.federation.CHECKPOINT_FORMAT (not imported: light)


def checkpoint_format(path: str | os.PathLike[str]) -> str | None:
    """The ``format`` in a safetensors file's header (None if it is not one)."""
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format")
    except Exception:           # not safetensors at all: the caller's own loader explains
        return None


def is_federation_checkpoint(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix == ".safetensors" and checkpoint_format(p) == FEDERATION_FORMAT


def _global_model(tensors: dict[str, torch.Tensor], base: ModelConfig, name: Path) -> tuple[FaceNet, ModelConfig]:
    glob = {k[len("global/"):]: v for k, v in tensors.items() if k.startswith("global/")}
    cfg = replace(base, proj_dim=int(glob["proj.weight"].shape[0]) if "proj.weight" in glob else None,
                  code_length=int(glob["uv_head.weight"].shape[0]) if "uv_head.weight" in glob else None)
    net = FaceNet(cfg)
    want = net.state_dict()
    missing = [k for k in want if k not in glob]
    if missing:
        raise CheckpointError(f"{name}: the global weights are not a fedfs model (missing {missing[:3]}); only "
                              "pretrained, fedfs, feduv and fedfs+feduv runs can be exported")
    # extra server-side tensors (a baseline's class embeddings) are not part of the model
    net.load_state_dict({k: glob[k] for k in want}, strict=True)
    return net.eval(), cfg


def _client_weights(tensors: dict[str, torch.Tensor], ident: dict[str, Any], global_cfg: ModelConfig,
                    client: int, name: Path) -> dict[str, torch.Tensor]:
    """``θ_c`` of ``client`` from the client store rows (the key order of the private
    template: the global FaceNet's state dict without ``uv_head.*``)."""
    rows, data = tensors["store/rows"], tensors["store/data"]
    n = int(rows.numel())
    if not 0 <= client < n:
        raise InputError(f"--client {client} is not a client of this run (0 … {n - 1})")
    row = int(rows[client])
    if row < 0:
        raise InputError(f"client {client} never trained in this run (never sampled), so it has no θ_c: it would "
                         "verify with the global model — leave out --client")
    if ident.get("config", {}).get("store_dtype", "fp32") != "fp32":
        raise CheckpointError(f"{name} keeps θ_c as {ident['config']['store_dtype']} differences from the round-0 "
                              "model, which needs ξ to rebuild: re-run the simulation with --store-dtype fp32")
    # tensors no client trains (scope=top: the trunk) are stored once, not in the rows
    shared = {k[len("store/shared/personal/"):]: v for k, v in tensors.items() if k.startswith("store/shared/personal/")}
    shapes = [(k, v.shape) for k, v in FaceNet(global_cfg).state_dict().items() if not k.startswith("uv_head.")]
    total = sum(int(torch.Size(s).numel()) for k, s in shapes if k not in shared)
    if total != data.shape[1]:
        raise CheckpointError(f"{name}: client store rows hold {data.shape[1]} values, the personalized model "
                              f"has {total}")
    flat, out, at = data[row].float(), {}, 0
    for k, s in shapes:
        if k in shared:
            out[k] = shared[k].float().reshape(s).clone()
            continue
        size = int(torch.Size(s).numel())
        out[k] = flat[at:at + size].reshape(s).clone()
        at += size
    return out


def export_federation_model(path: str | os.PathLike[str], out: str | os.PathLike[str],
                            client: int | None = None) -> dict[str, Any]:
    """Write the global model (``client=None``) or client ``client``'s verifier of the
    simulation checkpoint ``path`` to ``out`` as a fedfs checkpoint; returns its meta
    (``role``, ``method``, ``round``, ``client``, ``source``)."""
    p = Path(path)
    tensors, header = read_safetensors(p, FEDERATION_FORMAT, "simulation checkpoint")
    try:
        ident = json.loads(header["identity"])
        base = ModelConfig.from_json(ident["model_config"]).resolved()
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{p}: simulation checkpoint without a readable identity ({e})") from e
    method, options = str(ident.get("method")), dict(ident.get("options") or {})
    net, cfg = _global_model(tensors, base, p)
    meta: dict[str, Any] = {"source": str(p.resolve()), "source_format": FEDERATION_FORMAT, "method": method,
                            "round": int(header.get("round", 0)), "client": client}
    if client is None:
        save_checkpoint(out, net, cfg, {**meta, "role": "global"})
        return {**meta, "role": "global"}
    if not isinstance(client, int) or isinstance(client, bool):
        raise InputError(f"--client must be an integer, got {client!r}")
    personal = method in ("fedfs", "fedfs+feduv") and options.get("verify", "personal") != "global"
    meta["role"] = "client-verifier"
    if not personal:      # FedUV / ξ: every client verifies with the global backbone (+ head)
        n = int(ident.get("num_clients", 0))
        if not 0 <= client < n:
            raise InputError(f"--client {client} is not a client of this run (0 … {n - 1})")
        save_verifier(out, net.backbone, cfg, net.uv_head, meta={**meta, "verifies_with": "global"})
        return {**meta, "verifies_with": "global"}
    if "store/rows" not in tensors:
        raise CheckpointError(f"{p}: method {method} should keep θ_c but the checkpoint has no client store")
    theta = FaceNet(replace(cfg, code_length=None))
    theta.load_state_dict(_client_weights(tensors, ident, cfg, client, p), strict=True)
    if method == "fedfs+feduv" and options.get("verify") == "both":
        from fedfs_sdk.nn.dual_verifier import save_dual_verifier
        save_dual_verifier(out, theta.backbone, net.backbone, net.uv_head, cfg, meta={**meta, "verifies_with": "both"})
        return {**meta, "verifies_with": "both"}
    head = net.uv_head if method == "fedfs+feduv" else None
    save_verifier(out, theta.backbone, cfg, head, meta={**meta, "verifies_with": "personal"})
    return {**meta, "verifies_with": "personal"}


__all__ = ["FEDERATION_FORMAT", "checkpoint_format", "is_federation_checkpoint", "export_federation_model"]
