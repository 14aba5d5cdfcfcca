"""The deployment side of ``benchmarks/deployment_rehearsal.py``: an operator CA, a real
``fedfs serve`` process (HTTPS, ``fedfs-secagg/2``) and many :class:`DeviceAgent` s in one process.

Nothing here re-implements the protocol: the CA, the TLS certificate and the revocation list come
from the functions behind ``fedfs ca init / tls-cert / revoke / request / sign``, the server is the
``fedfs serve`` command line in a subprocess, and every device is a
:class:`~fedfs_sdk.federation.agent.DeviceAgent` built as ``fedfs device`` builds it (its own
:class:`~fedfs_sdk.federation.device_state.DeviceState`, identity key, certificate, key file, and
only its owner's photos). So what changes in the agent or the server flows in untouched.

The server's flags live in one place, :func:`server_flags` (e.g. to open statistics rounds once
``fedfs serve`` has a flag for them, add it there or pass ``--server-arg`` to the rehearsal).
"""
from __future__ import annotations

import json
import math
import os
import resource
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServerPlan:
    """What the rehearsal's server runs: the simulator's federation settings (method, T, p,
    seed, local SGD) with ξ and the public impostor set the simulator's devices ship with."""

    xi: str                       # a checkpoint path or a built-in name (dlib-resnet)
    impostors: Path | None        # fedfs-impostors/1 npz (None: devices keep ξ, the server ships none)
    method: str                   # fedfs | feduv | fedfs+feduv
    rounds: int
    participation: float
    seed: int
    train: dict[str, Any]         # the round task's ``train`` object (TRAIN_KEYS)
    extra: tuple[str, ...] = ()   # more `fedfs serve` flags (--server-arg)
    poll_interval: float = 2.0    # the server's retry_after hint: every waiting device polls this often


def server_flags(plan: ServerPlan, operator: "Operator", state: Path, port: int, rounds: int = 0) -> list[str]:
    """Every ``fedfs serve`` flag of the rehearsal, in one place. Rounds are not opened here
    (``rounds=0``): :func:`start_rounds` sets ``rounds``/``min_participants`` once every device
    has registered, so round 1 samples from all of them, as the simulator's does."""
    flags = ["--host", "127.0.0.1", "--port", str(port), "--state", str(state),
             # TLS with the operator's certificate; fedfs-secagg/2 authenticated by the CA (kept in operator.dir)
             "--tls-cert", str(operator.tls_cert), "--tls-key", str(operator.tls_key),
             "--secure-aggregation", "--secagg-ca", str(operator.ca_pub),
             # the model and the method: ξ (the global model starts from it) and the shipped impostors
             "--xi", plan.xi, "--method", plan.method, "--train", json.dumps(plan.train),
             # the federation: the simulator's T, p and seed
             "--rounds", str(rounds), "--participation", str(plan.participation), "--seed", str(plan.seed),
             # many devices on a shared 2-core machine: generous deadlines, every registered device eligible
             "--round-timeout", "7200", "--secagg-phase-timeout", "1800", "--device-ttl", "0",
             "--poll-interval", str(plan.poll_interval), "--log-level", "warning"]
    if plan.impostors is not None:
        flags += ["--impostors", str(plan.impostors)]
    return flags + list(plan.extra)


class Operator:
    """The operator's CA (its own directory, never the server's state), the server's TLS
    certificate, and the signed revocation list the devices require (``fedfs ca …``)."""

    def __init__(self, directory: Path, existing: bool = False) -> None:
        from fedfs_sdk.federation.secagg.identity import CertificateAuthority
        from fedfs_sdk.federation.tls_cert import write_server_certificate

        self.dir = directory
        if existing:        # the operator of an earlier run (--resume)
            self.ca, self.ca_pub = CertificateAuthority.load(directory), directory / "ca.pub"
            self.tls_cert, self.tls_key = directory / "tls" / "server.pem", directory / "tls" / "server.key"
            return
        self.ca = CertificateAuthority.generate()
        _, self.ca_pub = self.ca.save(directory)
        self.tls_cert, self.tls_key = write_server_certificate(directory / "tls", [])

    def revocation_list(self, out: Path) -> None:
        """``fedfs ca revoke --out``: the (empty) signed list, copied into the server's state."""
        from fedfs_sdk.federation.secagg.revocation import issue

        issue(self.ca, None, []).save(out)

    def certify(self, request: dict[str, Any], out: Path) -> None:
        """``fedfs ca sign``: the device's identity certificate."""
        self.ca.sign_request(request, None, 30).save(out)


