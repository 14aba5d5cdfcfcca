"""The device loop of the federation protocol (see ``docs/protocol.md``).

:class:`DeviceAgent` runs a device: it checks its local inputs (images, ξ, artifacts), registers
once through a :class:`~fedfs_sdk.federation.server_client.ServerClient`, keeps its secrets in a
:class:`~fedfs_sdk.federation.device_state.DeviceState`, trains whenever it is sampled — with
:class:`~fedfs_sdk.training.trainer.LocalTrainer` (torch) or, as a phone does, from ONNX Runtime
training artifacts without torch (:mod:`fedfs_sdk.federation.device_runtime`) — and uploads only
``w_c`` and ``|D_c|`` (masked, under secure aggregation). Importing this module does not
import torch.

Never sent: images, embeddings, ``r_u``, the codeword, ``θ_c``, the enrollment.

It treats ``round_closed``/``deadline_passed``/``round_failed`` (410),
``stale_model_version``/``already_uploaded`` (409) and ``not_selected`` (403) as "this round
is lost" and waits for the next task; an unreachable or failing (5xx) server as "wait and
retry", for at most ``DeviceConfig.wait_timeout_s``; everything else stops it.

Crash safety of a round: the new ``θ_c`` and the upload body are kept as a *pending*
round in the device state; ``θ_c`` replaces the stored one only after the server's
receipt. On the next start a pending round is uploaded again: a receipt (``duplicate``
when the server had it already) commits it, a refusal (round closed, failed, unknown)
discards it — ``θ_c`` never advances for an update the server did not accept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .device_config import DeviceConfig, check_local_inputs
from .device_runtime import DeviceRuntime, TorchRuntime
from .ort_runtime import OrtRuntime
from .device_state import DeviceState, DeviceStateError
from ..errors import InputError, ProtocolError
from ..training.methods import check_method, check_verification
from .agent_secure import SecureRounds
from .secagg.http_device import SecAggRoundLost
from .server_client import ServerClient, ServerError, is_transient
from .wire_format import MODEL_FORMAT, read_header, sha256_hex

LOST_ROUND_CODES = {"round_closed", "round_failed", "deadline_passed", "stale_model_version", "already_uploaded",
                    "not_selected",
                    # secure aggregation: the round moved on without this device, or it refused a step
                    "secagg_dropped", "replay_or_wrong_step", "unknown_device", "refused", "bad_message",
                    "integrity", "secure_round", "not_secure_round"}


@dataclass
class DeviceReport:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    lost_rounds: list[dict[str, Any]] = field(default_factory=list)
    finished_by_server: bool = False
    enrollment: Any = None


class DeviceAgent(SecureRounds):
    """Runs one device against a server (FedFS Alg. 1 / FedUV Alg. 2, client side).

    Args:
        client: the HTTP client (its token is set from the state).
        state: the device-state directory.
        runtime: how local training and verification run (default: :class:`OrtRuntime` when
            ``config.artifacts`` is set, else :class:`TorchRuntime` on ``config.device``).
        images: the owner's image files (or sources :func:`~fedfs_sdk.runtime.preprocess.preprocess` accepts).
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
        self._composed_sha: str | None = None   # global.safetensors holds this version composed from its top + ξ
        self._checked = batches is not None
        self._progress_at = clock()
        self._refused: set[int] = set()
        self._identity: Any = None

    def check_inputs(self) -> None:
        """:func:`check_local_inputs` once (:meth:`run` calls it before registering), and the
        secure-aggregation identity when a CA is pinned (installing ``identity_certificate``)."""
        if not self._checked:
            self._batches.update(check_local_inputs(self.images, self.config, self.runtime))
            self._checked = True
        self._load_identity()

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
        if reg.get("secure_aggregation") is True:
            self.state.mark_secure_aggregation()
        self.client.token = reg["token"]
        self._emit("registered", {"device_id": reg["device_id"], "secure_aggregation": reg.get("secure_aggregation")})

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
        self._check_transport()          # before the token travels, when secure rounds are required already
        while True:
            self._patience(self.config.wait_timeout_s - (self._clock() - self._progress_at))
            try:
                self.ensure_registered()
                break
            except ProtocolError as e:
                if not is_transient(e):
                    raise
                self._server_down(e)
        self._check_transport()
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
                    if task.get("stats_round") is not None and self.config.stats:
                        from .device_stats import take_part   # a statistics round is open for this device

                        if take_part(self) is not None:
                            self._progress_at = self._clock()
                    if self._clock() - self._progress_at > self.config.wait_timeout_s:
                        raise ProtocolError(f"no task from the server for {self.config.wait_timeout_s:.0f} s")
                    # the server's hint, bounded so a bad value neither spins nor stalls the device
                    self._sleep(min(max(float(task.get("retry_after") or 1.0), 0.05), 60.0))
                    continue
                if task.get("secagg") is not None and self.config.require_secure_aggregation is not False:
                    self.state.mark_secure_aggregation()     # from now on a plain round is refused
                    self._check_transport()
                if task.get("secagg") is None and self.secure_required():
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

    def all_images_array(self, input_size: int) -> np.ndarray:
        """Every one of the owner's images preprocessed for the model (cached per input size)."""
        if input_size not in self._batches:
            from ..runtime.preprocess import preprocess
            self._batches[input_size] = preprocess(self.images, input_size, detect_face=self.config.detect_face)
        return self._batches[input_size]

    def images_array(self, input_size: int) -> np.ndarray:
        """The images the device trains on: all of them, less the hold-out when it will check
        its models at enrollment (``config.enroll`` or ``config.impostors``: the do-no-harm check)."""
        x = self.all_images_array(input_size)
        # the check runs at every enrollment (do no harm by default): its photos are never trained on
        checks = self.config.select != "off" and (self.config.impostors is not None or self.config.enroll)
        return x[self.holdout_split()[0]] if checks else x

    def holdout_split(self) -> tuple[np.ndarray, np.ndarray]:
        """``(train, holdout)`` positions of the owner's images: photos held out by a hash of their
        name (stable when photos are added), at least two when there are enough
        (:func:`~fedfs_sdk.training.selection.holdout_count`)."""
        import hashlib

        from ..training.selection import holdout_count

        n = len(self.images)
        k = holdout_count(n, self.config.holdout)
        keys = [hashlib.sha256(str(Path(x).name if isinstance(x, (str, Path)) else i).encode()).digest()
                for i, x in enumerate(self.images)]
        order = sorted(range(n), key=lambda i: keys[i])
        hold = np.sort(np.asarray(order[:k], dtype=np.int64))
        return np.setdiff1d(np.arange(n), hold), hold

    def model_bytes(self, version: int, sha: str, task: Mapping[str, Any] | None = None) -> bytes:
        """Global model ``version`` (a fedfs checkpoint body), cached in the state by hash. Where the round
        ``task`` names the version's top-only body and ξ, only the top is downloaded and ξ's trunk put under
        it (:mod:`.model_top`: the same tensors, ~1/12 of the bytes for a MobileFaceNet); the whole model
        where that cannot be done (the device's ξ is another, the body does not check out)."""
        cached = self.state.file("global.safetensors")
        data = cached.read_bytes() if cached.is_file() else b""
        # a composed body has other bytes than the server's file (the same tensors): this process remembers it
        if sha256_hex(data) != sha and not (self._composed_sha == sha and data):
            composed = self._top_only(version, sha, task)
            data = composed or self.client.download_model(version, sha)
            self.state.save_weights_bytes("global", data)
            self._composed_sha = sha if composed else None
        if read_header(data)[1].get("format") != MODEL_FORMAT:
            raise ProtocolError(f"model version {version} is not a fedfs checkpoint")
        return data

    def _top_only(self, version: int, sha: str, task: Mapping[str, Any] | None) -> bytes | None:
        """:func:`.model_top.compose_model` of the task's top-only body and ξ, or None (then the whole model)."""
        top_sha, xi_sha = (task or {}).get("model_top_sha256"), (task or {}).get("xi_sha256")
        if not top_sha or not xi_sha:
            return None
        from .model_top import compose_model
        from .server_client import ServerError

        try:
            xi = self.xi_file(str(xi_sha))      # the server's ξ is checked there; a --xi of the device's own here
            if self.config.xi_path is not None and sha256_hex(xi.read_bytes()) != xi_sha:
                return None
            body = self.client.download_model_top(version, str(top_sha))
            data = compose_model(body, xi, sha)
        except (InputError, ProtocolError, ServerError) as e:
            self._emit("model_top_refused", {"model_version": version, "reason": str(e)[:300]})
            return None
        self._emit("model_downloaded", {"model_version": version, "top_only": True, "bytes": len(body)})
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
        self._check_dp_floor(task)       # the owner's DP floor holds in plain rounds too (issue 30)
        self._emit("round_started", {"round_id": round_id, "model_version": version, "method": method,
                                     "runtime": self.runtime.name})
        update = self.runtime.train(task, self.model_bytes(version, str(task["model_sha256"]), task), self)
        self._emit("trained", {"round_id": round_id, "num_samples": update.num_samples,
                               **{k: v for k, v in update.metrics.items() if k.endswith("_last")}})
        self.state.save_pending(round_id, version, update.body, update.personal, {
            "round_id": round_id, "model_version": version, "method": method, "num_samples": update.num_samples,
            "runtime": self.runtime.name, "at": time.time()})
        receipt = self._upload_pending(round_id, update.body)
        self._emit("uploaded", {"round_id": round_id, "bytes": len(update.body), "duplicate": receipt.get("duplicate"),
                                "clipped": receipt.get("clipped")})
        return receipt

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
        """Enroll the owner with the newest global model (and θ_c for FedFS methods), after the
        do-no-harm check when the device has a public impostor set
        (:func:`fedfs_sdk.federation.device_enrollment.enroll_device`)."""
        from .device_enrollment import enroll_device

        return enroll_device(self, after_round)



__all__ = ["DeviceAgent", "DeviceReport", "LOST_ROUND_CODES"]
