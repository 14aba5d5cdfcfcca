"""Wire privacy: every request the device client sends (URL, headers, body) is captured at
the transport; none holds an image, an embedding, θ_c, the enrollment, the codeword or
r_u — checked on the raw bytes, in the encodings a leak would plausibly use."""
from __future__ import annotations

import json

import cv2
import httpx
import numpy as np
import pytest
import torch

from conftest_server import start_server, write_images
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.nn.model import FaceNet, ModelConfig, personal_config
from fedfs_sdk.runtime.preprocess import preprocess
from fedfs_sdk.federation.wire import decode_weights

pytestmark = pytest.mark.timeout(180)


class RecordingTransport(httpx.BaseTransport):
    """Sees exactly the bytes httpx puts on the wire for each request."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        head = f"{request.method} {request.url}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in request.headers.items())
        self.sent.append(head.encode() + b"\r\n" + request.read())
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def windows(data: bytes, size: int = 32, count: int = 24) -> list[bytes]:
    """Evenly spread slices of ``data`` (the whole thing when short)."""
    if len(data) <= size:
        return [data]
    starts = np.linspace(0, len(data) - size, num=min(count, len(data) - size + 1)).astype(int)
    return [data[s:s + size] for s in starts]


def _repeats(w: bytes) -> bool:
    """A window that is one value over and over (8 codeword bits all +1 as float32 = eight 1.0s)
    says nothing secret: a frozen norm weight of 1.0s uploads the same bytes (scope=top)."""
    return any(len(w) % k == 0 and w == w[:k] * (len(w) // k) for k in (1, 2, 4))


def leaked(sent: list[bytes], secret: bytes, size: int = 32) -> bool:
    probes = [w for w in windows(secret, size) if not _repeats(w)]
    return any(w in blob for blob in sent for w in probes)


def test_device_sends_only_weights_and_counts(tmp_path):
    # FedFS+FedUV exercises everything a device keeps: ξ, θ_c, the codeword, an enrollment.
    xi_cfg = ModelConfig(backbone="tiny")
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "xi.safetensors", FaceNet(xi_cfg), xi_cfg)
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--proj-dim", "32",
                       "--xi", str(tmp_path / "xi.safetensors"), "--method", "fedfs+feduv", "--rounds", "1",
                       "--min-participants", "1", "--train", json.dumps({"local_epochs": 1, "batch_size": 5}))
    transport = RecordingTransport()
    images = write_images(tmp_path / "me", 10, seed=11)
    try:
        with DeviceState(tmp_path / "device") as state, \
                ServerClient(srv.url, transport=transport, retry=RetryPolicy(attempts=3, base_delay_s=0.05)) as client:
            report = DeviceAgent(client, state, [str(p) for p in images],
                                 DeviceConfig(rounds=1, enroll=True, q=0.8)).run()
            assert len(report.rounds) == 1 and report.enrollment is not None
            assert report.enrollment.meta["outlier_rule"].startswith("mad")      # DeviceConfig.outliers default
            codeword = state.load_codeword()
            r_bits = state.r_bits()
            personal, _ = state.load_weights("personal")
            enrollment_file = state.file("enrollment.fedfs").read_bytes()
            secrets_file = state.file("secrets.json").read_bytes()
    finally:
        srv.stop()
    sent = transport.sent
    uploads = [b for b in sent if b.startswith(b"PUT ")]
    assert len(uploads) == 1

    # Positive control: the search finds what was legitimately uploaded (w_c).
    body = uploads[0].split(b"\r\n\r\n", 1)[1]
    uploaded, meta = decode_weights(body)
    assert meta["num_samples"] == "8"        # the do-no-harm check's 2 hold-out photos are never trained on
    assert leaked(sent, uploaded["backbone.embed.weight"].numpy().tobytes())

    secret_blobs: dict[str, bytes] = {}
    for i, p in enumerate(images):
        secret_blobs[f"png {i}"] = p.read_bytes()
        bgr = cv2.imread(str(p))
        secret_blobs[f"pixels {i}"] = bgr.tobytes()
        secret_blobs[f"rgb {i}"] = bgr[..., ::-1].copy().tobytes()
    batch = preprocess([str(p) for p in images], 32)
    secret_blobs["preprocessed"] = batch.tobytes()

    # Embeddings of every model the device ran: ξ, the downloaded global, w_c, θ_c.
    cfg = ModelConfig(backbone="tiny", code_length=127, proj_dim=32).resolved()
    x = torch.from_numpy(batch)
    nets: dict[str, torch.nn.Module] = {}
    xi = FaceNet(xi_cfg)
    from safetensors.torch import load_file
    xi.load_state_dict(load_file(str(tmp_path / "xi.safetensors")))
    nets["xi"] = xi
    local = FaceNet(cfg)
    local.load_state_dict(uploaded)
    nets["w_c"] = local
    pers = FaceNet(personal_config(cfg))
    pers.load_state_dict(personal)
    nets["theta_c"] = pers
    with torch.no_grad():
        for name, net in nets.items():
            out = net.eval()(x)
            secret_blobs[f"embedding {name}"] = out.embedding.numpy().tobytes()
            if out.projection is not None:
                secret_blobs[f"projection {name}"] = out.projection.numpy().tobytes()
            if out.uv is not None:
                secret_blobs[f"uv {name}"] = out.uv.numpy().tobytes()

    # θ_c: tensors the personalized model does not share with w_c.
    for k, t in personal.items():
        if t.numel() >= 16 and not torch.equal(t, uploaded[k]):
            secret_blobs[f"theta_c {k}"] = t.numpy().tobytes()

    v = codeword.astype(np.int8)
    secret_blobs["codeword int8"] = v.tobytes()
    secret_blobs["codeword float32"] = v.astype(np.float32).tobytes()
    secret_blobs["codeword packed"] = np.packbits(v < 0).tobytes()
    secret_blobs["codeword hex"] = np.packbits(v < 0).tobytes().hex().encode()
    secret_blobs["codeword text"] = json.dumps(v.tolist()).encode()
    secret_blobs["codeword bits text"] = "".join("1" if b < 0 else "0" for b in v).encode()
    secret_blobs["r_u bits"] = r_bits.tobytes()
    secret_blobs["r_u text"] = "".join(map(str, r_bits)).encode()
    secret_blobs["r_u packed"] = np.packbits(r_bits).tobytes()
    secret_blobs["secrets file"] = secrets_file
    secret_blobs["enrollment file"] = enrollment_file
    secret_blobs["threshold"] = np.float64(report.enrollment.threshold).tobytes()
    if len(repr(report.enrollment.threshold)) >= 8:     # a short repr like "1.0" proves nothing
        secret_blobs["threshold text"] = repr(report.enrollment.threshold).encode()

    for name, blob in secret_blobs.items():
        size = 4 if name == "r_u packed" else 8 if name == "threshold" else min(32, len(blob))
        assert not leaked(sent, blob, size), f"{name} appears in a request"

    # On disk, r_u and the codeword are encrypted (AES-GCM under the device key), not in clear.
    on_disk = json.loads(secrets_file)
    assert on_disk["format"] == "fedfs-device-secrets/1" and set(on_disk) >= {"nonce", "ciphertext"}
    for name in ("r_u text", "codeword hex", "codeword bits text"):
        assert secret_blobs[name] not in secrets_file, f"{name} is stored in clear"
