"""The device side of the federation protocol (see ``docs/protocol.md``).

:class:`ServerClient` speaks HTTP to the aggregation server (httpx): register, fetch the
task, download a global version, upload an update — with exponential back-off on
connection errors and 5xx. :class:`DeviceAgent` runs a device: it checks its local inputs
(images, ξ, artifacts), registers once, keeps its secrets in a
:class:`~fedfs_sdk.device_state.DeviceState`, trains whenever it is sampled — with
:class:`~fedfs_sdk.trainer.LocalTrainer` (torch) or, as a phone does, from ONNX Runtime
training artifacts without torch (:mod:`fedfs_sdk.device_runtime`) — and uploads only
``w_c`` and ``|D_c|``. Importing this module does not import torch.

Never sent: images, embeddings, ``r_u``, the codeword, ``θ_c``, the enrollment.

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
:class:`DeviceAgent` treats ``round_closed``/``deadline_passed``/``round_failed`` (410),
``stale_model_version``/``already_uploaded`` (409) and ``not_selected`` (403) as "this round
is lost" and waits for the next task; an unreachable or failing (5xx) server as "wait and
retry", for at most ``DeviceConfig.wait_timeout_s``; everything else stops it.
Retrying an upload is safe: the server answers a repeated body with the same receipt and
counts it once.

Crash safety of a round: the new ``θ_c`` and the upload body are kept as a *pending*
round in the device state; ``θ_c`` replaces the stored one only after the server's
receipt. On the next start a pending round is uploaded again: a receipt (``duplicate``
when the server had it already) commits it, a refusal (round closed, failed, unknown)
discards it — ``θ_c`` never advances for an update the server did not accept.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

import httpx
import numpy as np

from .device_runtime import DeviceRuntime, OrtRuntime, TorchRuntime
from .device_state import DeviceState, DeviceStateError
from .secagg.http_device import SecAggRoundLost
from .errors import CheckpointError, InputError, ProtocolError
from .methods import SCORES, VERIFY_MODELS, check_method, check_verification
from .wire_format import MEDIA_TYPE, MODEL_FORMAT, read_header, sha256_hex

USER_AGENT = "fedfs-device/1"

UNKNOWN_DEVICE_HINT = "the server no longer knows this device (was its state reset?); start with a new --state"


class ServerError(ProtocolError):
    """The server refused a request (4xx) or kept failing (5xx after all retries)."""

    def __init__(self, status: int, code: str, reason: str, method: str, path: str, hint: str | None = None) -> None:
        super().__init__(f"{method} {path} → HTTP {status} {code}: {reason}" + (f" — {hint}" if hint else ""))
        self.status, self.code, self.reason, self.hint = status, code, reason, hint


class ServerUnavailableError(ProtocolError):
    """The server could not be reached (connection refused, timeouts) after all retries."""


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


class ServerClient:
    """HTTP client of one device (or of an admin script) for one server.

    ``base_url`` is checked here (:func:`check_server_url`): a malformed URL raises
    :class:`InputError` before any request."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 60.0,
                 retry: RetryPolicy = RetryPolicy(), transport: httpx.BaseTransport | None = None,
                 audit_dir: str | Path | None = None, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[str, float], None] | None = None) -> None:
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
                                  headers={"User-Agent": USER_AGENT}, event_hooks=hooks)

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

    def download_xi(self, expected_sha256: str | None = None) -> bytes:
        return self._download("/v1/xi", expected_sha256)

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


# ---- the device loop -------------------------------------------------------------------

LOST_ROUND_CODES = {"round_closed", "round_failed", "deadline_passed", "stale_model_version", "already_uploaded",
                    "not_selected",
                    # secure aggregation: the round moved on without this device, or it refused a step
                    "secagg_dropped", "replay_or_wrong_step", "unknown_device", "refused", "bad_message",
                    "integrity", "secure_round", "not_secure_round"}

CHECK_INPUT_SIZE = 112
"""Size the images are preprocessed at when checked before registration, when the model's
input size is not known yet (MobileFaceNet's; an export folder says its own)."""


