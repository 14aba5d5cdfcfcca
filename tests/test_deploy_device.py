"""A device runs the default's full rule without extra flags (issue 29 item 6): the do-no-harm
check at enrollment with the public impostor set the server ships with its model, ξ kept (and
said) when there is none; its preconditions are checked before it registers; an enrollment
records its preprocessing and verification applies it. Real server processes on 127.0.0.1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_server import cli_in_process, start_server, write_images
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from shared_assets import LFW

pytestmark = pytest.mark.timeout(600)


def test_enroll_with_too_few_photos_is_refused_before_registering(tmp_path):
    """It used to register, train and upload before refusing the enrollment."""
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--rounds", "1", "--min-participants", "1")
    try:
        write_images(tmp_path / "me", 3, seed=0)
        # `fedfs device` in this process (its real-subprocess runs: test_server_e2e, test_dp_device, …)
        r = cli_in_process("device", "--server", srv.url, "--images", str(tmp_path / "me"),
                           "--state", str(tmp_path / "dev"), "--enroll", "--wait-timeout", "30")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "q=0.9 needs at least 10 photos of the owner, got 3" in r.stderr, r.stderr
        assert srv.status()["devices"] == 0 and not (tmp_path / "dev").exists()
    finally:
        srv.stop()


def test_an_unreadable_image_folder_is_one_line(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads any folder")
    (tmp_path / "me").mkdir(mode=0o000)
    from fedfs_sdk.errors import InputError
    from fedfs_sdk.runtime.preprocess import list_images

    with pytest.raises(InputError, match="cannot be read"):
        list_images(tmp_path / "me")


@pytest.mark.parametrize("ships_impostors", [False, True])
def test_the_device_checks_by_default_and_keeps_xi_without_impostors(tmp_path, ships_impostors):
    """No ``--impostors`` on the device: with a server that ships a public set the check runs on it
    (downloaded with the model); without one the device keeps ξ and says why — it used to enroll
    the personalized model unchecked."""
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.runtime.impostors import ImpostorSet, save_impostors

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "xi.safetensors", FaceNet(ModelConfig("tiny")), ModelConfig("tiny"))
    rng = np.random.default_rng(0)
    save_impostors(tmp_path / "imp.npz", ImpostorSet(rng.integers(0, 255, (30, 32, 32, 3), dtype=np.uint8),
                                                     np.arange(30) // 3, [f"p{i}" for i in range(10)]))
    extra = ["--impostors", str(tmp_path / "imp.npz")] if ships_impostors else []
    srv = start_server(tmp_path / "server", "--xi", str(tmp_path / "xi.safetensors"), "--rounds", "1",
                       "--min-participants", "1", *extra)
    try:
        images = [str(p) for p in write_images(tmp_path / "me", 10, seed=3)]
        events: list[tuple[str, dict]] = []
        with DeviceState(tmp_path / "dev") as state, ServerClient(srv.url) as client:
            report = DeviceAgent(client, state, images, DeviceConfig(rounds=1, enroll=True, q=0.8),
                                 on_event=lambda n, f: events.append((n, f))).run()
            assert report.rounds[0]["num_samples"] == 8          # the 2 hold-out photos are never trained on
            meta = report.enrollment.meta
            assert meta["method"] == "fedfs+feduv"               # the server's default with a ξ
            chosen = [f for n, f in events if n == "model_chosen"]
            assert len(chosen) == 1 and chosen[0]["chosen"] == meta["model_choice"]
            if ships_impostors:
                assert [c["name"] for c in meta["selection"]["checks"]] == ["xi", "global", "personalized"]
                assert state.file("impostors.npz").read_bytes() == (tmp_path / "imp.npz").read_bytes()
                assert meta["operating_point"]["impostor_set"]["photos"] == 30
            else:
                assert meta["model_choice"] == "xi" and "no public impostor set" in meta["selection"]["reason"]
                assert "kept ξ" in meta["selection"]["reason"]
    finally:
        srv.stop()


@pytest.mark.skipif(not LFW.is_dir(), reason="../shared (LFW) not present")
def test_verification_applies_the_enrollments_preprocessing(tmp_path):
    """An enrollment made on aligned faces used to be verified on centre crops unless the flag was
    given again (the owner rejected, no warning)."""
    from fedfs_sdk.errors import InputError
    from fedfs_sdk.nn.model import VerifierNet
    from fedfs_sdk.runtime.enrollment import enroll, score
    from fedfs_sdk.runtime.inference import TorchBackend

    person = sorted(p for p in LFW.iterdir() if p.is_dir() and len(list(p.iterdir())) >= 8)[0]
    photos = [str(f) for f in sorted(person.iterdir())[:8]]
    torch.manual_seed(0)
    net = FaceNet(ModelConfig("tiny", input_size=112))
    backend = TorchBackend(VerifierNet(net.backbone).eval(), "m")
    e = enroll(backend, photos[:6], q=0.8, detect_face=True)
    assert e.meta["preprocessing"] == {"detect_face": "align", "face_mode": "align", "input_size": 112}
    recorded = score(backend, e, photos[6:])                              # as enrolled: aligned
    assert np.allclose(recorded, score(backend, e, photos[6:], detect_face=True))
    with pytest.raises(InputError, match="enrollment was made with detect_face='align'"):
        score(backend, e, photos[6:], detect_face=False)
    e.meta.pop("preprocessing")                                           # an enrollment from before
    assert not np.allclose(recorded, score(backend, e, photos[6:], detect_face=False))


def test_a_device_the_server_never_sampled_enrolls_under_feduv(tmp_path):
    """FedUV's new user on a device: registered, never in a round, it enrolls with the shipped model's
    scoring — a codeword made now (FedUV Alg. 2) — after the same do-no-harm check over ξ and the
    global model. It used to fail: "holds no codeword yet: the device has not trained a FedUV round"."""
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.runtime.impostors import ImpostorSet, save_impostors

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "xi.safetensors", FaceNet(ModelConfig("tiny")), ModelConfig("tiny"))
    rng = np.random.default_rng(0)
    save_impostors(tmp_path / "imp.npz", ImpostorSet(rng.integers(0, 255, (30, 32, 32, 3), dtype=np.uint8),
                                                     np.arange(30) // 3, [f"p{i}" for i in range(10)]))
    srv = start_server(tmp_path / "server", "--xi", str(tmp_path / "xi.safetensors"), "--method", "feduv",
                       "--rounds", "1", "--min-participants", "2", "--impostors", str(tmp_path / "imp.npz"))
    try:
        images = [str(p) for p in write_images(tmp_path / "me", 10, seed=4)]
        with DeviceState(tmp_path / "dev") as state, ServerClient(srv.url) as client:
            agent = DeviceAgent(client, state, images, DeviceConfig(q=0.8, stats=False))
            agent.ensure_registered()
            assert not state.info.rounds                         # never sampled, never trained
            enrollment = agent.enroll()
            meta = enrollment.meta
            assert meta["method"] == "feduv" and enrollment.mode in ("codeword", "template")
            assert [c["name"] for c in meta["selection"]["checks"]] == ["xi", "global"]
            if meta["model_choice"] == "global":
                assert enrollment.mode == "codeword"
            assert state.load_codeword().shape == (127,)         # made at enrollment, kept encrypted
    finally:
        srv.stop()
