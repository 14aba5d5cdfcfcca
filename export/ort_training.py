"""ONNX Runtime on-device training artifacts for a device's local step.

For each method (``feduv``, ``fedfs``, ``fedfs+feduv``) one folder holds what
``onnxruntime-training`` (Android/iOS C API, or :mod:`fedfs_sdk.training.ort_device` here) needs:
``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx`` (plain SGD),
``checkpoint`` (initial parameters) and ``artifact.json`` (how to drive them: inputs,
outputs, parameter names ↔ FaceNet state-dict keys, which are trainable, learning
rates, the soft-label protocol). The forward graphs are :mod:`export.training_graphs`.

Recipe (DESIGN.md, "Facts about the toolchain"): ``torch.onnx.export(dynamo=False,
training=TRAINING, do_constant_folding=False)`` of a module returning the loss first, then
``generate_artifacts(loss=None, optimizer=SGD)``; ORT ≥ 1.19 reads IR ≤ 10 (onnx 1.17).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from fedfs_sdk.nn.model import FaceNet, personal_config
from fedfs_sdk.training.objective import METHODS, ObjectiveConfig, uses_fedfs, uses_feduv
from fedfs_sdk.training.trainer import DEFAULT_EPOCHS, DEFAULT_HEAD_LR, DEFAULT_LR, TrainConfig

from .common import FORMAT_ORT_TRAINING, OPSET, ExportError, captured_native_stderr, quiet_onnxruntime
from .onnx_inference import check_runtime_compatible
from .ort_top import FEATURES_INPUT, check_top_exportable, export_trunk, top_models
from .training_graphs import (PREFIX_GLOBAL, PREFIX_PERSONAL, PREFIX_XI, FedFSStep, FedUVStep,
                              head_scale_for)

ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint", "artifact.json")

_NO_GRAD_OPS = {"PRelu", "InstanceNormalization", "Acos", "HardSwish", "HardSigmoid", "Softplus", "Elu",
                "LpNormalization", "ReduceMax", "Einsum", "CumSum"}
"""Ops ORT 1.19 cannot differentiate (DESIGN.md); checked on each graph's gradient path."""

_NO_GRAD_OUTPUT_OPS = {"Shape", "Size", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not",
                       "And", "Or", "Xor", "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf", "ConstantOfShape"}
"""Ops whose outputs carry no gradient (shapes, booleans, indices): dependence stops there."""


def supported_methods(global_model: FaceNet, xi: nn.Module | None) -> list[str]:
    """Methods whose artifacts can be built: FedUV needs a head, FedFS a projection and ξ."""
    cfg = global_model.config
    out = []
    if cfg.code_length:
        out.append("feduv")
    if cfg.proj_dim and xi is not None:
        out.append("fedfs")
        if cfg.code_length:
            out.append("fedfs+feduv")
    return out


def _dummy_inputs(step: nn.Module, input_size: int, code_length: int | None, batch: int = 4,
                  features: int | None = None) -> tuple:
    x = torch.zeros(batch, 3, input_size, input_size) if features is None else torch.zeros(batch, features)
    args: list[torch.Tensor] = [x]
    for name in step.input_names[1:]:
        if name == "alpha":
            args.append(torch.full((batch, batch), 1.0 / batch))
        elif name == "codeword":
            args.append(torch.ones(code_length))
        elif name == "neg_codewords":
            args.append(torch.ones(3, code_length))
    return tuple(args)


def _dynamic_axes(step: nn.Module) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {step.input_names[0]: {0: "batch"}}
    if "alpha" in step.input_names:
        axes["alpha"] = {0: "batch", 1: "batch"}
        axes["alpha_next"] = {0: "batch", 1: "batch"}
    if "neg_codewords" in step.input_names:
        axes["neg_codewords"] = {0: "negatives"}
    return axes