class Server:
    """``fedfs serve`` as a subprocess (its own process: its CPU time is measured apart)."""

    def __init__(self, flags: list[str], state: Path, env: dict[str, str], log: Path) -> None:
        self.state, self.log = state, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "fedfs_sdk.cli.main", "serve", *flags], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, url: str, pem: Path, timeout: float = 180.0) -> None:
        ctx = ssl.create_default_context(cafile=str(pem))
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fedfs serve exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", verify=ctx, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"fedfs serve did not come up in {timeout:.0f} s: {self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def cpu_seconds(self) -> float:
        """user + system CPU of the server process so far (Linux /proc)."""
        try:
            parts = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def round_times(state: Path) -> list[float]:
    """Seconds from opening to closing of each closed round (the server's database)."""
    import sqlite3

    db = sqlite3.connect(f"file:{state / 'server.db'}?mode=ro", uri=True)
    try:
        return [float(c - o) for o, c in db.execute(
            "SELECT opened_at, closed_at FROM rounds WHERE state = 'closed' ORDER BY id")]
    finally:
        db.close()


def admin(url: str, state: Path, pem: Path, method: str, path: str, body: Any = None) -> Any:
    """An admin request with the token the server generated into its state."""
    token = (state / "admin_token").read_text().strip()
    r = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {token}"},
                      verify=ssl.create_default_context(cafile=str(pem)), timeout=60)
    r.raise_for_status()
    return r.json()


def start_rounds(url: str, state: Path, pem: Path, rounds: int) -> None:
    """Every device is registered: let the server run ``rounds`` rounds on its own (a secure round
    needs at least 3 devices; the sample is ⌈p·N⌉ of all N, as in the simulator)."""
    admin(url, state, pem, "PUT", "/v1/admin/config", {"rounds": int(rounds), "min_participants": 3})


class CountingTransport(httpx.BaseTransport):
    """Bytes a device sends (request bodies) and receives (response bodies) over HTTPS."""

    def __init__(self, pem: Path) -> None:
        from fedfs_sdk.federation.server_client import tls_context

        self.inner = httpx.HTTPTransport(verify=tls_context(pem))
        self.sent = self.received = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += len(request.read())
        r = self.inner.handle_request(request)
        body = r.read()
        self.received += len(body)
        return httpx.Response(r.status_code, headers=r.headers, content=body, request=request,
                              extensions=r.extensions)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Device:
    """One rehearsal device: client ``client`` of the split, its state folder and photos."""

    client: int
    dir: Path
    photos: list[str]
    cert: Path
    q: float = 0.9                # the enrollment's target TPR (lowered where the photos are too few for it)
    batches: Any = None           # check_local_inputs' preprocessed photos
    score: str | None = None      # DeviceConfig.score (None: the method's default)
    artifacts: Path | None = None  # a phone: `fedfs device --artifacts EXPORT` (ONNX Runtime, no torch)
    report: Any = None
    error: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    sent: int = 0
    received: int = 0
    events: list[tuple[str, float, float]] = field(default_factory=list)   # (name, wall s, thread CPU s)

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"


def write_photos(folder: Path, images_u8: np.ndarray) -> list[str]:
    """The owner's photos as PNG files (lossless: the device reads exactly the simulator's pixels)."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, im in enumerate(images_u8):
        p = folder / f"photo_{i:03d}.png"
        cv2.imwrite(str(p), np.ascontiguousarray(im[..., ::-1]))       # RGB → OpenCV's BGR
        out.append(str(p))
    return out


def device_q(q: float, n_photos: int) -> float:
    """``q``, or the largest q (in steps of 0.001) that ``n_photos`` warm-up photos allow
    (``⌈1/(1−q)⌉ ≤ n``): a device refuses ``--enroll`` with too few photos for its q, while the
    simulator's evaluation only flags such clients (``n_insufficient``)."""
    from fedfs_sdk.runtime.enrollment import min_warmup_images

    while min_warmup_images(q) > n_photos and q > 0.5:
        q = math.floor(min(q, 1 - 1 / n_photos) * 1000 - 1e-9) / 1000
    return q


