"""HTTP to the aggregation server, as a device speaks it (see ``docs/protocol.md``).

:class:`ServerClient` (httpx): register, fetch the task, download a global version, upload an
update, the secure-aggregation messages — with exponential back-off on connection errors and
5xx. Importing this module does not import torch.

Retry rules:
    * the server URL is checked when a :class:`ServerClient` is made (http/https, a host, a
      valid port): a typo is an :class:`~fedfs_sdk.errors.InputError`, never retried;
    * connection errors, timeouts, 5xx (but 501, 505), 429 → retried with exponential
      back-off and jitter (``Retry-After`` honoured), up to :attr:`RetryPolicy.attempts`
      tries; then :class:`ServerUnavailableError` (or the last 5xx :class:`ServerError`);
    * registration (``POST /v1/devices``) is not idempotent: it is retried only when the
      request surely did not reach the server (connection refused / connect timeout, 429,
      503), never after a read timeout or a lost answer — a retry could leave an orphan
      device record;
    * any other 4xx, 501, 505, an answer that is not fedfs JSON → not retried:
      :class:`ServerError` with the server's code and reason (or the HTTP status and "is
      this a fedfs server?").
Retrying an upload is safe: the server answers a repeated body with the same receipt and
counts it once.
"""
from __future__ import annotations

import json
import math
import os
import random
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from ..errors import InputError, ProtocolError
from .wire_format import MEDIA_TYPE, sha256_hex

USER_AGENT = "fedfs-device/1"

UNKNOWN_DEVICE_HINT = "the server no longer knows this device (was its state reset?); start with a new --state"


class ServerError(ProtocolError):
    """The server refused a request (4xx) or kept failing (5xx after all retries)."""

    def __init__(self, status: int, code: str, reason: str, method: str, path: str, hint: str | None = None) -> None:
        super().__init__(f"{method} {path} → HTTP {status} {code}: {reason}" + (f" — {hint}" if hint else ""))
        self.status, self.code, self.reason, self.hint = status, code, reason, hint


class ServerUnavailableError(ProtocolError):
    """The server could not be reached (connection refused, timeouts) after all retries."""


class TlsError(ProtocolError):
    """The server's TLS certificate does not verify (not retried: a wrong server or an attacker)."""


def _root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return e


