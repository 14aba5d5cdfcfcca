"""``fedfs bench``: simulator throughput of the sequential vs batched executors
(client-updates/s, peak memory, winner per device). See :mod:`device_sim.throughput`."""
from __future__ import annotations

import argparse
import json

from .throughput import add_arguments as _add, config_from_args, devices_from_arg, format_table, run_benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add(p)


def run(args: argparse.Namespace) -> int:
    result = run_benchmark(config_from_args(args), devices_from_arg(args.device), tuple(args.executors))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all("error" not in r for r in result["rows"]) else 1


def main(argv: list[str] | None = None) -> int:
    """``benchmarks/sim_throughput.py``: the same as ``fedfs bench``."""
    p = argparse.ArgumentParser(description="Simulator throughput: sequential vs batched executors")
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["add_arguments", "main", "run"]
