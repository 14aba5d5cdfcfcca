"""HTTP routes of secure-aggregation rounds (``/v1/rounds/{round_id}/secagg…``).

Thin, like ``app.py``'s: authenticate the device, refuse before reading the body what no
body could make acceptable (round not open or not secure, device not sampled, a phase past
its deadline), read a bounded body, hand it to the coordinator. JSON messages are the core's
(:func:`fedfs_sdk.federation.secagg.to_json`: bytes as ``{"b64": …}``); the masked vector ``y_u`` is a
raw little-endian ``uint64`` body of exactly ``8·(dim + 1)`` bytes. docs/protocol.md
describes the phases.
"""
from __future__ import annotations

import asyncio
import io
from typing import Any, Callable, Literal

from fastapi import FastAPI, Path, Request, Security
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from fedfs_sdk.federation.wire_format import MAX_ID

from .transport import receive_body, require_media_type

_B64 = {"type": "object", "required": ["b64"], "additionalProperties": False,
        "properties": {"b64": {"type": "string"}}}
_ID = {"type": "integer", "minimum": 1, "maximum": (1 << 31) - 2}


def _message(kind: str, fields: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "title": kind, "type": "object",
        "required": ["type", "round", "device", *required],
        "properties": {"type": {"const": kind}, "round": {"type": "integer", "minimum": 0}, "device": _ID, **fields},
    }}}}}


def _list_of(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "object", "required": list(props), "properties": props}}


_CERT = {"type": "object", "description": "fedfs-device-cert/1: the operator CA's certificate of the device's "
                                          "Ed25519 identity key (fedfs-secagg/2)"}
ADVERTISE_BODY = _message("advertise_keys", {"c_pk": _B64, "s_pk": _B64, "cert": _CERT, "sig": _B64},
                          ["c_pk", "s_pk"])
CONSISTENCY_BODY = _message("consistency_signature", {"sig": _B64}, ["sig"])
SHARE_KEYS_BODY = _message("share_keys", {"ciphertexts": _list_of({"to": _ID, "ct": _B64})}, ["ciphertexts"])
UNMASK_BODY = _message("unmask_shares", {"b_shares": _list_of({"of": _ID, "share": _B64}),
                                         "s_shares": _list_of({"of": _ID, "share": _B64})}, ["b_shares", "s_shares"])
MASKED_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary",
               "description": "y_u: dim + 1 little-endian uint64 words (masked n·w and n)"}}}}}


class SecAggAck(BaseModel):
    round_id: int
    device: int
    step: str
    phase: str
    sha256: str | None = None


class SecAggView(BaseModel, extra="allow"):
    """The device's view: ``phase`` (``advertise``, ``share_keys``, ``masked``, ``consistency``
    (authenticated rounds), ``unmask``, ``done``, ``failed``) and the message it waits for:
    ``roster``, ``inbox``, ``consistency_request`` or ``unmask_request`` (bytes as ``{"b64": …}``)."""

    round_id: int
    phase: Literal["advertise", "share_keys", "masked", "consistency", "unmask", "done", "failed", "closed"]
    retry_after: float
    device: int | None = None
    deadline: float | None = None
    result_version: int | None = None
    reason: str | None = None
    dropped: bool | None = None
    """True: this device missed an earlier phase and takes no further part in the round."""


