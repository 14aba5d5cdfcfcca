"""How a device computes its part of a round, behind one small interface.

:class:`~fedfs_sdk.federation.agent.DeviceAgent` speaks the protocol (register, task, download,
upload, enroll); a runtime turns a task and the global model's bytes into an upload body
and, after training, gives the inference backend that enrolls the owner:

* :class:`TorchRuntime` — :class:`~fedfs_sdk.training.trainer.LocalTrainer` (PyTorch, CPU or CUDA),
  enrollment through :class:`~fedfs_sdk.runtime.inference.TorchBackend`;
* :class:`~.ort_runtime.OrtRuntime` — the phone's way: the ONNX Runtime training artifacts and the ONNX
  verifier of an export folder (``fedfs export --formats onnx,ort-training``), through
  :class:`~fedfs_sdk.training.ort_device.OrtDeviceTrainer` and
  :class:`~fedfs_sdk.runtime.onnx_backend.OnnxBackend`. Nothing in this path imports torch; it
  builds on what this module shares (:class:`LocalUpdate`, :func:`round_seed`, :func:`clip_upload` …).

Both send the same thing: ``w_c`` and ``|D_c|`` as a ``fedfs-update/1`` safetensors body.
A runtime writes nothing into the device state: the new ``θ_c`` (FedFS) travels in the
:class:`LocalUpdate`, and the agent keeps it as a pending file until the server has
accepted the upload, then makes it ``personal.safetensors`` (the same safetensors layout
in either runtime, so a device may switch runtimes between rounds).

Local training is seeded per round: :func:`round_seed` derives the seed of the mini-batch
order from the server's ``train.seed`` and the round id, so rounds do not repeat one order.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import numpy as np

from ..errors import InputError, ProtocolError
from ..training.methods import check_method, check_verification, uses_fedfs, uses_feduv
from .wire_format import MODEL_FORMAT

if TYPE_CHECKING:
    from .device_state import DeviceState
    from ..runtime.inference import InferenceBackend


class DeviceContext(Protocol):
    """What a runtime reads from the device running it (:class:`~fedfs_sdk.federation.agent.DeviceAgent`):
    its state directory, its images at a model's input size, and ξ by content hash. A protocol,
    so the runtimes do not import the agent that drives them."""

    state: "DeviceState"

    def images_array(self, input_size: int) -> np.ndarray: ...

    def xi_file(self, sha256: str | None) -> Path: ...


@dataclass
class LocalUpdate:
    """One round's result on the device: ``body`` is all that is uploaded.

    ``personal`` is the new ``θ_c`` (safetensors bytes; None for methods without one): it
    stays on the device and replaces the stored ``θ_c`` only once the server has accepted
    ``body``."""

    body: bytes
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    personal: bytes | None = None


def dp_clip_norm(task: Mapping[str, Any]) -> float | None:
    """The clip norm ``C`` of a DP-FedAvg round (``task["dp"]["clip"]``; None: not a DP round).

    The device clips its update ``w_c − w`` to ``C`` before encoding the upload, so what
    leaves the device is already bounded (McMahan et al. 2018, Alg. 1); the server clips
    again, since it cannot trust a device."""
    dp = task.get("dp")
    if not dp:
        return None
    from .dp import DpParams

    return DpParams.from_json(dp).clip


def clip_upload(weights: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], task: Mapping[str, Any],
                metrics: dict[str, float]) -> Mapping[str, np.ndarray]:
    """``weights`` with ``w_c − w`` clipped to the round's DP clip norm (unchanged outside DP);
    the norm before clipping goes into ``metrics["dp_update_norm"]``."""
    clip = dp_clip_norm(task)
    if clip is None:
        return weights
    from .dp import clip_flat_update

    out, norm, _ = clip_flat_update(weights, reference, clip)
    metrics["dp_update_norm"] = norm
    return out


def round_seed(seed: int, round_id: int) -> int:
    """The local-training seed of round ``round_id``: 32 bits drawn from
    ``numpy.random.SeedSequence([seed, round_id])`` (``seed`` = the server's ``train.seed``),
    so each round shuffles the mini-batches differently but reproducibly, in both runtimes."""
    mask = (1 << 64) - 1
    return int(np.random.SeedSequence([int(seed) & mask, int(round_id) & mask]).generate_state(1)[0])


class DeviceRuntime(Protocol):
    name: str

    def train(self, task: Mapping[str, Any], model: bytes, agent: DeviceContext) -> LocalUpdate:
        """Local training for ``task`` from the global model ``model`` (a fedfs checkpoint body)."""
        ...

    def verifier(self, method: str, model: bytes, agent: DeviceContext, version: int,
                 verify: str | None = None, candidate: str = "personalized", persist: bool = True) -> "InferenceBackend":
        """The backend the owner verifies with (global model version ``version``), kept in the
        state as the verifier ``fedfs verify --model`` takes unless ``persist=False`` (a candidate
        the check only scores; a runtime that needs the file to run it writes it anyway). ``candidate``
        (the do-no-harm check, :meth:`DeviceAgent.enroll`): ``xi`` — the frozen ξ as it is;
        ``global`` — the global model (with its FedUV head); ``personalized`` — by
        ``verify`` (:data:`fedfs_sdk.training.methods.VERIFY_MODELS`; ``None``: ``θ_c`` for FedFS methods,
        else the global model): ``personal`` → ``θ_c``'s backbone, ``global`` → the global
        one, ``both`` → the dual verifier ``unit(W q') ⊕ unit(W r')`` (``fedfs+feduv``); plus
        the global FedUV head for FedUV methods."""
        ...


def verifier_model(method: str, verify: str | None) -> str:
    """Which model verifies: ``verify``, or by default ``θ_c`` for FedFS methods and the global
    model otherwise (:class:`DeviceAgent` passes the method's verification default explicitly);
    the rules are :func:`fedfs_sdk.training.methods.check_verification`'s."""
    chosen = verify if verify is not None else ("personal" if uses_fedfs(method) else "global")
    score = None if uses_feduv(method) else "template"
    return check_verification(method, "head-template" if chosen == "both" else score, chosen)[1]


def negative_codewords(task: Mapping[str, Any], code_length: int) -> np.ndarray:
    """Random codewords for ``ℓ_neg`` (FedUV Eq. 4): a device knows no other user's codeword,
    so it draws ``task["neg_codewords"]`` codewords of random messages (docs/methods.md)."""
    from ..runtime.codes import random_codewords

    count = max(1, int(task.get("neg_codewords") or 0))
    return random_codewords(count, int(code_length), np.random.default_rng(secrets.randbits(128)))


class TorchRuntime:
    """Local training with :class:`~fedfs_sdk.training.trainer.LocalTrainer` on ``device`` (cpu, cuda)."""

    name = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    @staticmethod
    def _decode(model: bytes) -> tuple[dict[str, Any], dict[str, str]]:
        """The global model's tensors and checkpoint header."""
        from .wire import decode_weights

        weights, meta = decode_weights(model)
        if meta.get("format") != MODEL_FORMAT:
            raise ProtocolError(f"the server's model is not a fedfs checkpoint (format={meta.get('format')!r})")
        return weights, meta

    def train(self, task: Mapping[str, Any], model: bytes, agent: DeviceContext) -> LocalUpdate:
        from ..nn.model import ModelConfig
        from .device_features import training_features
        from .device_models import device_trainer, device_xi
        from .wire import check_finite, encode_update, encode_weights, train_config_from_json

        method = check_method(str(task["method"]))
        config = ModelConfig.from_json(json.dumps(task["model_config"])).resolved()
        train_cfg = train_config_from_json(method, task.get("train"), self.device)
        codeword = agent.state.codeword(int(config.code_length)) if uses_feduv(method) else None
        neg = (negative_codewords(task, int(config.code_length))
               if uses_feduv(method) and train_cfg.objective.lambda_neg > 0 else None)
        xi = device_xi(agent, agent.xi_file(task.get("xi_sha256"))) if uses_fedfs(method) else None
        personal = None
        if uses_fedfs(method):
            loaded = agent.state.load_weights("personal")
            personal = loaded[0] if loaded is not None else None
        images = agent.images_array(int(config.input_size))
        result = device_trainer(agent, config, train_cfg, xi).train(
            self._decode(model)[0], images, personal_weights=personal,
            codeword=codeword, neg_codewords=neg, seed=round_seed(train_cfg.seed, int(task["round_id"])),
            trunk_features=training_features(task, train_cfg, xi, images, agent))
        check_finite(result.weights, "local result")
        metrics = dict(result.metrics)
        upload = result.weights
        if dp_clip_norm(task) is not None:       # DP round: clip w_c − w to C before encoding (float64)
            import torch

            ref = {k: v.detach().cpu().numpy() for k, v in self._decode(model)[0].items()}
            clipped = clip_upload({k: v.detach().cpu().numpy() for k, v in upload.items()}, ref, task, metrics)
            upload = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in clipped.items()}
        body = encode_update(upload, round_id=int(task["round_id"]), model_version=int(task["model_version"]),
                             num_samples=result.num_samples)
        personal_bytes = encode_weights(result.personal_weights) if result.personal_weights is not None else None
        return LocalUpdate(body, result.num_samples, metrics, personal_bytes)   # θ_c stays on the device

    def verifier(self, method: str, model: bytes, agent: DeviceContext, version: int,
                 verify: str | None = None, candidate: str = "personalized", persist: bool = True) -> "InferenceBackend":
        from ..nn.checkpoint import load_checkpoint, load_verifier, save_verifier, verifier_in_memory
        from ..nn.dual_verifier import dual_verifier_in_memory, save_dual_verifier
        from ..runtime.inference import TorchBackend
        from ..nn.model import FaceNet, ModelConfig, personal_config

        chosen = {"xi": "xi", "norm-adapt": "xi", "global": "global"}.get(candidate) or verifier_model(method, verify)
        weights, meta = self._decode(model)
        config = ModelConfig.from_json(meta["model_config"]).resolved()
        if chosen == "xi":      # ξ as it is, on its own architecture (not the global model's: issue 29)
            xi = load_checkpoint(xi_path(agent))[0]           # a fresh copy: its backbone becomes this verifier's
            config = replace(xi.config.resolved(), code_length=None, proj_dim=None)
            if candidate == "norm-adapt":   # ξ re-fitted to the federation's embedding moments (fedfs_sdk.stats.in_domain)
                from ..stats.in_domain import norm_adapt_weights

                total = getattr(agent, "stats_embedding_sum", None)
                if total is None:
                    raise InputError("the norm-adapt candidate needs the federation's published embedding moments "
                                     "(a statistics round's xi.embedding)")
                xi.backbone.load_state_dict(norm_adapt_weights(xi.backbone.state_dict(), total))
            main_backbone, global_head = xi.backbone, None
        else:
            global_net = FaceNet(config)
            global_net.load_state_dict(weights)
            main_backbone, global_head = global_net.backbone, global_net.uv_head
        personal_backbone = None
        if chosen in ("personal", "both"):
            loaded = agent.state.load_weights("personal")
            if loaded is None:
                raise InputError(f"method {method!r} verifies with θ_c, which this device has not trained yet")
            personal = FaceNet(personal_config(config))
            personal.load_state_dict(loaded[0])
            personal_backbone = personal.backbone
        head = global_head if uses_feduv(method) and chosen != "xi" else None
        if not persist:         # the same (net, model id) the file below would load as, without the file
            net_id = (dual_verifier_in_memory(personal_backbone, main_backbone, head, config) if chosen == "both"
                      else verifier_in_memory(personal_backbone if chosen == "personal" else main_backbone,
                                              config, head))
            return TorchBackend(*net_id, device=self.device)
        path = agent.state.file("verifier.safetensors")    # what `fedfs verify --model` takes
        vmeta = {"global_version": int(version), "method": method, "verify": candidate if candidate == "norm-adapt" else chosen}
        if chosen == "both":
            save_dual_verifier(path, personal_backbone, main_backbone, head, config, meta=vmeta)
        else:
            backbone = personal_backbone if chosen == "personal" else main_backbone
            save_verifier(path, backbone, config, head, meta=vmeta)
        path.chmod(0o600)
        verifier, model_id = load_verifier(path)
        return TorchBackend(verifier, model_id, device=self.device)


def xi_path(agent: DeviceContext) -> Path:
    """The device's ξ file: the one it was given (``--xi``), else the one it downloaded to train."""
    cfg = getattr(agent, "config", None)
    if cfg is not None and getattr(cfg, "xi_path", None) is not None:
        return Path(cfg.xi_path)
    path = agent.state.file("xi.safetensors")
    if not path.is_file():
        raise InputError("this device has no ξ (it trained no FedFS round and was given no --xi): "
                         "it cannot compare its model with ξ")
    return path


from .ort_settings import OrtTrainSettings, ort_settings_for  # noqa: E402 (re-exported)


DUAL_ONNX_FILE = "onnx/verifier-dual.onnx"
"""The ``verify=both`` verifier graph of an export folder (``fedfs+feduv`` artifacts)."""


__all__ = ["DeviceRuntime", "LocalUpdate", "TorchRuntime", "DUAL_ONNX_FILE", "verifier_model",
           "OrtTrainSettings", "ort_settings_for",
           "negative_codewords", "round_seed", "dp_clip_norm", "clip_upload"]
