"""The clients' images as uint8, produced once and gathered per chunk (``--data-cache``).

A federation trains each participant on the same images every round, and evaluates on the
same test images every time; rendering (SynthFaces) or decoding (folders) them again each
time kept a GPU waiting on the CPU. :class:`ClientImageStore` produces each image once — on
the training device, in the renderer's large chunks — and keeps it as uint8 ``[3, S, S]``
(exact: see :mod:`device_sim.image_cache`), where the plan says:

* ``device`` — in GPU memory, reserved when the store is made (so the executor's chunk
  calibration sees what is left); a chunk is gathered on the GPU, no copy;
* ``host`` — in host RAM (page-locked when training on CUDA), allocated in 256 MiB pages
  as clients are first used; a chunk is gathered into a pinned buffer and copied to the
  GPU asynchronously;
* ``none`` — nothing kept: every request renders / decodes its images again, on the
  training device.

The memory each costs, for ``N`` clients with ``n`` images (train + test + warm-up) of side
``S``: ``N·n·3·S²`` bytes — 25.2 GB for the FedFS setting (10,000 × 67 at 112 px), 0.92 GB
for 10,000 × 30 at 32 px — on the GPU (``device``) or in RAM (``host``), nothing for
``none``; plus, whatever the choice, a chunk's uint8 images on the GPU (two chunks while
the next is prefetched: ``2·K·n_train·3·S²``, 1.1 GB for K = 256 clients of 57 at 112 px).
:func:`plan_data_cache` decides ``auto``: ``device`` when the store takes at most
:data:`DEVICE_SHARE` of the GPU's free memory, else ``host`` when it takes at most
:data:`HOST_SHARE` of the available RAM, else ``none`` — and says which and why.
"""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .datasets import IdentityDataset
from .splits import UserSplit

__all__ = ["ClientImageStore", "CachePlan", "plan_data_cache", "DATA_CACHE_CHOICES", "PARTS",
           "DEVICE_SHARE", "HOST_SHARE", "EXPLICIT_SHARE"]

PARTS = ("train", "test", "warmup")
DATA_CACHE_CHOICES = ("auto", "device", "host", "none")
DEVICE_SHARE = 0.25
"""``auto`` keeps the store on the GPU when it takes at most this share of the free GPU
memory. Not more: every GB the store holds is a GB less for training chunks (~1 GB per
MobileFaceNet client at 112 px), while ``host`` costs one asynchronous copy per chunk
(0.55 GB for 256 clients × 57 images at 112 px), which the prefetch overlaps with training."""
HOST_SHARE = 0.5
"""``auto`` keeps the store in host RAM when it takes at most this share of the available RAM
(the client store of θ_c, ξ and the process need the rest)."""
EXPLICIT_SHARE = 0.9
"""An explicit ``--data-cache device|host`` is refused when the store exceeds this share of
the free memory it goes to."""
PAGE_BYTES = 256 << 20


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


