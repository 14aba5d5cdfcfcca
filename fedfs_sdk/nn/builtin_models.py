"""Face recognizers that come with an install, by name: a real ξ (and ϕ's start) out of the box.

``pip install 'fedfs[faces]'`` installs dlib and ``face-recognition-models``, whose package ships
``dlib_face_recognition_resnet_model_v1.dat`` — dlib's ResNet face recognizer, the model behind
the ``face_recognition`` library (128-d descriptors of dlib's 150×150 five-point face chip;
LFW pairwise AUROC 0.99 here, ``benchmarks/dlib_parity.py``). This module turns that file into
a fedfs model, by name:

=================  ============================================================================
name               what it is
=================  ============================================================================
``dlib-resnet``    :class:`~fedfs_sdk.nn.backbones.dlib_resnet.DlibResNet` with the ``.dat``'s
                   weights (:mod:`fedfs_sdk.nn.dlib_import`), input: dlib's face chip
                   (``face_alignment = "dlib-chip"``, :func:`fedfs_sdk.runtime.align.dlib_chip`)
=================  ============================================================================

Everywhere a checkpoint path is taken for ξ or a verifier, the name works too: ``fedfs simulate
--pretrained dlib-resnet``, ``fedfs enroll --model dlib-resnet``, ``fedfs export --checkpoint
dlib-resnet`` (:func:`builtin_name` tells a name from a path: an existing file of that name
wins), and ``fedfs import-model dlib-resnet --out xi.safetensors`` writes it as a checkpoint.
:func:`default_real_face_model` is the name to use for a folder of real photos when nothing else
is asked for (None when the ``faces`` extra is missing; :func:`unavailable_reason` is the one
line that says what to install).

This is the only module that knows where the ``.dat`` file lives (:func:`model_file`). It is read
from the installed package — nothing is downloaded, ever — with ``importlib.util.find_spec``
(``face_recognition_models/__init__`` imports ``pkg_resources``, which recent setuptools no
longer ship). The conversion takes ≈ 0.2 s and is kept in memory for the process.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:   # torch stays unimported until a model is loaded: the runtime-only install asks
    import torch    # builtin_name() on every --model (fedfs verify with an .onnx file, no torch)

    from .model import FaceNet, ModelConfig

FACES_INSTALL = "pip install 'fedfs[faces]'"


@dataclass(frozen=True)
class BuiltinModel:
    """A recognizer an install provides. ``package``/``file``: where its weights are (a file of
    an installed Python package); ``needs``: modules that must import for it to be usable (dlib
    cuts its face chips)."""

    name: str
    backbone: str
    description: str
    package: str
    file: str
    needs: tuple[str, ...]


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "dlib-resnet": BuiltinModel(
        name="dlib-resnet", backbone="dlib-resnet",
        description="dlib's ResNet face recognizer (the face_recognition library's model): 128-d, "
                    "150×150 dlib face chips",
        package="face_recognition_models", file="models/dlib_face_recognition_resnet_model_v1.dat",
        needs=("dlib",)),
}


def builtin_names() -> tuple[str, ...]:
    """Names of the built-in models (whether installed or not)."""
    return tuple(BUILTIN_MODELS)


def builtin_name(spec: str | os.PathLike[str] | None) -> str | None:
    """``spec`` if it names a built-in model and is not the path of an existing file (a file
    always wins), else None. What every ``--pretrained`` / ``--model`` / ``--checkpoint`` asks."""
    if spec is None or not isinstance(spec, str) or spec not in BUILTIN_MODELS:
        return None
    return None if Path(spec).exists() else spec


def model_file(name: str) -> Path | None:
    """Where the installed weights of built-in model ``name`` are, or None when the package that
    ships them is not installed (found with ``importlib.util.find_spec``, never imported)."""
    m = _model(name)
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / m.file
    return f if f.is_file() else None


def unavailable_reason(name: str) -> str | None:
    """None when built-in model ``name`` can be used here, else one line saying what is missing
    and what to install."""
    m = _model(name)
    missing = [mod for mod in m.needs if importlib.util.find_spec(mod) is None]
    if model_file(name) is None:
        missing.append(m.package.replace("_", "-"))
    if not missing:
        return None
    return f"the built-in model {name!r} ({m.description}) needs {' and '.join(missing)}, which this install lacks: " \
           f"{FACES_INSTALL}"


def available(name: str) -> bool:
    """Whether built-in model ``name`` can be used here (:func:`unavailable_reason` is None)."""
    return unavailable_reason(name) is None


def default_real_face_model() -> str | None:
    """The ξ for a folder of real photos when none is named: ``"dlib-resnet"`` where the
    ``faces`` extra is installed, else None (then :func:`unavailable_reason` ``("dlib-resnet")``
    is the line to show)."""
    return "dlib-resnet" if available("dlib-resnet") else None


@functools.lru_cache(maxsize=None)
def _converted(name: str, path: str, mtime_ns: int) -> tuple["ModelConfig", dict[str, "torch.Tensor"], dict[str, Any]]:
    from .checkpoint import model_id_of
    from .dlib_import import convert_dlib_resnet

    model, meta = convert_dlib_resnet(path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = {**meta, "builtin": name, "model_id": model_id_of(state, model.config.backbone)}
    return model.config, state, meta


def load_builtin(name: str) -> tuple["FaceNet", dict[str, Any]]:
    """A fresh :class:`FaceNet` (eval mode, trainable) of built-in model ``name`` and the meta
    a checkpoint of it records (``builtin``, ``imported_from``, the file's sha256, ``model_id``,
    ``face_alignment``, …). :class:`~fedfs_sdk.extras.MissingExtraError` (one line: what to
    install) where it is not installed."""
    reason = unavailable_reason(name)
    if reason is not None:
        from ..extras import MissingExtraError

        raise MissingExtraError(reason)
    f = model_file(name)
    assert f is not None
    from .model import FaceNet

    config, state, meta = _converted(name, str(f), f.stat().st_mtime_ns)
    model = FaceNet(config)
    model.load_state_dict(state)
    return model.eval(), dict(meta)


def save_builtin(name: str, path: str | os.PathLike[str]) -> Path:
    """Write built-in model ``name`` as a fedfs checkpoint (``kind: "xi"``) at ``path``: for
    tools that take a file, or to pin the weights a run used."""
    from .checkpoint import save_checkpoint

    model, meta = load_builtin(name)
    save_checkpoint(path, model, model.config, meta)
    return Path(path)


def _model(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise InputError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN_MODELS)}") from None


__all__ = ["BUILTIN_MODELS", "BuiltinModel", "FACES_INSTALL", "available", "builtin_name", "builtin_names",
           "default_real_face_model", "load_builtin", "model_file", "save_builtin", "unavailable_reason"]
