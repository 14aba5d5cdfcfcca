"""Model size and cost: parameter count and MFLOPs per image."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from .model import FaceNet, ModelConfig


@dataclass(frozen=True)
class ModelProfile:
    name: str
    input_size: int
    embedding_dim: int
    params: int
    mflops: float  # 2 × MACs of conv/matmul for one image (torch's FlopCounterMode)


def profile_model(config: ModelConfig) -> ModelProfile:
    model = FaceNet(config).eval()
    cfg = model.config
    x = torch.zeros(1, 3, cfg.input_size, cfg.input_size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return ModelProfile(cfg.backbone, int(cfg.input_size), int(cfg.embedding_dim),
                        sum(p.numel() for p in model.parameters()), counter.get_total_flops() / 1e6)
