"""Models built on a backbone: the FedFS projection, the FedUV head, and their wiring.

``FaceNet`` is what a device trains and what the server averages (``w_c``): a backbone
``ϕ`` whose output is ``r'`` (FedFS Eq. 8 notation), an optional FedFS projection (the
"extra linear layer", ``r' → r``) and an optional FedUV head ``σ(W g_θ(x))``.
``VerifierNet`` is what verifies on a phone: an embedding network and, for FedUV, the head.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from .backbones import DEFAULTS, get_backbone
from .backbones.layers import l2_normalize
from ..errors import InputError


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`FaceNet`; stored inside every checkpoint.

    Attributes:
        backbone: ``mobilefacenet`` | ``feduv_cnn`` | ``tiny``.
        embedding_dim: backbone output (``r'``/``q'``/``g_θ(x)``) size; backbone default if None.
        input_size: square input side in pixels; backbone default if None.
        proj_dim: FedFS extra linear layer output (``r``/``q``) size; no projection if None.
        code_length: FedUV code length ``c`` (head ``W`` is ``c × embedding_dim``); no head if None.
        width: backbone width multiplier where the backbone has one (tiny, feduv_cnn).
    """

    backbone: str = "tiny"
    embedding_dim: int | None = None
    input_size: int | None = None
    proj_dim: int | None = None
    code_length: int | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        # A config also arrives from files and the network (checkpoint headers): bound every
        # size before a model of it is allocated.
        from ..runtime.codes import KNOWN_CODES

        if not isinstance(self.backbone, str):
            raise InputError(f"backbone must be a name, got {self.backbone!r}")
        for name, hi in (("embedding_dim", 8192), ("input_size", 1024), ("proj_dim", 8192), ("width", 64)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
                raise InputError(f"{name} must be an integer in [1, {hi}] or null, got {v!r}")
        if self.code_length is not None and (isinstance(self.code_length, bool) or self.code_length not in KNOWN_CODES):
            raise InputError(f"code_length must be one of {sorted(KNOWN_CODES)} (FedUV Table 1) or null, "
                             f"got {self.code_length!r}")

    def resolved(self) -> "ModelConfig":
        d = DEFAULTS.get(self.backbone)
        if d is None:
            raise InputError(f"unknown backbone {self.backbone!r}; known: {sorted(DEFAULTS)}")
        emb = self.embedding_dim or d["embedding_dim"]
        if self.backbone == "feduv_cnn" and self.width and not self.embedding_dim:
            emb = 16 * self.width
        return replace(self, embedding_dim=emb, input_size=self.input_size or d["input_size"])

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise InputError(f"model_config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InputError(f"model_config must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InputError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**data)


def scale_to_sqrt_c(z: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """FedUV's σ: scale each row of ``z`` to norm ``√c`` (``c`` = last dim)."""
    c = z.shape[-1]
    return l2_normalize(z, dim=-1, eps=eps) * math.sqrt(c)


class FedUVHead(nn.Module):
    """FedUV head: ``σ(W g)`` with ``W ∈ R^{c×d}`` (FedUV Fig. 1, Table 2 FC + Scaling)."""

    def __init__(self, embedding_dim: int, code_length: int) -> None:
        super().__init__()
        self.code_length = code_length
        self.weight = nn.Parameter(torch.empty(code_length, embedding_dim))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(embedding_dim))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return scale_to_sqrt_c(g @ self.weight.t())


class FaceOutputs(NamedTuple):
    """Per-image outputs. ``embedding`` = ``r'`` (or ``q'``), ``projection`` = ``r`` (or ``q``),
    ``uv`` = ``σ(W g_θ(x))``. Absent parts are ``None``."""

    embedding: torch.Tensor
    projection: torch.Tensor | None
    uv: torch.Tensor | None


class FaceNet(nn.Module):
    """Backbone + optional FedFS projection + optional FedUV head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.resolved()
        self.config = cfg
        kw: dict[str, Any] = {"embedding_dim": cfg.embedding_dim, "input_size": cfg.input_size}
        if cfg.width is not None:
            kw["width"] = cfg.width
        self.backbone = get_backbone(cfg.backbone, **kw)
        self.proj = nn.Linear(cfg.embedding_dim, cfg.proj_dim, bias=False) if cfg.proj_dim else None
        self.uv_head = FedUVHead(cfg.embedding_dim, cfg.code_length) if cfg.code_length else None

    @property
    def input_size(self) -> int:
        return int(self.config.input_size)

    def forward(self, x: torch.Tensor | None, embedding: torch.Tensor | None = None) -> FaceOutputs:
        """``embedding``: the backbone's output ``g(x)`` computed elsewhere (the simulator's
        client-folded trunk, :mod:`device_sim.executors.folding`); then ``x`` is not read and
        only the projection and the head run."""
        e = self.backbone(x) if embedding is None else embedding
        return FaceOutputs(
            embedding=e,
            projection=self.proj(e) if self.proj is not None else None,
            uv=self.uv_head(e) if self.uv_head is not None else None,
        )


class VerifierNet(nn.Module):
    """What verifies on the device: an embedding backbone and, for FedUV, the head.

    ``forward`` returns ``(embedding,)`` or ``(embedding, uv)``; this is the graph that
    ``export`` writes to ONNX / Core ML.
    """

    def __init__(self, backbone: nn.Module, uv_head: FedUVHead | None = None, project: bool = False) -> None:
        super().__init__()
        if project and uv_head is None:
            raise InputError("project=True verifies with the FedUV head's projection W·e: give the head")
        self.backbone = backbone
        self.uv_head = uv_head
        self.project = project
        """``True``: the verifier's embedding is the head projection ``W·e`` (before σ), and
        it has no ``uv`` output — a cosine template of ``W·e`` verifies, no codeword needed
        (``score=head-template``, docs/personalization.md)."""

    @property
    def input_size(self) -> int:
        return int(self.backbone.input_size)

    @property
    def embedding_dim(self) -> int:
        """Width of the ``embedding`` output (``c`` when it is the head projection ``W·e``)."""
        return int(self.uv_head.code_length) if self.project else int(self.backbone.embedding_dim)

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of :meth:`forward`'s outputs, in order (what backends and exports label them)."""
        return ("embedding", "uv") if self.uv_head is not None and not self.project else ("embedding",)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        e = self.backbone(x)
        if self.uv_head is None:
            return (e,)
        if self.project:
            return (e @ self.uv_head.weight.t(),)
        return (e, self.uv_head(e))


