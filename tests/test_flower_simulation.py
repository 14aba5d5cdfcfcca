"""fedfs+feduv on Flower's simulation engine (flwr.simulation.run_simulation, Ray backend):
the global model of every round equals fedfs's own aggregation of the same client updates."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fedfs[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray: pip install 'fedfs[flower]'")

from conftest_flower import build_federation, check_node_states, check_rounds_match_fedfs, run_config  # noqa: E402

pytestmark = pytest.mark.slow

NODES, ROUNDS = 3, 2


def test_simulation_rounds_equal_fedfs_aggregation(tmp_path):
    from flwr.simulation import run_simulation

    from fedfs_flower.client_app import create_app as client_app
    from fedfs_flower.server_app import create_app as server_app

    paths = build_federation(tmp_path, NODES)
    cfg = run_config(paths, ROUNDS, NODES)
    run_simulation(server_app=server_app(cfg), client_app=client_app(cfg), num_supernodes=NODES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    check_rounds_match_fedfs(paths, ROUNDS, NODES)
    check_node_states(paths, ROUNDS, NODES)
