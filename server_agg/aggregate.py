"""Weighted FedAvg: ``w ← Σ_c |D_c| · w_c / Σ_c |D_c|`` (FedFS Eq. 1; FedUV Alg. 1, server step).

Two entry points share one definition of the average:

* :class:`StreamingFedAvg` / :func:`fedavg` — updates arrive one at a time (the HTTP server,
  a sequential simulator). Running sums are kept in float64, so memory is O(model) however
  many clients report, and the result does not depend on float32 rounding of partial sums.
* :func:`fedavg_stacked` — all ``K`` client models are already stacked on one device (the
  batched CUDA simulator): one weighted reduction per key.

Keys and shapes are checked exactly; a mismatching update raises :class:`InputError` and
leaves the accumulator untouched. Results are cast back to the reference dtypes (integer
buffers are rounded, boolean ones take the weighted majority).
"""
from __future__ import annotations

import operator
from typing import Iterable, Mapping

import torch

from fedfs_sdk.errors import InputError

Weights = dict[str, torch.Tensor]

_STACK_CHUNK = 1 << 25
"""Largest float64 temporary (elements, 256 MiB) :func:`fedavg_stacked` makes per step."""

__all__ = ["StreamingFedAvg", "fedavg", "fedavg_stacked", "check_num_samples"]


def check_num_samples(num_samples: object) -> int:
    """``|D_c|`` as a positive Python int (rejects bools, floats, zero and negatives)."""
    if isinstance(num_samples, bool):
        raise InputError(f"num_samples must be a positive integer, got {num_samples!r}")
    try:
        n = operator.index(num_samples)  # int, numpy integer, 0-d integer tensor
    except TypeError:
        raise InputError(f"num_samples must be a positive integer, got {num_samples!r}") from None
    if n <= 0:
        raise InputError(f"num_samples must be > 0, got {n}")
    return int(n)


