"""How a device verifies after training: the default of each method (one source for the
simulator and the device), the ``verify=both`` dual verifier as a torch file and as ONNX, and
a real device (torch runtime, `fedfs serve` in a subprocess) enrolling with the default and
with the papers' codeword reading."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest_export import TINY, checkpoints, full_export
from conftest_server import start_server, write_images
from fedfs_sdk.nn.checkpoint import load_verifier, model_id_of, save_verifier
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.server_client import ServerClient
from fedfs_sdk.federation.device_runtime import DUAL_ONNX_FILE, verifier_model
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.nn.dual_verifier import save_dual_verifier
from fedfs_sdk.runtime.enrollment import verify
from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.training.methods import DEFAULT_LR, DEFAULT_VERIFICATION, PAPER_LR, check_verification
from fedfs_sdk.nn.model import DualVerifierNet, FaceNet, personal_config
from fedfs_sdk.runtime.onnx_backend import OnnxBackend
from fedfs_sdk.training.ort_device import dual_verifier_weights
from fedfs_sdk.runtime.preprocess import list_images, preprocess


def test_method_defaults_are_one_source_for_simulator_and_device() -> None:
    from device_sim.methods.sdk_methods import PRESETS

    default = PRESETS["fedfs+feduv"]["default"]
    assert default["lr"] == DEFAULT_LR["fedfs+feduv"] == 0.02
    assert (default["score"], default["verify"]) == DEFAULT_VERIFICATION["fedfs+feduv"] == ("head-template", "both")
    assert PRESETS["fedfs+feduv"]["paper"]["lr"] == PAPER_LR["fedfs+feduv"] == 5e-3      # FedFS §4.1
    assert PAPER_LR["feduv"] == DEFAULT_LR["feduv"] == 0.1                                # FedUV §6


@pytest.mark.parametrize("method,score,model,expected", [
    ("fedfs+feduv", None, None, ("head-template", "both")),
    ("fedfs+feduv", "codeword", "personal", ("codeword", "personal")),
    ("fedfs+feduv", None, "global", ("head-template", "global")),
    ("feduv", None, None, ("codeword", "global")),
    ("feduv", "head-template", None, ("head-template", "global")),
    ("fedfs", None, None, ("template", "personal")),
])
def test_verification_choices(method, score, model, expected) -> None:
    assert check_verification(method, score, model) == expected


@pytest.mark.parametrize("method,score,model,needle", [
    ("fedfs+feduv", "codeword", "both", "head-template"),
    ("feduv", None, "both", "one model"),
    ("feduv", None, "personal", "one model"),
    ("fedfs", "codeword", None, "no FedUV head"),
    ("fedfs+feduv", "cosine", None, "score must be one of"),
    ("fedfs+feduv", None, "mine", "verify must be one of"),
])
def test_impossible_verifications_are_named(method, score, model, needle) -> None:
    with pytest.raises(InputError, match=needle):
        check_verification(method, score, model)
    with pytest.raises(InputError):
        DeviceConfig(score="cosine")
    with pytest.raises(InputError):
        DeviceConfig(verify="mine")


def test_runtime_model_choice() -> None:
    assert verifier_model("fedfs+feduv", None) == "personal" and verifier_model("feduv", None) == "global"
    for method, choice in (("feduv", "both"), ("fedfs", "both"), ("fedfs", "global"), ("feduv", "personal")):
        with pytest.raises(InputError):
            verifier_model(method, choice)


def _two_models(seed: int = 0) -> tuple[FaceNet, FaceNet]:
    torch.manual_seed(seed)
    glob = FaceNet(TINY)
    personal = FaceNet(personal_config(TINY))
    with torch.no_grad():                        # θ_c ≠ w, so a swapped backbone would show
        for p in personal.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return glob, personal


def test_dual_verifier_file_is_the_concatenation_of_both_head_space_directions(tmp_path) -> None:
    glob, personal = _two_models()
    path = tmp_path / "dual.safetensors"
    mid = save_dual_verifier(path, personal.backbone, glob.backbone, glob.uv_head, TINY, meta={"verify": "both"})
    net, loaded_id = load_verifier(path)
    assert isinstance(net, DualVerifierNet) and loaded_id == mid and net.embedding_dim == 2 * 127
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(5, 3, 32, 32)).astype(np.float32))
    with torch.no_grad():
        (got,) = net(x)
        w = glob.uv_head.weight.double()
        q = personal.backbone(x).double() @ w.t()
        r = glob.backbone(x).double() @ w.t()
    want = torch.cat([q / q.norm(dim=1, keepdim=True), r / r.norm(dim=1, keepdim=True)], dim=1)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # cosine of the dual embedding = mean of the two head-space cosines (what the template scores)
    cos = torch.nn.functional.cosine_similarity
    pair = cos(got[:1].double(), got[1:2].double())
    assert float(pair) == pytest.approx(float(0.5 * (cos(q[:1], q[1:2]) + cos(r[:1], r[1:2]))), abs=1e-5)

    # a file whose recorded id is not its weights' is refused
    from fedfs_sdk.nn.checkpoint import read_checkpoint, save_checkpoint
    state, cfg, meta = read_checkpoint(path)
    net2, _ = load_verifier(path)
    with torch.no_grad():
        net2.global_backbone.embed_norm.weight.add_(1.0) if hasattr(net2.global_backbone, "embed_norm") else \
            next(net2.global_backbone.parameters()).add_(1.0)
    save_checkpoint(tmp_path / "tampered.safetensors", net2, cfg, meta)
    with pytest.raises(CheckpointError, match="model_id"):
        load_verifier(tmp_path / "tampered.safetensors")
    # a single-model verifier still loads as before
    save_verifier(tmp_path / "single.safetensors", personal.backbone, TINY, glob.uv_head)
    assert not isinstance(load_verifier(tmp_path / "single.safetensors")[0], DualVerifierNet)


def test_onnx_dual_verifier_matches_torch_and_carries_the_same_model_id() -> None:
    out, manifest = full_export()
    assert manifest["artifacts"]["onnx-dual"]["file"] == DUAL_ONNX_FILE
    glob, personal = _two_models(seed=3)
    g = {k: v.numpy() for k, v in glob.state_dict().items()}
    p = {k: v.numpy() for k, v in personal.state_dict().items()}
    backend = OnnxBackend(out / DUAL_ONNX_FILE, weights=dual_verifier_weights(g, p))
    net = DualVerifierNet(personal.backbone, glob.backbone, glob.uv_head).eval()
    assert backend.model_id == model_id_of(net.state_dict())       # one id for one set of weights
    x = np.random.default_rng(1).normal(size=(4, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x))[0].numpy()
    got = backend.run(x)["embedding"]
    assert got.shape == (4, 254) and np.abs(got - want).max() < 1e-5
    with pytest.raises(InputError, match="θ_c"):
        dual_verifier_weights(g, None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_device_enrolls_with_the_default_and_with_the_paper_reading(tmp_path) -> None:
    from fedfs_sdk.runtime.inference import TorchBackend
    from fedfs_sdk.federation.wire import decode_weights

    ck = checkpoints()
    srv = start_server(tmp_path / "server", "--init-model", str(ck["global"]), "--xi", str(ck["xi"]),
                       "--method", "fedfs+feduv", "--rounds", "2", "--min-participants", "1",
                       "--train", json.dumps({"local_epochs": 1, "batch_size": 8}))
    try:
        images = [str(p) for p in write_images(tmp_path / "me", 8, seed=11)]
        others = [str(p) for p in write_images(tmp_path / "them", 6, seed=99)]

        def take_part(score, model):
            with DeviceState(tmp_path / "dev") as st:
                # select="off": this test is about the method's own verifiers (the do-no-harm check would pick)
                cfg = DeviceConfig(rounds=1, wait_timeout_s=120, enroll=True, q=0.75, score=score, verify=model,
                                   select="off")
                enrollment = DeviceAgent(ServerClient(srv.url), st, images, cfg).run().enrollment
                personal_w = st.load_weights("personal")[0]
            return enrollment, personal_w

        # Round 1, the default: a head-space template of both models, the dual verifier file.
        default, personal_w = take_part(None, None)
        assert (default.meta["score"], default.meta["verify"], default.mode) == ("head-template", "both", "template")
        net, mid = load_verifier(tmp_path / "dev" / "verifier.safetensors")
        assert isinstance(net, DualVerifierNet) and mid == default.model_id
        # ...made of exactly this device's θ_c and the global model the enrollment records
        with DeviceState(tmp_path / "dev") as st:
            token = st.token
        with ServerClient(srv.url, token) as cl:
            version = int(default.meta["global_version"])
            gw, _ = decode_weights(cl.download_model(version, cl.latest_model()["sha256"]))
        glob, personal = FaceNet(TINY), FaceNet(personal_config(TINY))
        glob.load_state_dict(gw)
        personal.load_state_dict(personal_w)
        dual = DualVerifierNet(personal.backbone, glob.backbone, glob.uv_head).eval()
        assert model_id_of(dual.state_dict()) == default.model_id
        backend = TorchBackend(net, mid)
        own = [verify(backend, default, img).score for img in images]
        strangers = [verify(backend, default, img).score for img in others]
        assert sum(s >= default.threshold for s in own) >= 6           # warm-up q = 0.75 on these images
        assert np.mean(own) > np.mean(strangers)

        # Round 2, the papers' reading: FedUV's codeword scored with θ_c (q').
        paper, _ = take_part("codeword", "personal")
        assert (paper.meta["score"], paper.meta["verify"], paper.mode) == ("codeword", "personal", "codeword")
        assert not isinstance(load_verifier(tmp_path / "dev" / "verifier.safetensors")[0], DualVerifierNet)
    finally:
        srv.stop()