def check_inputs(dev: Device, operator: Operator, outliers: str) -> None:
    """What ``fedfs device`` checks before it registers (photos decode, enough for q): a device
    that would refuse to run must never be registered — the server would sample it and a secure
    round would wait for it until its phase deadline."""
    from fedfs_sdk.federation.device_config import check_local_inputs

    dev.batches = check_local_inputs(dev.photos, device_config(dev, operator, dev.q, outliers, score=dev.score),
                                     runtime=phone_runtime(dev))


def register(dev: Device, url: str, operator: Operator) -> None:
    """``fedfs ca request --server`` (register, identity key, request) and ``fedfs ca sign``."""
    from fedfs_sdk.federation.device_identity import identity_request
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient

    with DeviceState(dev.state_dir) as state:
        with ServerClient(url, tls_ca=operator.tls_cert) as client:
            reg = client.register(None)
        state.save_registration(client.base_url, reg["device_id"], reg["token"], reg["base_vector"])
        if reg.get("secure_aggregation") is True:
            state.mark_secure_aggregation()
        request = identity_request(state)
    operator.certify(request, dev.cert)


def device_config(dev: Device, operator: Operator, q: float, outliers: str = "mad",
                  revocation_max_age: float = 172800.0, score: str | None = None):
    """What ``fedfs device --enroll --rounds 0 --secagg-ca … --identity-cert … --key-file …
    --secagg-revocation-max-age … --outliers …`` builds (defaults for everything else: the do-no-harm
    check on the server's impostors, the method's verification)."""
    from fedfs_sdk.cli.common import read_key
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.secagg.identity import CaPublicKey
    from fedfs_sdk.federation.secagg.policy import DevicePolicy

    key = read_key(str(dev.dir / "device.key"), create=True)
    policy = DevicePolicy(ca=CaPublicKey.load(operator.ca_pub), max_revocation_age_s=revocation_max_age)
    return DeviceConfig(rounds=0, enroll=True, q=q, enrollment_key=key, secagg=policy, identity_certificate=dev.cert,
                        outliers=outliers, score=score, wait_timeout_s=7200.0, artifacts=dev.artifacts)


def phone_runtime(dev: Device):
    """A phone's runtime: :class:`~fedfs_sdk.federation.ort_runtime.OrtRuntime` on the export, one ONNX
    Runtime thread (a phone core; 50 of them share this machine's cores). None for a torch device."""
    if dev.artifacts is None:
        return None
    from fedfs_sdk.federation.ort_runtime import OrtRuntime

    return OrtRuntime(dev.artifacts, intra_op_threads=1)


ENROLL_GATE = threading.Semaphore(8)
"""Devices enrolling at once. Every device's check scores its candidates (ξ, the global model,
its dual verifier) on 100 impostors and its photos: ~150 MB each with a MobileFaceNet, and 102 of
them at once ran this machine out of memory (15 GB). Phones enroll on their own hardware; here
they take turns (the gate sets the pace, not what runs; :func:`set_enroll_concurrency`)."""


def set_enroll_concurrency(n: int) -> None:
    global ENROLL_GATE
    ENROLL_GATE = threading.Semaphore(max(1, int(n)))


