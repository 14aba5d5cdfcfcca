"""Where the simulator keeps every client's private weights (FedFS's ``θ_c``) across rounds.

FedFS's personalized model never leaves its device, so the simulator must hold one model
per client: 10,000 MobileFaceNets is 10.1 G parameters — 40 GB in float32. The store
keeps them as one flat ``[rows, P]`` tensor (one row per client that has trained, a row
index per client) with three knobs:

* ``location`` — ``cpu`` (host RAM), ``pinned`` (page-locked host RAM: asynchronous,
  fast host↔GPU copies of a chunk's rows), ``cuda`` (GPU memory: no copies at all, if it
  fits) or ``disk`` (a ``numpy.memmap`` file: only the OS page cache is used).
* ``dtype`` — ``fp32``, ``fp16`` or ``bf16``. Half precision stores the *difference*
  ``θ_c − θ_0`` from the round-0 weights (``encoding="delta"``), whose magnitude is that
  of the training since round 0 (the client's local updates, plus the global model's drift
  before its first round), so rounding is relative to that and not to the weight (an
  absolute fp16 weight would silently drop updates below 2⁻¹¹ of its magnitude).
* regeneration on demand — a client that has never trained has no row: :meth:`ClientStore.get`
  gives it the ``fresh`` weights the caller passes (the federation passes the private weights
  derived from the *current* global model, where a device starts ``θ_c`` on its first
  participation) or ``θ_0``. No row is allocated until it first trains, so memory grows with
  the number of *touched* clients ``N·(1 − (1 − p)^T)`` for participation ``p`` after ``T``
  rounds. (Codewords are likewise regenerated from the seed, see ``methods.sdk_methods``.)
* shared tensors — a tensor that no client's training moves (``scope="top"``: the trunk, which
  stays ξ's, :meth:`~device_sim.methods.base.FederatedMethod.trains_tensor`) is held once, from
  ``θ_0``, not in every row: MobileFaceNet's personalized model is 0.99 M parameters, its top
  0.07 M.

:func:`estimate_memory` gives the numbers; ``docs/simulation.md`` tabulates them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .methods.base import Params

LOCATIONS = ("cpu", "pinned", "cuda", "disk")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NP = {"fp32": np.float32, "fp16": np.float16}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes to hold the private weights of a population (see :func:`estimate_memory`)."""

    num_clients: int
    params_per_client: int
    dtype: str
    touched_clients: int
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / 2**30

    def describe(self) -> str:
        return (f"{self.touched_clients:,} of {self.num_clients:,} clients × {self.params_per_client:,} params "
                f"× {torch.finfo(DTYPES[self.dtype]).bits // 8} B ({self.dtype}) = {self.gib:.2f} GiB")


def touched_clients(num_clients: int, participation: float, rounds: int) -> int:
    """Expected number of clients that trained at least once: ``N·(1 − (1 − p)^T)``."""
    if not 0 < participation <= 1:
        raise InputError(f"participation must be in (0, 1], got {participation}")
    return min(num_clients, math.ceil(num_clients * (1 - (1 - participation) ** max(rounds, 0))))


