"""fedfs-secagg/2 on the real HTTP server: device identities, the consistency check, TLS, and the
attacks that need a network — an on-path attacker, a plain round offered to a device that
requires secure ones, plain http:// to another machine.

A ``fedfs serve --secure-aggregation --secagg-ca ca.pub --tls-cert … --tls-key …`` subprocess on
127.0.0.1 (a self-signed certificate made in the test with ``cryptography``, pinned by the
clients); devices speak the protocol with :class:`SecAggSession` (the device agents' code) and
hold identities certified with the ``fedfs ca`` commands.
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest_server import read_safetensors, self_signed_cert, start_server, wait_open, wait_round, write_images
from secagg_adversary import KeySwap
from fedfs_sdk.cli.main import main as fedfs
from fedfs_sdk.federation.secagg import CaPublicKey, Certificate, FixedPoint, from_json, to_json
from fedfs_sdk.federation.secagg.http_device import SecAggRoundLost, SecAggSession, flatten_update
from fedfs_sdk.federation.secagg.policy import DevicePolicy
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient, ServerError, TlsError
from fedfs_sdk.training.ort_device import encode_update

pytestmark = pytest.mark.timeout(180)

N = 5                       # t = ⌊2·5/3⌋ + 1 = 4: one device may drop
FAST = ("--init-backbone", "tiny", "--code-length", "127", "--min-participants", str(N), "--device-ttl", "0",
        "--secure-aggregation", "--secagg-phase-timeout", "3", "--round-timeout", "8")
SCALE = 2.0 ** -24
ATOL, RTOL = 0.5 * SCALE * 1.01, SCALE * 1.01


# ---- identities with the fedfs ca commands --------------------------------------------------

def make_ca(root: Path) -> Path:
    assert fedfs(["ca", "init", "--dir", str(root / "ca")]) == 0
    return root / "ca"


def enroll_identity(root: Path, ca: Path, name: str) -> tuple[Path, Path]:
    """``fedfs ca request`` in the device state, ``fedfs ca sign`` by the operator: (state, cert)."""
    state, req, cert = root / f"{name}-state", root / f"{name}.req.json", root / f"{name}.cert.json"
    assert fedfs(["ca", "request", "--state", str(state), "--out", str(req), "--subject", name]) == 0
    assert fedfs(["ca", "sign", "--ca", str(ca), "--request", str(req), "--out", str(cert)]) == 0
    return state, cert


def test_ca_commands_keep_private_keys_private(tmp_path, capsys):
    ca = make_ca(tmp_path)
    assert (ca / "ca.key").stat().st_mode & 0o777 == 0o600 and ca.stat().st_mode & 0o077 == 0
    state, cert_path = enroll_identity(tmp_path, ca, "alice")
    key_file = state / "identity.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    from fedfs_sdk.federation.secagg.identity import load_private_key

    sk = load_private_key(key_file, "identity key")
    raw = sk.private_bytes_raw()
    request = (tmp_path / "alice.req.json").read_bytes()
    for secret in (raw, raw.hex().encode(), __import__("base64").b64encode(raw)):
        assert secret not in request and secret not in cert_path.read_bytes()
    cert = Certificate.load(cert_path)
    cert.verify(CaPublicKey.load(ca / "ca.pub"))
    assert cert.subject == "alice" and cert.public_key == sk.public_key().public_bytes_raw()
    # a request whose proof of possession does not verify is refused (exit 2, one line)
    doc = json.loads(request)
    doc["subject"] = "mallory"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert fedfs(["ca", "sign", "--ca", str(ca), "--request", str(tmp_path / "bad.json"), "--out",
                  str(tmp_path / "x.json")]) == 2
    assert "proof of possession does not verify" in capsys.readouterr().err
    assert fedfs(["ca", "init", "--dir", str(ca)]) == 2                 # a CA key is never overwritten


# ---- in-process devices against a real server -----------------------------------------------

class Dev:
    """A registered device with a certified identity, its TLS-pinned client and a round update."""

    def __init__(self, srv, root: Path, ca: Path, i: int, transport: httpx.BaseTransport | None = None) -> None:
        from fedfs_sdk.federation.device_identity import install_certificate
        from fedfs_sdk.federation.device_state import DeviceState

        state_dir, cert = enroll_identity(root, ca, f"phone{i}")
        with DeviceState(state_dir) as st:
            self.identity = install_certificate(st, cert, CaPublicKey.load(ca / "ca.pub"))
        self.policy = DevicePolicy(ca=CaPublicKey.load(ca / "ca.pub"))
        self.sent: list[bytes] = []
        verify = srv.tls_cert if srv.url.startswith("https") else None
        reg = httpx.post(srv.url + "/v1/devices", verify=srv.verify).json()
        assert reg["secure_aggregation"] is True
        self.client = ServerClient(srv.url, reg["token"], tls_ca=verify, transport=transport,
                                   retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0))
        self.client._http.event_hooks["request"].append(lambda r: self.sent.append(r.read()))
        self.session: SecAggSession | None = None

    def start(self, ref: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        task = self.client.task()
        assert task["action"] == "train" and task["secagg"]["protocol"] == "fedfs-secagg/2", task
        self.session = SecAggSession(self.client, task, identity=self.identity, policy=self.policy)
        self.n = int(rng.integers(1, 50))
        upd = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in ref.items()}
        self.body = encode_update(upd, round_id=task["round_id"], model_version=task["model_version"],
                                  num_samples=self.n)
        self.w, _ = flatten_update(self.body)


def _model(srv, version: int) -> dict[str, np.ndarray]:
    with srv.admin() as c:
        return read_safetensors(c.get(f"/v1/models/{version}").content)[0]


def _flat(w: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(w[k], dtype=np.float64).ravel() for k in sorted(w)])


def _fleet(tmp_path: Path, tls: bool, *extra: str, transports: dict[int, httpx.BaseTransport] | None = None):
    ca = make_ca(tmp_path)
    srv = start_server(tmp_path / "server", *FAST, "--secagg-ca", str(ca / "ca.pub"), *extra,
                       tls=self_signed_cert(tmp_path / "tls") if tls else None)
    devs = [Dev(srv, tmp_path, ca, i, (transports or {}).get(i)) for i in range(N)]
    return srv, devs


def _run(srv, devs: list[Dev], rnd: int, rng, drop_after_mask: int = 0) -> dict:
    wait_open(srv, rnd)
    ref = _model(srv, rnd)
    for d in devs:
        d.start(ref, rng)
    for step in ("advertise", "share_keys"):
        for d in devs:
            getattr(d.session, step)()
    for d in devs:
        d.session.masked_input(d.body)
    for d in devs[drop_after_mask:]:        # one thread drives all: every signature first
        d.session.consistency()
    for d in devs[drop_after_mask:]:
        d.session.unmask()
    return wait_round(srv, rnd)


def test_tls_secure_round_with_identities_and_consistency_check(tmp_path):
    """HTTPS with a pinned self-signed certificate; fedfs-secagg/2: the published model is the
    weighted FedAvg of all five (one drops after masking: its input counts, it never signs or
    unmasks); no identity private key is in any request body or server file; the server's
    state holds certificates and signatures only."""
    srv, devs = _fleet(tmp_path, True, "--rounds", "2")
    try:
        for rnd, drop in ((1, 0), (2, N - 4)):
            info = _run(srv, devs, rnd, np.random.default_rng(rnd), drop_after_mask=drop)
            assert info["state"] == "closed", info
            sa = info["secure_aggregation"]
            assert sa["protocol"] == "fedfs-secagg/2" and sa["threshold"] == 4 and sa["survivors"] == N
            assert sa["dropped"].get("consistency", 0) == drop
            got = _flat(_model(srv, info["result_version"]))
            exp = sum(d.w * d.n for d in devs) / sum(d.n for d in devs)
            np.testing.assert_allclose(got, exp, rtol=RTOL, atol=ATOL)
        blobs = [p.read_bytes() for p in (tmp_path / "server").rglob("*") if p.is_file()]
        for d in devs:
            raw = d.identity._sk.private_bytes_raw()
            for secret in (raw, raw.hex().encode(), __import__("base64").b64encode(raw), d.identity.private_pem()):
                assert not any(secret in b for b in d.sent) and not any(secret in b for b in blobs)
        adverts = [from_json(b) for d in devs for b in d.sent if b.startswith(b'{"type":"advertise_keys"')]
        assert len(adverts) == 2 * N and all("cert" in a and len(a["sig"]) == 64 for a in adverts)
        assert "https://127.0.0.1" in (tmp_path / "server.server.log").read_text()
    finally:
        srv.stop()


def test_server_refuses_uncertified_advertisements(tmp_path):
    """The server checks what devices will check anyway, so a stray device cannot stall a
    round: no certificate, a certificate of another CA, a signature over other keys → 403."""
    srv, devs = _fleet(tmp_path, False, "--rounds", "1", "--round-timeout", "30", "--secagg-phase-timeout", "30")
    try:
        wait_open(srv, 1)
        ref = _model(srv, 1)
        d = devs[0]
        d.start(ref, np.random.default_rng(0))
        adv = d.session.device.advertise()
        url = f"{srv.url}/v1/rounds/1/secagg/advertise"
        hdr = {"Authorization": f"Bearer {d.client.token}", "Content-Type": "application/json"}
        bare = {k: v for k, v in adv.items() if k not in ("cert", "sig")}
        assert httpx.post(url, content=to_json(bare), headers=hdr).status_code == 403
        other = make_ca(tmp_path / "other")
        _, cert = enroll_identity(tmp_path / "other", other, "mallory")
        r = httpx.post(url, content=to_json({**adv, "cert": json.loads(cert.read_text())}), headers=hdr)
        assert r.status_code == 403 and "not a certified device" in r.json()["reason"]
        r = httpx.post(url, content=to_json({**adv, "c_pk": os.urandom(32)}), headers=hdr)   # keys swapped
        assert r.status_code == 403 and "not signed by its identity key" in r.json()["reason"]
        assert httpx.post(url, content=to_json(adv), headers=hdr).status_code == 200
    finally:
        srv.stop()


# ---- on-path attacker ---------------------------------------------------------------------------

class OnPath(httpx.BaseTransport):
    """Someone on one device's link (plain HTTP): rewrites that device's secure-aggregation
    messages with :class:`KeySwap` — its advertisement going out, the roster and inbox coming in,
    its sealed shares and masked vector going out — and fixes the receipts it alters."""

    def __init__(self, swap_out: bool = True) -> None:
        self.inner = httpx.HTTPTransport()
        self.swap: KeySwap | None = None
        self.swap_out = swap_out
        self.t = 0
        self.sent_y: bytes | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if "/secagg" not in path:
            return self.inner.handle_request(request)
        rid = int(path.split("/")[3])
        self.swap = self.swap or KeySwap(0, rid)
        body = request.read()
        if path.endswith("/advertise"):
            msg = from_json(body)
            self.swap.u = msg["device"]
            self.swap.real[msg["device"]] = (msg["c_pk"], msg["s_pk"])
            if self.swap_out:
                body = to_json(self.swap.advertise(msg)).encode()
        elif path.endswith("/share-keys"):
            body = to_json(self.swap.share_keys(from_json(body))).encode()
        elif path.endswith("/masked-input"):
            self.sent_y = body
            body = self.swap.masked(body, self.t)
        fwd = httpx.Request(request.method, request.url, headers={k: v for k, v in request.headers.items()
                                                                   if k.lower() != "content-length"}, content=body)
        resp = self.inner.handle_request(fwd)
        content = resp.read()
        if request.method == "GET" and resp.status_code == 200:
            view = from_json(content)
            if "roster" in view:
                self.t = view["roster"]["threshold"]
                view["roster"] = self.swap.roster(view["roster"])
            if "inbox" in view:
                view["inbox"] = self.swap.inbox(view["inbox"])
            content = to_json(view).encode()
        elif path.endswith("/masked-input") and resp.status_code == 200:
            import hashlib
            content = json.dumps({**json.loads(content), "sha256": hashlib.sha256(self.sent_y).hexdigest()}).encode()
        return httpx.Response(resp.status_code, headers={k: v for k, v in resp.headers.items()
                                                         if k.lower() not in ("content-length", "content-encoding")},
                              content=content)


def test_on_path_attacker_recovers_the_update_over_plain_http_on_the_previous_protocol(tmp_path):
    """Regression case: an honest server without identities (fedfs-secagg/1, legacy floors) over
    plain HTTP; the attacker on device 0's link swaps keys both ways and recovers that device's
    update exactly, while the round publishes the right FedAvg — nothing anyone checks notices."""
    srv = start_server(tmp_path / "server", *FAST, "--rounds", "1", "--secagg-phase-timeout", "10",
                       "--round-timeout", "20")
    try:
        mitm = OnPath()
        clients = []
        for i in range(N):
            reg = httpx.post(srv.url + "/v1/devices").json()
            clients.append(ServerClient(srv.url, reg["token"], transport=mitm if i == 0 else None,
                                        retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0)))
        wait_open(srv, 1)
        ref = _model(srv, 1)
        rng = np.random.default_rng(9)
        sessions, ws = [], []
        for c in clients:
            task = c.task()
            s = SecAggSession(c, task, policy=DevicePolicy.legacy())
            n = int(rng.integers(1, 50))
            body = encode_update({k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in ref.items()},
                                 round_id=1, model_version=1, num_samples=n)
            sessions.append((s, body))
            ws.append((flatten_update(body)[0], n))
        for step in ("advertise", "share_keys"):
            for s, _ in sessions:
                getattr(s, step)()
        for s, body in sessions:
            s.masked_input(body)
        for s, _ in sessions:
            s.unmask()
        info = wait_round(srv, 1)
        assert info["state"] == "closed"
        w0, n0 = ws[0]
        assert np.array_equal(mitm.swap.recovered, FixedPoint().encode(w0, n0)[0])     # device 0's update
        got = _flat(_model(srv, 2))
        np.testing.assert_allclose(got, sum(w * n for w, n in ws) / sum(n for _, n in ws), rtol=RTOL, atol=ATOL)
    finally:
        srv.stop()


@pytest.mark.parametrize("swap_out", [False, True])
def test_on_path_key_swap_is_refused_on_v2(tmp_path, swap_out):
    """The same attacker against fedfs-secagg/2 (still plain HTTP on loopback): swapping the
    roster's keys breaks their signatures — device 0 refuses to share; swapping its own
    advertisement breaks its signature — the server refuses it (and so would every device)."""
    mitm = OnPath(swap_out=swap_out)
    srv, devs = _fleet(tmp_path, False, "--rounds", "1", transports={0: mitm})
    try:
        wait_open(srv, 1)
        ref = _model(srv, 1)
        rng = np.random.default_rng(4)
        for d in devs:
            d.start(ref, rng)
        if swap_out:
            with pytest.raises(ServerError, match="not signed by its identity key"):
                devs[0].session.advertise()
        else:
            devs[0].session.advertise()
            for d in devs[1:]:
                d.session.advertise()
            with pytest.raises(SecAggRoundLost, match="not signed by its identity key"):
                devs[0].session.share_keys()
        assert mitm.swap is not None and mitm.swap.shares == {} and mitm.swap.recovered is None
    finally:
        srv.stop()


def test_tls_on_path_attacker_gets_no_byte(tmp_path):
    """With TLS and the server's certificate pinned, an on-path attacker presenting its own
    certificate fails the handshake: the device stops (not retried) and the attacker reads
    nothing."""
    cert, key = self_signed_cert(tmp_path / "server-tls")
    evil_cert, evil_key = self_signed_cert(tmp_path / "evil-tls")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(evil_cert), str(evil_key))
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    seen.append(tls.recv(65536))
            except (ssl.SSLError, OSError):
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = ServerClient(f"https://127.0.0.1:{port}", "d1.x", tls_ca=cert, retry=RetryPolicy(attempts=3))
        t0 = time.monotonic()
        with pytest.raises(TlsError, match="does not verify"):
            client.task()
        assert time.monotonic() - t0 < 5 and seen == []
    finally:
        lsock.close()


# ---- transport and downgrade refusals ------------------------------------------------------------

def test_secure_round_over_plain_http_to_another_host_is_refused():
    """A secure round refuses http:// to a host other than loopback before any request."""
    sent: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(500))
    task = {"round_id": 1, "secagg": {"dim": 4, "threshold": None, "neighbours": None, "clip": 1.0, "scale_bits": 24,
                                      "max_devices": 5, "max_samples": 10, "min_devices": 3,
                                      "layout_sha256": "0" * 64, "device": 1}}
    for url in ("http://10.0.0.7:8080", "http://aggregator.example.com"):
        with pytest.raises(SecAggRoundLost, match="plain http:// to a host other than loopback") as e:
            SecAggSession(ServerClient(url, "d1.x", transport=transport), task)
        assert e.value.code == "insecure_transport"
    for url in ("https://aggregator.example.com", "http://127.0.0.1:1", "http://localhost:1", "http://[::1]:1"):
        SecAggSession(ServerClient(url, "d1.x", transport=transport), task, policy=DevicePolicy.honest_but_curious())
    assert sent == []


