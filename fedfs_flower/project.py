"""The Flower App project (``pyproject.toml``) that ``flwr run`` builds into a FAB and submits
to a SuperLink.

The FAB holds only this file: the ServerApp and ClientApp are ``fedfs_flower.server_app:app``
and ``fedfs_flower.client_app:app`` from the installed fedfs (``pip install 'fedfs[flower]'``
on the SuperLink's and every SuperNode's machine). ``[tool.flwr.app.config]`` lists every
run-config key (:data:`fedfs_flower.settings.RUN_DEFAULTS`) so ``flwr run --run-config`` can
override any of them. Usage: ``python -m fedfs_flower.project DIR [key=value …]``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedfs_sdk.errors import InputError

from .settings import RUN_DEFAULTS

APP_NAME = "fedfs-flower"
PUBLISHER = "fedfs"
FLWR_REQUIREMENT = "flwr[simulation]==1.41.0"


def _toml_value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)        # a JSON string is a valid TOML basic string (\" \\ \uXXXX escapes)
    raise InputError(f"run config {key!r}: Flower takes int, float, str or bool values, got {type(v).__name__}")


def pyproject_text(run_config: Mapping[str, Any] | None = None) -> str:
    """The project's ``pyproject.toml``: components, and the run config over the defaults."""
    cfg = {**RUN_DEFAULTS, **dict(run_config or {})}
    unknown = sorted(set(cfg) - set(RUN_DEFAULTS))
    if unknown:
        raise InputError(f"unknown run config keys {unknown}; known: {sorted(RUN_DEFAULTS)}")
    lines = [
        "[build-system]", 'requires = ["setuptools>=77"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", f'name = "{APP_NAME}"', 'version = "1.0.0"',
        'description = "fedfs methods (FedFS, FedUV, FedFS+FedUV) on Flower"', 'license = "Apache-2.0"',
        # fedfs itself is not listed: it must already be installed where the apps run (a
        # runtime `uv sync` would fetch whatever the index calls "fedfs"); see docs/flower.md.
        f'dependencies = ["{FLWR_REQUIREMENT}"]', "",
        "[tool.flwr.app]", f'publisher = "{PUBLISHER}"', "",
        "[tool.flwr.app.components]", 'serverapp = "fedfs_flower.server_app:app"',
        'clientapp = "fedfs_flower.client_app:app"', "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{k} = {_toml_value(k, v)}" for k, v in cfg.items()]
    return "\n".join(lines) + "\n"


def write_app(folder: str | Path, run_config: Mapping[str, Any] | None = None) -> Path:
    """Write the project into ``folder`` (created); returns the ``pyproject.toml`` path."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    p = d / "pyproject.toml"
    p.write_text(pyproject_text(run_config), encoding="utf-8")
    return p


def _parse_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, raw = item.partition("=")
        if not sep or key not in RUN_DEFAULTS:
            raise InputError(f"{item!r}: expected key=value with a key among {sorted(RUN_DEFAULTS)}")
        default = RUN_DEFAULTS[key]
        try:
            out[key] = (raw.lower() in ("1", "true", "yes") if isinstance(default, bool) else
                        int(raw) if isinstance(default, int) else float(raw) if isinstance(default, float) else raw)
        except ValueError:
            raise InputError(f"{key}: {raw!r} is not a {type(default).__name__}") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(f"usage: python -m fedfs_flower.project DIR [key=value ...]\nkeys: {sorted(RUN_DEFAULTS)}\n")
        return 0 if args else 2
    try:
        path = write_app(args[0], _parse_pairs(args[1:]))
    except InputError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["APP_NAME", "PUBLISHER", "FLWR_REQUIREMENT", "pyproject_text", "write_app", "main"]
