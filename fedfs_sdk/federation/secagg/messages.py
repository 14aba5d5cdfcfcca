"""The messages of the protocol: plain dicts, JSON-able after :func:`to_json`.

Every message has ``type``, ``round`` and (device → server) ``device``. ``fedfs-secagg/2``
(authenticated rounds) adds ``cert`` and ``sig`` to ``advertise_keys`` and roster entries, and
the ConsistencyCheck step between masked input and unmasking. Byte fields are
``bytes`` in memory; :func:`to_json` writes them as ``{"b64": …}``. The masked vector
(``masked_input.y``, 8·(dim + 1) bytes) is meant to travel as a raw ``application/octet-stream``
body over HTTP, with the other fields in headers or the query.
"""
from __future__ import annotations

import base64
import json
from typing import Any

from .errors import BadMessageError, ReplayError
from .params import MAX_DEVICE_ID

ADVERTISE = "advertise_keys"       # device → server: c_pk, s_pk
ROSTER = "roster"                  # server → devices: the public keys of U1, the threshold
SHARE_KEYS = "share_keys"          # device → server: encrypted shares, one per holder
SHARES_INBOX = "shares_inbox"      # server → device: the ciphertexts addressed to it, U2
MASKED_INPUT = "masked_input"      # device → server: y_u
CONSISTENCY_REQUEST = "consistency_request"  # fedfs-secagg/2, server → survivors: U3
CONSISTENCY = "consistency_signature"          # fedfs-secagg/2, device → server: its signature over U3
UNMASK_REQUEST = "unmask_request"  # server → devices: survivors U3, dropped U2∖U3 (/2: + the signatures)
UNMASK_SHARES = "unmask_shares"    # device → server: b-shares of survivors, s-shares of dropped


def to_json(msg: dict[str, Any]) -> str:
    def enc(o: Any) -> Any:
        if isinstance(o, (bytes, bytearray)):
            return {"b64": base64.b64encode(bytes(o)).decode("ascii")}
        if isinstance(o, dict):
            return {k: enc(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [enc(v) for v in o]
        return o
    return json.dumps(enc(msg), separators=(",", ":"))


def from_json(text: str | bytes) -> dict[str, Any]:
    def dec(o: Any) -> Any:
        if isinstance(o, dict):
            if set(o) == {"b64"} and isinstance(o["b64"], str):
                try:
                    return base64.b64decode(o["b64"], validate=True)
                except ValueError as e:
                    raise BadMessageError(f"invalid base64 field: {e}") from e
            return {k: dec(v) for k, v in o.items()}
        if isinstance(o, list):
            return [dec(v) for v in o]
        return o
    try:
        msg = json.loads(text)
    except ValueError as e:
        raise BadMessageError(f"message is not JSON: {e}") from e
    if not isinstance(msg, dict):
        raise BadMessageError("message must be a JSON object")
    return dec(msg)


def check_header(msg: Any, expected_type: str, round_id: int) -> None:
    """Type and round of ``msg``; a message of another round/step is a :class:`ReplayError`."""
    if not isinstance(msg, dict):
        raise BadMessageError(f"{expected_type}: message must be a dict, got {type(msg).__name__}")
    if msg.get("round") != round_id:
        raise ReplayError(f"{expected_type}: message is for round {msg.get('round')!r}, this is round {round_id}")
    if msg.get("type") != expected_type:
        raise ReplayError(f"expected a {expected_type!r} message at this step, got {msg.get('type')!r}")


def get_id(obj: dict[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DEVICE_ID:
        raise BadMessageError(f"{where}: {key!r} must be a device id in [1, {MAX_DEVICE_ID}], got {v!r}")
    return v


def get_bytes(obj: dict[str, Any], key: str, where: str, length: int | None = None) -> bytes:
    v = obj.get(key)
    if not isinstance(v, (bytes, bytearray)):
        raise BadMessageError(f"{where}: {key!r} must be bytes, got {type(v).__name__}")
    if length is not None and len(v) != length:
        raise BadMessageError(f"{where}: {key!r} must be {length} bytes, got {len(v)}")
    return bytes(v)


def get_list(obj: dict[str, Any], key: str, where: str) -> list[Any]:
    v = obj.get(key)
    if not isinstance(v, list):
        raise BadMessageError(f"{where}: {key!r} must be a list, got {type(v).__name__}")
    return v


def get_id_list(obj: dict[str, Any], key: str, where: str) -> list[int]:
    ids = [get_id({"id": v}, "id", f"{where}: {key}") for v in get_list(obj, key, where)]
    if len(set(ids)) != len(ids):
        raise BadMessageError(f"{where}: {key!r} lists a device twice")
    return ids
