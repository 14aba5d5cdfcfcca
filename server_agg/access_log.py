"""The server's access log: an ASGI middleware (:class:`_AccessLog`) that writes one structured
line per HTTP request — method, path, status, client address, milliseconds — to the
``fedfs.server.http`` logger (:mod:`server_agg.logs` formats it as JSON). Never a header, a
token or a body. Used by :func:`server_agg.app.create_app`.
"""
from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("fedfs.server.http")


class _AccessLog:
    """ASGI middleware: one structured line per request (method, path, status, time)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), {"code": 500}

        async def _send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            client = scope.get("client") or ("?", 0)
            log.info("request", extra={"fields": {"method": scope["method"], "path": scope["path"],
                                                  "status": status["code"], "client": client[0],
                                                  "ms": round(1000 * (time.perf_counter() - t0), 2)}})

