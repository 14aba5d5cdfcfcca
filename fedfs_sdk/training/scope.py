"""Which layers of ϕ train on the device: all of them, or only the embedding layer on top of a
frozen trunk (``scope="top"``).

FedFS trains the whole personalized and global model (Alg. 1). With a strong pre-trained ξ —
a real face recognizer trained on millions of faces — a phone's dozen photos cannot improve
the convolutional trunk, only damage it (issue 23: the real MobileFaceNet lost 0.11–0.20
AUROC under the full-model presets). ``scope="top"`` keeps the trunk at ξ's weights and trains
what sits after it: the backbone's embedding layer (``embed``) and its normalization
(``embed_norm``), FedFS's extra linear layer and FedUV's head ``W``. The losses are unchanged
(Eq. 7–9, FedUV ℓ_pos); only the set of trained parameters shrinks. Three consequences:

* ξ, the global and the personalized model share one trunk, so a device runs it once per
  image (:class:`Trunk`) and trains the small top on its output (:class:`TopFaceNet`) — no
  back-propagation through the convolutions;
* what is averaged and stored still has the full model's shape (the trunk is ξ's), so
  checkpoints, FedAvg, exports and verifiers are unchanged;
* a backbone whose embedding does not end in an ``embed`` layer cannot be split
  (:func:`check_splittable` names it).
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from ..errors import InputError
from ..nn.model import FaceOutputs
from .top_keys import is_top_key, top_entries

SCOPES: tuple[str, ...] = ("all", "top")
"""``all``: every parameter of ϕ trains (FedFS as printed); ``top``: the embedding layer, its
normalization, the FedFS projection and the FedUV head train, the trunk stays ξ's."""

def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise InputError(f"scope must be one of {SCOPES}, got {scope!r}")
    return scope


def check_splittable(backbone: nn.Module) -> None:
    """:class:`InputError` unless ``backbone`` ends in an embedding layer ``embed`` (then,
    optionally, ``embed_norm``): every fedfs MobileFaceNet, insightface's mbf, ``tiny`` and
    ``dlib-resnet`` do."""
    if not isinstance(getattr(backbone, "embed", None), (nn.Linear, nn.Conv2d)):
        raise InputError(f"backbone {type(backbone).__name__} has no embedding layer 'embed' to train on its own: "
                         "scope='top' needs one (use scope='all')")


def top_state(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``weights`` that a top-only model holds."""
    return top_entries(weights)


class Trunk(nn.Module):
    """The backbone up to the input of its embedding layer: ``x → f`` (MobileFaceNet: the GDC
    output, flattened ``[B, 512]``; ``tiny``: ``[B, C]``; ``dlib-resnet``: the pooled ``[B, 256]``).

    Runs the backbone's own ``forward`` on a shallow copy whose ``embed`` / ``embed_norm`` are
    identities (every other submodule — and so every weight — is the backbone's own, live), so each
    backbone's layout is respected and ``vmap`` / ``functional_call`` see a plain module."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        check_splittable(backbone)
        body = copy.copy(backbone)
        body._modules = dict(backbone._modules)     # own module table: replacing two entries leaves the backbone alone
        body.embed = nn.Identity()
        if isinstance(getattr(backbone, "embed_norm", None), nn.Module):
            body.embed_norm = nn.Identity()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).flatten(1)


class EmbeddingTop(nn.Module):
    """``embed_norm(embed(f))``: the backbone after :class:`Trunk`, sharing its modules (and so
    its parameter names ``embed.*``, ``embed_norm.*``); a backbone without ``embed_norm``
    (``dlib-resnet``) ends at ``embed``."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        check_splittable(backbone)
        self.embed = backbone.embed
        norm = getattr(backbone, "embed_norm", None)
        self.embed_norm = norm if isinstance(norm, nn.Module) else nn.Identity()
        self.input_size = getattr(backbone, "input_size", None)
        self.embedding_dim = getattr(backbone, "embedding_dim", None)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, nn.Conv2d):       # MobileFaceNet's 1×1 conv embedding
            f = f[:, :, None, None]
        return self.embed_norm(self.embed(f).flatten(1))


class TopFaceNet(nn.Module):
    """A :class:`~fedfs_sdk.nn.model.FaceNet` seen from its trunk's output: the same
    ``FaceOutputs`` (embedding, FedFS projection, FedUV head) from features ``f`` instead of
    images, with the FaceNet's own modules (state-dict names are the top-only subset)."""

    def __init__(self, face: nn.Module) -> None:
        super().__init__()
        self.backbone = EmbeddingTop(face.backbone)
        self.proj = getattr(face, "proj", None)
        self.uv_head = getattr(face, "uv_head", None)

    def forward(self, f: torch.Tensor) -> FaceOutputs:
        e = self.backbone(f)
        return FaceOutputs(embedding=e, projection=self.proj(e) if self.proj is not None else None,
                           uv=self.uv_head(e) if self.uv_head is not None else None)


__all__ = ["SCOPES", "check_scope", "check_splittable", "is_top_key", "top_state", "Trunk", "EmbeddingTop",
           "TopFaceNet"]