def gated_agent():
    """:class:`DeviceAgent` whose :meth:`enroll` waits for :data:`ENROLL_GATE` — the same code,
    only the number of devices in it at once is bounded. A device gives its place back while it
    sleeps (waiting for the check-results round): the round needs every sampled device's checks, and
    devices holding the gate while the others wait behind it stalled it to its phase deadline."""
    from fedfs_sdk.federation.agent import DeviceAgent

    class GatedAgent(DeviceAgent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plain_sleep = self._sleep

            def sleep(seconds: float) -> None:
                gate = getattr(self, "_gate", None)
                if gate is None:
                    return plain_sleep(seconds)
                gate.release()
                try:
                    plain_sleep(seconds)
                finally:
                    gate.acquire()

            self._sleep = sleep

        def enroll(self, after_round=None):
            gate = self._gate = ENROLL_GATE     # read at call time: set_enroll_concurrency may have replaced it
            gate.acquire()
            try:
                return super().enroll(after_round)
            finally:
                self._gate = None
                gate.release()

    return GatedAgent


def run_device(dev: Device, url: str, operator: Operator, outliers: str = "mad", on_event=None) -> None:
    """One device's whole life, as ``fedfs device`` runs it (check inputs, rounds until the server
    is done, enroll); errors are kept on ``dev`` (one device's failure must not hide the others')."""
    from fedfs_sdk.federation.device_config import check_local_inputs
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient

    t0, c0 = time.perf_counter(), time.thread_time()
    transport = CountingTransport(operator.tls_cert)

    def event(name: str, fields: dict[str, Any]) -> None:
        dev.events.append((name, time.perf_counter(), time.thread_time()))
        if on_event is not None:
            on_event(dev, name, fields)

    try:
        config = device_config(dev, operator, dev.q, outliers, score=dev.score)
        batches = (dev.batches if dev.batches is not None
                   else check_local_inputs(dev.photos, config, runtime=phone_runtime(dev)))
        dev.batches = None          # the agent keeps its own copy
        with DeviceState(dev.state_dir) as state, ServerClient(url, timeout=600.0, transport=transport) as client:
            dev.report = gated_agent()(client, state, dev.photos, config, on_event=event, batches=batches,
                                       runtime=phone_runtime(dev)).run()
    except Exception as e:      # noqa: BLE001 — reported per device, the rehearsal goes on
        import traceback

        dev.error = f"{type(e).__name__}: {e}"
        if on_event is not None:    # said now: the others may wait for this device until a phase deadline
            on_event(dev, "device_failed", {"error": dev.error, "where": traceback.format_exc(limit=-4)})
    finally:
        dev.seconds, dev.cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
        dev.sent, dev.received = transport.sent, transport.received


PHASES = (("keys + train", "round_started", "trained"), ("masked upload", "trained", "uploaded"),
          ("unmask", "uploaded", "secure_round_done"), ("check + enroll", "server_done", "enrolled"))
"""Where a device's time goes, between two of the agent's events: advertising and sharing keys
(waiting for every sampled device), downloading the model and local training; the masked upload;
the consistency check and unmasking (waiting for the others again); after the server's last
round, waiting for it to close, the do-no-harm check of every candidate and the enrollment. Its
thread's CPU time is what the device itself spent."""


def phase_times(dev: Device) -> dict[str, dict[str, float]]:
    """``{phase: {"wall_s", "cpu_s"}}`` summed over the device's rounds (:data:`PHASES`)."""
    out = {name: {"wall_s": 0.0, "cpu_s": 0.0} for name, _, _ in PHASES}
    for name, start, end in PHASES:
        opened = None
        for ev, wall, cpu in dev.events:
            if ev == start:
                opened = (wall, cpu)
            elif ev == end and opened is not None:
                out[name]["wall_s"] += wall - opened[0]
                out[name]["cpu_s"] += cpu - opened[1]
                opened = None
    return out


def run_fleet(devices: Sequence[Device], url: str, operator: Operator, outliers: str = "mad",
              on_event=None) -> None:
    """Every device in its own thread of this process: a secure round needs all its sampled
    devices at once (key exchange, masked inputs, unmasking), so they cannot take turns."""
    threads = [threading.Thread(target=run_device, args=(d, url, operator, outliers, on_event), name=f"device-{d.client}",
                                daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def process_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


__all__ = ["round_times", "gated_agent", "ENROLL_GATE", "set_enroll_concurrency", "PHASES", "phase_times", "device_q", "check_inputs", "ServerPlan", "server_flags", "Operator", "Server", "Device", "write_photos", "register", "run_fleet",
           "start_rounds", "admin", "process_cpu_seconds", "CountingTransport"]