def test_device_refuses_plain_rounds_once_the_server_offered_secure_aggregation(tmp_path):
    """Default (automatic) require_secure_aggregation: the server says at registration that it
    runs secure aggregation; the operator then turns it off — the plain round is refused, nothing
    is trained or sent. A device pinning a CA refuses a fedfs-secagg/1 secure round too."""
    from fedfs_sdk.errors import ProtocolError
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState

    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--rounds", "1",
                       "--min-participants", "3", "--secure-aggregation", "--device-ttl", "0")
    try:
        images = write_images(tmp_path / "img", 3, seed=1)
        events: list[tuple[str, dict]] = []
        agent = DeviceAgent(ServerClient(srv.url, audit_dir=tmp_path / "audit"), DeviceState(tmp_path / "dev"), images,
                            DeviceConfig(rounds=1, wait_timeout_s=3),
                            on_event=lambda n, f: events.append((n, f)), sleep=lambda s: time.sleep(0.2))
        agent.ensure_registered()
        assert agent.state.info.secure_aggregation and agent.secure_required()
        with srv.admin() as c:
            assert c.put("/v1/admin/config", json={"secure_aggregation": False, "min_participants": 1}).status_code == 200
        with pytest.raises(ProtocolError, match="no secure-aggregation round"):
            agent.run()
        assert [f["round_id"] for n, f in events if n == "round_refused"] == [1]
        assert not [n for n, _ in events if n in ("trained", "uploaded", "round_started")]
        index = [json.loads(x) for x in (tmp_path / "audit" / "index.jsonl").read_text().splitlines()]
        assert not any(e["method"] == "PUT" for e in index)
        # a device with a pinned CA refuses a secure round of the previous protocol
        ca = make_ca(tmp_path)
        state, cert = enroll_identity(tmp_path, ca, "bob")
        pinned = DevicePolicy(ca=CaPublicKey.load(ca / "ca.pub"))
        task = {"round_id": 3, "secagg": {"dim": 4, "threshold": None, "neighbours": None, "clip": 1.0,
                                          "scale_bits": 24, "max_devices": 5, "max_samples": 10, "min_devices": 3,
                                          "layout_sha256": "0" * 64, "device": 1}}
        with pytest.raises(SecAggRoundLost, match="takes part only in fedfs-secagg/2"):
            SecAggSession(None, task, policy=pinned)
    finally:
        srv.stop()
