"""The federation round loop (FedFS Alg. 1, FedUV Alg. 1): sample, train locally, FedAvg.

Each round ``t``:

1. the server samples ``κ = max(round(p·N), 1)`` clients without replacement (its own
   ``numpy`` generator, whose state is checkpointed);
2. the method configures the round (:meth:`FederatedMethod.configure_round`);
3. participants train in chunks of the executor's size; each chunk's global weights are
   averaged with ``server_agg.aggregate.fedavg_stacked`` and folded into one
   ``StreamingFedAvg`` — the same weighted FedAvg (FedFS Eq. 1) the HTTP server runs — and
   each chunk's private weights go back to the :class:`ClientStore`;
4. ``method.server_update`` (FedAwS/FedGC-style server steps) gives the next global model.

Every client's local randomness is seeded from ``(seed, round, client)``, so a round's
result does not depend on the executor, the chunking or on what ran before — and resuming
from a checkpoint reproduces the next round bit for bit (tested).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from fedfs_sdk.checkpoint import read_safetensors, write_safetensors_atomic
from fedfs_sdk.errors import CheckpointError, InputError
from server_agg.aggregate import StreamingFedAvg, fedavg_stacked

from .client_store import ClientStore
from .executors import ClientTask, LocalConfig, make_executor, unstack
from .methods.base import FederatedMethod, Params, SimContext, Weights

CHECKPOINT_FORMAT = "fedfs-federation/1"


class ClientData(Protocol):
    """What the loop needs from the data: one client's local training images."""

    num_clients: int

    def train_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        """float32 ``[n_c, 3, S, S]`` (normalized like ``preprocess``)."""
        ...


