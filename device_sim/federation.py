"""The federation round loop (FedFS Alg. 1, FedUV Alg. 1): sample, train locally, FedAvg.

Each round ``t``:

1. the server samples ``κ = max(round(p·N), 1)`` clients without replacement (its own
   ``numpy`` generator, whose state is checkpointed);
2. the method configures the round (:meth:`FederatedMethod.configure_round`);
3. participants train in chunks of the executor's size (a first-time participant starts
   ``θ_c`` from this round's global model, as a device does); each chunk's global weights
   are averaged in float64 with ``server_agg.aggregate.fedavg_stacked`` and folded into one
   ``StreamingFedAvg`` — the same weighted FedAvg (FedFS Eq. 1) the HTTP server runs — and
   each chunk's private weights go back to the :class:`ClientStore`;
4. ``method.server_update`` (FedAwS/FedGC-style server steps) gives the next global model.

Every client's local randomness is seeded from ``(seed, round, client)``, so a round's
result does not depend on the executor, the chunking or on what ran before — and resuming
from a checkpoint reproduces the next round bit for bit (tested).

Given a :class:`~device_sim.distributed.DistContext` (``fedfs simulate --distributed`` /
``--workers N``), every rank runs this loop, trains the participants the round's
assignment gives it (:mod:`device_sim.rank_split`), borrowing the ``θ_c`` of those whose
home shard is on another rank for the round, stores only its home clients' ``θ_c``, and
the ranks combine their float64 FedAvg sums with one all-reduce per round
(:mod:`device_sim.distributed`, which states the bound on the difference from a
one-process run).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from fedfs_sdk.errors import InputError
from server_agg.aggregate import StreamingFedAvg, fedavg_stacked

from .borrowing import lend_rows, return_rows, store_chunk
from .client_store import ClientStore
from .distributed import DistContext, DistributedFedAvg, all_gather, gather_to_main
from .federation_state import (CHECKPOINT_FORMAT, IDENTITY_PARTS, RoundRecord, checkpoint_path, data_fingerprint,  # noqa: F401
                               latest_checkpoint, load_federation, save_federation)
from .executors import ClientTask, LocalConfig, make_executor, train_splitting, unstack
from .methods.base import FederatedMethod, Params, SimContext, Weights
from .prefetch import PREFETCH_MODES, ChunkFeed, chunk_images, prefetch_enabled
from .rank_split import assign_participants
from .phases import PhaseTimer
from .xi_cache import feature_caches

class ClientData(Protocol):
    """What the loop needs from the data: one client's local training images.

    Optionally ``train_chunk(clients, device) -> list[Tensor]`` (a chunk's images at once,
    uint8 or float per client, as :meth:`device_sim.population.Population.train_chunk`);
    ``fingerprint() -> dict[str, str]`` (digests of the dataset and the split, as
    :meth:`device_sim.population.Population.fingerprint`): checkpoints record it, with a
    digest of a few clients' training images (``reference_train_images`` where the data
    have it), so a resume on other data is refused.
    """

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
        prefetch: ``auto`` | ``on`` | ``off`` — prepare the next chunk's images while a chunk
            trains (:mod:`device_sim.prefetch`; ``auto``: on CUDA). Changes no result.
        compile: ``auto`` | ``on`` | ``off`` — the batched executor's folded trunk through
            ``torch.compile`` (:mod:`device_sim.executors.compiled`; ``auto``: on CUDA with Triton).
            The same updates within float rounding.
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
    prefetch: str = "auto"
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise InputError(f"rounds must be ≥ 0, got {self.rounds}")
        if not 0 < self.participation <= 1:
            raise InputError(f"participation must be in (0, 1], got {self.participation}")
        if self.prefetch not in PREFETCH_MODES:
            raise InputError(f"prefetch must be one of {', '.join(PREFETCH_MODES)}, got {self.prefetch!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FederationConfig":
        d = dict(d)
        d["local"] = LocalConfig(**d["local"])
        return cls(**d)


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
        store_path: memmap file for ``store_location="disk"`` (rank ``r > 0`` of a
            distributed run appends ``.rank<r>``: each rank's shard is its own file).
        dist: the rank's place in a distributed run (:mod:`device_sim.distributed`), or None.
    """

    def __init__(self, method: FederatedMethod, data: ClientData, xi: torch.nn.Module,
                 config: FederationConfig, store_path: str | Path | None = None,
                 dist: DistContext | None = None) -> None:
        self.method, self.data, self.config = method, data, config
        self.dist = dist if dist is not None and dist.world_size > 1 else None
        if self.dist is not None:
            check_distributable(method)
            if store_path is not None and not self.dist.is_main:
                store_path = Path(f"{store_path}.rank{self.dist.rank}")
        self.ctx = SimContext(xi.config, xi, data.num_clients, config.seed, config.device)
        method.setup(self.ctx)
        if method.trains or self.is_main:      # a method that only evaluates is evaluated on rank 0
            method.prepare(data)
        self.global_weights: Weights = method.init_global()
        self.executor = make_executor(config.executor, config.device, config.chunk_size,
                                      **({"compile": config.compile} if config.compile != "auto" else {}))
        self.feature_caches = feature_caches(method, config.device, config.local.amp) if method.trains else []
        """ξ(x) — and a frozen stem's outputs — of every participant's images, computed once per run."""
        template = method.init_private(self.global_weights)
        # tensors no client's training moves (scope=top: the trunk) are kept once, not per client
        frozen = [(g, k) for g, w in template.items() for k in w if not method.trains_tensor(g, k)]
        self.store = ClientStore(data.num_clients, template, config.store_dtype, config.store_location,
                                 path=store_path, shared=frozen) if method.private_groups else None
        self.round = 0
        self.sampler = np.random.default_rng([config.seed, 0x5A4D])
        self.history: list[RoundRecord] = []
        self._states: dict[int, Any] = {}
        # Clients with a stored θ_c row (they trained before, or came with a checkpoint): the
        # same on every rank, so a trainer knows which borrowed clients arrive with a row.
        self._has_row = np.zeros(data.num_clients, dtype=bool)
        self._xi_fingerprint: str | None = None               # computed on the first save/load
        self._data_fingerprint: dict[str, str] | None = None   # computed on the first save/load
        self.borrowed_clients = 0
        """Distributed: clients this rank trained off their home rank, over the run."""
        self.dp = None   # device_sim.dp_sim.SimDp: user-level DP-FedAvg (fedfs simulate --dp-*), set by the caller
        self.phases = PhaseTimer()
        """Wall time per phase over the run (``PhaseTimer(sync=device)`` to attribute GPU time)."""

    @property
    def is_main(self) -> bool:
        """True outside a distributed run and on rank 0 (the rank that evaluates and writes)."""
        return self.dist is None or self.dist.is_main

    # ---- one round ---------------------------------------------------------------------
    @property
    def clients_per_round(self) -> int:
        if self.method.local_only:      # a per-client baseline: everyone trains once, no federation
            return self.data.num_clients
        return max(1, min(self.data.num_clients, round(self.config.participation * self.data.num_clients)))

    @property
    def planned_rounds(self) -> int:
        """Rounds :meth:`run` runs by default: ``config.rounds``, at most 1 for a per-client
        baseline without federation (``method.local_only``)."""
        return min(self.config.rounds, 1) if self.method.local_only else self.config.rounds

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
        participants = self.sample_participants() if self.dp is None else self.dp.sample(self.sampler)
        plan = method.configure_round(r, participants)
        # Distributed: every rank sampled the same participants and computes the same
        # assignment; this one trains its share, borrowing θ_c of clients homed elsewhere.
        mine, trainer, borrowed = participants, None, {}
        if self.dist is not None:
            trainer = assign_participants(participants, self._loads(participants), self.dist.world_size,
                                          self.dist.rank_split)
            mine = participants[trainer == self.dist.rank]
            if self.store is not None:
                borrowed = lend_rows(self.store, self._has_row, participants, trainer, self.dist)
                self.borrowed_clients += len(borrowed)
        returned: dict[int, torch.Tensor] = {}    # borrowed clients' trained rows, encoded for their home
        acc = StreamingFedAvg(self.global_weights) if self.dist is None else \
            DistributedFedAvg(self.global_weights, self.dist)
        if self.dp is not None:     # DP-FedAvg: clipped, weighted, noised sum (device_sim.dp_sim)
            acc = self.dp.accumulator(self.global_weights, r)
        # Each chunk's mean stays float64 until the end of the round: the result then does not
        # depend on the chunking beyond float64 rounding (a float32 chunk mean would).
        chunk_ref = {k: torch.empty(v.shape, dtype=torch.float64, device="meta") for k, v in self.global_weights.items()}
        global_dev = {k: v.to(ex.device) for k, v in self.global_weights.items()}
        # A client's first participation starts θ_c from the global model it receives now,
        # as a device does (LocalTrainer.train with personal_weights=None).
        # Flattened once per round, on the executor's device.
        fresh_flat = self.store.flatten_one(method.init_private(global_dev)) if self.store is not None else None
        sums: dict[str, float] = {}
        stepped = 0
        total_samples = 0

        def tasks_of(chunk: np.ndarray, images: list[torch.Tensor]) -> list[ClientTask]:
            with self.phases("store"):
                private = self.store.get(chunk, ex.device, fresh_flat=fresh_flat, borrowed=borrowed) \
                    if self.store is not None else {}
            tasks = []
            for i, c in enumerate(chunk.tolist()):
                params: Params = {"global": global_dev, **unstack(private, i)}
                consts = method.client_consts(plan, self.client_state(c))
                # uint8 images stay uint8: the executor normalizes them on its device
                tasks.append(ClientTask(c, images[i], params, consts, client_seed(cfg.seed, r, c)))
            if self.feature_caches:
                with self.phases("xi"):
                    for cache in self.feature_caches:
                        cache.fill(tasks)
            return tasks

        if getattr(ex, "needs_calibration", False) and len(mine):
            # Size chunks before the first one is built: a probe step of the round's first
            # clients at their real image count, batch size and epochs (executors.memory).
            with self.phases("data"):
                probe_images = chunk_images(self.data, mine[:2], ex.device)
            probe = tasks_of(mine[:2], probe_images)
            with self.phases("calibrate"):
                ex.calibrate(method, plan, probe, cfg.local)
            del probe, probe_images
        # The round's chunks are cut in one place, ChunkFeed._cut, at ex.chunk_size as it is when
        # the previous chunk is handed out; each comes with its images (uint8 from a Population),
        # the next chunk's prepared while this one trains (device_sim/prefetch.py). "data" is
        # the time the loop waited for them.
        feed = ChunkFeed(self.data, mine, lambda: ex.chunk_size, ex.device, prefetch_enabled(cfg.prefetch, ex.device),
                         waiting=lambda: self.phases("data"))
        for chunk, images in feed:
            tasks = tasks_of(chunk, images)
            # out of memory: split in half and retry (clients are independent; executors.splitting)
            with self.phases("train"):
                res = train_splitting(ex, method, plan, tasks, cfg.local)
            n_chunk = int(res.num_samples.sum())
            with self.phases("fedavg"):
                method.receive(plan, res.clients, res.params, res.num_samples)  # server-held class embeddings (FedAwS, FedGC, PrivacyFace)
                if self.dp is not None:
                    self.dp.add_chunk(acc, res.params["global"], res.num_samples)
                else:
                    acc.add(fedavg_stacked(res.params["global"], res.num_samples, reference=chunk_ref), n_chunk)
            if self.store is not None:
                with self.phases("store"):
                    store_chunk(self.store, res.clients, {g: res.params[g] for g in method.private_groups},
                                borrowed, returned)
            took = res.client_steps > 0
            stepped += int(took.sum())
            for k, v in res.metrics.items():    # metrics are on the CPU
                sums[k] = sums.get(k, 0.0) + float(v[took].double().sum())
            total_samples += n_chunk
        if trainer is not None and self.store is not None and self.dist is not None:
            return_rows(self.store, participants, trainer, returned, self.dist)
        if self.store is not None:
            self._has_row[participants] = True
        with self.phases("fedavg"):
            aggregated = acc.result()          # distributed: the round's one all-reduce
        if self.dist is not None:
            # a round's metric sums from every rank, added in rank order (small Python floats)
            gathered = all_gather((stepped, sums), self.dist)
            stepped, sums = 0, {}
            for st, sm in gathered:
                stepped += st
                for k, v in sm.items():
                    sums[k] = sums.get(k, 0.0) + v
            total_samples = acc.total_samples
        self.global_weights = {k: v.detach().to("cpu") for k, v in method.server_update(aggregated, plan).items()}
        self.round = r
        dt = time.perf_counter() - t0
        moved = None if trainer is None or self.dist is None else \
            int((trainer != participants % self.dist.world_size).sum())
        rec = RoundRecord(r, int(len(participants)), total_samples, dt, len(participants) / max(dt, 1e-9),
                          {k: v / stepped for k, v in sums.items()} if stepped else {}, None, stepped, moved)
        self.history.append(rec)
        return rec

    # ---- distributed ---------------------------------------------------------------------
    def _loads(self, participants: np.ndarray) -> np.ndarray | None:
        """Each participant's work for the rank assignment: its training images where the
        data report them (``num_train``), else None (one unit per client)."""
        count = getattr(self.data, "num_train", None)
        if not callable(count):
            return None
        return np.array([max(int(count(int(c))), 1) for c in participants], dtype=np.float64)

    def run(self, rounds: int | None = None,
            on_round: Callable[["Federation", RoundRecord], None] | None = None) -> list[RoundRecord]:
        """Run until ``rounds`` (default ``config.rounds``) rounds are done in total."""
        target = self.planned_rounds if rounds is None else rounds
        if self.method.local_only:
            target = min(target, 1)
        out = []
        while self.method.trains and self.round < target:
            rec = self.run_round()
            if on_round is not None:
                on_round(self, rec)
            out.append(rec)
        return out

    def private_weights(self, client: int) -> Params | None:
        """``θ_c`` of ``client`` (None if it never trained or the method has none). In a
        distributed run, complete on rank 0 after :meth:`collect_private`."""
        return None if self.store is None else self.store.get_one(client)

    def collect_private(self) -> None:
        """Distributed: bring every rank's store shard to rank 0 (a collective — every rank
        calls it at the same point: before rank 0 evaluates or checkpoints). Each rank sends
        the stored rows of the clients it owns, bit for bit; a no-op in one process."""
        if self.dist is None or self.store is None:
            return
        mine = self.dist.owned(self.store.touched())
        shards = gather_to_main((mine, self.store.export_rows(mine)), self.dist)
        if shards is not None:
            for r, (ids, rows) in enumerate(shards):
                if r != self.dist.rank:
                    self.store.import_rows(ids, rows)

    # ---- checkpoints -------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the whole federation state to one safetensors file, atomically
        (:func:`device_sim.federation_state.save_federation`). Distributed: a collective;
        rank 0 writes, the other ranks return None."""
        return save_federation(self, path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a state written by :meth:`save` for the same method, data and settings."""
        load_federation(self, path)


def check_distributable(method: FederatedMethod) -> None:
    """Refuse a method whose server reads per-client uploads (:meth:`FederatedMethod.receive`:
    FedAwS / FedGC class embeddings, PrivacyFace's DP cluster centres) in a distributed run:
    only the FedAvg sums cross ranks, so such a server would see one rank's clients only."""
    if type(method).receive is not FederatedMethod.receive:
        raise InputError(f"method {method.name!r} cannot run distributed (--distributed / --workers > 1): its server "
                         f"reads each client's upload (method.receive), and only the FedAvg sums are combined "
                         f"across ranks; run it in one process (--workers 1)")


__all__ = ["Federation", "FederationConfig", "RoundRecord", "ClientData", "client_seed", "check_distributable",
           "latest_checkpoint", "checkpoint_path", "data_fingerprint", "CHECKPOINT_FORMAT", "IDENTITY_PARTS"]
