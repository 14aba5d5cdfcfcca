"""fedfs — on-device personalized face verification trained by federated learning.

The package is import-light: ``import fedfs_sdk`` loads neither torch nor onnxruntime;
the names below are resolved on first use, so an app that only verifies with the ONNX
backend never imports torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # errors (no heavy deps)
    "FedFSError": "fedfs_sdk.errors", "InputError": "fedfs_sdk.errors",
    "ImageDecodeError": "fedfs_sdk.errors", "NoFaceError": "fedfs_sdk.errors",
    "InsufficientWarmupError": "fedfs_sdk.errors", "EnrollmentError": "fedfs_sdk.errors",
    "CodeError": "fedfs_sdk.errors", "CheckpointError": "fedfs_sdk.errors", "TrainingError": "fedfs_sdk.errors",
    # numpy-only
    "preprocess": "fedfs_sdk.runtime.preprocess", "load_image": "fedfs_sdk.runtime.preprocess",
    "make_codeword": "fedfs_sdk.runtime.codes", "get_code": "fedfs_sdk.runtime.codes",
    "Enrollment": "fedfs_sdk.runtime.enrollment", "enroll": "fedfs_sdk.runtime.enrollment",
    "verify": "fedfs_sdk.runtime.enrollment", "save_enrollment": "fedfs_sdk.runtime.enrollment",
    "load_enrollment": "fedfs_sdk.runtime.enrollment", "warmup_threshold": "fedfs_sdk.runtime.enrollment",
    "mad_outliers": "fedfs_sdk.runtime.enrollment", "generate_key": "fedfs_sdk.runtime.enrollment",
    "min_warmup_images": "fedfs_sdk.runtime.enrollment", "ImageNotFoundError": "fedfs_sdk.errors",
    # torch
    "ModelConfig": "fedfs_sdk.nn.model", "FaceNet": "fedfs_sdk.nn.model", "VerifierNet": "fedfs_sdk.nn.model",
    "TrainConfig": "fedfs_sdk.training.trainer", "LocalTrainer": "fedfs_sdk.training.trainer",
    "TorchBackend": "fedfs_sdk.runtime.inference",
    # onnxruntime only (never torch): what a phone-like app runs
    "OnnxBackend": "fedfs_sdk.runtime.onnx_backend", "OrtDeviceTrainer": "fedfs_sdk.training.ort_device",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedfs_sdk' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:    # an optional dependency: name the extra that provides it
        from .extras import missing_extra
        err = missing_extra(e, f"fedfs_sdk.{name}")
        if err is None:
            raise
        raise err from None
