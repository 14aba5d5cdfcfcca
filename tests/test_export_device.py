"""A phone-like process: no torch importable. Enroll/verify with the ONNX backend, and a full
federated round in which artifact-only devices train from the ORT artifacts and the real
aggregation logic (server_agg Coordinator) averages their uploads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest_export import TOL, TINY, TMP, checkpoints, faces, full_export, run_device_script, tiny_weights, xi_model
from export.ort_training import train_config_of
from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.runtime.enrollment import score
from fedfs_sdk.runtime.enrollment import enroll as torch_enroll
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.nn.model import FaceNet, VerifierNet
from fedfs_sdk.training.ort_device import UPDATE_FORMAT
from fedfs_sdk.training.trainer import LocalTrainer
from fedfs_sdk.federation.wire import UPDATE_FORMAT as WIRE_UPDATE_FORMAT
from fedfs_sdk.federation.wire import decode_update



def _uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(x.transpose(0, 2, 3, 1) * 127.5 + 127.5, 0, 255).round().astype(np.uint8)


def test_enroll_and_verify_with_onnx_backend_without_torch() -> None:
    out, manifest = full_export()
    owner, _ = faces(1, 14, seed=21)
    other, _ = faces(3, 2, seed=22)
    data = TMP / "enroll-data.npz"
    np.savez(data, owner=_uint8(owner), other=_uint8(other))
    codeword, _ = make_codeword(4242, 127, rng=np.random.default_rng(3))   # warms the BCH cache too
    code = f"""
import json
import numpy as np
from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.runtime.enrollment import enroll, generate_key, load_enrollment, save_enrollment, verify
from fedfs_sdk.runtime.onnx_backend import OnnxBackend

d = np.load({str(data)!r})
backend = OnnxBackend({str(out / 'onnx/verifier.onnx')!r})
cw, _ = make_codeword(4242, 127, rng=np.random.default_rng(3))
# outliers="none": this checks ONNX/torch parity with the minimum 10 images (a random model's
# scores can flag an owner image, which would leave too few for q = 0.9)
e = enroll(backend, list(d["owner"][:10]), q=0.9, codeword=cw, outliers="none")   # uint8: preprocessing runs here
key = generate_key()
save_enrollment({str(TMP / 'owner.fedfs')!r}, e, key, overwrite=True)
e = load_enrollment({str(TMP / 'owner.fedfs')!r}, key)
res = [verify(backend, e, img) for img in list(d["owner"][10:]) + list(d["other"])]
t = enroll(backend, list(d["owner"][:10]), q=0.9, outliers="none")
print(json.dumps({{"model_id": e.model_id, "tau": e.threshold, "scores": [r.score for r in res],
                  "accepted": [r.accepted for r in res], "template_tau": t.threshold, "mode": t.mode}}))
"""
    got = json.loads(run_device_script(code).strip().splitlines()[-1])
    # Same decisions and scores as the torch backend on the same images (the parity that matters).
    model = FaceNet(TINY)
    model.load_state_dict(tiny_weights())
    torch_backend = TorchBackend(VerifierNet(model.backbone, model.uv_head), manifest["model_id"])
    from fedfs_sdk.runtime.preprocess import preprocess
    owner_pre = preprocess(list(_uint8(owner)), 32)
    other_pre = preprocess(list(_uint8(other)), 32)
    ref = torch_enroll(torch_backend, owner_pre[:10], q=0.9, codeword=codeword, outliers="none")
    ref_scores = score(torch_backend, ref, np.concatenate([owner_pre[10:], other_pre]))
    assert got["model_id"] == manifest["model_id"]
    assert got["tau"] == pytest.approx(ref.threshold, abs=1e-5)
    np.testing.assert_allclose(got["scores"], ref_scores, atol=1e-5)
    assert got["accepted"] == [s >= got["tau"] for s in got["scores"]]
    assert got["mode"] == "template" and -1 <= got["template_tau"] <= 1


def test_artifact_only_devices_take_part_in_a_round() -> None:
    """Two torch-free devices train fedfs+feduv from the artifacts and upload; the server's
    Coordinator validates and FedAvgs the uploads. The new global model equals FedAvg of
    torch LocalTrainer updates on the same data; θ_c and the codeword never leave."""
    from server_agg.rounds import Coordinator
    from server_agg.store import Layout

    out, _ = full_export()
    art = out / "ort-training" / "fedfs_feduv"
    train = {"local_epochs": 2, "batch_size": 64}          # batch ≥ |D_c|: shuffling cannot matter
    coord = Coordinator(Layout(TMP / "server-state"), policy_overrides={
        "method": "fedfs+feduv", "train": train, "min_participants": 2})
    coord.install_model(checkpoints()["global"].read_bytes())
    devices = [coord.register() for _ in range(2)]
    for d in devices:
        coord.authenticate(d["token"])                   # their first poll: only then are they sampled
    coord.open_round()
    tasks = [coord.task_for(d["device_id"]) for d in devices]
    assert all(t["action"] == "train" for t in tasks)
    model_path, _ = coord.model_file(tasks[0]["model_version"])
    jobs = []
    for i, (d, t) in enumerate(zip(devices, tasks)):
        x, _ = faces(1, 8 + 4 * i, seed=30 + i)             # |D_c| = 8 and 12
        np.save(TMP / f"dev{i}.npy", x)
        jobs.append({"images": str(TMP / f"dev{i}.npy"), "base": d["base_vector"], "round_id": t["round_id"],
                     "version": t["model_version"], "update": str(TMP / f"update{i}.bin"),
                     "personal": str(TMP / f"personal{i}.safetensors")})
    code = f"""
