"""Simulator throughput: client-updates/s and peak memory of the sequential and batched
executors on CPU (and CUDA where available), with the winner per device.

    PYTHONPATH=. python benchmarks/sim_throughput.py --device all --clients 32
    PYTHONPATH=. python benchmarks/sim_throughput.py --device cuda --backbone mobilefacenet --clients 256 --amp bf16

Same as ``fedfs bench``; the implementation is :mod:`device_sim.throughput`
(measurement) and :mod:`device_sim.cli_bench` (printing).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_sim.cli_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
