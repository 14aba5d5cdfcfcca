"""The client-folded trunk through ``torch.compile`` (issue 32 item 1), with an eager fallback
that says why.

The folded trunk (:mod:`.folding`) spends its time in memory-bound layers — group norm, PReLU,
per-channel affines, depthwise convolutions — each a separate kernel that reads and writes the
whole activation. Inductor fuses the per-element layers into their neighbours (norm statistics +
affine + activation in one pass) and, on CUDA, emits Triton kernels for them; convolutions stay
cuDNN/oneDNN calls. Forward and backward are both compiled (AOTAutograd), so
``torch.autograd.grad`` through the compiled forward runs the compiled backward.

Compilation happens at the first call of each input shape (a round's chunks share one shape; its
last, smaller chunk has another). :class:`TrunkCall` times each first call apart (``compile_s``:
forward + backward on the chunk's real batch, compilation included), so a benchmark can report
training throughput without it. If compilation fails (no C++ compiler, no
Triton, an unsupported op), the call falls back to eager for the rest of the run and ``note``
says why — the updates are the same within the bound tests/test_sim_executor_compile.py asserts.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Callable

import torch

from fedfs_sdk.errors import InputError

from .folding import folded_call

COMPILE_MODES = ("auto", "on", "off")


def compile_choice(mode: str, device: torch.device) -> tuple[bool, str]:
    """Whether to compile the folded trunk, and why.

    ``auto``: on CUDA where Triton is installed (the fused kernels are what the GPU lacks: the
    eager profile is dominated by memory-bound norm/activation layers, docs/simulation.md); off on
    CPU, where inductor's C++ build of a MobileFaceNet's forward and backward takes minutes — more
    than a CPU run's training — and oneDNN's convolutions already dominate a step.
    """
    if mode not in COMPILE_MODES:
        raise InputError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "off":
        return False, "compile=off"
    if mode == "on":
        return True, "compile=on"
    if device.type != "cuda":
        return False, "compile=auto: eager on CPU (inductor's C++ build costs minutes; pass compile=on to force)"
    if importlib.util.find_spec("triton") is None:
        return False, "compile=auto: eager (Triton is not installed)"
    return True, "compile=auto: inductor on CUDA"


class TrunkCall:
    """``(params, x) → [K, B, D]``: the folded trunk, compiled at the first call when asked.

    Args:
        folded: the client-folded backbone (:func:`.folding.fold_module`).
        channels_last: NHWC input layout (as :func:`.folding.folded_call`).
        compile: whether to compile (see :func:`compile_choice`).
        options: extra ``torch.compile`` keyword arguments (e.g. ``mode="max-autotune-no-cudagraphs"``).
    """

    def __init__(self, folded: torch.nn.Module, channels_last: bool = False, compile: bool = False,
                 **options) -> None:
        self.folded, self.channels_last = folded, bool(channels_last)
        self.compiled = bool(compile)
        self.compile_s = 0.0
        """Seconds of the first compiled forward + backward (compilation included)."""
        self.note = "eager"
        self._fn: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] = self._eager
        self._seen: set[tuple] = set()
        if self.compiled:
            # dynamic=False: a chunk's shapes are fixed for its steps; the last, smaller chunk of a
            # round recompiles once rather than every chunk paying for symbolic shapes
            self._fn = torch.compile(self._eager, dynamic=False, **options)
            self.note = "compiled (inductor)"

    def _eager(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return folded_call(self.folded, params, x, self.channels_last)

    eager = _eager
    """The uncompiled call (the memory probe uses it: see BatchedExecutor.calibrate)."""

    def __call__(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, torch.is_autocast_enabled(x.device.type))
        if self.compiled and key not in self._seen:
            self._seen.add(key)
            self._warm_up(params, x)
        return self._fn(params, x)

    def _warm_up(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> None:
        """Compile forward and backward for this shape, timed apart; fall back to eager on failure."""
        leaves = [p for p in params.values() if p.requires_grad]
        t0 = time.perf_counter()
        try:
            out = self._fn(params, x)
            if leaves and out.requires_grad:
                torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
        except Exception as e:  # noqa: BLE001 — any compiler failure: the eager path computes the same
            self._fn, self.compiled = self._eager, False
            self.note = f"compile failed ({_reason(e)}): eager"
        self.compile_s += time.perf_counter() - t0


def _reason(e: BaseException) -> str:
    """One line: the wrapper's type and the root cause (dynamo wraps a backend's error in
    ``BackendCompilerFailed`` whose own first line names only the backend)."""
    root = e
    while (getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = getattr(root, "inner_exception", None) or root.__cause__
    msg = next((ln.strip() for ln in str(root).splitlines() if ln.strip()), "")[:200]
    return type(e).__name__ + (f" ← {type(root).__name__}: {msg}" if root is not e else f": {msg}")


__all__ = ["COMPILE_MODES", "TrunkCall", "compile_choice"]
