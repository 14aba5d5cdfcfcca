"""``app``: fedfs's server as a Flower ``ServerApp`` (``fedfs_flower.server_app:app``).

Reads the run config (:class:`fedfs_flower.settings.ServerSettings`), loads the round-0
global model from a fedfs checkpoint, and runs :class:`~fedfs_flower.strategy.FedFSStrategy`
for ``num-rounds`` rounds. With ``out-dir`` set, the global model of every round is published
there as a fedfs checkpoint (``global_round<r>.safetensors``, the format ``fedfs serve``
publishes and ``fedfs enroll`` / ``fedfs export`` read), with ``base_vectors.json`` (the
``b_u`` table) and ``rounds.jsonl`` (which updates went into each round).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fedfs_flower import require_flwr

require_flwr()

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedfs_sdk.nn.checkpoint import FORMAT, read_checkpoint, write_safetensors_atomic  # noqa: E402

from .settings import ServerSettings  # noqa: E402
from .strategy import FedFSStrategy  # noqa: E402

def publisher(out_dir: Path, model_config_json: str, method: str):
    """``on_aggregate`` callback writing each round's global model and its provenance."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def publish(server_round: int, weights: dict[str, torch.Tensor], accepted: list[dict[str, Any]]) -> None:
        meta = {"round": server_round, "engine": "flower", "method": method, "num_updates": len(accepted),
                "total_samples": sum(a["num_samples"] for a in accepted)}
        write_safetensors_atomic(out_dir / f"global_round{server_round:03d}.safetensors",
                                 {k: v.contiguous() for k, v in weights.items()},
                                 {"format": FORMAT, "model_config": model_config_json, "meta": json.dumps(meta)})
        with open(out_dir / "rounds.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"round": server_round, "updates": accepted}) + "\n")
    return publish


def create_app(run_config: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose run config is ``run_config`` over Flower's (see client_app.create_app)."""
    server = ServerApp()
    overrides = dict(run_config or {})

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        main(grid, {**context.run_config, **overrides})

    return server


def main(grid: Grid, run_config: Mapping[str, Any]) -> FedFSStrategy:
    """Run fedfs's method for the configured rounds on the nodes Flower connects."""
    s = ServerSettings.from_run_config(run_config)
    weights, model_config, _meta = read_checkpoint(s.initial_model)
    config_json = model_config.to_json()
    strategy = FedFSStrategy(
        method=s.method, model_config_json=config_json, train=s.train, fraction_train=s.fraction_train,
        min_nodes=s.min_nodes, record_dir=s.record_dir,
        base_vectors_file=s.out_dir / "base_vectors.json" if s.out_dir is not None else None,
        on_aggregate=publisher(s.out_dir, config_json, s.method) if s.out_dir is not None else None)
    strategy.start(grid=grid, initial_arrays=ArrayRecord.from_torch_state_dict(weights), num_rounds=s.num_rounds,
                   timeout=s.round_timeout, train_config=ConfigRecord({}))
    return strategy


app = create_app()


__all__ = ["app", "create_app", "main", "publisher"]
