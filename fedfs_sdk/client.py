"""The device side of the federation protocol (see ``docs/protocol.md``).

:class:`ServerClient` speaks HTTP to the aggregation server (httpx): register, fetch the
task, download a global version, upload an update — with exponential back-off on
connection errors and 5xx. :class:`DeviceAgent` runs a device: it registers once, keeps
its secrets in a :class:`~fedfs_sdk.device_state.DeviceState`, trains whenever it is
sampled — with :class:`~fedfs_sdk.trainer.LocalTrainer` (torch) or, as a phone does, from
ONNX Runtime training artifacts without torch (:mod:`fedfs_sdk.device_runtime`) — and
uploads only ``w_c`` and ``|D_c|``. Importing this module does not import torch.

Never sent: images, embeddings, ``r_u``, the codeword, ``θ_c``, the enrollment.

Retry rules:
    * connection errors, timeouts, 5xx, 429 → retried with exponential back-off and
      jitter (``Retry-After`` honoured), up to :attr:`RetryPolicy.attempts` tries;
    * any other 4xx → not retried: :class:`ServerError` with the server's code and reason.
      :class:`DeviceAgent` treats ``round_closed``/``deadline_passed`` (410),
      ``stale_model_version``/``already_uploaded`` (409) and ``not_selected`` (403) as
      "this round is lost" and waits for the next task; everything else stops it.
Retrying an upload is safe: the server answers a repeated body with the same receipt and
counts it once. Retrying a registration whose answer was lost can leave an unused device
record on the server; the device keeps only the registration it received.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx
import numpy as np

from .device_runtime import DeviceRuntime, OrtRuntime, TorchRuntime
from .device_state import DeviceState, DeviceStateError
from .errors import InputError, ProtocolError
from .methods import uses_feduv
from .wire_format import MEDIA_TYPE, MODEL_FORMAT, read_header, sha256_hex

USER_AGENT = "fedfs-device/1"


class ServerError(ProtocolError):
    """The server refused a request (4xx) or kept failing (5xx after all retries)."""

    def __init__(self, status: int, code: str, reason: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path} → HTTP {status} {code}: {reason}")
        self.status, self.code, self.reason = status, code, reason


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


class RequestRecorder:
    """httpx request hook writing every request body this client sends to ``directory``
    (``index.jsonl`` + one file per body) — so a user can audit exactly what left the
    device. Headers are not recorded (they carry the token)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        index = self.dir / "index.jsonl"
        self._n = len(index.read_text().splitlines()) if index.is_file() else 0

    def __call__(self, request: httpx.Request) -> None:
        body = request.content
        self._n += 1
        name = f"{self._n:05d}.bin" if body else None
        if name:
            (self.dir / name).write_bytes(body)
        entry = {"seq": self._n, "method": request.method, "path": request.url.path, "bytes": len(body),
                 "sha256": sha256_hex(body), "file": name}
        with open(self.dir / "index.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


class ServerClient:
    """HTTP client of one device (or of an admin script) for one server."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 60.0,
                 retry: RetryPolicy = RetryPolicy(), transport: httpx.BaseTransport | None = None,
                 audit_dir: str | Path | None = None, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[str, float], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = retry
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
                token: str | None = None, content_type: str | None = None) -> httpx.Response:
        """Send with retries (see module docstring); raise :class:`ServerError` on a refusal."""
        headers: dict[str, str] = {}
        tok = token if token is not None else self.token
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        if content_type:
            headers["Content-Type"] = content_type
        last: Exception | None = None
        for attempt in range(self.retry.attempts):
            try:
                r = self._http.request(method, path, content=content, json=json_body, headers=headers)
            except httpx.TransportError as e:          # connection refused/reset, timeout, protocol error
                last = e
                if attempt + 1 < self.retry.attempts:
                    self._wait(self.retry.delay(attempt), f"{method} {path}: {e}")
                continue
            if r.status_code < 400:
                return r
            code, reason = _error_of(r)
            last = ServerError(r.status_code, code, reason, method, path)
            if r.status_code >= 500 or r.status_code == 429:
                if attempt + 1 < self.retry.attempts:
                    self._wait(self.retry.delay(attempt, _retry_after(r)), str(last))
                continue
            raise last
        if isinstance(last, ServerError):
            raise last
        raise ProtocolError(f"{method} {path}: server unreachable after {self.retry.attempts} tries: {last}") from last

    def _wait(self, delay: float, why: str) -> None:
        if self._on_retry is not None:
            self._on_retry(why, delay)
        self._sleep(delay)

    # ---- endpoints -------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health").json()

    def register(self, registration_token: str | None = None) -> dict[str, Any]:
        """Register: ``{device_id, token, base_vector, base_bits}``."""
        data = self.request("POST", "/v1/devices", token=registration_token or "").json()
        if not isinstance(data.get("base_vector"), int) or not isinstance(data.get("token"), str):
            raise ProtocolError(f"unexpected registration answer: keys {sorted(data)}")
        return data

    def task(self) -> dict[str, Any]:
        data = self.request("GET", "/v1/task").json()
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
        receipt = self.request("PUT", f"/v1/rounds/{int(round_id)}/update", content=body,
                               content_type=MEDIA_TYPE).json()
        if receipt.get("sha256") != sha256_hex(body):
            raise ProtocolError("the server's receipt does not match the uploaded body")
        return receipt

    def round_status(self, round_id: int) -> dict[str, Any]:
        return self.request("GET", f"/v1/rounds/{int(round_id)}").json()

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/rounds/current").json()

    def latest_model(self) -> dict[str, Any]:
        return self.request("GET", "/v1/models/latest").json()


def _error_of(r: httpx.Response) -> tuple[str, str]:
    try:
        d = r.json()
        return str(d.get("error", "error")), str(d.get("reason", d))
    except (ValueError, AttributeError):
        return "error", r.text[:200] or r.reason_phrase


def _retry_after(r: httpx.Response) -> float | None:
    v = r.headers.get("Retry-After")
    try:
        d = float(v) if v is not None else None
    except ValueError:
        return None
    return d if d is not None and math.isfinite(d) and d >= 0 else None   # "nan", "-1": ignore the hint


# ---- the device loop -------------------------------------------------------------------

LOST_ROUND_CODES = {"round_closed", "round_failed", "deadline_passed", "stale_model_version", "already_uploaded",
                    "not_selected"}


@dataclass
class DeviceConfig:
    """How a device behaves.

    Attributes:
        rounds: rounds to take part in during this run (0: until the server says ``done``).
        device: torch device for local training (``cpu``, ``cuda``).
        artifacts: an export folder (``fedfs export --formats onnx,ort-training``): train and
            verify with ONNX Runtime from it, as a phone does — no torch (:class:`OrtRuntime`).
        xi_path: local ξ checkpoint for FedFS methods (else the server's ξ is downloaded).
        wait_timeout_s: stop (with an error) after waiting this long without a task.
        detect_face: crop faces with OpenCV before training / enrolling.
        enroll: after the last round, enroll the owner with the final model.
        q: target TPR of the enrollment warm-up (FedUV Alg. 2).
        enrollment_key: AES-GCM key of the enrollment (else ``enrollment.key`` in the state).
        registration_token: presented at registration when the server requires one.
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
    """

    def __init__(self, client: ServerClient, state: DeviceState, images: Sequence[Any],
                 config: DeviceConfig = DeviceConfig(),
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 runtime: DeviceRuntime | None = None) -> None:
        if len(images) == 0:
            raise InputError("a device needs at least one image")
        self.client, self.state, self.images, self.config = client, state, list(images), config
        if runtime is None:
            runtime = OrtRuntime(config.artifacts) if config.artifacts is not None else TorchRuntime(config.device)
        self.runtime = runtime
        self._emit = on_event or (lambda name, fields: None)
        self._sleep, self._clock = sleep, clock
        self._batches: dict[int, np.ndarray] = {}

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
        """Take part in rounds until ``config.rounds`` are done or the server says ``done``."""
        self.ensure_registered()
        report = DeviceReport()
        waited_since = self._clock()
        while self.config.rounds == 0 or len(report.rounds) < self.config.rounds:
            task = self.client.task()
            if task["action"] == "done":
                report.finished_by_server = True
                self._emit("server_done", {"model_version": task.get("model_version")})
                break
            if task["action"] == "wait":
                if self._clock() - waited_since > self.config.wait_timeout_s:
                    raise ProtocolError(f"no task from the server for {self.config.wait_timeout_s:.0f} s")
                # the server's hint, bounded so a bad value neither spins nor stalls the device
                self._sleep(min(max(float(task.get("retry_after") or 1.0), 0.05), 60.0))
                continue
            try:
                report.rounds.append(self.run_round(task))
            except ServerError as e:
                if e.code not in LOST_ROUND_CODES:
                    raise
                report.lost_rounds.append({"round_id": task["round_id"], "code": e.code, "reason": e.reason})
                self._emit("round_lost", {"round_id": task["round_id"], "code": e.code, "reason": e.reason})
            waited_since = self._clock()
        if self.config.enroll:
            last = report.rounds[-1]["round_id"] if report.rounds else None
            report.enrollment = self.enroll(after_round=last)
        return report

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
        """Download, train locally (:attr:`runtime`), upload. Returns the server's receipt."""
        round_id, version, method = int(task["round_id"]), int(task["model_version"]), str(task["method"])
        self._emit("round_started", {"round_id": round_id, "model_version": version, "method": method,
                                     "runtime": self.runtime.name})
        update = self.runtime.train(task, self.model_bytes(version, str(task["model_sha256"])), self)
        self._emit("trained", {"round_id": round_id, "num_samples": update.num_samples,
                               **{k: v for k, v in update.metrics.items() if k.endswith("_last")}})
        receipt = self.client.upload(round_id, update.body)
        self.state.record_round({"round_id": round_id, "model_version": version, "method": method,
                                 "num_samples": update.num_samples, "sha256": receipt["sha256"],
                                 "runtime": self.runtime.name, "at": time.time()})
        self._emit("uploaded", {"round_id": round_id, "bytes": len(update.body), "duplicate": receipt.get("duplicate"),
                                "clipped": receipt.get("clipped")})
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
        backend = self.runtime.verifier(method, self.model_bytes(version, info["sha256"]), self, version)
        codeword = self.state.load_codeword() if uses_feduv(method) else None
        enrollment = enroll(backend, self.images, q=self.config.q, codeword=codeword,
                            detect_face=self.config.detect_face,
                            meta={"global_version": version, "method": method, "runtime": self.runtime.name})
        key = self.config.enrollment_key or self.state.enrollment_key()
        save_enrollment(self.state.file("enrollment.fedfs"), enrollment, key, overwrite=True)
        self._emit("enrolled", {"mode": enrollment.mode, "threshold": enrollment.threshold,
                                "model_id": backend.model_id, "n_warmup": enrollment.n_warmup})
        return enrollment


__all__ = ["ServerClient", "ServerError", "RetryPolicy", "RequestRecorder", "DeviceAgent", "DeviceConfig",
           "DeviceReport", "LOST_ROUND_CODES", "TorchRuntime", "OrtRuntime"]
