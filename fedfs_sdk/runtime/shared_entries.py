"""A thread-safe, bounded store whose entries are computed once, for the devices of one process.

The devices a process hosts (the deployment rehearsal, a test bench) ask for the same public results
at once — a public model's outputs on the public impostor set
(:class:`~fedfs_sdk.runtime.impostor_outputs.PublicOutputs`), ξ's trunk features of that set
(:class:`~fedfs_sdk.federation.public_trunk.PublicTrunk`). :meth:`SharedEntries.entry` computes a
missing entry once — the others asking for the same key wait for it, other keys go on — and keeps the
``max_entries`` most recently used.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable


class SharedEntries:
    """Entries by key, computed once per key (see the module); ``hits`` / ``misses`` count lookups."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = int(max_entries)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._computing: dict[Hashable, threading.Lock] = {}
        self.hits = self.misses = 0

    def entry(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The entry for ``key``, ``compute()`` on a miss."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            gate = self._computing.setdefault(key, threading.Lock())
        with gate:                                   # one computes, the others wait for it
            with self._lock:
                if key in self._entries:
                    self.hits += 1
                    return self._entries[key]
            out = compute()
            with self._lock:
                self.misses += 1
                self._entries[key] = out
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
                self._computing.pop(key, None)
            return out

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


__all__ = ["SharedEntries"]