def _gradient_path_ops(model: onnx.ModelProto, trainable: set[str], loss: str) -> set[str]:
    """Op types on some path from a trainable initializer to ``loss`` (what ORT must
    differentiate)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    # nodes the loss depends on
    upstream: set[int] = set()
    stack = [loss]
    seen: set[str] = set()
    index = {id(n): i for i, n in enumerate(model.graph.node)}
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        n = producers.get(t)
        if n is not None:
            upstream.add(index[id(n)])
            stack.extend(n.input)
    # nodes that depend on a trainable parameter
    reach = set(trainable)
    downstream: set[int] = set()
    for i, n in enumerate(model.graph.node):  # graph.node is topologically sorted
        if any(inp in reach for inp in n.input):
            downstream.add(i)
            if n.op_type not in _NO_GRAD_OUTPUT_OPS:
                reach.update(n.output)
    return {model.graph.node[i].op_type for i in upstream & downstream}


def build_step(method: str, global_model: FaceNet, *, xi: nn.Module | None = None,
               objective: ObjectiveConfig = ObjectiveConfig(), lr: float | None = None,
               head_lr: float | None = None, scope: str = "all") -> tuple[nn.Module, float]:
    """The loss module of ``method`` and its head scale ``a`` (see training_graphs);
    ``head_lr=None`` is the device default :data:`~fedfs_sdk.training.trainer.DEFAULT_HEAD_LR`.
    ``scope="top"``: the same losses over the models' tops, fed trunk features (:mod:`export.ort_top`)."""
    if method not in METHODS:
        raise ExportError(f"unknown method {method!r}; choose from {METHODS}")
    if scope not in ("all", "top"):
        raise ExportError(f"scope must be 'all' or 'top', got {scope!r}")
    eff_lr = lr if lr is not None else DEFAULT_LR[method]
    eff_head_lr = head_lr if head_lr is not None else DEFAULT_HEAD_LR
    if objective.lambda_neg > 0 and method == "fedfs+feduv":
        raise ExportError(f"λ_neg (objective.lambda_neg={objective.lambda_neg:g}) is exported only for the feduv "
                          "method: fedfs+feduv artifacts cannot train ℓ_neg; set lambda_neg to 0 or leave "
                          "fedfs+feduv out (e.g. --methods feduv,fedfs)")
    if method == "feduv":
        if global_model.uv_head is None:
            raise ExportError("feduv artifacts need a checkpoint with a FedUV head (code_length)")
        scale = head_scale_for(eff_lr, eff_head_lr)
        if scope == "top":
            check_top_exportable(global_model, None)
            step = FedUVStep(top_models(global_model, None, None)[0], objective, head_scale=scale)
            step.x_name = FEATURES_INPUT
            return step, scale
        return FedUVStep(global_model, objective, head_scale=scale), scale
    if xi is None:
        raise ExportError(f"{method} artifacts need the frozen pre-trained model ξ (pass --xi)")
    if not global_model.config.proj_dim:
        raise ExportError(f"{method} artifacts need a checkpoint with the FedFS extra linear layer (proj_dim)")
    xi_dim = int(getattr(xi.backbone if isinstance(xi, FaceNet) else xi, "embedding_dim"))
    want = objective.fedfs.projection_dim(xi_dim)
    if global_model.config.proj_dim != want:
        raise ExportError(f"ξ embeds into {xi_dim} dims, so z = r ⊕ q ({objective.fedfs.combine}) needs "
                          f"proj_dim={want}, but the checkpoint has proj_dim={global_model.config.proj_dim}")
    xi_size = int(getattr(xi.backbone if isinstance(xi, FaceNet) else xi, "input_size"))
    if xi_size != global_model.input_size:
        raise ExportError(f"ξ takes {xi_size}×{xi_size} inputs but the model takes "
                          f"{global_model.input_size}×{global_model.input_size}")
    personal = FaceNet(personal_config(global_model.config))
    personal.load_state_dict({k: t for k, t in global_model.state_dict().items() if not k.startswith("uv_head.")})
    scale = head_scale_for(eff_lr, eff_head_lr) if uses_feduv(method) else 1.0
    if scope == "top":
        check_top_exportable(global_model, xi)
        step = FedFSStep(method, *top_models(global_model, personal, xi), objective, head_scale=scale)
        step.x_name = FEATURES_INPUT
        return step, scale
    return FedFSStep(method, global_model, personal, xi, objective, head_scale=scale), scale


