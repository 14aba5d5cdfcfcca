"""A phone-like device over real HTTP: `fedfs serve` in a subprocess and two `fedfs device
--artifacts` processes that cannot import torch. They register, train fedfs+feduv from the ORT
training artifacts for 2 rounds, upload, and enroll with the ONNX verifier; the server's FedAvg
equals the weighted average of what went over the wire, and a device's first update equals the
torch LocalTrainer's on the same images and codeword. Both as deployed by default (the server's
rounds and the export's artifacts train the top on ξ's trunk, ``scope="top"``) and with every
layer training (``scope="all"``)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest_export import NO_TORCH_PRELUDE, TINY, TOL, checkpoints, full_export, tiny_weights, top_export, xi_model
from conftest_server import (ROOT, assert_published_fedavg, audited_uploads, start_server, subprocess_env,
                             write_images)
from fedfs_sdk.federation.device_runtime import ort_settings_for, round_seed
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.methods import DEFAULT_LR
from fedfs_sdk.training.top_keys import is_top_key
from fedfs_sdk.training.ort_device import TrainingArtifact
from fedfs_sdk.runtime.preprocess import list_images, preprocess
from fedfs_sdk.training.trainer import LocalTrainer
from fedfs_sdk.federation.wire import train_config_from_json

TRAIN = {"local_epochs": 1, "batch_size": 64}   # batch ≥ |D_c|: the shuffle order cannot matter

DEVICE_MAIN = """
from fedfs_sdk.cli.main import main
rc = main({argv!r})
assert "torch" not in sys.modules, "torch was imported on the device path"
sys.exit(rc)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scope", ["top", "all"])
def test_artifact_only_devices_run_rounds_over_http(tmp_path, scope: str) -> None:
    # top: `fedfs export` and `fedfs serve --xi` as they are, no flag; all: both told to train every layer
    out, _ = top_export() if scope == "top" else full_export()
    ck = checkpoints()
    srv = start_server(tmp_path / "server", "--init-model", str(ck["global"]), "--xi", str(ck["xi"]),
                       "--method", "fedfs+feduv", "--rounds", "2", "--min-participants", "2",
                       "--train", json.dumps(TRAIN if scope == "top" else {**TRAIN, "scope": "all"}))
    counts = (6, 10)
    try:
        procs = []
        for d, n in enumerate(counts):
            write_images(tmp_path / f"img{d}", n, seed=40 + d)
            argv = ["device", "--server", srv.url, "--images", str(tmp_path / f"img{d}"),
                    "--state", str(tmp_path / f"dev{d}"), "--artifacts", str(out), "--rounds", "2",
                    "--enroll", "--select", "off", "--q", "0.5", "--audit-dir", str(tmp_path / f"audit{d}"), "--wait-timeout", "120"]
            code = NO_TORCH_PRELUDE.format(root=str(ROOT)) + DEVICE_MAIN.format(argv=argv)
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=240)[0] for p in procs]
        for p, text in zip(procs, outs):
            assert p.returncode == 0, text
            assert "took part in 2 round(s)" in text and "enrolled" in text and "runtime=ort" in text, text

        # The server averaged exactly what the devices sent: w_c and |D_c|, nothing else.
        uploads: dict[int, list[tuple[dict[str, np.ndarray], int]]] = {1: [], 2: []}
        for d, n in enumerate(counts):
            sent = audited_uploads(tmp_path / f"audit{d}")
            assert [r for r, _, _ in sent] == [1, 2]
            for rnd, w, num in sent:
                assert num == n and set(w) == set(tiny_weights())      # no θ_c, codeword or images
                uploads[rnd].append((w, num))
        assert srv.status()["model_version"] == 3
        assert_published_fedavg(srv, uploads)

        # Device 0's round-1 update is the torch trainer's, on the same images and its own codeword.
        state0 = tmp_path / "dev0"
        with DeviceState(state0) as st:
            codeword = st.load_codeword()
            info = json.loads((state0 / "device.json").read_text())
        assert [r["runtime"] for r in info["rounds"]] == ["ort", "ort"]
        x = preprocess([str(p) for p in list_images(tmp_path / "img0")], TINY.resolved().input_size)
        # the device seeds round r's batch order with round_seed(train.seed, r); train.seed defaults to 0
        # the ORT artifact's scope is baked in; the task and the torch reference read the same one
        with srv.admin() as a:
            assert a.get("/v1/admin/config").json()["train"]["scope"] == scope
        ref = LocalTrainer(TINY, train_config_from_json("fedfs+feduv", {**TRAIN, "scope": scope}), xi=xi_model()).train(
            tiny_weights(), x, codeword=codeword, seed=round_seed(0, 1))
        got = dict(uploads[1][0][0])
        diff = max(float(np.abs(got[k] - ref.weights[k].numpy()).max()) for k in got)
        moved = max(float((ref.weights[k] - tiny_weights()[k]).abs().max()) for k in got)
        assert moved > 1e-3 and diff <= TOL, (moved, diff)
        trunk = [k for k in got if not is_top_key(k)]
        kept = [k for k in trunk if np.array_equal(got[k], tiny_weights()[k].numpy())]
        if scope == "top":      # the top trained on trunk.onnx's features; the trunk went back as received
            assert trunk and kept == trunk
            assert max(float(np.abs(got[k] - tiny_weights()[k].numpy()).max()) for k in got if is_top_key(k)) > 1e-3
        else:
            assert len(kept) < len(trunk)

        # θ_c, the codeword and the enrollment stayed on the device: no request body holds them.
        for f in ("personal.safetensors", "secrets.json", "enrollment.fedfs"):
            assert (state0 / f).stat().st_mode & 0o777 == 0o600
        from safetensors.numpy import load
        personal = load((state0 / "personal.safetensors").read_bytes())
        secrets_ = {"codeword": np.packbits(codeword < 0).tobytes(),
                    "θ_c (personal proj)": np.ascontiguousarray(personal["proj.weight"]).tobytes()[:256],
                    "enrollment": (state0 / "enrollment.fedfs").read_bytes()[:256]}
        bodies = [p.read_bytes() for p in (tmp_path / "audit0").iterdir() if p.name != "index.jsonl"]
        assert bodies
        for name, blob in secrets_.items():
            assert not any(blob in b for b in bodies), f"{name} went over the wire"
        assert not (state0 / "verifier.safetensors").exists()        # the ORT path enrolls via ONNX
        assert (state0 / "verifier.onnx").stat().st_mode & 0o777 == 0o600

        # The owner verifies with the device's own ONNX verifier — by default fedfs+feduv's dual
        # verifier (θ_c and w through W, onnx/verifier-dual.onnx) — still without torch. With
        # q = 0.5 the warm-up accepts at least half of the owner's 6 images.
        argv = ["verify", "--model", str(state0 / "verifier.onnx"), "--enrollment", str(state0 / "enrollment.fedfs"),
                "--key-file", str(state0 / "enrollment.key"), str(tmp_path / "img0")]
        r = subprocess.run([sys.executable, "-c", NO_TORCH_PRELUDE.format(root=str(ROOT)) + DEVICE_MAIN.format(argv=argv)],
                           cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 1) and r.stdout.count("ACCEPT") >= 3, r.stdout + r.stderr
        from fedfs_sdk.runtime.onnx_backend import OnnxBackend
        assert OnnxBackend(state0 / "verifier.onnx").outputs == ("embedding",)       # unit(W q') ⊕ unit(W r')
        assert OnnxBackend(state0 / "verifier.onnx").embedding_dim == 2 * 127
        argv[2], argv[-1] = str(out / "onnx" / "verifier.onnx"), str(list_images(tmp_path / "img0")[0])
        # the global model is another model:
        r = subprocess.run([sys.executable, "-c", NO_TORCH_PRELUDE.format(root=str(ROOT)) + DEVICE_MAIN.format(argv=argv)],
                           cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "model" in r.stderr, r.stderr          # the enrollment refuses it
    finally:
        srv.stop()


def _task(**train) -> dict:
    info = TrainingArtifact.load(full_export()[0] / "ort-training" / "fedfs_feduv").info
    return {"method": "fedfs+feduv", "model_config": json.loads(TINY.resolved().to_json()),
            "xi_sha256": info["xi_sha256"], "train": train}, info


def test_ort_runtime_checks_the_task_against_the_artifact() -> None:
    task, info = _task(**TRAIN)
    s = ort_settings_for(task, info)
    assert (s.lr, s.local_epochs, s.batch_size) == (pytest.approx(DEFAULT_LR["fedfs+feduv"]), 1, 64)
    ref = train_config_from_json("fedfs+feduv", TRAIN)         # the torch device's reading of the same task
    assert (ref.effective_lr, ref.effective_epochs, ref.batch_size) == (s.lr, s.local_epochs, s.batch_size)

    bad = [({"head_lr": 1.0}, "head_lr/lr"), ({"momentum": 0.9}, "plain SGD"),
           ({"objective": {"fedfs": {"gamma": 3.0}}}, "objective.fedfs.gamma"),
           ({"objective": {"uv_weight": 2.0}}, "objective.uv_weight"),
           # this artifact trains every layer; a default round trains the top: both fixes are named
           ({"scope": "top"}, "export the artifacts with --train '{\"scope\": \"top\"}', or start the server "
                              "with --train '{\"scope\": \"all\"}'")]
    for extra, words in bad:
        task, info = _task(**TRAIN, **extra)
        with pytest.raises(InputError, match=re.escape(words)):
            ort_settings_for(task, info)
    task, info = _task(**TRAIN)
    with pytest.raises(InputError, match="model_config.code_length"):
        ort_settings_for({**task, "model_config": {**task["model_config"], "code_length": 255}}, info)
    with pytest.raises(InputError, match="ξ"):
        ort_settings_for({**task, "xi_sha256": "0" * 64}, info)

