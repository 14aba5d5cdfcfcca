"""What an untrusted connection may cost the server: bounded, deadline-limited request bodies
and a deadline on request heads.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``), but a connection that
sends nothing, a partial head or a partial body is kept open forever, and its httptools
parser does not bound a head's size (h11 does). Two pieces close that gap:

* :func:`deadline_protocol` — uvicorn's protocol class (httptools, or h11 without it) whose
  connections must deliver a complete request head of at most 16 KiB within
  ``header_timeout_s`` (from connect, or from the first byte of a later request on a
  kept-alive connection), else they are closed.
* :func:`receive_body` — the app reads a body itself, from the ASGI channel, into a sink
  (a spool file or a small buffer), refusing it once it passes its limit (413), once its
  deadline passes (408), or when the client goes away mid-body (no 500: the client is gone).

Routes check authentication, the round and sampling *before* calling
:func:`receive_body`, so unauthenticated or pointless bodies are never read.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request

from fedfs_sdk.federation.wire_format import parse_decimal
from fedfs_sdk.errors import InputError

from .errors import ApiError, BadRequest, PayloadTooLarge, UnsupportedMediaType


class RequestTimeout(ApiError):
    status, code = 408, "request_timeout"


class ClientGone(ApiError):
    """The client closed the connection before its body was complete (nobody reads the answer)."""

    status, code = 400, "client_disconnected"


class _Sink(Protocol):
    def write(self, data: bytes, /) -> Any: ...


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_media_type(request: Request, *accepted: str) -> None:
    got = media_type(request)
    if got not in accepted:
        raise UnsupportedMediaType(f"body must be {' or '.join(accepted)}, got {got or 'none'!r}")


def declared_length(request: Request, limit: int) -> int | None:
    """``Content-Length`` as an int (strict ASCII digits), 413 if it exceeds ``limit``."""
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    try:
        n = parse_decimal(raw, "Content-Length")
    except InputError as e:
        raise BadRequest(str(e), code="bad_content_length") from None
    if n > limit:
        raise PayloadTooLarge(f"body of {n} bytes exceeds the limit of {limit} bytes")
    return n


async def receive_body(request: Request, limit: int, timeout_s: float, sink: _Sink) -> int:
    """Copy the request body into ``sink``; returns its size.

    Refused with 413 as soon as it is known to exceed ``limit`` (from ``Content-Length``
    before reading, or while streaming a chunked body), 408 when it is not complete within
    ``timeout_s`` seconds, and :class:`ClientGone` when the client disconnects. Marks
    ``request.state.body_complete`` so an error answer knows whether the connection still
    holds unread bytes (then it is closed, not drained).
    """
    declared_length(request, limit)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    size = 0
    receive = request.receive
    while True:
        remaining = end - loop.time()
        if remaining <= 0:
            raise RequestTimeout(f"the request body was not complete within {timeout_s:g} s")
        try:
            msg = await asyncio.wait_for(receive(), remaining)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"the request body was not complete within {timeout_s:g} s") from None
        if msg["type"] == "http.disconnect":
            raise ClientGone(f"the client disconnected after {size} bytes of the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
        if chunk:
            sink.write(chunk)
        if not msg.get("more_body", False):
            request.state.body_complete = True
            return size


MAX_HEAD_BYTES = 16 << 10
"""Largest request head (request line + headers) a connection may send: h11's own default
bound, kept when the parser is httptools (which has none)."""

_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                   b"connection: close\r\ncontent-length: 31\r\n\r\nrequest head larger than 16 KiB\n")


def http_parser() -> str:
    """``"httptools"`` (C, llhttp) where it is installed — the ``server`` extra installs it —
    else ``"h11"`` (pure Python). Profiled under a burst of 200 uploads (py-spy on the
    server), h11's header validation was the event loop's largest single cost, ~1 ms per
    request head on a loaded core, and `/health` waited behind it (docs/protocol.md)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def deadline_protocol(header_timeout_s: float, parser: str | None = None,
                      max_head_bytes: int = MAX_HEAD_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``parser``: :func:`http_parser` by default) with a request-head
    deadline and size bound (pass as ``uvicorn.Config(http=…)``).

    The deadline starts when the connection opens and again when the first byte of a new
    request arrives on a kept-alive connection; once the head is complete the request's
    route owns the connection (its body has :func:`receive_body`'s deadline). A head that
    grows past ``max_head_bytes`` before it is complete gets a 431 and the connection closes.
    """
    parser = parser or http_parser()
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"parser must be 'httptools' or 'h11', got {parser!r}")

    class DeadlineProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def _idle(self) -> bool:
            """No request head has been completed since the last response."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_deadline)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self._idle():
                self._arm()                  # a new request starts on a kept-alive connection
                self._head_bytes = 0
            super().data_received(data)
            if not self._idle():
                self._disarm()               # its head is complete
                self._head_bytes = 0
                return
            # counted after parsing: a chunk that completes the head may carry body bytes too
            self._head_bytes += len(data)
            if self._head_bytes > max_head_bytes and not self.transport.is_closing():
                self._disarm()
                self.transport.write(_HEAD_TOO_LARGE)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    DeadlineProtocol.__name__ = DeadlineProtocol.__qualname__ = f"Deadline{base.__name__}"
    return DeadlineProtocol


def tls_files(cert: Path | None, key: Path | None) -> tuple[str, str] | None:
    """``(cert, key)`` for uvicorn when HTTPS is asked for (``fedfs serve --tls-cert/--tls-key``);
    :class:`InputError` when half given, missing, or the key does not belong to the certificate
    (checked with ``ssl`` before the port is bound and the state touched)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise InputError("give both --tls-cert and --tls-key (or neither)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise InputError(f"{flag}: no such file {path}")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as e:
        raise InputError(f"--tls-cert {cert} / --tls-key {key} cannot be used: {e}") from None
    return str(cert), str(key)


__all__ = ["RequestTimeout", "ClientGone", "media_type", "require_media_type", "declared_length",
           "receive_body", "deadline_protocol", "http_parser", "MAX_HEAD_BYTES", "tls_files"]