@dataclass(frozen=True)
class CachePlan:
    """Where the clients' images are kept, and why (``reason`` is one line for the user)."""

    location: str          # device | host | none
    device: str            # the training device: images are produced and delivered there
    pinned: bool           # host pages page-locked (training on CUDA)
    full_bytes: int        # the store once every client's images are in
    free_bytes: int | None  # the free memory the decision compared with
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_host_bytes() -> int:
    """RAM the kernel reports available (``MemAvailable``), else physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_data_cache(choice: str, full_bytes: int, device: str | torch.device,
                    free_device: int | None = None, free_host: int | None = None) -> CachePlan:
    """Decide where a store of ``full_bytes`` goes for training on ``device``.

    ``choice``: ``auto`` (device ≤ :data:`DEVICE_SHARE` of the free GPU memory, else host ≤
    :data:`HOST_SHARE` of the available RAM, else none), ``device`` / ``host`` (refused with
    an :class:`InputError` when over :data:`EXPLICIT_SHARE` of the free memory), ``none``.
    On a CPU device, ``device`` and ``host`` are the same RAM. ``free_device`` /
    ``free_host`` override the measured free memory (tests).
    """
    if choice not in DATA_CACHE_CHOICES:
        raise InputError(f"--data-cache must be one of {', '.join(DATA_CACHE_CHOICES)}, got {choice!r}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    size = f"the clients' images take {_gb(full_bytes)} as uint8"
    if choice == "none":
        return CachePlan("none", str(dev), False, full_bytes, None,
                         f"--data-cache none: {size}; nothing is kept, every chunk renders/decodes its images on {dev}")
    if cuda and choice in ("auto", "device"):
        free = int(torch.cuda.mem_get_info(dev)[0]) if free_device is None else int(free_device)
        share = DEVICE_SHARE if choice == "auto" else EXPLICIT_SHARE
        if full_bytes <= share * free:
            return CachePlan("device", str(dev), False, full_bytes, free,
                             f"--data-cache {choice}: {size}, ≤ {share:.0%} of the GPU's free {_gb(free)}: kept on {dev}")
        if choice == "device":
            raise InputError(f"--data-cache device: {size}, more than {share:.0%} of the GPU's free {_gb(free)}; "
                             f"use --data-cache host (page-locked RAM) or auto, or fewer clients / images / pixels")
        why_not_device = f"more than {share:.0%} of the GPU's free {_gb(free)}"
    else:
        why_not_device = ""
    host = available_host_bytes() if free_host is None else int(free_host)
    share = HOST_SHARE if choice == "auto" else EXPLICIT_SHARE
    where = "page-locked host RAM" if cuda else "RAM"
    if full_bytes <= share * host:
        lead = f"{size} ({why_not_device})" if why_not_device else size
        return CachePlan("host", str(dev), cuda, full_bytes, host,
                         f"--data-cache {choice}: {lead}, ≤ {share:.0%} of the available {_gb(host)}: kept in {where}")
    if choice != "auto":
        raise InputError(f"--data-cache {choice}: {size}, more than {share:.0%} of the available RAM "
                         f"({_gb(host)}); use --data-cache none (render/decode each chunk again) or auto")
    return CachePlan("none", str(dev), False, full_bytes, host,
                     f"--data-cache auto: {size}, more than {HOST_SHARE:.0%} of the available RAM ({_gb(host)})"
                     + (f" and {why_not_device}" if why_not_device else "")
                     + f": nothing kept, every chunk renders/decodes its images on {dev} (--data-cache none)")


class ClientImageStore:
    """The uint8 images of a population's clients (``users[c]`` is client ``c``), kept per
    :class:`CachePlan`. Thread-safe: the round loop's prefetch thread and the evaluation
    share it.

    Each (client, part) gets a run of rows the first time it is asked for; each image is
    produced (``dataset.batch_uint8`` on the plan's device, ``cache=False``) the first time
    it is asked for and never again. Rows live in pages of :data:`PAGE_BYTES`.
    """

    def __init__(self, dataset: IdentityDataset, users: Sequence[UserSplit], plan: CachePlan,
                 page_bytes: int = PAGE_BYTES) -> None:
        self.dataset, self.plan = dataset, plan
        self.device = torch.device(plan.device)
        S = int(dataset.image_size)
        self.image_size = S
        self.row_bytes = 3 * S * S
        n = len(users)
        self.identity = np.array([u.identity for u in users], dtype=np.int64)
        self.lens = np.array([[u.train.size, u.test.size, u.warmup.size] for u in users], dtype=np.int64).reshape(n, 3)
        flat = self.lens.ravel()
        self.base = (np.cumsum(flat) - flat).reshape(n, 3)      # global position of each (client, part)
        parts = [np.asarray(a, dtype=np.int64) for u in users for a in (u.train, u.test, u.warmup)]
        self.index = np.concatenate(parts) if parts else np.zeros(0, np.int64)   # dataset index per position
        self.total = int(flat.sum())
        self.full_bytes = self.total * self.row_bytes
        self.filled = np.zeros(self.total, dtype=bool)
        self.slot_row = np.full((n, 3), -1, dtype=np.int64)
        self.next_row = 0
        self.page_rows = max(1, min(int(page_bytes) // self.row_bytes, self.total))   # a small store: one page
        self.pages: list[torch.Tensor] = []
        self.hold = None if plan.location == "none" else (self.device if plan.location == "device" else torch.device("cpu"))
        self.produced = 0
        """Images rendered / decoded through the store."""
        self._lock = threading.Lock()
        if plan.location == "device":
            self._grow(self.total)      # reserved now, so chunk calibration sees the memory that is left

    @property
    def allocated_bytes(self) -> int:
        return len(self.pages) * self.page_rows * self.row_bytes

    def stats(self) -> dict[str, Any]:
        return {"location": self.plan.location, "full_bytes": self.full_bytes, "allocated_bytes": self.allocated_bytes,
                "images_kept": int(self.filled.sum()), "images_produced": self.produced}

    def images(self, clients: Sequence[int] | np.ndarray, part: str = "train",
               positions: Sequence[np.ndarray] | None = None,
               device: str | torch.device | None = None) -> tuple[torch.Tensor, list[int]]:
        """uint8 ``[Σ n_i, 3, S, S]`` on ``device`` (default: the plan's) and the counts ``n_i``:
        the ``part`` images of each of ``clients`` in order (``positions[i]``: only those of
        client ``i``'s part, by position)."""
        if part not in PARTS:
            raise InputError(f"part must be one of {PARTS}, got {part!r}")
        p = PARTS.index(part)
        cl = np.asarray(clients, dtype=np.int64).reshape(-1)
        if cl.size and (cl.min() < 0 or cl.max() >= len(self.identity)):
            raise InputError(f"unknown client in {cl.tolist()[:10]} (there are {len(self.identity)})")
        pos_list = [np.arange(self.lens[c, p]) for c in cl] if positions is None else \
            [np.asarray(x, dtype=np.int64).reshape(-1) for x in positions]
        if len(pos_list) != cl.size:
            raise InputError(f"{len(pos_list)} position lists for {cl.size} clients")
        counts = [int(x.size) for x in pos_list]
        who = np.repeat(cl, counts)
        pos = np.concatenate(pos_list) if pos_list else np.zeros(0, np.int64)
        if pos.size and ((pos < 0) | (pos >= self.lens[who, p])).any():
            raise InputError(f"image position out of range for a client's {part} images")
        dev = self.device if device is None else torch.device(device)
        gpos = self.base[who, p] + pos
        if self.hold is None:
            return self._produce(who, gpos).to(dev), counts
        with self._lock:
            self._fill(who, p, pos, gpos)
            return self._gather(self.slot_row[who, p] + pos, dev), counts

    # -- internals --------------------------------------------------------------------------
    def _produce(self, who: np.ndarray, gpos: np.ndarray) -> torch.Tensor:
        ids, idx = self.identity[who], self.index[gpos]
        self.produced += int(ids.size)
        fn = getattr(self.dataset, "batch_uint8", None)
        if fn is not None:
            return fn(ids, idx, device=self.device, cache=False)
        x = self.dataset.batch(ids, idx)         # a dataset without uint8 output: quantize back (exact)
        return torch.round(x * 127.5 + 127.5).to(torch.uint8).to(self.device)

    def _fill(self, who: np.ndarray, p: int, pos: np.ndarray, gpos: np.ndarray) -> None:
        for c in np.unique(who[self.slot_row[who, p] < 0]).tolist():
            self.slot_row[c, p] = self.next_row
            self.next_row += int(self.lens[c, p])
        self._grow(self.next_row)
        miss = ~self.filled[gpos]
        if not miss.any():
            return
        mg, first = np.unique(gpos[miss], return_index=True)
        mc, mp = who[miss][first], pos[miss][first]
        data = self._produce(mc, mg)
        if data.device != self.hold:
            data = data.to(self.hold)
        rows = self.slot_row[mc, p] + mp
        for k, sel in self._by_page(rows):
            self.pages[k].index_copy_(0, torch.as_tensor(rows[sel] % self.page_rows, device=self.hold),
                                      data[torch.as_tensor(sel, device=data.device)])
        self.filled[mg] = True

    def _gather(self, rows: np.ndarray, dev: torch.device) -> torch.Tensor:
        S = self.image_size
        staged = self.hold.type == "cpu" and dev.type == "cuda"
        out = torch.empty((rows.size, 3, S, S), dtype=torch.uint8, device=self.hold, pin_memory=staged)
        for k, sel in self._by_page(rows):
            src = torch.as_tensor(rows[sel] % self.page_rows, device=self.hold)
            out.index_copy_(0, torch.as_tensor(sel, device=self.hold), self.pages[k].index_select(0, src))
        return out.to(dev, non_blocking=staged) if out.device != dev else out

    def _by_page(self, rows: np.ndarray):
        page = rows // self.page_rows
        for k in np.unique(page).tolist():
            yield k, np.flatnonzero(page == k)

    def _grow(self, rows: int) -> None:
        S = self.image_size
        pin = self.plan.pinned and self.hold.type == "cpu"
        while len(self.pages) * self.page_rows < rows:
            self.pages.append(torch.empty((self.page_rows, 3, S, S), dtype=torch.uint8, device=self.hold, pin_memory=pin))
