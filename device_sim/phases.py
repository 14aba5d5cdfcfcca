"""Wall time per phase of the round loop (data, ξ, training, FedAvg, client store, …).

The federation wraps each phase of a round in ``with timer("train"):``; the times add up over
the run. Work on a GPU is asynchronous, so a phase's time is only its own when the training stream is
synchronized at its edges: ``PhaseTimer(sync=device)`` does that (``benchmarks/gpu_paper_scale.py``),
the default does not (no stalls in normal runs, and the times then say where the host waited).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


class PhaseTimer:
    """Seconds and entries per phase name; :attr:`current` is the innermost open phase."""

    def __init__(self, sync: torch.device | str | None = None) -> None:
        self.sync = torch.device(sync) if sync is not None else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.entries: dict[str, int] = defaultdict(int)
        self._stack: list[str] = []

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def _barrier(self) -> None:
        # the current stream only: a device-wide synchronize would also wait for the next chunk's
        # images being prepared on the prefetch side stream and undo the overlap being measured
        if self.sync is not None and self.sync.type == "cuda":
            torch.cuda.current_stream(self.sync).synchronize()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._barrier()
        t0 = time.perf_counter()
        self._stack.append(name)
        try:
            yield
        finally:
            self._barrier()
            self._stack.pop()
            self.seconds[name] += time.perf_counter() - t0
            self.entries[name] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.entries.clear()


class UtilizationSampler:
    """Samples the GPU's busy share (``torch.cuda.utilization``: the share of the last sample
    period in which a kernel ran, from NVML) every ``period`` seconds in a thread, filed under
    the phase open at that moment (``phase()``)."""

    def __init__(self, device: torch.device, phase: Callable[[], str | None], period: float = 0.1) -> None:
        self.device, self.phase, self.period = device, phase, period
        self.samples: dict[str, list[int]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: str | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                u = int(torch.cuda.utilization(self.device))
            except Exception as e:  # no NVML (pynvml missing): report it once instead of a figure
                self.error = f"{type(e).__name__}: {e}"
                return
            self.samples[self.phase() or "other"].append(u)

    def __enter__(self) -> "UtilizationSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self, phase: str) -> float | None:
        s = self.samples.get(phase)
        return sum(s) / len(s) if s else None
