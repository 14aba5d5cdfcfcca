"""The device-state folder itself: created with mode 0700, locked while a process uses it, every
file written atomically with mode 0600; and the registration record ``device.json``
(:class:`DeviceInfo`: server, device id, FedUV base vector ``b_u``, rounds done) with the token.

The base of :class:`~fedfs_sdk.federation.device_state.DeviceState` (which documents the
layout and what is encrypted); the FedUV secrets and the device key are in
:mod:`.device_secrets`, a round's pending upload in :mod:`.device_pending`.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..runtime.codes import BASE_BITS
from ..errors import FedFSError, InputError
from ..fileio import atomic_write_bytes, fsync_directory, lock_file, unlock_file

STATE_FORMAT = "fedfs-device/1"
FILE_MODE = 0o600
DIR_MODE = 0o700

# Names a device state may hold (a folder holding only these — e.g. after a registration that
# failed half-way — is still taken as a device state; anything else without device.json is not).
STATE_FILES = frozenset({
    "device.json", "token", "secrets.json", "personal.safetensors", "global.safetensors", "xi.safetensors",
    "verifier.safetensors", "verifier.onnx", "enrollment.fedfs", "enrollment.key", ".lock",
    "pending.json", "pending.update.safetensors", "pending.personal.safetensors", "identity.key", "identity.cert",
    "stats"})


class DeviceStateError(FedFSError):
    """The device-state directory is missing, locked by another process, or inconsistent."""


class DeviceKeyError(DeviceStateError):
    """``secrets.json`` does not decrypt with the given device key (wrong key, or tampered)."""


@dataclass
class DeviceInfo:
    """The non-secret part of the state (``device.json``)."""

    server: str
    device_id: str
    base_vector: int
    registered_at: float = field(default_factory=time.time)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    format: str = STATE_FORMAT
    secure_aggregation: bool = False
    """The server has offered secure aggregation (at registration or in a round): with the default
    ``DeviceConfig.require_secure_aggregation`` the device refuses plain rounds from then on."""


def _check_key(key: bytes, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) not in (16, 24, 32):
        n = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise DeviceStateError(f"{what} must be 16, 24 or 32 raw bytes (AES), got {n}")
    return bytes(key)


def _is_state_entry(name: str) -> bool:
    return name in STATE_FILES or (name.startswith(".") and name.endswith(".tmp"))


def _json_object(raw: bytes, path: Path, problem: str) -> dict[str, Any]:
    """``raw`` as a JSON object, else :class:`DeviceStateError` ``"<path> <problem>: …"``."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeviceStateError(f"{path} {problem}: {e}") from None
    if not isinstance(data, dict):
        raise DeviceStateError(f"{path} {problem}: not a JSON object")
    return data

