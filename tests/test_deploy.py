"""docs/deploy.md, run verbatim: the secure deployment's commands as real processes on 127.0.0.1.

The ```bash deploy``` block of the page is read here and each line run with bash (``fedfs``
is the CLI of this checkout): the CA, the server's TLS certificate, the revocation list, the
server, and for each of three devices the request (registering first), the signature and
``fedfs device``. The round must close as an authenticated secure round of all three over
HTTPS with the published model version; the request must name the device by its device id.
"""
from __future__ import annotations

import json
import re
import shlex
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest_server import ROOT, free_port, subprocess_env, write_images

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]


def deploy_commands() -> list[str]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```bash deploy\n(.*?)```", text, re.S)
    assert block, "docs/deploy.md has no ```bash deploy block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_documented_commands_fit_in_ten():
    cmds = deploy_commands()
    assert len(cmds) <= 10 and all(c.startswith("fedfs ") for c in cmds)


def test_secure_deployment_as_documented(tmp_path):
    cmds = deploy_commands()
    port = free_port()
    env = {**subprocess_env(), "HOST": "127.0.0.1", "BIND": "127.0.0.1", "PORT": str(port),
           "STATE": str(tmp_path / "server")}
    # exec: the shell becomes the fedfs process, so terminating it stops the server itself
    prelude = f"fedfs() {{ exec {shlex.quote(sys.executable)} -m fedfs_sdk.cli.main \"$@\"; }}\n"

    def sh(cmd: str, extra: dict[str, str] | None = None, **kw):
        return subprocess.Popen(["bash", "-c", prelude + cmd], cwd=tmp_path, env={**env, **(extra or {})},
                                stdout=kw.pop("stdout", subprocess.PIPE), stderr=subprocess.STDOUT, text=True, **kw)

    def run(cmd: str, extra: dict[str, str] | None = None) -> str:
        p = sh(cmd, extra)
        out = p.communicate(timeout=180)[0]
        assert p.returncode == 0, f"{cmd}\n{out[-3000:]}"
        return out

    operator, serve, device = cmds[:3], cmds[3], cmds[4:]
    assert serve.startswith("fedfs serve") and len(device) == 3
    for c in operator:
        run(c)
    with open(tmp_path / "server.log", "w") as log:
        srv = sh(serve, stdout=log)
    procs: list[subprocess.Popen] = []
    try:
        url = f"https://127.0.0.1:{port}"
        pem = ssl.create_default_context(cafile=str(tmp_path / "ca" / "tls" / "server.pem"))
        t0 = time.monotonic()
        while True:
            assert srv.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", verify=pem, timeout=1).status_code == 200:   # checks the SANs too
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < 90, "server did not come up"
            time.sleep(0.2)
        devs = []
        for d in range(3):
            extra = {"DEV": str(tmp_path / f"dev{d}"), "PHOTOS": str(tmp_path / f"photos{d}")}
            write_images(tmp_path / f"photos{d}", 4 + d, seed=40 + d)
            run(device[0], extra)
            run(device[1], extra)
            device_id = json.loads((tmp_path / f"dev{d}" / "device.json").read_text())["device_id"]
            assert json.loads((tmp_path / f"dev{d}.cert.json").read_text())["subject"] == device_id
            devs.append(extra)
        procs = [sh(device[2], extra) for extra in devs]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        admin = (tmp_path / "server" / "admin_token").read_text().strip()
        info = httpx.get(url + "/v1/rounds/1", verify=pem, headers={"Authorization": f"Bearer {admin}"}).json()
        assert info["state"] == "closed", info
        sa = info["secure_aggregation"]
        assert sa["protocol"] == "fedfs-secagg/2" and sa["survivors"] == 3, sa
        for d in range(3):           # the device logged the round and the revocation list it accepted
            log = json.loads((tmp_path / f"dev{d}" / "secagg_rounds.json").read_text())
            assert list(log["rounds"].values()) == [[1]] and list(log["revocations"].values()) == [1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        srv.terminate()
        try:
            srv.wait(15)
        except subprocess.TimeoutExpired:
            srv.kill()


def test_tls_cert_names_what_devices_dial(tmp_path):
    """``fedfs ca tls-cert``: subjectAltNames 127.0.0.1, ::1, localhost and each --host (IP or
    DNS); the key 0600; an existing key is never overwritten; a bad host is refused."""
    import ipaddress

    from cryptography import x509

    from fedfs_sdk.errors import InputError
    from fedfs_sdk.federation.tls_cert import write_server_certificate

    cert, key = write_server_certificate(tmp_path / "tls", ["fl.example.org", "10.1.2.3"])
    san = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "fl.example.org"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address(a) for a in
                                                             ("127.0.0.1", "::1", "10.1.2.3")}
    assert key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(InputError, match="exists"):
        write_server_certificate(tmp_path / "tls")
    with pytest.raises(InputError, match="neither an IP address nor a DNS name"):
        write_server_certificate(tmp_path / "tls2", ["https://x"])
