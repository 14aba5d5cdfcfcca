"""Errors the server answers with: an HTTP status, a stable machine-readable code, a reason.

Every refusal is one of these (or a request-validation error), so a malformed or
unauthorised request always gets a 4xx with a reason, never a 5xx.
"""
from __future__ import annotations

from fedfs_sdk.errors import ProtocolError


class ApiError(ProtocolError):
    """A refused request. ``status`` is the HTTP status, ``code`` a stable identifier."""

    status = 400
    code = "bad_request"

    def __init__(self, reason: str, *, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def to_json(self) -> dict[str, str]:
        return {"error": self.code, "reason": self.reason}


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class Gone(ApiError):
    status, code = 410, "round_closed"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(ApiError):
    status, code = 415, "unsupported_media_type"


class Unprocessable(ApiError):
    status, code = 422, "invalid_update"


__all__ = ["ApiError", "BadRequest", "Unauthorized", "Forbidden", "NotFound", "Conflict", "Gone",
           "PayloadTooLarge", "UnsupportedMediaType", "Unprocessable"]
