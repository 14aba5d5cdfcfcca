"""Fixtures of the baseline tests (imported explicitly by tests/test_sim_baselines*.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_sim.methods import parse_method
from device_sim.methods.base import FederatedMethod, SimContext
from fedfs_sdk.nn.model import FaceNet, ModelConfig

EMB = 16


@pytest.fixture(scope="module")
def tiny_xi() -> FaceNet:
    """A small random ξ (the baselines only need its architecture and backbone weights)."""
    torch.manual_seed(0)
    return FaceNet(ModelConfig("tiny", embedding_dim=EMB, input_size=32, width=8)).eval().requires_grad_(False)


def make_method(spec: str, xi: FaceNet, num_clients: int = 4, seed: int = 0) -> FederatedMethod:
    m = parse_method(spec)
    m.setup(SimContext(xi.config, xi, num_clients, seed, "cpu"))
    return m


def start_params(m: FederatedMethod) -> dict:
    gw = m.init_global()
    return {"global": gw, **m.init_private(gw)}


def images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=g) * 2 - 1


def participants(*clients: int) -> np.ndarray:
    return np.asarray(clients, dtype=np.int64)
