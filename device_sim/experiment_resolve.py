"""Resolution of an :class:`~device_sim.experiment.ExperimentConfig`, once, at the CLI edge.

:func:`resolve_experiment` applies, in this order, what ``build_data`` used to apply to the
argparse Namespace on every call:

1. ``--scenario`` (:func:`device_sim.scenarios.apply_scenario`);
2. the real-photo ξ default (:func:`real_face_default`: ``dlib-resnet`` with the ``faces``
   extra) and the input a built-in or face-cropped ξ dictates (its size, its face crop);
3. SynthFaces' split defaults for ``synth`` data;

and refuses a bad combination with the same one-line :class:`~fedfs_sdk.errors.InputError`
as before (a capture shift of synthetic data, a scenario without its folders, a built-in ξ
with another ``--image-size``, a ``--data`` that is no directory). Each step returns a new
frozen config (:func:`dataclasses.replace`). Resolving a resolved config changes nothing.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.backbones import DEFAULTS, face_alignment
from fedfs_sdk.nn.builtin_models import BUILTIN_MODELS, FACES_INSTALL, builtin_name, default_real_face_model

from .experiment import DataConfig, ExperimentConfig
from .scenarios import apply_scenario

DEFAULT_IMAGE_SIZE = 32
DEFAULT_BACKBONE = "tiny"
"""``--image-size`` / ``--backbone`` when neither they nor a ξ say otherwise."""


def experiment_from_args(args: argparse.Namespace, real_face_default: bool | None = None) -> ExperimentConfig:
    """The resolved config of a command line (the one place a Namespace becomes a config).

    ``real_face_default``: may a real-photo run take the built-in ξ when none is asked for?
    Default: where the command has ``--pretrained`` (``simulate``, ``demo``; not ``pretrain``,
    whose job is to train ξ)."""
    if real_face_default is None:
        real_face_default = hasattr(args, "pretrained")
    return resolve_experiment(ExperimentConfig.from_mapping(vars(args)), real_face_default=real_face_default)


def resolve_experiment(cfg: ExperimentConfig, real_face_default: bool = True) -> ExperimentConfig:
    """``cfg`` with its scenario, ξ's input and split defaults applied, validated (module doc)."""
    cfg = replace(cfg, data=apply_scenario(cfg.data))
    cfg, notes = resolve_xi_input(cfg, real_face_default)
    d = cfg.data
    if d.data == "synth":
        if (d.capture_shift or "none") != "none":
            raise InputError("--capture-shift applies to a folder of real photos (--data PATH); "
                             "SynthFaces renders its looks itself: use --domain")
        d = apply_synth_defaults(d)
        notes = []          # a synthetic run's notes are its split's; ξ's line is for folders
    elif not Path(d.data).is_dir():
        raise InputError(f"--data must be 'synth' or an ImageFolder directory; {Path(d.data)} is not a directory")
    return replace(cfg, data=d, notes=tuple(notes), resolved=True)


def apply_synth_defaults(d: DataConfig) -> DataConfig:
    """Split sizes left unset get SynthFaces' defaults (``synth`` only: a folder's defaults
    depend on the folder, :mod:`device_sim.folder_split`)."""
    unset = {k: v for k, v in d.synth_defaults if getattr(d, k) is None}
    return replace(d, **unset) if unset else d


def resolve_xi_input(cfg: ExperimentConfig, real_face_default: bool = True) -> tuple[ExperimentConfig, list[str]]:
    """The ξ of a real-photo run and the input it dictates; returns the config and lines for the notes.

    ``fedfs simulate --data DIR`` with no ξ asked for (no ``--pretrained``, ``--pretrain-data``,
    ``--scenario``, ``--backbone``, ``--width``, ``--embedding-dim``) takes the built-in real face
    recognizer (:func:`fedfs_sdk.nn.builtin_models.default_real_face_model`: ``dlib-resnet`` with
    the ``faces`` extra) as ξ and ϕ's start; without the extra it pre-trains ξ on the folder's
    public identities as before and says, in one line, what to install. A built-in ξ (also when
    named, ``--pretrained dlib-resnet``) fixes the input: its size (150) and its face crop
    (dlib's chip); the folder's public identities are trained on by nobody — they are the public
    impostor set (do-no-harm check, ``enroll --far``). ``--scenario real-phone`` / ``real-night``
    (capture shifts of the folder's own photos) count as "no ξ asked for". An unset
    ``--image-size`` then gets its default."""
    notes: list[str] = []
    d, x = cfg.data, cfg.xi
    asked = [x.pretrained, d.pretrain_data, x.backbone, x.width, x.embedding_dim,
             d.scenario not in (None, "real-phone", "real-night")]
    if real_face_default and d.data != "synth" and not any(asked):
        name = default_real_face_model()
        if name is None:
            notes.append(f"ξ: pre-trained on the folder's public identities; for a real face recognizer as ξ "
                         f"(dlib-resnet): {FACES_INSTALL}")
        else:
            x = replace(x, pretrained=name)
    name = builtin_name(x.pretrained)
    if name is not None:
        backbone = BUILTIN_MODELS[name].backbone
        size = int(DEFAULTS[backbone]["input_size"])
        if d.image_size not in (None, size):
            raise InputError(f"--pretrained {name} takes {size} px inputs; drop --image-size {d.image_size}")
        d = replace(d, image_size=size, detect_face=face_alignment(backbone) or d.detect_face)
        notes.append(f"ξ: the built-in {name} ({BUILTIN_MODELS[name].description}; {d.detect_face} "
                     f"preprocessing); the folder's public identities are not trained on: they are the public impostor set")
    elif x.pretrained and Path(x.pretrained).is_file():
        # a ξ checkpoint of a backbone trained on one face crop (an imported dlib-resnet) gets that crop
        from fedfs_sdk.nn.checkpoint import read_checkpoint

        _, ck, _ = read_checkpoint(x.pretrained)
        if face_alignment(ck.backbone):
            d = replace(d, detect_face=face_alignment(ck.backbone),
                        image_size=d.image_size if d.image_size is not None else int(ck.resolved().input_size))
    if d.image_size is None:
        d = replace(d, image_size=DEFAULT_IMAGE_SIZE)
    return replace(cfg, data=d, xi=x), notes


__all__ = ["experiment_from_args", "resolve_experiment", "resolve_xi_input", "apply_synth_defaults",
           "DEFAULT_IMAGE_SIZE", "DEFAULT_BACKBONE"]
