"""Which optional extra provides which module, and the one-line error when it is missing.

``pip install fedfs`` is the verification runtime only (numpy, OpenCV, ONNX Runtime, onnx,
cryptography, safetensors, Pillow): an app enrolls and verifies with an exported ONNX model
and never imports torch. Everything else is an extra (``pyproject.toml``):

=================  ===========================================================================
extra              for
=================  ===========================================================================
``device``         the federation client's HTTP transport (httpx), with either runtime
``train``          torch training on the device (``fedfs device`` without ``--artifacts``)
``sim``            the simulator, ``fedfs demo``/``simulate``/``pretrain``/``bench``
``server``         ``fedfs serve`` (FastAPI, uvicorn)
``export``         ``fedfs export`` (torch, onnx, coremltools)
``ort-training``   ONNX Runtime on-device training (``onnxruntime-training`` 1.19.2, Python 3.11)
``faces``          dlib five-point alignment with its shipped model files
``dp``             the DP accountant (dp-accounting)
``flower``         fedfs's methods on Flower
=================  ===========================================================================

A command or a lazily resolved name that needs a missing module raises
:class:`MissingExtraError`: one line naming the module and the ``pip install`` that adds it.
"""
from __future__ import annotations

from .errors import FedFSError

EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "train",
    "galois": "train",
    "httpx": "device",
    "sklearn": "sim",
    "matplotlib": "sim",
    "tqdm": "sim",
    "fastapi": "server",
    "uvicorn": "server",
    "starlette": "server",
    "coremltools": "export",
    "onnxscript": "export",
    "dlib": "faces",
    "face_recognition_models": "faces",
    "dp_accounting": "dp",
    "flwr": "flower",
    "onnx": "runtime",
    "onnxruntime": "runtime",
    "cv2": "runtime",
    "safetensors": "runtime",
    "cryptography": "runtime",
    "PIL": "runtime",
    "numpy": "runtime",
}
"""Top-level module → the extra whose install provides it (``runtime``: the core install)."""

INCLUDES: dict[str, frozenset[str]] = {
    "device": frozenset({"device"}),
    "train": frozenset({"train", "device"}),
    "sim": frozenset({"sim", "train", "device"}),
    "server": frozenset({"server", "train", "device"}),
    "export": frozenset({"export", "train", "device"}),
}
"""The extras each extra pulls in (pyproject.toml): a command needing ``sim`` names ``sim`` even
when the first missing module is torch, so one install fixes the command."""

ORT_TRAINING_HINT = ("pip install 'fedfs[ort-training]' (Python 3.11 only: onnxruntime-training 1.19.2 is "
                     "its last release); it installs the same 'onnxruntime' module as onnxruntime, so if "
                     "both are installed run: pip install --force-reinstall --no-deps onnxruntime-training==1.19.2")


class MissingExtraError(FedFSError, ImportError):
    """A feature needs a module this install lacks; the message names the extra to install."""


def install_hint(module: str, wanted: str | None = None) -> str | None:
    """``pip install …`` that provides ``module``, or None if fedfs does not know it.

    ``wanted``: the extra the caller's feature needs as a whole (e.g. ``sim`` for ``fedfs demo``);
    named instead of the module's own extra when it includes it.
    """
    top = module.split(".")[0]
    if module.startswith("onnxruntime.training"):
        return ORT_TRAINING_HINT
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    if extra == "runtime":
        return "pip install --force-reinstall fedfs (a dependency of the core install is missing)"
    if wanted is not None and extra in INCLUDES.get(wanted, frozenset()):
        extra = wanted
    hint = f"pip install 'fedfs[{extra}]'"
    if top == "torch" or extra in ("train", "sim", "server", "export"):
        # a bare torch requirement pulls a multi-GB CUDA build where no CPU wheel is local
        hint += " (install your torch build first where none is installed, e.g. pip install torch==2.13.0)"
    return hint


def missing_extra(exc: ModuleNotFoundError, what: str, wanted: str | None = None) -> MissingExtraError | None:
    """The :class:`MissingExtraError` for ``exc`` raised while doing ``what``, or None when the
    missing module is not one of fedfs's optional dependencies (a genuine bug: re-raise it)."""
    name = exc.name or ""
    hint = install_hint(name, wanted)
    if hint is None:
        return None
    shown = name if name.startswith("onnxruntime.training") else name.split(".")[0]
    return MissingExtraError(f"{what} needs the Python module '{shown}', which this install lacks: {hint}")


def require_ort_training(feature: str) -> None:
    """Raise :class:`MissingExtraError` unless the installed ``onnxruntime`` module has the
    on-device training API — absent where only ``onnxruntime`` is installed, and where it was
    installed after ``onnxruntime-training`` and overwrote the shared module's files."""
    import importlib

    try:
        capi = importlib.import_module("onnxruntime.capi._pybind_state")
    except ModuleNotFoundError as e:
        raise MissingExtraError(f"{feature} needs ONNX Runtime's training build: {ORT_TRAINING_HINT}") from e
    if not hasattr(capi, "load_checkpoint"):
        raise MissingExtraError(f"{feature} needs ONNX Runtime's training build, but the installed 'onnxruntime' "
                                f"module is the inference-only one: {ORT_TRAINING_HINT}")
