"""Helpers for the server tests: a real ``fedfs serve`` subprocess on 127.0.0.1, generated
images, and independent (numpy) reading of safetensors bodies.

Imported explicitly by tests/test_server_*.py (not a pytest conftest).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "test-admin-token"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("FEDFS_CACHE_DIR", str(ROOT / ".fedfs_cache"))
    env["OMP_NUM_THREADS"] = "1"   # several processes share 2 cores
    return env


def cli_in_process(*args: str, env: dict[str, str] | None = None,
                   main: "Callable[[list[str]], int] | None" = None) -> subprocess.CompletedProcess[str]:
    """``fedfs ARGS`` through ``fedfs_sdk.cli.main.main`` in this process, giving what a subprocess
    would: the exit code (argparse's ``SystemExit`` included), stdout and stderr. For tests of what a
    command does, where a new interpreter (seconds of torch import each) is not what is tested; each
    command keeps real-subprocess tests elsewhere. An uncaught exception is not turned into a
    traceback on stderr: it fails the test where it is raised. ``main``: another command's entry
    point (``fedfs_sdk.cli.import_model.main``)."""
    if main is None:
        from fedfs_sdk.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["fedfs", *args], code, out.getvalue(), err.getvalue())


def refused_serve(*args: str, port: int | None = None) -> subprocess.CompletedProcess[str]:
    """``fedfs serve ARGS`` expected to refuse before it binds (flags, a new state's model), run in
    this process by :func:`cli_in_process` on ``port`` — by default one this call holds and listens
    on, so a server that did not refuse fails at its bind ("cannot listen on …") instead of serving.
    The server's loggers (``setup_logging`` routes ``fedfs`` and uvicorn to a handler of its own,
    not propagating) are put back afterwards: later tests' ``caplog`` must still see ``fedfs.*``."""
    import logging

    names = ("fedfs", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in map(logging.getLogger, names)]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
            if port is None:
                held.bind(("127.0.0.1", 0))
                held.listen()
                port = held.getsockname()[1]
            return cli_in_process("serve", "--host", "127.0.0.1", "--admin-token", ADMIN, *args, "--port", str(port))
    finally:
        for lg, handlers, level, propagate, disabled in saved:
            lg.handlers[:], lg.level, lg.propagate, lg.disabled = handlers, level, propagate, disabled


def self_signed_cert(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed TLS certificate for ``host`` (and localhost), made here with
    ``cryptography``: ``(cert.pem, key.pem)``. Devices pin it (``fedfs device --tls-ca``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host)),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@dataclass
class ServerProc:
    proc: subprocess.Popen
    url: str
    state: Path
    log: Path
    verify: "ssl.SSLContext | bool" = True
    """Trusts only the server's certificate when it serves HTTPS (what the test's clients use)."""
    tls_cert: Path | None = None

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30,
                            verify=self.verify)

    def status(self) -> dict:
        with self.admin() as c:
            return c.get("/v1/rounds/current").json()

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(state: Path, *args: str, port: int | None = None, timeout: float = 180.0,
                 tls: tuple[Path, Path] | None = None) -> ServerProc:
    """``python -m fedfs_sdk.cli.main serve`` on a free port; waits for /health. ``tls``:
    ``(cert, key)`` — the server speaks HTTPS (``--tls-cert/--tls-key``) and is checked with cert.

    ``timeout`` is generous: a loaded machine (the suite runs on two xdist workers) may take a
    minute to import the server. A free port can be taken by another worker between
    :func:`free_port` and the bind: then the server is started again on a new port."""
    chosen = port
    for attempt in range(3):
        port = chosen or free_port()
        if tls is not None and attempt == 0:
            args = (*args, "--tls-cert", str(tls[0]), "--tls-key", str(tls[1]))
        log = state.parent / f"{state.name}.server.log"
        cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--state", str(state), "--admin-token", ADMIN, "--tick-interval", "0.1", "--poll-interval", "0.2", *args]
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(tls[0])) if tls else True
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                text = log.read_text()
                if chosen is None and "address already in use" in text.lower():
                    break                                   # another worker took the port: a new one
                raise RuntimeError(f"server exited with {proc.returncode}:\n{text[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200:
                    return ServerProc(proc, url, state, log, verify, tls[0] if tls else None)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            proc.kill()
            raise RuntimeError(f"server did not come up in {timeout} s:\n{log.read_text()[-3000:]}")
    raise RuntimeError(f"no free port for the server after 3 tries:\n{log.read_text()[-3000:]}")


def new_device(url: str, verify: "ssl.SSLContext | bool" = True) -> dict:
    """Register a device over HTTP and make its first poll (``GET /v1/task``), as ``fedfs device``
    does: the server samples only devices that polled, never one that only registered."""
    reg = httpx.post(url + "/v1/devices", verify=verify).json()
    got = httpx.get(url + "/v1/task", headers={"Authorization": f"Bearer {reg['token']}"}, verify=verify)
    assert got.status_code == 200, got.text
    return reg


def write_images(folder: Path, count: int, seed: int, size: int = 40) -> list[Path]:
    """Simple synthetic 'faces': a per-identity base pattern plus noise, saved as PNG with cv2."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size, size, 3))
    paths = []
    for i in range(count):
        img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
        p = folder / f"img_{i:03d}.png"
        cv2.imwrite(str(p), img)
        paths.append(p)
    return paths


def read_safetensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a safetensors body with numpy only (independent of the code under test)."""
    from safetensors.numpy import load

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n]).get("__metadata__", {})
    return load(data), meta


