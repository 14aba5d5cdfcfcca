"""Structured logs: one JSON object per line on stderr.

Log calls pass their fields as ``extra={"fields": {...}}``. Only identifiers, counts,
norms and timings are logged — never a tensor, a token, a request body or anything a
device keeps secret.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import TextIO


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Route the server's and uvicorn's loggers to one JSON handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    lvl = getattr(logging, level.upper(), logging.INFO)
    for name in ("fedfs", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(lvl)
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # replaced by our request log


__all__ = ["JsonFormatter", "setup_logging"]