def build_artifacts(step: nn.Module, example_inputs: tuple[torch.Tensor, ...], out_dir: Path,
                    what: str) -> tuple[list[str], list[str]]:
    """Export ``step`` (a module whose first output is the loss, with ``input_names`` /
    ``output_names`` attributes) and generate ORT training artifacts into ``out_dir``.

    Parameters named ``xi.*`` are frozen, all others trainable. Returns ``(trainable,
    frozen)`` parameter names. Fails with :class:`ExportError` when an op without an ORT
    gradient lies on the gradient path.
    """
    from fedfs_sdk.extras import require_ort_training

    require_ort_training("exporting ONNX Runtime training artifacts")
    from onnxruntime.training import artifacts  # imports torch: fine at export time only

    quiet_onnxruntime()
    out_dir.mkdir(parents=True, exist_ok=True)  # generate_artifacts needs it to exist
    step.train()
    fwd_path = out_dir / "forward.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # legacy (dynamo=False) exporter notice
        torch.onnx.export(step, example_inputs, str(fwd_path), dynamo=False, opset_version=OPSET,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=step.input_names, output_names=step.output_names,
                          dynamic_axes=_dynamic_axes(step))
    fwd = onnx.load(str(fwd_path))
    fwd_path.unlink()
    check_runtime_compatible(fwd, f"{what} forward graph")
    if fwd.graph.output[0].name != "loss":
        raise ExportError(f"the loss must be the first graph output, got {fwd.graph.output[0].name!r}")
    init_names = {i.name for i in fwd.graph.initializer}
    params = dict(step.named_parameters())
    unnamed = sorted(n for n in init_names if n not in params and n.split(".")[0] in
                     (PREFIX_GLOBAL[:-1], PREFIX_PERSONAL[:-1], PREFIX_XI[:-1]))
    if unnamed:
        raise ExportError(f"exporter renamed parameters {unnamed[:3]}")
    trainable = sorted(n for n in init_names if n in params and not n.startswith(PREFIX_XI))
    frozen = sorted(n for n in init_names if n in params and n.startswith(PREFIX_XI))
    bad = _gradient_path_ops(fwd, set(trainable), "loss") & _NO_GRAD_OPS
    if bad:
        raise ExportError(f"{what}: ops without an ORT gradient on the gradient path: {sorted(bad)}")
    with captured_native_stderr() as log:
        try:
            artifacts.generate_artifacts(fwd, requires_grad=trainable, frozen_params=frozen, loss=None,
                                         optimizer=artifacts.OptimType.SGD, artifact_directory=str(out_dir))
        except Exception as e:
            raise ExportError(f"{what}: onnxruntime could not build the training graph: {e}") from e
    if log and "[E:" in log[0]:
        raise ExportError(f"{what}: onnxruntime reported errors while building artifacts:\n{log[0][-2000:]}")
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        check_runtime_compatible(onnx.load(str(out_dir / name), load_external_data=False), f"{what}/{name}")
    return trainable, frozen