def weighted_average(updates: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """FedAvg recomputed independently: Σ n_c w_c / Σ n_c in float64."""
    total = float(sum(n for _, n in updates))
    keys = updates[0][0].keys()
    return {k: sum(w[k].astype(np.float64) * n for w, n in updates) / total for k in keys}


def audited_uploads(audit_dir: Path) -> list[tuple[int, dict[str, np.ndarray], int]]:
    """``(round_id, w_c, |D_c|)`` of every update a device sent, read from its ``--audit-dir``
    copies of the request bodies (what actually went over the wire)."""
    index = [json.loads(line) for line in (audit_dir / "index.jsonl").read_text().splitlines()]
    out = []
    for e in index:
        if e["method"] == "PUT":
            w, meta = read_safetensors((audit_dir / e["file"]).read_bytes())
            assert meta["format"] == "fedfs-update/1" and e["path"] == f"/v1/rounds/{meta['round_id']}/update"
            out.append((int(meta["round_id"]), w, int(meta["num_samples"])))
    return out


def assert_published_fedavg(srv: "ServerProc", uploads: dict[int, list[tuple[dict[str, np.ndarray], int]]],
                            atol: float = 1e-6) -> None:
    """Every round's published global version equals the |D_c|-weighted average of its uploads."""
    with srv.admin() as c:
        for rnd, ups in sorted(uploads.items()):
            info = c.get(f"/v1/rounds/{rnd}").json()
            assert info["state"] == "closed" and info["accepted"] == len(ups)
            assert info["total_samples"] == sum(n for _, n in ups)
            published, meta = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)
            expected = weighted_average(ups)
            assert set(published) == set(expected)
            for k in expected:
                np.testing.assert_allclose(published[k], expected[k].astype(np.float32), rtol=0, atol=atol, err_msg=k)
            assert json.loads(meta["meta"])["num_updates"] == len(ups)


def wait_round(srv: "ServerProc", rnd: int, timeout: float = 30.0) -> dict:
    """Round ``rnd``'s status once it is no longer open (done or failed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with srv.admin() as c:
            st = c.get(f"/v1/rounds/{rnd}")
        if st.status_code == 200 and st.json()["state"] != "open":
            return st.json()
        time.sleep(0.1)
    raise AssertionError(f"round {rnd} did not end in {timeout} s")


def wait_open(srv: "ServerProc", rnd: int, timeout: float = 30.0) -> None:
    """Until ``/health`` names ``rnd`` as the open round."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if httpx.get(srv.url + "/health", verify=srv.verify).json()["round_id"] == rnd:
            return
        time.sleep(0.1)
    raise AssertionError(f"round {rnd} did not open in {timeout} s")
