"""Whether an ONNX Runtime training artifact can run a round task as the torch trainer would
(:func:`ort_settings_for`), and the settings it is built with. Re-exported by
:mod:`fedfs_sdk.federation.device_runtime`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import CheckpointError, InputError
from ..training.methods import (DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS, DEFAULT_HEAD_LR, DEFAULT_LR, check_method,
                                uses_fedfs, uses_feduv)
from .wire_format import split_train_json


def _differences(expected: Mapping[str, Any], given: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between two JSON objects (numbers compared with a relative tolerance)."""
    out = []
    for k in sorted(set(expected) | set(given)):
        a, b = expected.get(k), given.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _differences(a, b, f"{prefix}{k}.")
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            if not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0):
                out.append(f"{prefix}{k}: artifact {a!r}, task {b!r}")
        elif a != b:
            out.append(f"{prefix}{k}: artifact {a!r}, task {b!r}")
    return out


@dataclass(frozen=True)
class OrtTrainSettings:
    """What an :class:`~fedfs_sdk.training.ort_device.OrtDeviceTrainer` is built with for one task."""

    lr: float
    local_epochs: int
    batch_size: int
    seed: int
    lambda_neg: float


def ort_settings_for(task: Mapping[str, Any], info: Mapping[str, Any]) -> OrtTrainSettings:
    """Check that an ORT training artifact (its ``artifact.json``) can run ``task`` exactly as
    the torch trainer would, and return the settings; :class:`InputError` names each
    mismatch (the artifact bakes in the model, ξ, the objective and the head/backbone
    learning-rate ratio — only ``lr``, epochs, batch size and seed are free)."""
    method = check_method(str(task["method"]))
    problems = []
    given_cfg = task.get("model_config") or {}
    for k, v in sorted((info.get("model_config") or {}).items()):
        if v is not None and given_cfg.get(k) is not None and given_cfg.get(k) != v:
            problems.append(f"model_config.{k}: artifact {v!r}, server {given_cfg.get(k)!r}")
    if uses_fedfs(method) and info.get("xi_sha256") and task.get("xi_sha256") and info["xi_sha256"] != task["xi_sha256"]:
        problems.append("ξ: the artifact was exported with another frozen model than the server serves "
                        f"(sha256 {info['xi_sha256'][:12]}… vs {str(task['xi_sha256'])[:12]}…)")
    scalars, obj, fedfs = split_train_json(task.get("train"))
    for k in ("momentum", "weight_decay"):
        if scalars.get(k):
            problems.append(f"train.{k}={scalars[k]}: the ORT training artifacts run plain SGD only")
    baked = info.get("scope", "all")
    if scalars.get("scope", baked) != baked:
        problems.append(f"train.scope={scalars['scope']}: the ORT training artifact trains "
                        f"{'every layer' if baked == 'all' else 'the top only'} (its scope is baked in; export the "
                        f"artifacts with --train '{{\"scope\": \"{scalars['scope']}\"}}', or start the server with "
                        f"--train '{{\"scope\": \"{baked}\"}}')")
    lr = float(scalars["lr"]) if scalars.get("lr") is not None else DEFAULT_LR[method]
    if not lr > 0:
        problems.append(f"train.lr must be > 0, got {lr}")
    if uses_feduv(method) and lr > 0:
        head_lr = float(scalars["head_lr"]) if scalars.get("head_lr") is not None else DEFAULT_HEAD_LR
        baked = float(info["head_lr"]) / float(info["lr"])
        if not math.isclose(head_lr / lr, baked, rel_tol=1e-6):
            problems.append(f"head_lr/lr: the artifact bakes in {baked:g}, the task asks {head_lr / lr:g} "
                            f"(head_lr {head_lr:g}, lr {lr:g}); export again with these --train settings")
    # The objective: what the task says, with the defaults filling what it leaves out.
    defaults = info.get("objective_defaults")
    if defaults is None:
        raise CheckpointError("artifact.json lacks objective_defaults (exported by an older fedfs): export again")
    artifact_obj = info.get("objective") or {}
    wanted = {**defaults, **obj, "fedfs": {**defaults.get("fedfs", {}), **fedfs}}
    problems += [f"objective.{d}" for d in _differences(artifact_obj, wanted)]
    if problems:
        raise InputError(f"the {method} ORT training artifact cannot run this round as the server asks: "
                         + "; ".join(problems))
    return OrtTrainSettings(lr=lr, local_epochs=int(scalars.get("local_epochs") or DEFAULT_EPOCHS[method]),
                            batch_size=int(scalars.get("batch_size") or DEFAULT_BATCH_SIZE),
                            seed=int(scalars.get("seed") or 0),
                            lambda_neg=float(artifact_obj.get("lambda_neg") or 0.0))


__all__ = ["OrtTrainSettings", "ort_settings_for"]