import json
from pathlib import Path
import numpy as np
from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.runtime.enrollment import enroll
from fedfs_sdk.runtime.onnx_backend import OnnxBackend
from fedfs_sdk.training.ort_device import (OrtDeviceTrainer, decode_model, encode_update, save_weights,
                                  verifier_weights)

weights, header = decode_model(Path({str(model_path)!r}).read_bytes())
trainer = OrtDeviceTrainer({str(art)!r}, local_epochs={train['local_epochs']}, batch_size={train['batch_size']})
report = []
for job in {json.dumps(jobs)}:
    x = np.load(job["images"])
    cw, _ = make_codeword(job["base"], 127, rng=np.random.default_rng(job["base"] % 1000))
    up = trainer.train(weights, x, codeword=cw)
    Path(job["update"]).write_bytes(encode_update(up.weights, round_id=job["round_id"],
                                                  model_version=job["version"], num_samples=up.num_samples))
    save_weights(job["personal"], up.personal_weights)            # θ_c stays on the device
    # verify with the personalized model q' (θ_c) and the head W, as the phone does
    backend = OnnxBackend({str(out / 'onnx/verifier.onnx')!r}, weights=verifier_weights(up.weights, up.personal_weights))
    e = enroll(backend, x, q=0.5, codeword=cw)
    report.append({{"metrics": up.metrics, "model_id": backend.model_id, "tau": e.threshold}})
print(json.dumps(report))
"""
    report = json.loads(run_device_script(code).strip().splitlines()[-1])
    bodies = [Path(j["update"]).read_bytes() for j in jobs]
    for d, t, body in zip(devices, tasks, bodies):
        w, meta = decode_update(body)                       # the server's own parser
        assert set(w) == set(tiny_weights())               # w_c only: no θ_c, no codeword, no images
        assert meta.num_samples in (8, 12)
        receipt = coord.submit_update(d["device_id"], t["round_id"], body)
        assert receipt["duplicate"] is False
    assert coord.status()["model_version"] == 2             # quorum reached → FedAvg published
    new = coord.model.weights

    # Reference: torch LocalTrainer on the same images/codewords, FedAvg weighted by |D_c|.
    cfg = train_config_of(json.loads((art / "artifact.json").read_text()))
    from dataclasses import replace
    cfg = replace(cfg, local_epochs=train["local_epochs"], batch_size=train["batch_size"])
    acc: dict[str, torch.Tensor] = {}
    total = 0
    for j in jobs:
        x = np.load(j["images"])
        cw, _ = make_codeword(j["base"], 127, rng=np.random.default_rng(j["base"] % 1000))
        r = LocalTrainer(TINY, cfg, xi=xi_model()).train(tiny_weights(), x, codeword=cw)
        for k, v in r.weights.items():
            acc[k] = acc.get(k, 0) + r.num_samples * v.double()
        total += r.num_samples
    diff = max(float((new[k].double() - acc[k] / total).abs().max()) for k in new)
    moved = max(float((new[k] - tiny_weights()[k]).abs().max()) for k in new)
    assert moved > 1e-3 and diff <= TOL, (moved, diff)
    assert all(r["tau"] <= 1.0 and len(r["model_id"]) == 16 for r in report)
    assert report[0]["model_id"] != report[1]["model_id"]   # each device verifies with its own θ_c


def test_update_format_constant_matches_wire() -> None:
    assert UPDATE_FORMAT == WIRE_UPDATE_FORMAT


def test_device_modules_keep_torch_out_even_where_it_is_installed() -> None:
    """Without the import blocker: onnxruntime-training's package init would import torch
    (it probes its optional ORTModule); the SDK's ORT import skips that, so the device path
    stays torch-free in an ordinary environment too."""
    import subprocess
    import sys

    from conftest_export import ROOT

    out, _ = full_export()
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from fedfs_sdk.runtime.onnx_backend import OnnxBackend
from fedfs_sdk.training.ort_device import OrtDeviceTrainer
import fedfs_sdk.runtime.enrollment, fedfs_sdk.runtime.preprocess
OnnxBackend({str(out / 'onnx/verifier.onnx')!r})
OrtDeviceTrainer({str(out / 'ort-training/feduv')!r})
import importlib.util
assert importlib.util.find_spec("torch") is not None, "torch should be installed in this environment"
print("torch" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
