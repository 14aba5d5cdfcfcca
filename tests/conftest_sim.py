"""Fixtures of the simulator-engine tests (imported explicitly by tests/test_sim_*.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_sim.executors import ClientTask
from device_sim.methods import FederatedMethod, SimContext, parse_method
from fedfs_sdk.nn.model import FaceNet, ModelConfig

XI_CONFIG = ModelConfig("tiny", embedding_dim=16, input_size=32, width=4)


@pytest.fixture(scope="session")
def xi() -> FaceNet:
    """A small random ξ: the engine tests need its architecture, not its quality."""
    torch.manual_seed(0)
    return FaceNet(XI_CONFIG).eval().requires_grad_(False)


class RandomClients:
    """``num_clients`` clients with uneven numbers of random images around a per-client mean
    (so that each client is a 'identity' the objective can fit)."""

    def __init__(self, num_clients: int = 6, sizes: tuple[int, ...] = (7, 12, 5, 9, 8, 10), seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_clients = num_clients
        self.x = [(0.6 * torch.randn(1, 3, 32, 32, generator=g) +
                   0.3 * torch.randn(sizes[c % len(sizes)], 3, 32, 32, generator=g)).clamp(-1, 1)
                  for c in range(num_clients)]

    def train_images(self, client: int, device=None) -> torch.Tensor:
        return self.x[client] if device is None else self.x[client].to(device)


def setup_method(spec: str, xi: FaceNet, num_clients: int = 6, seed: int = 0, device: str = "cpu") -> FederatedMethod:
    m = parse_method(spec)
    m.setup(SimContext(xi.config, xi, num_clients, seed, device))
    return m


def make_tasks(method: FederatedMethod, data: RandomClients, clients: list[int], round_idx: int = 1):
    """A round's plan and its client tasks starting from the method's round-0 weights."""
    g = method.init_global()
    priv = method.init_private(g)
    plan = method.configure_round(round_idx, np.asarray(clients))
    tasks = [ClientTask(c, data.train_images(c), {"global": g, **priv},
                        method.client_consts(plan, method.client_state_init(c)), seed=100 + c) for c in clients]
    return plan, tasks


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[g][k] - b[g][k]).abs().max()) for g in a for k in a[g])