def install_secagg_routes(app: FastAPI, coord: Any, device: Callable[..., str], errors: Callable[..., Any],
                          body_timeout_s: float, receive_slots: asyncio.Semaphore, prefix: str = "/v1/rounds",
                          tag: str = "secure aggregation") -> None:
    """Add the secure-aggregation endpoints to ``app`` (``device``: the bearer dependency) under
    ``{prefix}/{round_id}/secagg``. ``coord`` answers ``secagg_check``, ``secagg_receive`` and
    ``secagg_view``: the coordinator for weight rounds (``/v1/rounds``), the statistics desk for
    statistics rounds (``/v1/stats-round``, :mod:`.stats_routes`) — one protocol, one set of routes."""

    async def _receive(request: Request, device_id: str, round_id: int, step: str, media: str) -> dict[str, Any]:
        require_media_type(request, media)
        limit = await run_in_threadpool(coord.secagg_check, device_id, round_id, step)
        buf = io.BytesIO()
        async with receive_slots:
            await receive_body(request, limit, body_timeout_s, buf)
        return await run_in_threadpool(coord.secagg_receive, device_id, round_id, step, buf.getvalue())

    refusals = errors(400, 401, 403, 404, 408, 409, 410, 413, 415, 422)

    @app.get(prefix + "/{round_id}/secagg", response_model=SecAggView, response_model_exclude_none=True,
             responses=errors(401, 403, 404, 409, 422), tags=[tag])
    def secagg_view(round_id: int = Path(ge=1, le=MAX_ID), device_id: str = Security(device)) -> dict[str, Any]:
        """This device's view of a secure round: the phase and the message it waits for."""
        return coord.secagg_view(device_id, round_id)

    @app.post(prefix + "/{round_id}/secagg/advertise", response_model=SecAggAck, response_model_exclude_none=True,
              responses=refusals, tags=[tag], openapi_extra=ADVERTISE_BODY)
    async def secagg_advertise(request: Request, round_id: int = Path(ge=1, le=MAX_ID),
                               device_id: str = Security(device)) -> dict[str, Any]:
        """Phase 0, AdvertiseKeys: this device's two X25519 public keys ``c_pk``, ``s_pk``."""
        return await _receive(request, device_id, round_id, "advertise", "application/json")

    @app.post(prefix + "/{round_id}/secagg/share-keys", response_model=SecAggAck, response_model_exclude_none=True,
              responses=refusals, tags=[tag], openapi_extra=SHARE_KEYS_BODY)
    async def secagg_share_keys(request: Request, round_id: int = Path(ge=1, le=MAX_ID),
                                device_id: str = Security(device)) -> dict[str, Any]:
        """Phase 1, ShareKeys: one AES-GCM ciphertext of Shamir shares per neighbour in the roster."""
        return await _receive(request, device_id, round_id, "share-keys", "application/json")

    @app.put(prefix + "/{round_id}/secagg/masked-input", response_model=SecAggAck,
             response_model_exclude_none=True, responses=refusals, tags=[tag],
             openapi_extra=MASKED_BODY)
    async def secagg_masked_input(request: Request, round_id: int = Path(ge=1, le=MAX_ID),
                                  device_id: str = Security(device)) -> dict[str, Any]:
        """Phase 2, MaskedInputCollection: ``y_u`` as a raw body of exactly 8·(dim + 1) bytes."""
        return await _receive(request, device_id, round_id, "masked-input", "application/octet-stream")

    @app.post(prefix + "/{round_id}/secagg/consistency", response_model=SecAggAck,
              response_model_exclude_none=True, responses=refusals, tags=[tag],
              openapi_extra=CONSISTENCY_BODY)
    async def secagg_consistency(request: Request, round_id: int = Path(ge=1, le=MAX_ID),
                                 device_id: str = Security(device)) -> dict[str, Any]:
        """fedfs-secagg/2, ConsistencyCheck: this device's Ed25519 signature over the survivor set U3."""
        return await _receive(request, device_id, round_id, "consistency", "application/json")

    @app.post(prefix + "/{round_id}/secagg/unmask", response_model=SecAggAck, response_model_exclude_none=True,
              responses=refusals, tags=[tag], openapi_extra=UNMASK_BODY)
    async def secagg_unmask(request: Request, round_id: int = Path(ge=1, le=MAX_ID),
                            device_id: str = Security(device)) -> dict[str, Any]:
        """Phase 3, Unmasking: b-shares of survivors, s_sk-shares of devices dropped before masking."""
        return await _receive(request, device_id, round_id, "unmask", "application/json")


__all__ = ["install_secagg_routes", "SecAggView", "SecAggAck"]
