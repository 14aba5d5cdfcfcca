"""A simulation's result in an app (issue 12 #5, #6): a ``fedfs simulate`` checkpoint →
``fedfs export`` (ONNX) → ``fedfs enroll`` → ``fedfs verify``, for the global model and for
one simulated client's personalized verifier; ``fedfs verify`` of a device enrollment needs
no ``--model``; a folder given to verify verifies each image."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from device_sim import cli_simulate
from device_sim.federation import latest_checkpoint
from device_sim.sim_export import export_federation_model
from device_sim.synthfaces import SynthFaces, write_image_folder
from fedfs_sdk.nn.checkpoint import load_checkpoint, load_verifier
from fedfs_sdk.cli.main import main

SIM = ["--clients", "4", "--new-users", "1", "--public", "6", "--train-per-client", "6", "--test-per-client", "2",
       "--public-images", "6", "--width", "4", "--embedding-dim", "16", "--pretrain-epochs", "1",
       "--pretrain-batch-size", "12", "--rounds", "1", "--participation", "1.0", "--checkpoint-every", "1",
       "--local-epochs", "1", "--quiet"]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sim")
    args = cli_simulate.experiment_from_argv(["--method", "fedfs", "--out", str(tmp / "run"),
                                              "--cache-dir", str(tmp / "c"), *SIM])
    keep: dict = {}
    res = cli_simulate.run_simulation(args, keep=keep)
    ck = latest_checkpoint(tmp / "run" / "checkpoints" / "fedfs")
    assert ck is not None and ck.name == "round_00001.safetensors"
    return tmp, res, keep["fedfs"], ck


def test_client_verifier_is_that_clients_theta(sim) -> None:
    tmp, _, fed, ck = sim
    out = tmp / "client1.safetensors"
    meta = export_federation_model(ck, out, client=1)
    assert meta["verifies_with"] == "personal" and meta["round"] == 1
    net, _ = load_checkpoint(out)
    theta = fed.private_weights(1)["personal"]
    for k, v in net.backbone.state_dict().items():
        assert torch.equal(v, theta["backbone." + k]), k
    # another client's θ_c differs (personalized), and the global model is w
    other = fed.private_weights(2)["personal"]
    assert any(not torch.equal(v, other["backbone." + k]) for k, v in net.backbone.state_dict().items())
    export_federation_model(ck, tmp / "global.safetensors")
    g, gmeta = load_checkpoint(tmp / "global.safetensors")
    assert gmeta["role"] == "global" and g.proj is not None          # FedFS's projection ships for training
    for k, v in g.state_dict().items():
        assert torch.equal(v, fed.global_weights[k]), k
    with pytest.raises(Exception, match="not a client of this run"):
        export_federation_model(ck, tmp / "x.safetensors", client=99)


def test_simulate_export_enroll_verify(sim, capsys) -> None:
    tmp, res, fed, ck = sim
    identity = fed.data.splits.clients[0].identity
    other = fed.data.splits.clients[1].identity
    faces = SynthFaces(0, 32, 1.0)
    owner = write_image_folder(faces, tmp / "owner", [identity], 12, start_index=50) / f"{identity:06d}"
    probes = write_image_folder(faces, tmp / "probes", [identity], 3, start_index=80) / f"{identity:06d}"
    impostor = write_image_folder(faces, tmp / "imp", [other], 1, start_index=80) / f"{other:06d}" / "0080.png"
    # ONNX of client 0's personalized verifier
    assert main(["export", "--checkpoint", str(ck), "--client", "0", "--formats", "onnx", "--out", str(tmp / "x0"),
                 "--quiet"]) == 0
    onnx = tmp / "x0" / "onnx" / "verifier.onnx"
    assert onnx.is_file()
    key = tmp / "key"
    assert main(["enroll", "--model", str(onnx), "--images", str(owner), "--out", str(tmp / "a.enr"),
                 "--key-file", str(key)]) == 0
    # the enrollment records its model: verify needs no --model; a folder verifies each image
    code = main(["verify", "--enrollment", str(tmp / "a.enr"), "--key-file", str(key), str(probes)])
    out = capsys.readouterr().out
    assert code in (0, 1) and out.count("score=") == 3 and "of 3 accepted" in out
    # the simulation checkpoint itself, client 0, through torch: same decisions as its ONNX export
    assert main(["enroll", "--model", str(ck), "--client", "0", "--images", str(owner), "--out", str(tmp / "b.enr"),
                 "--key-file", str(key)]) == 0
    capsys.readouterr()
    for img in sorted(probes.iterdir()) + [impostor]:
        a = main(["verify", "--enrollment", str(tmp / "a.enr"), "--key-file", str(key), str(img)])
        sa = capsys.readouterr().out
        b = main(["verify", "--enrollment", str(tmp / "b.enr"), "--key-file", str(key), str(img)])
        sb = capsys.readouterr().out
        assert a == b and abs(float(sa.split("score=")[1].split()[0]) - float(sb.split("score=")[1].split()[0])) < 1e-3
    # the global model exports too (FedFS training artifacts need ξ; ONNX alone does not)
    assert main(["export", "--checkpoint", str(ck), "--formats", "onnx", "--out", str(tmp / "xg"), "--quiet"]) == 0
    assert json.loads((tmp / "xg" / "manifest.json").read_text())["model_id"]
    assert res["clients"] and len(res["clients"]) == 4


def test_client_flag_on_a_plain_model_is_refused(sim, capsys) -> None:
    tmp, _, _, ck = sim
    export_federation_model(ck, tmp / "g.safetensors")
    assert main(["enroll", "--model", str(tmp / "g.safetensors"), "--client", "0", "--images", str(tmp),
                 "--out", str(tmp / "c.enr"), "--key-file", str(tmp / "k2")]) == 2
    assert "--client picks a client of a simulation checkpoint" in capsys.readouterr().err


def test_verify_finds_the_device_verifier_next_to_its_enrollment(tmp_path, capsys) -> None:
    """``fedfs device --enroll`` writes STATE/verifier.safetensors and STATE/enrollment.fedfs
    (meta without a model path): ``fedfs verify`` needs no --model."""
    from fedfs_sdk import enroll, generate_key, save_enrollment
    from fedfs_sdk.nn.checkpoint import save_verifier
    from fedfs_sdk.runtime.inference import TorchBackend
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    cfg = ModelConfig(backbone="tiny", width=4, embedding_dim=16, input_size=32)
    torch.manual_seed(0)
    net = FaceNet(cfg)
    state = tmp_path / "state"
    state.mkdir()
    save_verifier(state / "verifier.safetensors", net.backbone, cfg)
    faces = SynthFaces(0, 32, 1.0)
    imgs = write_image_folder(faces, tmp_path / "img", [3], 12) / "000003"
    v, mid = load_verifier(state / "verifier.safetensors")
    e = enroll(TorchBackend(v, mid), [str(f) for f in sorted(imgs.iterdir())[:10]], q=0.9,
               meta={"runtime": "torch", "method": "fedfs"}, outliers="none")
    key = generate_key()
    (state / "enrollment.key").write_bytes(key)
    save_enrollment(state / "enrollment.fedfs", e, key)
    code = main(["verify", "--enrollment", str(state / "enrollment.fedfs"), "--key-file", str(state / "enrollment.key"),
                 str(sorted(imgs.iterdir())[11])])
    assert code in (0, 1), capsys.readouterr().err
    assert "score=" in capsys.readouterr().out
    # nothing recorded and no verifier beside it: one line naming --model
    (state / "verifier.safetensors").unlink()
    assert main(["verify", "--enrollment", str(state / "enrollment.fedfs"), "--key-file", str(state / "enrollment.key"),
                 str(imgs)]) == 2
    assert "pass --model" in capsys.readouterr().err


def test_feduv_methods_client_verifiers(tmp_path) -> None:
    """FedFS+FedUV (verify=personal): θ_c's backbone with the global head W; FedUV: the global
    model for every client (it keeps no θ_c)."""
    from device_sim.report import slug

    args = cli_simulate.experiment_from_argv(["--method", "fedfs+feduv:verify=personal", "feduv",
                                              "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c"),
                                              *SIM])
    keep: dict = {}
    cli_simulate.run_simulation(args, keep=keep)
    fed = keep["fedfs+feduv:verify=personal"]
    ck = latest_checkpoint(tmp_path / "run" / "checkpoints" / slug(fed.method.label))
    meta = export_federation_model(ck, tmp_path / "c2.safetensors", client=2)
    assert meta["verifies_with"] == "personal"
    net, _ = load_checkpoint(tmp_path / "c2.safetensors")
    theta = fed.private_weights(2)["personal"]
    assert all(torch.equal(v, theta["backbone." + k]) for k, v in net.backbone.state_dict().items())
    assert torch.equal(net.uv_head.weight, fed.global_weights["uv_head.weight"])
    uv = keep["feduv"]
    ck = latest_checkpoint(tmp_path / "run" / "checkpoints" / slug(uv.method.label))
    assert export_federation_model(ck, tmp_path / "u.safetensors", client=1)["verifies_with"] == "global"
    net, _ = load_checkpoint(tmp_path / "u.safetensors")
    assert all(torch.equal(v, uv.global_weights["backbone." + k]) for k, v in net.backbone.state_dict().items())


def test_default_fedfs_feduv_client_exports_its_dual_verifier(tmp_path, capsys) -> None:
    """fedfs+feduv's default verifies with both models (verify=both): ``--client N`` exports that
    dual verifier as ONNX; enrolling with it and with the simulation checkpoint itself gives the
    same model id and the same scores."""
    from device_sim.report import slug
    from fedfs_sdk.nn.dual_verifier import load_dual_verifier
    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    args = cli_simulate.experiment_from_argv(["--method", "fedfs+feduv", "--out", str(tmp_path / "run"),
                                              "--cache-dir", str(tmp_path / "c"), *SIM])
    keep: dict = {}
    cli_simulate.run_simulation(args, keep=keep)
    fed = keep["fedfs+feduv"]
    ck = latest_checkpoint(tmp_path / "run" / "checkpoints" / slug(fed.method.label))
    assert export_federation_model(ck, tmp_path / "d.safetensors", client=3)["verifies_with"] == "both"
    net, mid = load_dual_verifier(tmp_path / "d.safetensors")
    theta = fed.private_weights(3)["personal"]
    assert all(torch.equal(v, theta["backbone." + k]) for k, v in net.backbone.state_dict().items())
    assert all(torch.equal(v, fed.global_weights["backbone." + k]) for k, v in net.global_backbone.state_dict().items())
    assert main(["export", "--checkpoint", str(ck), "--client", "3", "--formats", "onnx", "--out", str(tmp_path / "x"),
                 "--quiet"]) == 0
    onnx = tmp_path / "x" / "onnx" / "verifier.onnx"
    assert OnnxBackend(str(onnx)).model_id == mid
    assert main(["export", "--checkpoint", str(ck), "--client", "3", "--formats", "onnx,coreml",
                 "--out", str(tmp_path / "y"), "--quiet"]) == 2
    assert "--formats onnx" in capsys.readouterr().err
    identity = fed.data.splits.clients[3].identity
    owner = write_image_folder(SynthFaces(0, 32, 1.0), tmp_path / "o", [identity], 12, start_index=50)
    owner = owner / f"{identity:06d}"
    key = tmp_path / "key"
    assert main(["enroll", "--model", str(onnx), "--images", str(owner), "--out", str(tmp_path / "a.enr"),
                 "--key-file", str(key), "--outliers", "none"]) == 0
    assert main(["enroll", "--model", str(ck), "--client", "3", "--images", str(owner), "--out", str(tmp_path / "b.enr"),
                 "--key-file", str(key), "--outliers", "none"]) == 0
    lines = capsys.readouterr().out.splitlines()
    taus = [float(line.split("τ=")[1].split()[0]) for line in lines if "τ=" in line]
    assert len(taus) == 2 and abs(taus[0] - taus[1]) < 1e-4 and all(mid in line for line in lines if "τ=" in line)


def test_a_simulation_checkpoint_where_one_model_is_expected_says_what_takes_it(sim) -> None:
    from fedfs_sdk.errors import CheckpointError

    _, _, _, ck = sim
    with pytest.raises(CheckpointError, match="fedfs export --checkpoint.*--client N"):
        load_checkpoint(ck)