class DualVerifierNet(nn.Module):
    """Verifies with both FedFS models through the FedUV head: the embedding is
    ``unit(W q') ⊕ unit(W r')`` (personalized ``ϕ(θ_c)`` and global ``ϕ(w)``), so a cosine
    template of it averages the two head-space cosines (``verify=both``,
    docs/personalization.md). Weight names: ``backbone.*`` (θ_c), ``global_backbone.*``
    (w) and ``uv_head.weight``."""

    output_names = ("embedding",)

    def __init__(self, backbone: nn.Module, global_backbone: nn.Module, uv_head: FedUVHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.global_backbone = global_backbone
        self.uv_head = uv_head

    @property
    def input_size(self) -> int:
        return int(self.backbone.input_size)

    @property
    def embedding_dim(self) -> int:
        """``2c``: the two unit head-space vectors side by side."""
        return 2 * int(self.uv_head.code_length)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        w = self.uv_head.weight.t()
        return (torch.cat([l2_normalize(self.backbone(x) @ w), l2_normalize(self.global_backbone(x) @ w)], dim=-1),)


def personal_config(global_config: ModelConfig) -> ModelConfig:
    """The personalized model ``ϕ(θ_c)``: same backbone and projection, no FedUV head
    (``W`` is global and shared, FedFS+FedUV uses the global ``W`` on ``q'``)."""
    return replace(global_config, code_length=None)