def export_training_artifacts(method: str, global_model: FaceNet, out_dir: str | os.PathLike[str], *,
                              xi: nn.Module | None = None, objective: ObjectiveConfig = ObjectiveConfig(),
                              lr: float | None = None, head_lr: float | None = None,
                              local_epochs: int | None = None, batch_size: int = 32,
                              model_id: str = "", model_version: str = "unversioned",
                              xi_sha256: str | None = None, scope: str = "all") -> dict[str, Any]:
    """Write the ORT training artifacts of ``method`` into ``out_dir`` (created).

    ``lr``/``head_lr``/``local_epochs`` default to the method's paper values
    (:data:`fedfs_sdk.training.trainer.DEFAULT_LR`, ``DEFAULT_HEAD_LR``). The ratio
    ``head_lr/lr`` is baked into the graph (FedUV methods); the device may change ``lr``
    and the head's rate follows it. ``xi_sha256`` (of ξ's checkpoint file) is recorded so a
    device can check that the ξ baked into the artifact (frozen) is the one a round task
    names. ``scope="top"`` trains the top on ``trunk.onnx``'s features (:mod:`export.ort_top`).
    Returns the ``artifact.json`` content.
    """
    out = Path(out_dir)
    eff_lr = float(lr if lr is not None else DEFAULT_LR[method])
    step, scale = build_step(method, global_model, xi=xi, objective=objective, lr=eff_lr, head_lr=head_lr,
                             scope=scope)
    cfg = global_model.config
    trunk = None
    if scope == "top":          # the trunk graph first: its output's width is the training graph's input's
        out.mkdir(parents=True, exist_ok=True)
        trunk = export_trunk(global_model.backbone, out, method)
    feats = trunk["feature_dim"] if trunk is not None else None
    trainable, frozen = build_artifacts(step, _dummy_inputs(step, cfg.input_size, cfg.code_length, features=feats),
                                        out, method)

    def keys(prefix: str, names: list[str]) -> list[str]:
        return [n[len(prefix):] for n in names if n.startswith(prefix)]

    epochs = int(local_epochs if local_epochs is not None else DEFAULT_EPOCHS[method])
    info: dict[str, Any] = {
        "format": FORMAT_ORT_TRAINING,
        "method": method,
        "model_id": model_id,
        "model_version": model_version,
        "model_config": json.loads(cfg.to_json()),
        "input_size": int(cfg.input_size),
        "code_length": int(cfg.code_length or 0),
        "scope": scope,
        "trunk": trunk,       # scope=top: trunk.onnx (x → features) and the sha256 of the trunk it holds
        "inputs": step.input_names,
        "outputs": step.output_names,
        "soft_labels": ({"input": "alpha", "output": "alpha_next",
                         "protocol": "eval_step(x, any alpha) -> alpha_next; train_step(x, alpha_next)"}
                        if uses_fedfs(method) else None),
        "min_batch": 2 if uses_fedfs(method) else 1,
        "prefixes": {"global": PREFIX_GLOBAL, "personal": PREFIX_PERSONAL, "xi": PREFIX_XI},
        "trainable": {"global": keys(PREFIX_GLOBAL, trainable), "personal": keys(PREFIX_PERSONAL, trainable)},
        "frozen": {"xi": keys(PREFIX_XI, frozen)},
        # every state-dict key (trained or not) and its shape: a device refuses weights that
        # do not fit this model exactly (missing, unexpected or reshaped keys)
        "state_shapes": {
            "global": {k: list(t.shape) for k, t in global_model.state_dict().items()},
            **({"personal": {k: list(t.shape) for k, t in global_model.state_dict().items()
                             if not k.startswith("uv_head.")}} if uses_fedfs(method) else {}),
        },
        "xi_sha256": xi_sha256 if uses_fedfs(method) else None,
        "param_scales": {f"{PREFIX_GLOBAL}uv_head.weight": scale} if scale != 1.0 else {},
        "optimizer": "sgd",
        "lr": eff_lr,
        "head_lr": eff_lr * scale * scale if uses_feduv(method) else None,
        "local_epochs": epochs,
        "batch_size": int(batch_size),
        "objective": {"uv_weight": objective.uv_weight, "lambda_neg": objective.lambda_neg,
                      "fedfs": asdict(objective.fedfs)},
        # what a round task means when it leaves a setting out (the device checks the task against both)
        "objective_defaults": {"uv_weight": ObjectiveConfig().uv_weight, "lambda_neg": ObjectiveConfig().lambda_neg,
                               "fedfs": asdict(ObjectiveConfig().fedfs)},
    }
    (out / "artifact.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


def train_config_of(info: dict[str, Any]) -> TrainConfig:
    """The torch :class:`~fedfs_sdk.training.trainer.TrainConfig` an artifact folder reproduces."""
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig

    obj = info["objective"]
    return TrainConfig(method=info["method"], lr=info["lr"], head_lr=info["head_lr"],
                       local_epochs=info["local_epochs"], batch_size=info["batch_size"],
                       scope=info.get("scope", "all"),        # older artifacts (no scope) train every layer
                       objective=ObjectiveConfig(fedfs=FedFSLossConfig(**obj["fedfs"]),
                                                 uv_weight=obj["uv_weight"], lambda_neg=obj["lambda_neg"]))
