"""Backbones: one ``get_backbone(name)`` switch over a few files (insightface style)."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .feduv_cnn import FedUVCNN
from .insightface_mbf import InsightFaceMBF
from .layers import ChannelAffine, GroupNormP, PReLUP, l2_normalize
from .mobilefacenet import MobileFaceNet, MobileFaceNetAffine
from .tiny import TinyFaceNet

BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "mobilefacenet": MobileFaceNet,
    "mobilefacenet-affine": MobileFaceNetAffine,
    "insightface-mbf": InsightFaceMBF,
    "feduv_cnn": FedUVCNN,
    "tiny": TinyFaceNet,
}

DEFAULTS: dict[str, dict[str, int]] = {
    "mobilefacenet": {"embedding_dim": 128, "input_size": 112},
    "mobilefacenet-affine": {"embedding_dim": 128, "input_size": 112},
    "insightface-mbf": {"embedding_dim": 512, "input_size": 112},
    "feduv_cnn": {"embedding_dim": 1024, "input_size": 64},
    "tiny": {"embedding_dim": 64, "input_size": 32},
}


def get_backbone(name: str, **kwargs: Any) -> nn.Module:
    """Build backbone ``name`` (``mobilefacenet``, ``mobilefacenet-affine``, ``insightface-mbf``,
    ``feduv_cnn``, ``tiny``).

    Every backbone maps ``[B, 3, S, S]`` normalized RGB to ``[B, embedding_dim]`` and has
    ``input_size`` and ``embedding_dim`` attributes.
    """
    try:
        ctor = BACKBONES[name]
    except KeyError:
        from ...errors import InputError
        raise InputError(f"unknown backbone {name!r}; known: {sorted(BACKBONES)}") from None
    args = {**DEFAULTS[name], **{k: v for k, v in kwargs.items() if v is not None}}
    return ctor(**args)


__all__ = ["BACKBONES", "DEFAULTS", "get_backbone", "ChannelAffine", "GroupNormP", "PReLUP", "l2_normalize",
           "MobileFaceNet", "MobileFaceNetAffine", "InsightFaceMBF", "FedUVCNN", "TinyFaceNet"]
