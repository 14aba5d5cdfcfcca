"""The response bodies of the HTTP API as pydantic models, for the OpenAPI document
(``/openapi.json``): every refusal's ``{error, reason}`` (:class:`ErrorBody`, listed per endpoint
by :func:`_errors`), registration (with the device's FedUV base vector ``b_u``), tasks, upload
receipts, round and server status, model info; and the binary request body of uploads
(``_BINARY_BODY``). Re-exported by :mod:`server_agg.app`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from fedfs_sdk.federation.wire import MEDIA_TYPE


class ErrorBody(BaseModel):
    error: str
    reason: str


class Health(BaseModel):
    status: Literal["ok"]
    model_version: int | None
    round_id: int | None


class Registration(BaseModel):
    device_id: str
    token: str
    base_vector: int
    base_bits: int
    secure_aggregation: bool = False
    """The server runs secure-aggregation rounds: a device (with the default
    ``require_secure_aggregation``) records it and from then on refuses plain rounds."""


class Task(BaseModel, extra="allow"):
    """``action`` is ``train`` (with the round's task fields), ``wait`` or ``done``."""

    action: Literal["train", "wait", "done"]
    retry_after: float | None = None
    round_id: int | None = None
    model_version: int | None = None


class Receipt(BaseModel):
    round_id: int
    device_id: str
    num_samples: int
    sha256: str
    update_norm: float
    clipped: bool
    received_at: float
    duplicate: bool


class RoundStatus(BaseModel):
    round_id: int
    state: Literal["open", "closed", "failed"]
    model_version: int
    sampled: int
    accepted: int
    total_samples: int | None
    """``Σ|D_c|`` of the accepted updates; null in a DP round (not covered by ε, not published)."""
    quorum: int
    opened_at: float
    deadline: float
    closed_at: float | None
    result_version: int | None
    reason: str | None
    secure_aggregation: dict[str, Any] | None = None
    """A secure-aggregation round: its phase and per-phase counts (server_agg.secagg_rounds)."""


class ServerStatus(BaseModel):
    model_version: int | None
    rounds_completed: int
    rounds_target: int
    devices: int
    active_devices: int
    round: RoundStatus | None
    dp: dict[str, Any] | None = None
    """User-level DP-FedAvg: ε spent at δ, the budget, whether it is exhausted (server_agg.dp)."""


class ModelInfo(BaseModel):
    version: int
    sha256: str
    config: dict[str, Any]
    nbytes: int
    dp: dict[str, Any] | None = None
    """The (ε, δ) per user this version is published with (DP-FedAvg rounds; server_agg.dp)."""
    xi_sha256: str | None = None
    """ξ served with the model (``GET /v1/xi``), if any."""
    impostors_sha256: str | None = None
    """The public impostor set shipped with the model (``GET /v1/impostors``), if any."""
    method: str | None = None
    """The method the federation trains (the policy's): how a device that never trained verifies."""


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The refusals an endpoint documents (all share the ``{error, reason}`` body)."""
    return {s: {"model": ErrorBody} for s in statuses}
_BINARY_BODY = {"requestBody": {"required": True, "content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


__all__ = ["ErrorBody", "Health", "Registration", "Task", "Receipt", "RoundStatus", "ServerStatus", "ModelInfo"]