@dataclass
class DeviceConfig:
    """How a device behaves.

    Attributes:
        rounds: rounds to take part in during this run (0: until the server says ``done``).
        device: torch device for local training (``cpu``, ``cuda``).
        artifacts: an export folder (``fedfs export --formats onnx,ort-training``): train and
            verify with ONNX Runtime from it, as a phone does — no torch (:class:`OrtRuntime`).
        xi_path: local ξ checkpoint for FedFS methods (else the server's ξ is downloaded).
        wait_timeout_s: stop (with an error) after this long without progress: no task, or
            the server unreachable / failing.
        detect_face: crop faces with OpenCV before training / enrolling.
        enroll: after the last round, enroll the owner with the final model.
        q: target TPR of the enrollment warm-up (FedUV Alg. 2).
        outliers: the enrollment's outlier rule (``mad``: drop photos scoring far below the
            others before τ is set, :func:`fedfs_sdk.enrollment.enroll`; ``none``: keep all).
        enrollment_key: the device key (16/24/32 bytes): encrypts the enrollment and the
            FedUV secrets (else ``enrollment.key`` in the state).
        registration_token: presented at registration when the server requires one.
        score: how a FedUV model verifies, ``codeword`` (FedUV Eq. 5) or ``head-template``
            (a cosine template of ``W g``); ``None``: the method's default
            (:data:`fedfs_sdk.methods.DEFAULT_VERIFICATION`).
        verify: which ``fedfs+feduv`` model verifies: ``personal``, ``global`` or ``both``
            (``unit(W q') ⊕ unit(W r')``); ``None``: the method's default.
        require_secure_aggregation: take part only in secure-aggregation rounds: a round whose
            task has no ``secagg`` is refused (event ``round_refused``, nothing is trained or
            sent) — the server cannot quietly turn secure aggregation off for this device.
    """

    rounds: int = 1
    device: str = "cpu"
    artifacts: Path | None = None
    xi_path: Path | None = None
    wait_timeout_s: float = 3600.0
    detect_face: bool = False
    enroll: bool = False
    q: float = 0.9
    enrollment_key: bytes | None = None
    registration_token: str | None = None
    outliers: str = "mad"
    score: str | None = None
    verify: str | None = None
    require_secure_aggregation: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise InputError(f"rounds must be an integer ≥ 0 (0: until the server is done), got {self.rounds!r}")
        w = self.wait_timeout_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise InputError(f"the wait timeout must be a positive number of seconds, got {w!r}")
        if isinstance(self.q, bool) or not isinstance(self.q, (int, float)) or not 0 < self.q < 1:
            raise InputError(f"q (the enrollment's target TPR) must be in (0, 1), got {self.q!r}")
        if self.enrollment_key is not None and len(self.enrollment_key) not in (16, 24, 32):
            raise InputError(f"the enrollment key must be 16, 24 or 32 raw bytes, got {len(self.enrollment_key)}")
        if self.outliers not in ("mad", "none"):
            raise InputError(f"outliers (the enrollment's outlier rule) must be 'mad' or 'none', got {self.outliers!r}")
        if self.score is not None and self.score not in SCORES:
            raise InputError(f"score must be one of {SCORES} (or None for the method's default), got {self.score!r}")
        if not isinstance(self.require_secure_aggregation, bool):
            raise InputError(f"require_secure_aggregation must be True or False, got {self.require_secure_aggregation!r}")
        if self.verify is not None and self.verify not in VERIFY_MODELS:
            raise InputError(f"verify must be one of {VERIFY_MODELS} (or None for the method's default), "
                             f"got {self.verify!r}")


def check_xi_file(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a readable fedfs checkpoint (ξ for FedFS methods), else
    :class:`~fedfs_sdk.errors.CheckpointError` naming the problem (read without torch)."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"ξ checkpoint not found: {p}")
    try:
        meta = read_header(p.read_bytes())[1]
    except OSError as e:
        raise CheckpointError(f"ξ checkpoint {p} is unreadable: {e.strerror or e}") from None
    except InputError as e:
        raise CheckpointError(f"ξ checkpoint {p} is not a safetensors file: {e}") from None
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"ξ checkpoint {p} is not a fedfs checkpoint (format={meta.get('format')!r})")
    return p


