"""The messages a secure round accepted since its last full snapshot, appended one by one.

:class:`server_agg.secagg_rounds.SecAggRound` used to rewrite its whole state — every public key,
every routed share ciphertext, the unmask shares — after each accepted message: with k devices
in a phase that is k rewrites of a state that grows with k² ciphertexts (a 51-device
MobileFaceNet round spent a quarter of the server's CPU there). Now the whole state is written at
each phase close only (one *generation*), and each accepted message in between is appended here
and made durable (one fsync) before the device gets its answer; a restarted server restores the
snapshot and replays the journal its snapshot names.

A record is ``step (u8) · device index (u32) · payload length (u32) · payload · CRC-32 (u32)``,
little-endian. A masked input's record carries no payload: the journal never holds a device's
masked vector, only the round's running sum does (its own file, written before the record), so
the disk holds masked vectors only summed, as before. Only the last record can be torn (a crash
mid-append, never acknowledged): it is cut off when the journal is read back.
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from .store import fsync_dir

STEPS = ("advertise", "share-keys", "masked-input", "consistency", "unmask")
"""The URL steps a record can hold (its first byte is the index here)."""

_HEAD = struct.Struct("<BII")
_CRC = struct.Struct("<I")


def encode_record(step: str, device: int, payload: bytes) -> bytes:
    head = _HEAD.pack(STEPS.index(step), device, len(payload))
    return head + payload + _CRC.pack(zlib.crc32(head + payload))


def read_records(path: Path) -> tuple[list[tuple[str, int, bytes]], int]:
    """``(records, end of the last whole record)`` of the journal at ``path`` (none if absent);
    reading stops at the first short or damaged record — a torn append."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    out, at = [], 0
    while at + _HEAD.size <= len(data):
        code, device, n = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + n
        if code >= len(STEPS) or end + _CRC.size > len(data) or \
                _CRC.unpack_from(data, end)[0] != zlib.crc32(data[at:end]):
            break
        out.append((STEPS[code], device, data[at + _HEAD.size:end]))
        at = end + _CRC.size
    return out, at


class Journal:
    """Append-only, fsynced records of one generation of a round's state (see the module)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: BinaryIO | None = None

    def records(self) -> Iterator[tuple[str, int, bytes]]:
        """The whole records; a torn tail is cut off the file so later appends follow the last one."""
        records, end = read_records(self.path)
        if self.path.exists() and self.path.stat().st_size != end:
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return iter(records)

    def append(self, step: str, device: int, payload: bytes = b"") -> None:
        """Append one record and make it durable before returning."""
        if self._fh is None:
            created = not self.path.exists()
            self._fh = open(self.path, "ab")
            if created:
                fsync_dir(self.path.parent)
        self._fh.write(encode_record(step, device, payload))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


__all__ = ["Journal", "STEPS", "encode_record", "read_records"]
