"""A round's chunks of participants, each handed out with its training images — the next
chunk's images prepared while the current chunk trains.

:class:`ChunkFeed` is the one place where the round loop's participants are cut into
chunks: chunk ``k + 1`` is cut (at the executor's chunk size at that moment) when chunk
``k`` is handed out, with or without prefetching, so both give the same chunks and the same
results. With prefetching, chunk ``k + 1``'s images are then prepared by one background
thread — ``data.train_chunk`` (a gather from the image store, or a render / decode) —
while chunk ``k`` trains. On CUDA that thread works on a side stream:

* it first waits for an event recorded on the training stream when the job was handed to
  it (so it sees every earlier write, e.g. an evaluation's fills of the store), not for the
  chunk that is about to train;
* the training stream waits for the event the thread records when the images are ready,
  and each image tensor is ``record_stream``-ed on the training stream, so the caching
  allocator does not give its memory back to the side stream while training still reads it.

If the executor's chunk size shrinks after a chunk was cut (calibration, an out-of-memory
split), the prepared chunk is handed out in pieces of the new size; no image is prepared
twice.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterator

import numpy as np
import torch

from fedfs_sdk.errors import InputError

__all__ = ["ChunkFeed", "PREFETCH_MODES", "prefetch_enabled", "chunk_images"]

PREFETCH_MODES = ("auto", "on", "off")


def prefetch_enabled(mode: str, device: str | torch.device) -> bool:
    """``auto``: prefetch on CUDA (the GPU must not wait for data); off on CPU, where a second
    thread would compete with training for the same cores."""
    if mode not in PREFETCH_MODES:
        raise InputError(f"prefetch must be one of {', '.join(PREFETCH_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def chunk_images(data: Any, clients: np.ndarray, device: str | torch.device) -> list[torch.Tensor]:
    """The training images of ``clients`` on ``device``, one tensor per client: from
    ``data.train_chunk`` (uint8, all at once) where the data have it, else
    ``data.train_images`` per client. :class:`~device_sim.executors.ClientTask` takes either."""
    fn = getattr(data, "train_chunk", None)
    if callable(fn):
        return list(fn(clients, device))
    return [data.train_images(int(c), device) for c in np.asarray(clients).tolist()]


class _Ready:
    """A chunk's images prepared without the background thread (or split off a prepared chunk)."""

    def __init__(self, fn: Callable[[], Any] | None = None, value: Any = None) -> None:
        self.fn, self.value = fn, value

    def result(self) -> Any:
        if self.fn is not None:
            self.value, self.fn = self.fn(), None
        return self.value


class ChunkFeed:
    """Iterate ``(chunk, images)``: ``chunk`` an int64 array of clients, ``images`` their
    training images (one tensor per client, uint8 or float32) on ``device``.

    Args:
        data: the clients' data — ``train_chunk(clients, device)`` when it has it, else
            ``train_images(client, device)`` per client.
        participants: the clients to train, in order.
        chunk_size: the executor's current chunk size (read when a chunk is cut).
        device: where the images go (the executor's device).
        prefetch: prepare the next chunk's images in a background thread.
        waiting: a context manager entered while the loop waits for a chunk's images (a
            phase timer's ``data``).
    """

    def __init__(self, data: Any, participants: np.ndarray, chunk_size: Callable[[], int],
                 device: str | torch.device, prefetch: bool,
                 waiting: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.data = data
        self.participants = np.asarray(participants, dtype=np.int64)
        self.chunk_size = chunk_size
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.waiting = waiting
        self._pos = 0
        self._cuda = self.device.type == "cuda"

    def _size(self) -> int:
        return max(1, int(self.chunk_size()))

    def _cut(self) -> np.ndarray | None:
        """The next chunk: the next ``chunk_size`` participants (None when all are cut)."""
        if self._pos >= self.participants.size:
            return None
        chunk = self.participants[self._pos:self._pos + self._size()]
        self._pos += chunk.size
        return chunk

    def _prepare(self, chunk: np.ndarray) -> list[torch.Tensor]:
        return chunk_images(self.data, chunk, self.device)

    def _job(self, pool: ThreadPoolExecutor | None, stream: Any, chunk: np.ndarray) -> Future | _Ready:
        if pool is None:
            return _Ready(lambda: (self._prepare(chunk), None))
        if stream is None:
            return pool.submit(lambda: (self._prepare(chunk), None))
        handed = torch.cuda.Event()
        handed.record(torch.cuda.current_stream(self.device))

        def on_side() -> tuple[list[torch.Tensor], Any]:
            with torch.cuda.stream(stream):
                stream.wait_event(handed)
                images = self._prepare(chunk)
                ready = torch.cuda.Event()
                ready.record(stream)
            return images, ready

        return pool.submit(on_side)

    def _receive(self, job: Future | _Ready) -> list[torch.Tensor]:
        images, ready = job.result()
        if ready is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ready)
            for x in images:
                if x.is_cuda:
                    x.record_stream(main)
        return images

    def __iter__(self) -> Iterator[tuple[np.ndarray, list[torch.Tensor]]]:
        pool = ThreadPoolExecutor(1, thread_name_prefix="fedfs-prefetch") if self.prefetch else None
        stream = torch.cuda.Stream(self.device) if (pool is not None and self._cuda) else None
        pending: deque[tuple[np.ndarray, Future | _Ready]] = deque()
        try:
            first = self._cut()
            if first is not None:
                pending.append((first, self._job(pool, stream, first)))
            while pending:
                chunk, job = pending.popleft()
                with self.waiting():
                    images = self._receive(job)
                n = self._size()
                if chunk.size > n:      # the chunk size shrank since this chunk was cut
                    pending.appendleft((chunk[n:], _Ready(value=(images[n:], None))))
                    chunk, images = chunk[:n], images[:n]
                if not pending and (nxt := self._cut()) is not None:
                    pending.append((nxt, self._job(pool, stream, nxt)))   # prepared while `chunk` trains
                yield chunk, images
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
