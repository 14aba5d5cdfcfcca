"""The simulator's side of ``benchmarks/deployment_rehearsal.py``: what the deployment takes from the
simulator's split and settings — its images as a device's uint8 photos (:func:`to_u8`), its public
impostor set as the ``fedfs impostors`` file the server ships (:func:`write_impostors`), its local
SGD settings as the round task's ``train`` object (:func:`train_settings`) — and the simulator's
``results.json`` rows (:func:`sim_rows`), refused when run on another split (:func:`check_same_split`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def to_u8(x) -> np.ndarray:
    """Simulator images (float ``[N, 3, S, S]`` in [−1, 1]) as uint8 RGB ``[N, S, S, 3]``."""
    return np.clip(np.rint(x.numpy() * 127.5 + 127.5), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1).copy()


def write_impostors(cfg, ds, splits, out: Path) -> Path:
    """The simulator's public impostor set (:func:`~device_sim.experiment_data.public_impostor_images`)
    as the ``fedfs impostors`` file the server ships (identities from the same public group)."""
    from device_sim.experiment_data import build_pretrain_data, public_impostor_images
    from fedfs_sdk.runtime.impostors import ImpostorSet, save_impostors

    images = to_u8(public_impostor_images(cfg, ds, splits))
    _, src_splits = build_pretrain_data(cfg, ds, splits)
    ids = src_splits.pairs("public", "train")[0]
    if ids.size > images.shape[0]:       # the same seeded sample public_impostor_images draws
        keep = np.sort(np.random.default_rng([cfg.data.split_seed, 0x1A90]).choice(ids.size, images.shape[0],
                                                                                    replace=False))
        ids = ids[keep]
    names = sorted({int(i) for i in ids})
    pos = {n: k for k, n in enumerate(names)}
    imp = ImpostorSet(images, np.array([pos[int(i)] for i in ids], dtype=np.int32), [f"public-{n}" for n in names],
                      {"source": "fedfs simulate public identities", "input_size": int(images.shape[1]),
                       "detect_face": str(cfg.data.detect_face)})
    return save_impostors(out, imp)


def train_settings(cfg, spec: str) -> dict[str, Any]:
    """The round task's ``train`` object: the simulator's local SGD settings for ``spec``."""
    from device_sim.methods import parse_method

    t = cfg.train
    opts = parse_method(spec).options()
    out: dict[str, Any] = {"batch_size": t.batch_size, "seed": t.seed}
    lr = t.lr if t.lr is not None else opts.get("lr")
    if lr is not None:
        out["lr"] = lr
    if t.head_lr is not None:
        out["head_lr"] = t.head_lr
    epochs = t.local_epochs if t.local_epochs is not None else opts.get("epochs")
    if epochs is not None:
        out["local_epochs"] = epochs
    if t.momentum:
        out["momentum"] = t.momentum
    if t.weight_decay:
        out["weight_decay"] = t.weight_decay
    if opts.get("scope") is not None:
        out["scope"] = opts["scope"]
    return out


def sim_rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in results["methods"] if r.get("eval") is not None}


def check_same_split(results: dict[str, Any], cfg, pop, ds, splits, eval_clients: list[int]) -> None:
    """Refuse a results.json of another run: federation settings, population sizes, client names,
    evaluated clients."""
    from device_sim.cli_simulate import _client_names

    mine = cfg.to_settings()
    keys = ("rounds", "participation", "seed", "split_seed", "scenario", "capture_shift", "batch_size", "lr",
            "local_epochs")
    differ = {k: (results["settings"].get(k), mine.get(k)) for k in keys if results["settings"].get(k) != mine.get(k)}
    if differ:
        raise SystemExit(f"--sim-results was run with other settings (theirs, this run's): {differ}")

    want = {"clients": pop.num_clients, "public": len(splits.public), "image_size": pop.image_size}
    got = {k: results["population"].get(k) for k in want}
    if got != want:
        raise SystemExit(f"--sim-results is of another split: {got} vs this run's {want}")
    names = _client_names(ds, splits)
    if results.get("clients") and names and list(results["clients"]) != list(names):
        raise SystemExit("--sim-results names other clients (another --split-seed or folder?)")
    for label, r in sim_rows(results).items():
        if list(r["eval"]["clients"]) != list(eval_clients):
            raise SystemExit(f"--sim-results row {label!r} evaluated other clients")


__all__ = ["to_u8", "write_impostors", "train_settings", "sim_rows", "check_same_split"]