def check_local_inputs(images: Sequence[Any], config: DeviceConfig,
                       runtime: DeviceRuntime | None = None) -> dict[int, np.ndarray]:
    """Everything a device needs locally, checked before it registers (so a bad image or a
    wrong path never leaves a registered device that stalls every round): every image
    decodes (and has a face with ``detect_face``), ``config.xi_path`` is a fedfs checkpoint,
    ``config.artifacts`` is a complete export. Returns the preprocessed images by input
    size (a cache for :class:`DeviceAgent`)."""
    from .preprocess import preprocess

    if len(images) == 0:
        raise InputError("a device needs at least one image")
    size = CHECK_INPUT_SIZE
    if config.artifacts is not None:
        rt = runtime if isinstance(runtime, OrtRuntime) else OrtRuntime(config.artifacts)
        size = rt.check(enroll=config.enroll)
    if config.xi_path is not None:
        check_xi_file(config.xi_path)
    return {size: preprocess(list(images), size, detect_face=config.detect_face)}


@dataclass
class DeviceReport:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    lost_rounds: list[dict[str, Any]] = field(default_factory=list)
    finished_by_server: bool = False
    enrollment: Any = None


class DeviceAgent:
    """Runs one device against a server (FedFS Alg. 1 / FedUV Alg. 2, client side).

    Args:
        client: the HTTP client (its token is set from the state).
        state: the device-state directory.
        runtime: how local training and verification run (default: :class:`OrtRuntime` when
            ``config.artifacts`` is set, else :class:`TorchRuntime` on ``config.device``).
        images: the owner's image files (or sources :func:`~fedfs_sdk.preprocess.preprocess` accepts).
        config: behaviour.
        on_event: ``(name, fields)`` callback for progress (the CLI prints it).
        batches: the result of :func:`check_local_inputs` when the caller already checked
            the inputs (else :meth:`run` checks them before registering).
    """

    def __init__(self, client: ServerClient, state: DeviceState, images: Sequence[Any],
                 config: DeviceConfig = DeviceConfig(),
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 runtime: DeviceRuntime | None = None, batches: Mapping[int, np.ndarray] | None = None) -> None:
        if len(images) == 0:
            raise InputError("a device needs at least one image")
        self.client, self.state, self.images, self.config = client, state, list(images), config
        if config.enrollment_key is not None:
            state.use_key(config.enrollment_key)       # the app's key also encrypts the FedUV secrets
        if runtime is None:
            runtime = OrtRuntime(config.artifacts) if config.artifacts is not None else TorchRuntime(config.device)
        self.runtime = runtime
        self._emit = on_event or (lambda name, fields: None)
        self._sleep, self._clock = sleep, clock
        self._batches: dict[int, np.ndarray] = dict(batches or {})
        self._checked = batches is not None
        self._progress_at = clock()
        self._refused: set[int] = set()

    def check_inputs(self) -> None:
        """:func:`check_local_inputs` once (:meth:`run` calls it before registering)."""
        if not self._checked:
            self._batches.update(check_local_inputs(self.images, self.config, self.runtime))
            self._checked = True

    # ---- registration ------------------------------------------------------------------

    def ensure_registered(self) -> None:
        info = self.state.info
        if info is not None:
            if info.server.rstrip("/") != self.client.base_url:
                raise DeviceStateError(f"device state {self.state.path} belongs to server {info.server}, "
                                       f"not {self.client.base_url}; use another --state")
            token = self.state.token
            if not token:
                raise DeviceStateError(f"device state {self.state.path} has no token")
            self.client.token = token
            return
        reg = self.client.register(self.config.registration_token)
        self.state.save_registration(self.client.base_url, reg["device_id"], reg["token"], reg["base_vector"])
        self.client.token = reg["token"]
        self._emit("registered", {"device_id": reg["device_id"]})

    # ---- main loop ---------------------------------------------------------------------

    def run(self) -> DeviceReport:
        """Take part in rounds until ``config.rounds`` are done or the server says ``done``.

        Local inputs are checked first, before registration. While the server is
        unreachable or failing (5xx), the device waits and retries — for at most
        ``config.wait_timeout_s`` without progress (event ``server_unreachable``)."""
        self.check_inputs()
        report = DeviceReport()
        self._progress_at = self._clock()
        try:
            self._take_part(report)
        finally:
            self._patience(None)
        if self.config.enroll:
            last = report.rounds[-1]["round_id"] if report.rounds else None
            report.enrollment = self.enroll(after_round=last)
        return report

    def _patience(self, left: float | None) -> None:
        """Let the client's own retries stop when the wait timeout would pass."""
        try:
            self.client.retry_until = None if left is None else time.monotonic() + max(left, 0.0)
        except AttributeError:      # a client without retries
            pass

    def _take_part(self, report: DeviceReport) -> None:
        while True:
            self._patience(self.config.wait_timeout_s - (self._clock() - self._progress_at))
            try:
                self.ensure_registered()
                break
            except ProtocolError as e:
                if not is_transient(e):
                    raise
                self._server_down(e)
        while self.config.rounds == 0 or len(report.rounds) < self.config.rounds:
            self._patience(self.config.wait_timeout_s - (self._clock() - self._progress_at))
            try:
                if self.state.has_pending():
                    self.resume_pending(report)
                    continue
                task = self.client.task()
                if task["action"] == "done":
                    report.finished_by_server = True
                    self._emit("server_done", {"model_version": task.get("model_version")})
                    break
                if task["action"] == "wait":
                    if self._clock() - self._progress_at > self.config.wait_timeout_s:
                        raise ProtocolError(f"no task from the server for {self.config.wait_timeout_s:.0f} s")
                    # the server's hint, bounded so a bad value neither spins nor stalls the device
                    self._sleep(min(max(float(task.get("retry_after") or 1.0), 0.05), 60.0))
                    continue
                if self.config.require_secure_aggregation and task.get("secagg") is None:
                    self._refuse_plain(report, task)
                    continue
                self._progress_at = self._clock()         # a task is progress: the round gets the full timeout
                self._patience(self.config.wait_timeout_s)
                try:
                    report.rounds.append(self.run_round(task))
                except (ServerError, SecAggRoundLost) as e:
                    if e.code not in LOST_ROUND_CODES:
                        raise
                    self._lost(report, int(task["round_id"]), e)
                self._progress_at = self._clock()
            except ProtocolError as e:
                if not is_transient(e):
                    raise
                self._server_down(e)

    def _refuse_plain(self, report: DeviceReport, task: Mapping[str, Any]) -> None:
        """A plain round offered to a device that requires secure aggregation: record it once,
        then wait like for ``wait`` (the server offers it again until it closes)."""
        round_id = int(task["round_id"])
        if round_id not in self._refused:
            self._refused.add(round_id)
            reason = "the round does not run secure aggregation and this device requires it"
            report.lost_rounds.append({"round_id": round_id, "code": "not_secure_round", "reason": reason})
            self._emit("round_refused", {"round_id": round_id, "reason": reason})
        if self._clock() - self._progress_at > self.config.wait_timeout_s:
            raise ProtocolError(f"no secure-aggregation round from the server for {self.config.wait_timeout_s:.0f} s")
        self._sleep(1.0)

    def _lost(self, report: DeviceReport, round_id: int, e: "ServerError | SecAggRoundLost") -> None:
        report.lost_rounds.append({"round_id": round_id, "code": e.code, "reason": e.reason})
        self._emit("round_lost", {"round_id": round_id, "code": e.code, "reason": e.reason})
        self._progress_at = self._clock()

    def _server_down(self, e: ProtocolError) -> None:
        """Wait for an unreachable / failing server, or give up after ``wait_timeout_s``."""
        waited = self._clock() - self._progress_at
        left = self.config.wait_timeout_s - waited
        if left <= 0:
            raise ProtocolError(f"the server has been unreachable or failing for {waited:.0f} s "
                                f"(wait timeout {self.config.wait_timeout_s:.0f} s): {e}") from e
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
        self._emit("server_unreachable", {"error": str(e), "retrying_until": until})
        self._sleep(min(1.0, left))

    def images_array(self, input_size: int) -> np.ndarray:
        """The owner's images preprocessed for the model (cached per input size)."""
        if input_size not in self._batches:
            from .preprocess import preprocess
            self._batches[input_size] = preprocess(self.images, input_size, detect_face=self.config.detect_face)
        return self._batches[input_size]

    def model_bytes(self, version: int, sha: str) -> bytes:
        """Global model ``version`` (a fedfs checkpoint body), cached in the state by hash."""
        cached = self.state.file("global.safetensors")
        data = cached.read_bytes() if cached.is_file() else b""
        if sha256_hex(data) != sha:
            data = self.client.download_model(version, sha)
            self.state.save_weights_bytes("global", data)
        if read_header(data)[1].get("format") != MODEL_FORMAT:
            raise ProtocolError(f"model version {version} is not a fedfs checkpoint")
        return data

    def xi_file(self, sha: str | None) -> Path:
        """The frozen ξ for FedFS methods: ``config.xi_path``, else the server's (downloaded once)."""
        if self.config.xi_path is not None:
            return Path(self.config.xi_path)
        if sha is None:
            raise InputError("this round trains a FedFS method, which needs ξ; the server serves none: pass --xi")
        path = self.state.file("xi.safetensors")
        if not (path.is_file() and sha256_hex(path.read_bytes()) == sha):
            self.state.save_weights_bytes("xi", self.client.download_xi(sha))
        return path

    def run_round(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """Download, train locally (:attr:`runtime`), upload. Returns the server's receipt.

        The new ``θ_c`` is kept as a pending round until the server's receipt; a refused
        upload discards it (``θ_c`` stays as it was), a failed one leaves it for
        :meth:`resume_pending`."""
        round_id, version, method = int(task["round_id"]), int(task["model_version"]), str(task["method"])
        if self.config.enroll:      # before training: a verification the method cannot do fails now, not after
            check_verification(check_method(method), self.config.score, self.config.verify)
        if task.get("secagg") is not None:
            return self._run_secure_round(task)
        self._emit("round_started", {"round_id": round_id, "model_version": version, "method": method,
                                     "runtime": self.runtime.name})
        update = self.runtime.train(task, self.model_bytes(version, str(task["model_sha256"])), self)
        self._emit("trained", {"round_id": round_id, "num_samples": update.num_samples,
                               **{k: v for k, v in update.metrics.items() if k.endswith("_last")}})
        self.state.save_pending(round_id, version, update.body, update.personal, {
            "round_id": round_id, "model_version": version, "method": method, "num_samples": update.num_samples,
            "runtime": self.runtime.name, "at": time.time()})
        receipt = self._upload_pending(round_id, update.body)
        self._emit("uploaded", {"round_id": round_id, "bytes": len(update.body), "duplicate": receipt.get("duplicate"),
                                "clipped": receipt.get("clipped")})
        return receipt

    def _run_secure_round(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """A secure-aggregation round (Bonawitz et al. 2017; docs/privacy.md): advertise keys and
        share them before training, then upload only the masked ``n·w`` (and ``n``) and answer
        the unmask request. The plain update body never leaves the device: it is kept as the
        pending round only so that ``θ_c`` advances once the masked input is accepted, and a
        secure pending round is never uploaded again (:meth:`resume_pending` discards it)."""
        from .secagg.http_device import SecAggSession

        round_id, version, method = int(task["round_id"]), int(task["model_version"]), str(task["method"])
        session = SecAggSession(self.client, task, sleep=self._sleep, clock=self._clock,
                                wait_timeout_s=self.config.wait_timeout_s)
        self._emit("round_started", {"round_id": round_id, "model_version": version, "method": method,
                                     "runtime": self.runtime.name, "secure_aggregation": True})
        session.advertise()
        session.share_keys()
        update = self.runtime.train(task, self.model_bytes(version, str(task["model_sha256"])), self)
        self._emit("trained", {"round_id": round_id, "num_samples": update.num_samples,
                               **{k: v for k, v in update.metrics.items() if k.endswith("_last")}})
        self.state.save_pending(round_id, version, update.body, update.personal, {
            "round_id": round_id, "model_version": version, "method": method, "num_samples": update.num_samples,
            "runtime": self.runtime.name, "secure_aggregation": True, "at": time.time()})
        try:
            receipt = session.masked_input(update.body)
        except BaseException:
            self.state.discard_pending()           # not in the sum: θ_c does not advance
            raise
        self.state.commit_pending(receipt)          # counted (unless the whole round fails)
        self._emit("uploaded", {"round_id": round_id, "bytes": session.bytes_sent, "secure_aggregation": True,
                                "clipped_weights": receipt.get("n_clipped")})
        session.unmask()
        done = session.result()
        self._emit("secure_round_done", {"round_id": round_id, "result_version": done.get("result_version"),
                                         "bytes_sent": session.bytes_sent, "bytes_received": session.bytes_received})
        return {**receipt, "round_id": round_id, "result_version": done.get("result_version"),
                "secure_aggregation": True}

    def _upload_pending(self, round_id: int, body: bytes) -> dict[str, Any]:
        try:
            receipt = self.client.upload(round_id, body)
        except ServerError as e:
            if not is_transient(e) and e.status != 401:
                self.state.discard_pending()       # refused for good: θ_c does not advance
            raise
        self.state.commit_pending(receipt)          # accepted: record the round, θ_c ← the pending one
        return receipt

    def resume_pending(self, report: DeviceReport | None = None) -> dict[str, Any] | None:
        """Settle a round left pending by an earlier run (a crash, a lost answer): upload its
        body again. A receipt — ``duplicate`` if the server had it — commits it (records the
        round, installs its ``θ_c``); a refusal (closed, failed or unknown round …) discards
        it. Returns the receipt, or None when there was nothing to settle or it was lost."""
        pend = self.state.pending()
        if pend is None:
            return None
        round_id = int(pend["round_id"])
        if (pend.get("record") or {}).get("secure_aggregation"):
            # a secure round interrupted before its masked input was accepted: its keys are gone
            # with the process, and the plain body must never be sent — drop it (θ_c stays)
            self.state.discard_pending()
            self._emit("secure_round_abandoned", {"round_id": round_id})
            return None
        self._emit("resuming_upload", {"round_id": round_id, "model_version": pend.get("model_version")})
        try:
            receipt = self._upload_pending(round_id, pend["body"])
        except ServerError as e:
            if is_transient(e) or e.status == 401:
                raise
            if report is not None:
                self._lost(report, round_id, e)
            return None
        if report is not None:
            report.rounds.append(receipt)
        self._progress_at = self._clock()
        self._emit("uploaded", {"round_id": round_id, "bytes": len(pend["body"]), "duplicate": receipt.get("duplicate"),
                                "clipped": receipt.get("clipped"), "resumed": True})
        return receipt

    # ---- enrollment --------------------------------------------------------------------

    def enroll(self, after_round: int | None = None):
        """Enroll the owner with the newest global model (and θ_c for FedFS methods).

        Waits for ``after_round`` to close so the model includes this device's last update.
        Writes the encrypted ``enrollment.fedfs`` into the device state (the torch runtime
        also ``verifier.safetensors``, what ``fedfs verify --model`` takes); returns the
        enrollment.
        """
        from .enrollment import enroll, save_enrollment

        if after_round is not None:
            t0 = self._clock()
            while self.client.round_status(after_round)["state"] == "open":
                if self._clock() - t0 > self.config.wait_timeout_s:
                    raise ProtocolError(f"round {after_round} did not close within {self.config.wait_timeout_s:.0f} s")
                self._sleep(1.0)
        info = self.client.latest_model()
        method = (self.state.info.rounds[-1]["method"] if self.state.info and self.state.info.rounds
                  else ("feduv" if info["config"].get("code_length") else "fedfs"))
        version = int(info["version"])
        score, model = check_verification(check_method(method), self.config.score, self.config.verify)
        backend = self.runtime.verifier(method, self.model_bytes(version, info["sha256"]), self, version, model)
        codeword = self.state.load_codeword() if score == "codeword" else None
        # a single model's head-template is the cosine of its uv output (σ keeps W g's direction);
        # the dual verifier's embedding is already unit(W q') ⊕ unit(W r')
        template_output = "uv" if score == "head-template" and model != "both" else "embedding"
        enrollment = enroll(backend, self.images, q=self.config.q, codeword=codeword,
                            detect_face=self.config.detect_face, outliers=self.config.outliers,
                            template_output=template_output,
                            meta={"global_version": version, "method": method, "runtime": self.runtime.name,
                                  "score": score, "verify": model})
        key = self.config.enrollment_key or self.state.enrollment_key()
        save_enrollment(self.state.file("enrollment.fedfs"), enrollment, key, overwrite=True)
        self._emit("enrollment_outliers", {"rule": enrollment.meta["outlier_rule"], "dropped": enrollment.meta["dropped"],
                                           "n_given": enrollment.meta["n_given"]})
        self._emit("enrolled", {"mode": enrollment.mode, "threshold": enrollment.threshold,
                                "model_id": backend.model_id, "n_warmup": enrollment.n_warmup})
        return enrollment


__all__ = ["ServerClient", "ServerError", "ServerUnavailableError", "RetryPolicy", "RequestRecorder", "DeviceAgent",
           "DeviceConfig", "DeviceReport", "LOST_ROUND_CODES", "TorchRuntime", "OrtRuntime", "check_server_url",
           "check_local_inputs", "check_xi_file", "is_transient"]