@dataclass(frozen=True)
class FederationConfig:
    """Settings of a federated run.

    Attributes:
        rounds: number of rounds ``T``.
        participation: fraction ``p`` of clients sampled per round (FedFS Table 2: 0.01–0.7).
        local: local SGD settings (lr, epochs, batch size, AMP).
        seed: seeds sampling, initialization and every client's local randomness.
        device: ``cpu`` or ``cuda``.
        executor: ``auto`` | ``sequential`` | ``batched``.
        chunk_size: clients per executor call (0: the executor's default / calibration).
        store_dtype, store_location: where ``θ_c`` lives (see :mod:`device_sim.client_store`).
    """

    rounds: int = 10
    participation: float = 0.1
    local: LocalConfig = field(default_factory=LocalConfig)
    seed: int = 0
    device: str = "cpu"
    executor: str = "auto"
    chunk_size: int = 0
    store_dtype: str = "fp32"
    store_location: str = "cpu"

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise InputError(f"rounds must be ≥ 0, got {self.rounds}")
        if not 0 < self.participation <= 1:
            raise InputError(f"participation must be in (0, 1], got {self.participation}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FederationConfig":
        d = dict(d)
        d["local"] = LocalConfig(**d["local"])
        return cls(**d)


@dataclass
class RoundRecord:
    """Per-round metrics: participants, samples, time and mean objective parts."""

    round: int
    participants: int
    num_samples: int
    seconds: float
    client_updates_per_s: float
    metrics: dict[str, float]
    eval: dict[str, Any] | None = None


def client_seed(seed: int, round_idx: int, client: int) -> int:
    """The local-training seed of ``client`` in ``round_idx`` (independent of everything else)."""
    return int(np.random.SeedSequence([seed, round_idx, client]).generate_state(1, np.uint64)[0] >> 1)


class Federation:
    """A federated run of one method over a population of single-identity clients.

    Args:
        method: the federated method (not yet set up).
        data: the clients' training images.
        xi: the frozen pre-trained model ``ξ`` (a FaceNet).
        config: the run settings.
        store_path: memmap file for ``store_location="disk"``.
    """

    def __init__(self, method: FederatedMethod, data: ClientData, xi: torch.nn.Module,
                 config: FederationConfig, store_path: str | Path | None = None) -> None:
        self.method, self.data, self.config = method, data, config
        self.ctx = SimContext(xi.config, xi, data.num_clients, config.seed, config.device)
        method.setup(self.ctx)
        self.global_weights: Weights = method.init_global()
        self.executor = make_executor(config.executor, config.device, config.chunk_size)
        template = method.init_private(self.global_weights)
        self.store = ClientStore(data.num_clients, template, config.store_dtype, config.store_location,
                                 path=store_path) if method.private_groups else None
        self.round = 0
        self.sampler = np.random.default_rng([config.seed, 0x5A4D])
        self.history: list[RoundRecord] = []
        self._states: dict[int, Any] = {}

    # ---- one round ---------------------------------------------------------------------
    @property
    def clients_per_round(self) -> int:
        return max(1, min(self.data.num_clients, round(self.config.participation * self.data.num_clients)))

    def sample_participants(self) -> np.ndarray:
        """``κ = max(round(p·N), 1)`` clients, uniformly without replacement (sorted)."""
        return np.sort(self.sampler.choice(self.data.num_clients, self.clients_per_round, replace=False))

    def client_state(self, client: int):
        st = self._states.get(client)
        if st is None:
            st = self.method.client_state_init(client)
            if len(self._states) < 65536:  # states are regenerable; keep the cache bounded
                self._states[client] = st
        return st

    def run_round(self) -> RoundRecord:
        """Run the next round and return its record (also appended to ``history``)."""
        if not self.method.trains:
            raise InputError(f"method {self.method.name!r} does not train; there are no rounds to run")
        t0 = time.perf_counter()
        r = self.round + 1
        cfg, method, ex = self.config, self.method, self.executor
        participants = self.sample_participants()
        plan = method.configure_round(r, participants)
        acc = StreamingFedAvg(self.global_weights)
        global_dev = {k: v.to(ex.device) for k, v in self.global_weights.items()}
        sums: dict[str, float] = {}
        total_samples = 0
        start = 0
        while start < len(participants):
            chunk = participants[start:start + ex.chunk_size]
            private = self.store.get(chunk, ex.device) if self.store is not None else {}
            tasks = []
            for i, c in enumerate(chunk.tolist()):
                params: Params = {"global": global_dev, **unstack(private, i)}
                consts = method.client_consts(plan, self.client_state(c))
                tasks.append(ClientTask(c, self.data.train_images(c, ex.device), params, consts,
                                        client_seed(cfg.seed, r, c)))
            res = ex.train(method, plan, tasks, cfg.local)
            method.receive(plan, res.clients, res.params, res.num_samples)  # server-held class embeddings (FedAwS, FedGC, PrivacyFace)
            n_chunk = int(res.num_samples.sum())
            acc.add(fedavg_stacked(res.params["global"], res.num_samples), n_chunk)
            if self.store is not None:
                self.store.put(res.clients, {g: res.params[g] for g in method.private_groups})
            for k, v in res.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.double().sum())
            total_samples += n_chunk
            start += len(chunk)
            # executor chunk size may be calibrated by the first call (CUDA)
        aggregated = acc.result()
        self.global_weights = {k: v.detach().to("cpu") for k, v in method.server_update(aggregated, plan).items()}
        self.round = r
        dt = time.perf_counter() - t0
        rec = RoundRecord(r, int(len(participants)), total_samples, dt, len(participants) / max(dt, 1e-9),
                          {k: v / len(participants) for k, v in sums.items()})
        self.history.append(rec)
        return rec

    def run(self, rounds: int | None = None,
            on_round: Callable[["Federation", RoundRecord], None] | None = None) -> list[RoundRecord]:
        """Run until ``rounds`` (default ``config.rounds``) rounds are done in total."""
        target = self.config.rounds if rounds is None else rounds
        out = []
        while self.method.trains and self.round < target:
            rec = self.run_round()
            if on_round is not None:
                on_round(self, rec)
            out.append(rec)
        return out

    def private_weights(self, client: int) -> Params | None:
        """``θ_c`` of ``client`` (None if it never trained or the method has none)."""
        return None if self.store is None else self.store.get_one(client)

    # ---- checkpoints -------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        cfg = self.config.to_dict()
        for k in ("rounds", "executor", "chunk_size", "device"):  # may differ on resume
            cfg.pop(k)
        return {"method": self.method.name, "options": self.method.options(), "config": cfg,
                "num_clients": self.data.num_clients, "model_config": self.ctx.model_config.to_json()}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the whole federation state (global and server weights, client store, round,
        sampler and torch RNG states, history) to one safetensors file, atomically."""
        tensors: dict[str, torch.Tensor] = {f"global/{k}": v.contiguous() for k, v in self.global_weights.items()}
        tensors.update({f"server/{k}": v.detach().cpu().contiguous() for k, v in self.method.server_state().items()})
        if self.store is not None:
            tensors.update({f"store/{k}": v for k, v in self.store.state_tensors().items()})
        tensors["rng/torch"] = torch.get_rng_state()
        meta = {"format": CHECKPOINT_FORMAT, "round": str(self.round),
                "identity": json.dumps(self._identity(), sort_keys=True),
                "sampler": json.dumps(self.sampler.bit_generator.state),
                "history": json.dumps([asdict(h) for h in self.history])}
        return write_safetensors_atomic(path, tensors, meta)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a state written by :meth:`save` for the same method, data and settings."""
        p = Path(path)
        tensors, meta = read_safetensors(p, CHECKPOINT_FORMAT, "federation checkpoint")
        saved, mine = json.loads(meta["identity"]), json.loads(json.dumps(self._identity(), sort_keys=True))
        if saved != mine:
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise CheckpointError(f"{p} was written by a different run (differs in {diff}); "
                                  f"use the same method, data and settings to resume")
        glob = {k[len("global/"):]: v for k, v in tensors.items() if k.startswith("global/")}
        if set(glob) != set(self.global_weights):
            raise CheckpointError(f"{p}: global weights do not match the method's model")
        self.global_weights = glob
        self.method.load_server_state({k[len("server/"):]: v for k, v in tensors.items() if k.startswith("server/")})
        if self.store is not None:
            self.store.load_state_tensors({k[len("store/"):]: v for k, v in tensors.items() if k.startswith("store/")})
        torch.set_rng_state(tensors["rng/torch"])
        self.sampler.bit_generator.state = json.loads(meta["sampler"])
        self.round = int(meta["round"])
        self.history = [RoundRecord(**h) for h in json.loads(meta["history"])]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The highest-round ``round_*.safetensors`` in ``directory`` (None if there is none)."""
    d = Path(directory)
    files = sorted(d.glob("round_*.safetensors")) if d.is_dir() else []
    return files[-1] if files else None


def checkpoint_path(directory: str | os.PathLike[str], round_idx: int) -> Path:
    return Path(directory) / f"round_{round_idx:05d}.safetensors"


__all__ = ["Federation", "FederationConfig", "RoundRecord", "ClientData", "client_seed",
           "latest_checkpoint", "checkpoint_path", "CHECKPOINT_FORMAT"]