def _cast_back(avg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return avg.to(dtype)
    if dtype == torch.bool:
        return avg >= 0.5
    return torch.round(avg).to(dtype)


class StreamingFedAvg:
    """Accumulates ``Σ |D_c| w_c`` and ``Σ |D_c|`` one client at a time.

    Args:
        reference: a state dict fixing the expected keys, shapes and output dtypes (the
            current global model). Without it, the first update fixes them.

    Attributes:
        count: number of updates added.
        total_samples: ``Σ |D_c|`` over the added updates.
    """

    def __init__(self, reference: Mapping[str, torch.Tensor] | None = None) -> None:
        self._shapes: dict[str, torch.Size] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.total_samples = 0
        if reference is not None:
            self._fix_layout(reference)

    def _fix_layout(self, ref: Mapping[str, torch.Tensor]) -> None:
        if not ref:
            raise InputError("a state dict to average must have at least one tensor")
        for k, t in ref.items():
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
        self._shapes = {k: t.shape for k, t in ref.items()}
        self._dtypes = {k: t.dtype for k, t in ref.items()}
        self._sums = {k: torch.zeros(t.shape, dtype=torch.float64, device=t.device) for k, t in ref.items()}

    @property
    def keys(self) -> list[str]:
        """The expected keys (empty before the layout is fixed)."""
        return list(self._shapes or {})

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`InputError` if ``weights`` does not match the layout (no state change)."""
        if self._shapes is None:
            return
        missing = sorted(set(self._shapes) - set(weights))
        unexpected = sorted(set(weights) - set(self._shapes))
        if missing or unexpected:
            raise InputError(f"update keys differ from the model: missing {missing[:5]}"
                             f"{'…' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{'…' if len(unexpected) > 5 else ''}")
        for k, shape in self._shapes.items():
            t = weights[k]
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
            if t.shape != shape:
                raise InputError(f"{k}: shape {list(t.shape)} differs from the model's {list(shape)}")

    def add(self, weights: Mapping[str, torch.Tensor], num_samples: int) -> None:
        """Add one client's weights ``w_c`` with weight ``|D_c|`` (validated before any change)."""
        n = check_num_samples(num_samples)
        if self._shapes is None:
            self._fix_layout(weights)
        else:
            self.check(weights)
        for k, s in self._sums.items():
            # In-place add with type promotion: computed in float64, no float64 copy of w_c.
            s.add_(weights[k].detach().to(device=s.device), alpha=n)
        self.count += 1
        self.total_samples += n

    def result(self) -> Weights:
        """``Σ |D_c| w_c / Σ |D_c|`` cast to the reference dtypes (a new dict; state kept)."""
        if self.count == 0:
            raise InputError("cannot average zero updates")
        total = float(self.total_samples)
        return {k: _cast_back(s / total, self._dtypes[k]) for k, s in self._sums.items()}


def fedavg(updates: Iterable[tuple[Mapping[str, torch.Tensor], int]],
           reference: Mapping[str, torch.Tensor] | None = None) -> Weights:
    """Weighted FedAvg of ``(weights, num_samples)`` pairs (FedFS Eq. 1), streaming.

    ``updates`` may be a generator (e.g. reading update files one by one): only one client
    model and the float64 sums are in memory at a time.
    """
    acc = StreamingFedAvg(reference)
    for weights, n in updates:
        acc.add(weights, n)
    return acc.result()


def fedavg_stacked(stacked: Mapping[str, torch.Tensor], num_samples: torch.Tensor | Iterable[int],
                   reference: Mapping[str, torch.Tensor] | None = None) -> Weights:
    """Weighted FedAvg of ``K`` client models stacked along dim 0 (``[K, *shape]`` per key).

    Works on any device (CUDA included: the reduction runs where the tensors are). The
    weights ``|D_c| / Σ|D_c|`` and the reduction are float64; results take each key's
    input dtype (or ``reference``'s, whose keys/shapes are then checked too).
    """
    if not stacked:
        raise InputError("stacked state dict is empty")
    n = torch.as_tensor(num_samples)
    if n.dim() != 1 or n.numel() == 0:
        raise InputError(f"num_samples must be a non-empty 1-D tensor, got shape {list(n.shape)}")
    if n.dtype.is_floating_point:
        if not torch.equal(n, torch.round(n)):
            raise InputError("num_samples must be integers")
    elif n.dtype == torch.bool or n.dtype.is_complex:
        raise InputError(f"num_samples must be integers, got dtype {n.dtype}")
    if not bool((n > 0).all()):
        raise InputError("every num_samples must be > 0")
    k_clients = n.numel()
    for k, t in stacked.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != k_clients:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{k}: expected a [{k_clients}, ...] stacked tensor, got {shape}")
    if reference is not None:
        missing = sorted(set(reference) - set(stacked))
        unexpected = sorted(set(stacked) - set(reference))
        if missing or unexpected:
            raise InputError(f"stacked keys differ from the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for k, ref in reference.items():
            if stacked[k].shape[1:] != ref.shape:
                raise InputError(f"{k}: per-client shape {list(stacked[k].shape[1:])} differs from the model's {list(ref.shape)}")
    out: Weights = {}
    w_cache: dict[torch.device, torch.Tensor] = {}
    for k, t in stacked.items():
        dtype = reference[k].dtype if reference is not None else t.dtype
        if k_clients > 1 and t.stride(0) == 0:
            # one tensor broadcast to every client (a frozen trunk the clients share): its weighted
            # average is itself (Σ w = 1); a float64 pass over K views would only round back to it
            out[k] = t[0].detach().to(dtype).clone()
            continue
        w = w_cache.get(t.device)
        if w is None:
            nd = n.to(device=t.device, dtype=torch.float64)
            w = w_cache[t.device] = nd / nd.sum()
        # float64 in slices of clients: the temporary copy stays ≤ _STACK_CHUNK elements
        # however large K × model is (10k clients on one GPU).
        per_client = max(1, t[0].numel())
        step = max(1, _STACK_CHUNK // per_client)
        avg = torch.zeros(t.shape[1:], dtype=torch.float64, device=t.device)
        for i in range(0, k_clients, step):
            avg += torch.tensordot(w[i:i + step], t[i:i + step].detach().to(torch.float64), dims=1)
        out[k] = _cast_back(avg, dtype)
    return out