class DeviceFolder:
    """The locked folder, its file primitives and the registration (``device.json``, ``token``);
    the arguments are :class:`~fedfs_sdk.federation.device_state.DeviceState`'s."""

    def __init__(self, path: str | os.PathLike[str], *, key: bytes | None = None, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = bool(read_only)
        self._key = _check_key(key, "the device key") if key is not None else None
        self._info: DeviceInfo | None = None
        self._lock_fd = -1
        try:
            self._open_folder()
            fd = lock_file(self.path / ".lock", shared=self.read_only, mode=FILE_MODE)
        except OSError as e:
            raise DeviceStateError(f"cannot use device state {self.path}: {e.strerror or e}") from None
        if fd is None:
            raise DeviceStateError(f"device state {self.path} is in use by another process")
        self._lock_fd = fd

    def _open_folder(self) -> None:
        p = self.path
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise DeviceStateError(f"{p} is not a folder: a device state is a directory (give --state a new "
                                       "or empty folder)")
            if (p / "device.json").is_file():
                return
            if self.read_only:
                raise DeviceStateError(f"{p} is not a fedfs device state (no device.json): has the device "
                                       "registered (fedfs device --state)?")
            foreign = sorted(n for n in os.listdir(p) if not _is_state_entry(n))
            if foreign:
                shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
                raise DeviceStateError(f"{p} is not a fedfs device state (no device.json) and is not empty "
                                       f"({shown}); give --state a new or empty folder")
            return
        if self.read_only:
            raise DeviceStateError(f"no device state at {p} (folder not found)")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(p, DIR_MODE)
        os.chmod(p, DIR_MODE)        # only a folder created here: the umask may have narrowed mkdir's mode

    def close(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            unlock_file(fd)

    def _write(self, name: str, data: bytes) -> None:
        if self.read_only:
            raise DeviceStateError(f"device state {self.path} is open read-only; cannot write {name}")
        try:
            atomic_write_bytes(self.path / name, data, mode=FILE_MODE)
        except OSError as e:
            raise DeviceStateError(f"cannot write {self.path / name}: {e.strerror or e}") from None

    def _read_bytes(self, name: str) -> bytes | None:
        p = self.path / name
        if not p.is_file():
            return None
        try:
            return p.read_bytes()
        except OSError as e:
            raise DeviceStateError(f"{p} is unreadable: {e.strerror or e}") from None

    def _read_json(self, name: str) -> dict[str, Any] | None:
        p = self.path / name
        raw = self._read_bytes(name)
        if raw is None:
            return None
        return _json_object(raw, p, "is unreadable")

    # ---- registration ----------------------------------------------------------------

    @property
    def info(self) -> DeviceInfo | None:
        """The registration, or None before the device has registered."""
        if self._info is None:
            d = self._read_json("device.json")
            if d is not None:
                try:
                    self._info = DeviceInfo(**d)
                except TypeError as e:
                    raise DeviceStateError(f"{self.path / 'device.json'} is malformed: {e}") from None
                if self._info.format != STATE_FORMAT:
                    raise DeviceStateError(f"unsupported device state format {self._info.format!r}")
        return self._info

    @property
    def token(self) -> str | None:
        raw = self._read_bytes("token")
        return raw.decode("utf-8", "replace").strip() if raw is not None else None

    def save_registration(self, server: str, device_id: str, token: str, base_vector: int) -> DeviceInfo:
        """Persist what the server issued at registration (token first: it is the credential)."""
        if not 0 <= int(base_vector) < (1 << BASE_BITS):
            raise InputError(f"base vector {base_vector} does not fit in {BASE_BITS} bits")
        self._write("token", token.encode() + b"\n")
        info = DeviceInfo(server=server, device_id=device_id, base_vector=int(base_vector))
        self._save_info(info)
        return info

    def _save_info(self, info: DeviceInfo) -> None:
        self._write("device.json", json.dumps(asdict(info), indent=1, sort_keys=True).encode())
        self._info = info

    def mark_secure_aggregation(self) -> None:
        """Remember, for good, that this device's server offers secure aggregation."""
        info = self.info
        if info is not None and not info.secure_aggregation:
            info.secure_aggregation = True
            self._save_info(info)

    def record_round(self, entry: Mapping[str, Any]) -> None:
        """Append a participation record (round id, model version, receipt hash …); a round
        already recorded (same ``round_id``) is not recorded twice."""
        info = self.info
        if info is None:
            raise DeviceStateError("cannot record a round before registration")
        if "round_id" in entry and any(r.get("round_id") == entry["round_id"] for r in info.rounds):
            return
        info.rounds.append(dict(entry))
        self._save_info(info)

    def _remove(self, *names: str) -> None:
        if self.read_only:
            return
        removed = False
        for n in names:
            try:
                (self.path / n).unlink()
                removed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                raise DeviceStateError(f"cannot remove {n} from {self.path}: {e.strerror or e}") from None
        if removed:
            fsync_directory(self.path)


__all__ = ["DeviceFolder", "DeviceInfo", "DeviceStateError", "DeviceKeyError", "STATE_FORMAT", "STATE_FILES",
           "FILE_MODE", "DIR_MODE"]
