"""A federation's state on disk: one safetensors file per checkpoint, and what it must match.

:func:`save_federation` writes the global and server weights, the client store, the round, the
sampler's and torch's RNG states and the history atomically; :func:`load_federation` refuses a
file written by another run (:func:`federation_identity`: method, settings, data and ξ
fingerprints) and names what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedfs_sdk.errors import CheckpointError
from fedfs_sdk.nn.checkpoint import model_id_of, read_safetensors, write_safetensors_atomic

if TYPE_CHECKING:
    from .federation import ClientData, Federation

CHECKPOINT_FORMAT = "fedfs-federation/1"


IDENTITY_PARTS = {
    "data.dataset": "the dataset (images, identities, preprocessing)",
    "data.splits": "the public / client / new-user split",
    "data.images": "the clients' training images",
    "xi": "the pre-trained ξ weights",
}


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
    clients_with_steps: int | None = None
    """Participants that applied at least one local step; ``metrics`` average over them only
    (a client with too few images for a batch trains nothing and reports no loss). Empty
    ``metrics`` when none did. ``None`` in histories written before it was recorded."""
    borrowed: int | None = None
    """Distributed runs: participants trained on a rank other than their home rank
    (``--rank-split balanced``); None in one process."""


def data_fingerprint(data: "ClientData", sample_clients: int = 3) -> dict[str, str]:
    """``data.fingerprint()`` (when it has one) plus ``images``: sha256 of the training images
    of ``sample_clients`` clients spread over the population (first, middle, last) — a cheap
    check that the client data themselves are the same."""
    fp_fn = getattr(data, "fingerprint", None)
    out = {str(k): str(v) for k, v in (fp_fn() if callable(fp_fn) else {}).items()}
    n = int(data.num_clients)
    h = hashlib.sha256(str(n).encode())
    images_of = getattr(data, "reference_train_images", None) or data.train_images
    for c in sorted({round(i * (n - 1) / max(sample_clients - 1, 1)) for i in range(sample_clients)}) if n else []:
        x = images_of(c).detach().to("cpu", torch.float32).contiguous()
        h.update(json.dumps([c, list(x.shape)]).encode())
        h.update(x.numpy().tobytes())
    out["images"] = h.hexdigest()
    return out


def federation_identity(fed: "Federation") -> dict[str, Any]:
    """What a checkpoint must match to be resumed: method and options, settings (but those that
    may change on resume), population size, model, data and ξ fingerprints (computed once)."""
    cfg = fed.config.to_dict()
    for k in ("rounds", "executor", "chunk_size", "device", "prefetch", "compile"):  # may differ on resume
        cfg.pop(k)
    if fed._data_fingerprint is None:
        fed._data_fingerprint = data_fingerprint(fed.data)
    if fed._xi_fingerprint is None:
        fed._xi_fingerprint = model_id_of(fed.ctx.xi.state_dict())
    return {"method": fed.method.name, "options": fed.method.options(), "config": cfg,
            "num_clients": fed.data.num_clients, "model_config": fed.ctx.model_config.to_json(),
            "data": fed._data_fingerprint, "xi": fed._xi_fingerprint}


def save_federation(fed: "Federation", path: str | os.PathLike[str]) -> Path | None:
    """Write the whole federation state (global and server weights, client store, round,
    sampler and torch RNG states, history) to one safetensors file, atomically.

    Distributed: a collective (every rank calls it); rank 0 gathers the store shards and
    writes, the other ranks write nothing and return None."""
    fed.collect_private()
    if not fed.is_main:
        return None
    tensors: dict[str, torch.Tensor] = {f"global/{k}": v.contiguous() for k, v in fed.global_weights.items()}
    tensors.update({f"server/{k}": v.detach().cpu().contiguous() for k, v in fed.method.server_state().items()})
    if fed.store is not None:
        tensors.update({f"store/{k}": v for k, v in fed.store.state_tensors().items()})
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"format": CHECKPOINT_FORMAT, "round": str(fed.round),
            "identity": json.dumps(federation_identity(fed), sort_keys=True),
            "sampler": json.dumps(fed.sampler.bit_generator.state),
            "history": json.dumps([asdict(h) for h in fed.history])}
    return write_safetensors_atomic(path, tensors, meta)

def load_federation(fed: "Federation", path: str | os.PathLike[str]) -> None:
    """Restore a state written by :func:`save_federation` for the same method, data and settings."""
    p = Path(path)
    tensors, meta = read_safetensors(p, CHECKPOINT_FORMAT, "federation checkpoint")
    saved, mine = json.loads(meta["identity"]), json.loads(json.dumps(federation_identity(fed), sort_keys=True))
    if saved != mine:
        raise CheckpointError(identity_mismatch(p, saved, mine))
    glob = {k[len("global/"):]: v for k, v in tensors.items() if k.startswith("global/")}
    if set(glob) != set(fed.global_weights):
        raise CheckpointError(f"{p}: global weights do not match the method's model")
    fed.global_weights = glob
    fed.method.load_server_state({k[len("server/"):]: v for k, v in tensors.items() if k.startswith("server/")})
    if fed.store is not None:
        fed.store.load_state_tensors({k[len("store/"):]: v for k, v in tensors.items() if k.startswith("store/")})
        fed._has_row = fed.store.rows >= 0
    torch.set_rng_state(tensors["rng/torch"])
    fed.sampler.bit_generator.state = json.loads(meta["sampler"])
    fed.round = int(meta["round"])
    fed.history = [RoundRecord(**h) for h in json.loads(meta["history"])]


def identity_mismatch(path: Path, saved: dict[str, Any], mine: dict[str, Any]) -> str:
    """Why a checkpoint's identity differs from this run's: the differing parts, by name."""
    diff: list[str] = []
    for k in sorted(set(saved) | set(mine)):
        a, b = saved.get(k), mine.get(k)
        if a == b:
            continue
        if k == "data" and isinstance(a, dict) and isinstance(b, dict):
            diff += [f"data.{s}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
        else:
            diff.append(k)
    if {"data", "xi"} & set(mine) and not {"data", "xi"} & set(saved) and diff == sorted(
            {"data", "xi"} & set(mine)):
        return (f"{path} has no data/ξ fingerprints (written by an older fedfs), so it cannot be checked "
                f"against this run's data and ξ; start this run afresh (remove {path.parent})")
    named = [f"{d} ({IDENTITY_PARTS[d]})" if d in IDENTITY_PARTS else d for d in diff]
    return (f"{path} was written by a different run (differs in: {', '.join(named)}); "
            f"use the same method, data, ξ and settings to resume")


_ROUND_FILE = re.compile(r"round_(\d+)\.safetensors")


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The highest-round ``round_<N>.safetensors`` in ``directory`` by the parsed round number
    (names are zero-padded to 5 digits, so ≥ 100000 rounds would sort wrong as text);
    None if there is none."""
    d = Path(directory)
    best: tuple[int, Path] | None = None
    for f in (d.iterdir() if d.is_dir() else ()):
        m = _ROUND_FILE.fullmatch(f.name)
        if m and f.is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), f)
    return best[1] if best else None


def checkpoint_path(directory: str | os.PathLike[str], round_idx: int) -> Path:
    return Path(directory) / f"round_{round_idx:05d}.safetensors"


__all__ = ["save_federation", "load_federation", "federation_identity", "data_fingerprint", "identity_mismatch",
           "latest_checkpoint", "checkpoint_path", "CHECKPOINT_FORMAT", "IDENTITY_PARTS"]
