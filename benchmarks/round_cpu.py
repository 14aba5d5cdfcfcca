"""Rounds in CPU seconds: run ``fedfs simulate`` or ``benchmarks/peer_pfl.py`` with the round clock
reading ``time.process_time`` (this process's CPU over all its threads) instead of
``time.perf_counter`` (issue 32). The ``seconds`` a run records per round — fedfs's
``results.json`` history, peer_pfl's ``result.json`` rates — then count CPU, not wall time: on a
shared machine the figure that does not depend on other people's load. One process only.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/round_cpu.py device_sim.federation simulate \\
        --method fedfs:select=off ... --threads 1 --out OUT
    PYTHONPATH=. OMP_NUM_THREADS=1 /tmp/pflvenv/bin/python benchmarks/round_cpu.py benchmarks/peer_pfl.py \\
        --clients 50 ... --out OUT
"""
from __future__ import annotations

import importlib
import sys
import time
import types


def _cpu_clock() -> types.SimpleNamespace:
    shim = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    shim.perf_counter = time.process_time
    return shim


def main() -> None:
    target, rest = sys.argv[1], sys.argv[2:]
    if target.endswith(".py"):          # a script (peer_pfl.py): its main's module globals get the clock
        import runpy

        sys.path.insert(0, target.rsplit("/", 1)[0])
        sys.argv = [target, *rest]
        g = runpy.run_path(target, run_name="round_cpu")
        g["main"].__globals__["time"] = _cpu_clock()
        g["main"]()
    else:                               # a module of fedfs (device_sim.federation): the CLI runs it
        importlib.import_module(target).time = _cpu_clock()
        sys.argv = ["fedfs", *rest]
        from fedfs_sdk.cli.main import main as cli

        cli()


if __name__ == "__main__":
    main()