def _tls_verification_failed(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` means "the server is down or overloaded, try again later" (unreachable,
    5xx but 501/505, 429, 408) rather than a refusal or a configuration mistake. 408: the
    server's body deadline (``fedfs serve --body-timeout``) passed before a slow upload arrived."""
    if isinstance(e, ServerUnavailableError):
        return True
    return isinstance(e, ServerError) and (e.status in (408, 429) or (e.status >= 500 and e.status not in (501, 505)))


def check_server_url(url: str) -> str:
    """``url`` without a trailing slash, if it is a usable server URL (``http``/``https``,
    a host, a port in 1…65535, no query or fragment); else :class:`InputError`."""
    if not isinstance(url, str) or not url.strip():
        raise InputError("the server URL is empty; give e.g. http://127.0.0.1:8080")
    u = url.strip()
    try:
        parts = urlsplit(u)
        port = parts.port
    except ValueError as e:
        raise InputError(f"invalid server URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https"):
        hint = " (did you forget http://?)" if not parts.scheme or not parts.netloc else ""
        raise InputError(f"invalid server URL {url!r}: the scheme must be http or https{hint}")
    if not parts.hostname:
        raise InputError(f"invalid server URL {url!r}: no host")
    if port is not None and not 1 <= port <= 65535:
        raise InputError(f"invalid server URL {url!r}: port {port} is not in 1…65535")
    if parts.query or parts.fragment:
        raise InputError(f"invalid server URL {url!r}: no query or fragment allowed")
    try:
        httpx.URL(u)
    except httpx.InvalidURL as e:
        raise InputError(f"invalid server URL {url!r}: {e}") from None
    return u.rstrip("/")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off: try ``attempts`` times, waiting ``base·2^i`` (± jitter, ≤ max)."""

    attempts: int = 8
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_delay_s)
        d = min(self.max_delay_s, self.base_delay_s * (2 ** attempt))
        return d * (0.5 + 0.5 * random.random())   # jitter: devices that failed together do not retry together


def _write_private(path: Path, data: bytes, append: bool = False) -> None:
    """Write (or append to) ``path`` with mode 0600, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


class RequestRecorder:
    """httpx request hook writing every request body this client sends to ``directory``
    (``index.jsonl`` + one file per body) — so a user can audit exactly what left the
    device. Headers are not recorded (they carry the token). A directory created here
    gets mode 0700; every file is 0600 (bodies hold the device's model updates)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        try:
            if not self.dir.exists():
                self.dir.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(self.dir, 0o700)
                os.chmod(self.dir, 0o700)
            elif not self.dir.is_dir():
                raise InputError(f"audit directory {self.dir} is not a folder")
            index = self.dir / "index.jsonl"
            self._n = len(index.read_text().splitlines()) if index.is_file() else 0
        except OSError as e:
            raise InputError(f"cannot use audit directory {self.dir}: {e.strerror or e}") from None

    def __call__(self, request: httpx.Request) -> None:
        body = request.content
        self._n += 1
        name = f"{self._n:05d}.bin" if body else None
        if name:
            _write_private(self.dir / name, body)
        entry = {"seq": self._n, "method": request.method, "path": request.url.path, "bytes": len(body),
                 "sha256": sha256_hex(body), "file": name}
        _write_private(self.dir / "index.jsonl", (json.dumps(entry) + "\n").encode(), append=True)


def tls_context(ca_file: str | Path | None) -> ssl.SSLContext | bool:
    """What httpx verifies an ``https://`` server with: the system's CAs (``None``), or only the
    certificates in ``ca_file`` — a CA bundle, or the server's own (self-signed) certificate,
    which pins it. :class:`InputError` if the file is missing or holds no certificate."""
    if ca_file is None:
        return True
    p = Path(ca_file)
    if not p.is_file():
        raise InputError(f"TLS CA file not found: {p}")
    try:
        return ssl.create_default_context(cafile=str(p))     # only these: the system store is not loaded
    except (ssl.SSLError, OSError, ValueError) as e:
        raise InputError(f"TLS CA file {p} holds no usable certificate: {e}") from None


class ServerClient:
    """HTTP client of one device (or of an admin script) for one server.

    ``base_url`` is checked here (:func:`check_server_url`): a malformed URL raises
    :class:`InputError` before any request. ``tls_ca``: trust only these certificates for an
    ``https://`` server (a CA bundle, or the server's pinned self-signed certificate)."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 60.0,
                 retry: RetryPolicy = RetryPolicy(), transport: httpx.BaseTransport | None = None,
                 audit_dir: str | Path | None = None, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[str, float], None] | None = None, tls_ca: str | Path | None = None) -> None:
        self.base_url = check_server_url(base_url)
        if not isinstance(timeout, httpx.Timeout) and not (
                isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise InputError(f"the HTTP timeout must be a positive number of seconds, got {timeout!r}")
        self.token = token
        self.retry = retry
        self.retry_until: float | None = None    # time.monotonic() after which no retry is started
        self._sleep = sleep
        self._on_retry = on_retry
        hooks = {"request": [RequestRecorder(audit_dir)]} if audit_dir is not None else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                  headers={"User-Agent": USER_AGENT}, event_hooks=hooks, verify=tls_context(tls_ca))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ServerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, content: bytes | None = None, json_body: Any = None,
                token: str | None = None, content_type: str | None = None, idempotent: bool = True) -> httpx.Response:
        """Send with retries (see module docstring); raise :class:`ServerError` on a refusal.

        ``idempotent=False`` (registration): retried only where the request surely did not
        reach the server (connect errors, 429, 503)."""
        headers: dict[str, str] = {}
        tok = token if token is not None else self.token
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        if content_type:
            headers["Content-Type"] = content_type
        last: Exception | None = None
        tries = 0
        for attempt in range(self.retry.attempts):
            tries = attempt + 1
            try:
                r = self._http.request(method, path, content=content, json=json_body, headers=headers)
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:     # a configuration mistake: no retry
                raise InputError(f"{method} {self.base_url}{path}: {e}") from None
            except httpx.TransportError as e:          # connection refused/reset, timeout, protocol error
                if _tls_verification_failed(e):           # never transient: the wrong server, or someone on the path
                    raise TlsError(f"{method} {self.base_url}{path}: the server's TLS certificate does not verify "
                                   f"({_root_cause(e)}): an on-path attacker, or the wrong --tls-ca; nothing was "
                                   "sent") from e
                if not idempotent and not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
                    raise ProtocolError(
                        f"{method} {path}: {type(e).__name__}: {e or 'no answer'} — the server may have "
                        "registered this device and its answer was lost; not retried, so that no orphan device "
                        "record is left: run again") from e
                last = e
                if attempt + 1 < self.retry.attempts and not self._retry_wait(
                        self.retry.delay(attempt), f"{method} {path}: {type(e).__name__}: {e}"):
                    break
                continue
            if r.status_code < 400:
                return r
            code, reason, hint = self._error_of(r)
            last = ServerError(r.status_code, code, reason, method, path, hint)
            retry = r.status_code in (408, 429) or (r.status_code >= 500 and r.status_code not in (501, 505))
            if not idempotent:                    # 408 too: the server refused before acting on the body
                retry = r.status_code in (408, 429, 503)
            if retry:
                if attempt + 1 < self.retry.attempts and not self._retry_wait(
                        self.retry.delay(attempt, _retry_after(r)), str(last)):
                    break
                continue
            raise last
        if isinstance(last, ServerError):
            raise last
        raise ServerUnavailableError(f"{method} {self.base_url}{path}: server unreachable after "
                                     f"{tries} tries: {type(last).__name__}: {last}") from last

    def _retry_wait(self, delay: float, why: str) -> bool:
        """Wait before the next try; False when that would pass :attr:`retry_until`."""
        if self.retry_until is not None and time.monotonic() + delay > self.retry_until:
            return False
        self._wait(delay, why)
        return True

    def _error_of(self, r: httpx.Response) -> tuple[str, str, str | None]:
        """``(code, reason, hint)`` of a refusal: the fedfs JSON error body, or — for any other
        answer (an HTML page, another service) — the status phrase and a hint."""
        try:
            d = r.json()
        except ValueError:
            d = None
        if isinstance(d, dict) and isinstance(d.get("error"), str):
            code, reason = d["error"], str(d.get("reason", ""))
            return code, reason, (UNKNOWN_DEVICE_HINT if r.status_code == 401 and code == "unknown_device" else None)
        return "http_error", r.reason_phrase or "error", f"not a fedfs error answer: is {self.base_url} a fedfs server?"

    def _json(self, r: httpx.Response, what: str) -> dict[str, Any]:
        try:
            d = r.json()
        except ValueError:
            d = None
        if not isinstance(d, dict):
            raise ProtocolError(f"{what}: the answer is not a JSON object: is {self.base_url} a fedfs server?")
        return d

    def _wait(self, delay: float, why: str) -> None:
        if self._on_retry is not None:
            self._on_retry(why, delay)
        self._sleep(delay)

    # ---- endpoints -------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json(self.request("GET", "/health"), "GET /health")

    def register(self, registration_token: str | None = None) -> dict[str, Any]:
        """Register: ``{device_id, token, base_vector, base_bits}`` (not retried once the
        request may have reached the server: see the module docstring)."""
        data = self._json(self.request("POST", "/v1/devices", token=registration_token or "", idempotent=False),
                          "POST /v1/devices")
        if not isinstance(data.get("base_vector"), int) or not isinstance(data.get("token"), str) \
                or not isinstance(data.get("device_id"), str):
            raise ProtocolError(f"unexpected registration answer: keys {sorted(data)}")
        return data

    def task(self) -> dict[str, Any]:
        data = self._json(self.request("GET", "/v1/task"), "GET /v1/task")
        if data.get("action") not in ("train", "wait", "done"):
            raise ProtocolError(f"unexpected task answer: action={data.get('action')!r}")
        return data

    def download_model(self, version: int, expected_sha256: str | None = None) -> bytes:
        """The bytes of a global version, checked against ``expected_sha256``."""
        return self._download(f"/v1/models/{int(version)}", expected_sha256)

    def download_model_top(self, version: int, expected_sha256: str | None = None) -> bytes:
        """A version's top-only body (``fedfs-model-top/1``), checked against ``expected_sha256``."""
        return self._download(f"/v1/models/{int(version)}/top", expected_sha256)

    def download_xi(self, expected_sha256: str | None = None) -> bytes:
        return self._download("/v1/xi", expected_sha256)

    def download_impostors(self, expected_sha256: str | None = None) -> bytes:
        """The public impostor set the server ships with its model (``GET /v1/impostors``)."""
        return self._download("/v1/impostors", expected_sha256)

    def _download(self, path: str, expected: str | None) -> bytes:
        r = self.request("GET", path)
        data = r.content
        sha = sha256_hex(data)
        if expected is not None and sha != expected:
            raise ProtocolError(f"GET {path}: content SHA-256 {sha[:12]}… differs from the expected {expected[:12]}…")
        return data

    def upload(self, round_id: int, body: bytes) -> dict[str, Any]:
        """Upload an update body; returns the receipt (``duplicate`` on a retried body)."""
        path = f"/v1/rounds/{int(round_id)}/update"
        receipt = self._json(self.request("PUT", path, content=body, content_type=MEDIA_TYPE), f"PUT {path}")
        if receipt.get("sha256") != sha256_hex(body):
            raise ProtocolError("the server's receipt does not match the uploaded body")
        return receipt

    def round_status(self, round_id: int) -> dict[str, Any]:
        return self._json(self.request("GET", f"/v1/rounds/{int(round_id)}"), "GET /v1/rounds/{id}")

    def status(self) -> dict[str, Any]:
        return self._json(self.request("GET", "/v1/rounds/current"), "GET /v1/rounds/current")

    def latest_model(self) -> dict[str, Any]:
        return self._json(self.request("GET", "/v1/models/latest"), "GET /v1/models/latest")


def _retry_after(r: httpx.Response) -> float | None:
    v = r.headers.get("Retry-After")
    try:
        d = float(v) if v is not None else None
    except ValueError:
        return None
    return d if d is not None and math.isfinite(d) and d >= 0 else None   # "nan", "-1": ignore the hint
