"""Backbones: one ``get_backbone(name)`` switch over a few files (insightface style)."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .dlib_resnet import DlibResNet
from .feduv_cnn import FedUVCNN
from .insightface_mbf import InsightFaceMBF
from .layers import ChannelAffine, GroupNormP, PReLUP, l2_normalize
from .mobilefacenet import MobileFaceNet, MobileFaceNetAffine
from .tiny import TinyFaceNet

BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "mobilefacenet": MobileFaceNet,
    "mobilefacenet-affine": MobileFaceNetAffine,
    "insightface-mbf": InsightFaceMBF,
    "dlib-resnet": DlibResNet,
    "feduv_cnn": FedUVCNN,
    "tiny": TinyFaceNet,
}

DEFAULTS: dict[str, dict[str, int]] = {
    "mobilefacenet": {"embedding_dim": 128, "input_size": 112},
    "mobilefacenet-affine": {"embedding_dim": 128, "input_size": 112},
    "insightface-mbf": {"embedding_dim": 512, "input_size": 112},
    "dlib-resnet": {"embedding_dim": 128, "input_size": 150},
    "feduv_cnn": {"embedding_dim": 1024, "input_size": 64},
    "tiny": {"embedding_dim": 64, "input_size": 32},
}


def get_backbone(name: str, **kwargs: Any) -> nn.Module:
    """Build backbone ``name`` (``mobilefacenet``, ``mobilefacenet-affine``, ``insightface-mbf``,
    ``dlib-resnet``, ``feduv_cnn``, ``tiny``).

    Every backbone maps ``[B, 3, S, S]`` normalized RGB to ``[B, embedding_dim]`` and has
    ``input_size`` and ``embedding_dim`` attributes; one trained on a particular face crop says
    which in ``face_alignment`` (:func:`face_alignment`).
    """
    try:
        ctor = BACKBONES[name]
    except KeyError:
        from ...errors import InputError
        raise InputError(f"unknown backbone {name!r}; known: {sorted(BACKBONES)}") from None
    args = {**DEFAULTS[name], **{k: v for k, v in kwargs.items() if v is not None}}
    return ctor(**args)


def face_alignment(name: str) -> str | None:
    """The face crop backbone ``name`` must be fed (a :func:`fedfs_sdk.runtime.preprocess.face_mode`
    value, e.g. ``"dlib-chip"`` for ``dlib-resnet``), or None when the caller's ``detect_face``
    choice applies."""
    return getattr(BACKBONES.get(name), "face_alignment", None)


__all__ = ["BACKBONES", "DEFAULTS", "get_backbone", "face_alignment", "DlibResNet", "ChannelAffine", "GroupNormP", "PReLUP", "l2_normalize",
           "MobileFaceNet", "MobileFaceNetAffine", "InsightFaceMBF", "FedUVCNN", "TinyFaceNet"]
