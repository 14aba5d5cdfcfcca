"""The Flower run's settings (``[tool.flwr.app.config]`` / ``--run-config``) and a node's
(``flower-supernode --node-config``), checked with errors that name the key and the fix.

Flower hands both as flat ``key → int | float | str | bool`` mappings. fedfs's nested
training settings travel as one JSON string (``train``), the same object a fedfs round task
carries (:func:`fedfs_sdk.federation.wire.train_config_from_json`), so one schema serves both servers.
No Flower import here: the settings are testable without the extra.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedfs_sdk.errors import InputError
from fedfs_sdk.training.methods import check_method, uses_fedfs

RUN_DEFAULTS: dict[str, Any] = {
    "method": "fedfs+feduv",
    "initial-model": "",
    "num-rounds": 3,
    "fraction-train": 1.0,
    "min-nodes": 2,
    "train": "{}",
    "xi": "",
    "data-root": "",
    "state-root": "",
    "out-dir": "",
    "record-dir": "",
    "torch-threads": 1,
    "detect-face": False,
    "round-timeout": 600.0,
}
"""Every run-config key the apps read, with its default (the Flower App project writes them
all, so ``flwr run --run-config 'k=v'`` can override any of them)."""

NODE_KEYS = ("data-dir", "state-dir", "xi")
"""Node-config keys of a SuperNode (deployment): its own image folder, its device-state
folder (θ_c, r_u, codeword) and, optionally, where ξ lies on that machine."""


def _get(cfg: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    v = cfg.get(key, RUN_DEFAULTS.get(key))
    if isinstance(v, bool) and kind is not bool:
        raise InputError(f"run config {key!r} must be {getattr(kind, '__name__', kind)}, got {v!r}")
    if kind is float and isinstance(v, int):
        v = float(v)
    if not isinstance(v, kind):
        raise InputError(f"run config {key!r} must be {getattr(kind, '__name__', kind)}, got {v!r} "
                         f"(flwr run --run-config '{key}=…')")
    return v


@dataclass(frozen=True)
class ServerSettings:
    """What the ServerApp needs."""

    method: str
    initial_model: Path
    num_rounds: int
    fraction_train: float
    min_nodes: int
    train: dict[str, Any]
    out_dir: Path | None
    record_dir: Path | None
    round_timeout: float

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> "ServerSettings":
        method = check_method(_get(cfg, "method", str))
        model = _get(cfg, "initial-model", str)
        if not model:
            raise InputError("run config 'initial-model' is empty: give the fedfs checkpoint of the round-0 global "
                             "model (the file `fedfs serve --model` takes)")
        n = _get(cfg, "num-rounds", int)
        if n < 1:
            raise InputError(f"run config 'num-rounds' must be ≥ 1, got {n}")
        frac = _get(cfg, "fraction-train", float)
        if not 0 < frac <= 1:
            raise InputError(f"run config 'fraction-train' must be in (0, 1], got {frac}")
        min_nodes = _get(cfg, "min-nodes", int)
        if min_nodes < 1:
            raise InputError(f"run config 'min-nodes' must be ≥ 1, got {min_nodes}")
        timeout = _get(cfg, "round-timeout", float)
        out, rec = _get(cfg, "out-dir", str), _get(cfg, "record-dir", str)
        return cls(method, Path(model), n, frac, min_nodes, parse_train(cfg), Path(out) if out else None,
                   Path(rec) if rec else None, timeout)


@dataclass(frozen=True)
class NodeSettings:
    """What one ClientApp node needs: its images, its device-state folder and ξ."""

    data_dir: Path
    state_dir: Path
    xi: Path | None
    torch_threads: int
    detect_face: bool

    @classmethod
    def from_configs(cls, run_cfg: Mapping[str, Any], node_cfg: Mapping[str, Any], method: str,
                     need_data: bool = True) -> "NodeSettings":
        """A SuperNode's ``data-dir``/``state-dir`` (deployment), else client ``partition-id``
        of ``data-root``'s sorted sub-folders and ``state-root/node-<partition-id>`` (simulation).
        ``need_data=False``: the images come from elsewhere (a benchmark's in-memory clients)."""
        data, state = node_cfg.get("data-dir"), node_cfg.get("state-dir")
        if not need_data and state is None and node_cfg.get("partition-id") is not None:
            sroot = _get(run_cfg, "state-root", str)
            if not sroot:
                raise InputError("run config 'state-root' is empty: each node needs a device-state folder")
            data, state = "", str(Path(sroot) / f"node-{int(node_cfg['partition-id'])}")
        if data is None or state is None:
            pid = node_cfg.get("partition-id")
            root, sroot = _get(run_cfg, "data-root", str), _get(run_cfg, "state-root", str)
            if pid is None or not root or not sroot:
                raise InputError("this node has no images: start the SuperNode with --node-config "
                                 "'data-dir=\"…\" state-dir=\"…\"', or (simulation) set run config "
                                 "'data-root' (one sub-folder of images per node) and 'state-root'")
            folders = sorted(p for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []
            if not 0 <= int(pid) < len(folders):
                raise InputError(f"simulation node {pid}: data-root {root} has {len(folders)} image sub-folders; "
                                 "it needs one per node (num-supernodes)")
            data = data if data is not None else str(folders[int(pid)])
            state = state if state is not None else str(Path(sroot) / f"node-{int(pid)}")
        xi = node_cfg.get("xi") or _get(run_cfg, "xi", str)
        if uses_fedfs(method) and not xi:
            raise InputError(f"method {method!r} trains against the frozen ξ: set run config 'xi' (or the node's "
                             "--node-config 'xi=\"…\"') to ξ's fedfs checkpoint")
        threads = _get(run_cfg, "torch-threads", int)
        return cls(Path(str(data)), Path(str(state)), Path(str(xi)) if xi else None, threads,
                   _get(run_cfg, "detect-face", bool))


def parse_train(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``train``: a JSON object of fedfs's round-task training settings (``{}`` = defaults)."""
    raw = _get(cfg, "train", str)
    try:
        train = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise InputError(f"run config 'train' is not valid JSON ({e}): give an object such as "
                         "'{\"lr\": 0.02, \"local_epochs\": 1}'") from None
    if not isinstance(train, dict):
        raise InputError(f"run config 'train' must be a JSON object, got {type(train).__name__}")
    return train


__all__ = ["RUN_DEFAULTS", "NODE_KEYS", "ServerSettings", "NodeSettings", "parse_train"]