def estimate_memory(num_clients: int, params_per_client: int, dtype: str = "fp16",
                    participation: float = 1.0, rounds: int | None = None) -> MemoryEstimate:
    """Memory of the store for ``num_clients`` private models of ``params_per_client``
    parameters. With ``rounds``, only the expected touched clients are counted."""
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    touched = num_clients if rounds is None else touched_clients(num_clients, participation, rounds)
    nbytes = touched * params_per_client * (torch.finfo(DTYPES[dtype]).bits // 8)
    return MemoryEstimate(num_clients, params_per_client, dtype, touched, nbytes)


class ClientStore:
    """Private weights of ``num_clients`` clients, flat rows allocated on first write.

    Args:
        num_clients: population size.
        template: the round-0 private weights ``θ_0`` (same for every client), as
            ``{group: {name: tensor}}``: the base of the delta encoding and the default
            weights of a client without a row.
        dtype: ``fp32`` | ``fp16`` | ``bf16`` storage precision.
        location: ``cpu`` | ``pinned`` | ``cuda`` | ``disk``.
        path: the memmap file for ``location="disk"``.
        encoding: ``absolute`` or ``delta`` (from ``θ_0``); default delta for half types.
        shared: ``(group, name)`` of tensors that are the same for every client at every round
            (frozen in local training): kept once, from ``template``, and given to every client.
    """

    def __init__(self, num_clients: int, template: Params, dtype: str = "fp32", location: str = "cpu",
                 path: str | Path | None = None, encoding: str | None = None,
                 shared: "Sequence[tuple[str, str]] | set[tuple[str, str]]" = ()) -> None:
        if dtype not in DTYPES:
            raise InputError(f"store dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if location not in LOCATIONS:
            raise InputError(f"store location must be one of {LOCATIONS}, got {location!r}")
        if location in ("pinned", "cuda") and not torch.cuda.is_available():
            raise InputError(f"store location {location!r} needs CUDA, which is not available")
        if location == "disk" and (path is None or dtype == "bf16"):
            raise InputError("store location 'disk' needs a path and dtype fp32 or fp16 (numpy memmap)")
        self.encoding = encoding or ("absolute" if dtype == "fp32" else "delta")
        if self.encoding not in ("absolute", "delta"):
            raise InputError(f"encoding must be 'absolute' or 'delta', got {self.encoding!r}")
        self.num_clients, self.dtype, self.location = int(num_clients), dtype, location
        every = [(g, k) for g, w in template.items() for k in w]
        shared = set(shared)
        if shared - set(every):
            raise InputError(f"shared tensors not in the template: {sorted(shared - set(every))[:3]}")
        self.keys: list[tuple[str, str]] = [gk for gk in every if gk not in shared]
        """The per-client tensors, in row order."""
        self.shared: dict[tuple[str, str], torch.Tensor] = {
            gk: template[gk[0]][gk[1]].detach().float().cpu().clone() for gk in every if gk in shared}
        self._order = every
        self.shapes = {gk: tuple(template[gk[0]][gk[1]].shape) for gk in every}
        sizes = [math.prod(self.shapes[gk]) for gk in self.keys]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.params_per_client = int(self.offsets[-1])
        self._template = torch.cat([template[g][k].detach().float().reshape(-1).cpu() for g, k in self.keys]) \
            if self.keys else torch.zeros(0)
        self.rows = np.full(self.num_clients, -1, dtype=np.int64)
        self.used = 0
        self._path = Path(path) if path is not None else None
        self._data = self._allocate(0 if location != "disk" else self.num_clients)

    # ---- storage -----------------------------------------------------------------------
    @property
    def storage_device(self) -> torch.device:
        return torch.device("cuda") if self.location == "cuda" else torch.device("cpu")

    def _allocate(self, rows: int) -> torch.Tensor:
        p = self.params_per_client
        if self.location == "disk":
            assert self._path is not None
            self._path.parent.mkdir(parents=True, exist_ok=True)
            mm = np.memmap(self._path, dtype=_NP[self.dtype], mode="w+", shape=(max(rows, 1), max(p, 1)))
            return torch.from_numpy(mm)
        t = torch.zeros((rows, p), dtype=DTYPES[self.dtype], device=self.storage_device)
        return t.pin_memory() if self.location == "pinned" else t

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self._data.shape[0]:
            return
        new = self._allocate(min(self.num_clients, max(rows, 2 * self._data.shape[0], 64)))
        new[:self.used] = self._data[:self.used]
        self._data = new

    @property
    def nbytes(self) -> int:
        """Bytes allocated for rows (capacity, not just used rows)."""
        return int(self._data.numel() * self._data.element_size())

    def estimate(self) -> MemoryEstimate:
        return estimate_memory(self.num_clients, self.params_per_client, self.dtype)

    # ---- access ------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= self.num_clients):
            bad = a[(a < 0) | (a >= self.num_clients)][0]
            raise InputError(f"unknown client {int(bad)} (store holds clients 0..{self.num_clients - 1})")
        return a

    def has(self, client: int) -> bool:
        return bool(self.rows[self._check_ids([client])[0]] >= 0)

    def touched(self) -> np.ndarray:
        """Clients with a stored row (they trained at least once)."""
        return np.flatnonzero(self.rows >= 0)

    def get(self, ids: Sequence[int] | np.ndarray, device: str | torch.device = "cpu",
            fresh_flat: torch.Tensor | None = None,
            borrowed: Mapping[int, torch.Tensor | None] | None = None) -> Params:
        """Stacked float32 weights ``{group: {name: [K, ...]}}`` of ``ids`` on ``device``.

        Clients without a row (never trained) get ``fresh_flat`` — the private weights a
        client starts from on its first participation (flattened by :meth:`flatten_one`),
        e.g. derived from the current global model as a device does — or ``θ_0`` (the
        template) without it. It is one model shared by every such client: no row or memory
        per client.

        ``borrowed``: clients this store does not hold (a distributed trainer rank borrowing
        them from their home rank's shard), each with its row as :meth:`export_rows` gave it
        (decoded exactly as this store decodes its own rows), or None for a client that has
        no row anywhere (it gets ``fresh_flat``). They take precedence over this store's rows."""
        a = self._check_ids(ids)
        dev = torch.device(device)
        base = self._template if fresh_flat is None else fresh_flat
        flat = base.to(dev).unsqueeze(0).repeat(len(a), 1)
        rows = self.rows[a].copy()
        lent: list[int] = []
        if borrowed:
            for i, c in enumerate(a.tolist()):
                if c in borrowed:
                    rows[i] = -1                    # never this store's (possibly stale) row
                    if borrowed[c] is not None:
                        lent.append(i)
        if lent:
            raw = torch.stack([borrowed[int(a[i])] for i in lent])  # type: ignore[index, misc]
            flat[torch.tensor(lent, device=dev)] = self.decode_rows(raw, dev)
        have = np.flatnonzero(rows >= 0)
        if have.size:
            r = torch.from_numpy(rows[have]).to(self._data.device)
            if self.location == "pinned" and dev.type == "cuda":
                # gather into a pinned staging buffer so the host→GPU copy is asynchronous
                staging = torch.empty((r.numel(), self.params_per_client), dtype=self._data.dtype, pin_memory=True)
                torch.index_select(self._data, 0, r, out=staging)
                stored = staging.to(dev, non_blocking=True).float()
            else:
                stored = self._data[r].to(dev).float()
            pos = torch.from_numpy(have).to(dev)
            flat[pos] = stored + self._template.to(dev).unsqueeze(0) if self.encoding == "delta" else stored
        out = self._unflatten(flat)
        if not self.shared:
            return out
        for (g, name), t in self.shared.items():     # one tensor for all: a view, no copy per client
            out.setdefault(g, {})[name] = t.to(dev).unsqueeze(0).expand((len(a),) + tuple(t.shape))
        ordered: Params = {}
        for g, name in self._order:                 # the template's order
            ordered.setdefault(g, {})[name] = out[g][name]
        return ordered

    def decode_rows(self, raw: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
        """Flat float32 ``[K, P]`` weights of rows kept as stored (:meth:`export_rows`,
        :meth:`encode_rows`): the same operations :meth:`get` applies to its own rows."""
        stored = raw.to(torch.device(device)).float()
        return stored + self._template.to(stored.device).unsqueeze(0) if self.encoding == "delta" else stored

    def encode_rows(self, stacked: Mapping[str, Mapping[str, torch.Tensor]], k: int) -> torch.Tensor:
        """``[K, ...]`` weights as the rows :meth:`put` would store (storage dtype and
        encoding, on the CPU) without storing them: what a distributed trainer rank sends
        back to a borrowed client's home rank, which :meth:`import_rows` them bit for bit."""
        return self._encode(self._flatten(stacked, k)).to("cpu", DTYPES[self.dtype]).contiguous()

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat - self._template.to(flat.device).unsqueeze(0) if self.encoding == "delta" else flat

    def get_one(self, client: int, device: str | torch.device = "cpu") -> Params | None:
        """One client's weights, or None if it never trained."""
        if not self.has(client):
            return None
        stacked = self.get([client], device)
        return {g: {k: v[0] for k, v in w.items()} for g, w in stacked.items()}

    def put(self, ids: Sequence[int] | np.ndarray, stacked: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Store ``[K, ...]`` weights of ``ids`` (allocating rows on first write)."""
        a = self._check_ids(ids)
        if len(set(a.tolist())) != len(a):
            raise InputError("duplicate client ids in one put()")
        flat = self._flatten(stacked, len(a))
        new = a[self.rows[a] < 0]
        if new.size:
            self._ensure_capacity(self.used + new.size)
            self.rows[new] = np.arange(self.used, self.used + new.size)
            self.used += int(new.size)
        flat = self._encode(flat)
        r = torch.from_numpy(self.rows[a]).to(self._data.device)
        self._data[r] = flat.to(self._data.device, DTYPES[self.dtype])

    def export_rows(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The stored rows of ``ids`` exactly as kept (storage dtype and encoding, on the
        CPU): what :meth:`import_rows` of another store with the same template takes, bit
        for bit (distributed shards → rank 0, :mod:`device_sim.distributed`). Every id
        must have a row."""
        a = self._check_ids(ids)
        rows = self.rows[a]
        if (rows < 0).any():
            raise InputError(f"client {int(a[rows < 0][0])} has no stored row to export")
        return self._data[torch.from_numpy(rows).to(self._data.device)].detach().to("cpu").contiguous()

    def import_rows(self, ids: Sequence[int] | np.ndarray, raw: torch.Tensor) -> None:
        """Store rows written by :meth:`export_rows` of a store with the same layout,
        dtype and template (allocating rows on first write)."""
        a = self._check_ids(ids)
        if tuple(raw.shape) != (a.size, self.params_per_client) or raw.dtype != DTYPES[self.dtype]:
            raise InputError(f"rows to import must be [{a.size}, {self.params_per_client}] {self.dtype}, "
                             f"got {list(raw.shape)} {raw.dtype}")
        if len(set(a.tolist())) != len(a):
            raise InputError("duplicate client ids in one import_rows()")
        if not a.size:
            return
        new = a[self.rows[a] < 0]
        if new.size:
            self._ensure_capacity(self.used + new.size)
            self.rows[new] = np.arange(self.used, self.used + new.size)
            self.used += int(new.size)
        self._data[torch.from_numpy(self.rows[a]).to(self._data.device)] = raw.to(self._data.device)

    def flatten_one(self, params: Params) -> torch.Tensor:
        """One client's ``{group: {name: tensor}}`` as the flat float32 ``[P]`` vector
        :meth:`get` takes as ``fresh_flat`` (on the tensors' device)."""
        return self._flatten({g: {k: v.unsqueeze(0) for k, v in w.items()} for g, w in params.items()}, 1)[0]

    def _flatten(self, stacked: Mapping[str, Mapping[str, torch.Tensor]], k: int) -> torch.Tensor:
        parts = []
        for g, name in self.keys:
            try:
                t = stacked[g][name]
            except KeyError:
                raise InputError(f"private weights lack {g}/{name}") from None
            if tuple(t.shape) != (k,) + self.shapes[(g, name)]:
                raise InputError(f"{g}/{name}: expected shape {[k, *self.shapes[(g, name)]]}, got {list(t.shape)}")
            parts.append(t.detach().float().reshape(k, -1))
        dev = parts[0].device if parts else torch.device("cpu")
        return torch.cat([p.to(dev) for p in parts], dim=1) if parts else torch.zeros(k, 0)

    def _unflatten(self, flat: torch.Tensor) -> Params:
        out: Params = {}
        for i, (g, name) in enumerate(self.keys):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            out.setdefault(g, {})[name] = flat[:, lo:hi].reshape((flat.shape[0],) + self.shapes[(g, name)])
        return out

    # ---- checkpoints -------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors that restore the store exactly (used rows only)."""
        return {"rows": torch.from_numpy(self.rows.copy()),
                "data": self._data[:self.used].detach().to("cpu").contiguous().clone(),
                # the tensors no row holds, so that a reader (sim_export) can rebuild a client's θ_c
                **{f"shared/{g}/{name}": t.clone() for (g, name), t in self.shared.items()}}

    def load_state_tensors(self, state: Mapping[str, torch.Tensor]) -> None:
        rows = state["rows"].numpy().astype(np.int64)
        data = state["data"]
        if rows.shape != (self.num_clients,) or data.dim() != 2 or data.shape[1] != self.params_per_client:
            raise InputError(f"client store state does not match: rows {list(rows.shape)}, data {list(data.shape)} "
                             f"for {self.num_clients} clients × {self.params_per_client} params")
        if data.dtype != DTYPES[self.dtype]:
            raise InputError(f"client store state is {data.dtype}, the store is {self.dtype}")
        self.rows = rows
        self.used = int(data.shape[0])
        if self.location != "disk":
            self._data = self._allocate(self.used)
        self._data[:self.used] = data.to(self._data.device)


__all__ = ["ClientStore", "MemoryEstimate", "estimate_memory", "touched_clients", "LOCATIONS", "DTYPES"]
