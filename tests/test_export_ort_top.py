"""``scope="top"`` ORT training artifacts (the export's default, :mod:`export.ort_top`): a device
runs ``trunk.onnx`` once and trains the top on its features, as the torch trainer does under
``scope="top"``; the trunk goes back as received, and a model with another trunk is refused.

Tolerance as in test_export_ort_training.py: every weight within 2e-5 of torch's LocalTrainer
after 3 SGD steps (observed ≤ 2e-6), while the steps move the top by > 1e-3.
"""
from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch

from conftest_export import TINY, TMP, TOL, faces, tiny_weights, top_export, xi_model
from export.common import ExportError
from export.ort_training import export_training_artifacts, train_config_of
from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.nn.model import FaceNet
from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.training.ort_device import OrtDeviceTrainer, TrainingArtifact
from fedfs_sdk.training.scope import Trunk
from fedfs_sdk.training.top_keys import is_top_key, trunk_sha256
from fedfs_sdk.training.trainer import LocalTrainer

LR = 0.05
CODEWORD = make_codeword(11, 127, rng=np.random.default_rng(0))[0]


def _np(weights) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in weights.items()}


@functools.lru_cache(maxsize=None)
def _artifact(method: str):
    model = FaceNet(TINY)
    model.load_state_dict(tiny_weights())
    out = TMP / f"top-{method.replace('+', '_')}"
    info = export_training_artifacts(method, model, out, xi=xi_model() if method != "feduv" else None, scope="top",
                                     lr=LR, local_epochs=3, batch_size=12)
    return out, info


@pytest.mark.parametrize("method", ["feduv", "fedfs", "fedfs+feduv"])
def test_top_steps_match_torch_and_keep_the_trunk(method: str) -> None:
    art, info = _artifact(method)
    assert info["scope"] == "top" and info["inputs"][0] == "features"
    trained = info["trainable"]["global"] + info["trainable"].get("personal", [])
    assert trained and all(is_top_key(k) for k in trained)                 # only the top is in the graph
    assert set(info["state_shapes"]["global"]) == set(tiny_weights())      # …but whole models go in and out
    x, _ = faces(1, 12, seed=5)
    cfg = train_config_of(info)
    assert cfg.effective_scope == "top"
    w0 = tiny_weights()
    xi = xi_model() if method != "feduv" else None
    feats = Trunk(xi.backbone)(torch.from_numpy(x)).detach() if xi is not None else None
    ref = LocalTrainer(TINY, cfg, xi=xi).train(w0, x, codeword=CODEWORD, trunk_features=feats)
    got = OrtDeviceTrainer(art).train(_np(w0), x, codeword=CODEWORD)
    top = [k for k in w0 if is_top_key(k)]
    assert max(float((ref.weights[k] - w0[k]).abs().max()) for k in top) > 1e-3
    assert max(float(np.abs(got.weights[k] - ref.weights[k].numpy()).max()) / max(1.0, float(ref.weights[k].abs().max()))
               for k in w0) <= TOL
    for k in w0:
        if not is_top_key(k):
            assert np.array_equal(got.weights[k], w0[k].numpy()), k      # the trunk, bit for bit
    if method != "feduv":
        assert max(float(np.abs(got.personal_weights[k] - ref.personal_weights[k].numpy()).max())
                   for k in ref.personal_weights) <= TOL
    assert got.metrics["loss_first"] == pytest.approx(ref.metrics["loss_first"], rel=1e-5, abs=1e-6)


def test_trunk_graph_is_the_trunk() -> None:
    art, info = _artifact("fedfs+feduv")
    dev = OrtDeviceTrainer(art)
    x, _ = faces(3, 15, seed=2)                                       # 45 images: two trunk batches (32 + 13)
    got = dev.trunk_features(x)
    with torch.no_grad():
        ref = Trunk(xi_model().backbone)(torch.from_numpy(x)).numpy()
    assert got.shape == ref.shape == (45, info["trunk"]["feature_dim"])
    assert float(np.abs(got - ref).max()) <= 1e-5
    assert info["trunk"]["sha256"] == trunk_sha256(tiny_weights())


def test_a_model_with_another_trunk_is_refused_and_nothing_changes() -> None:
    art, _ = _artifact("fedfs+feduv")
    dev = OrtDeviceTrainer(art)
    w = _np(tiny_weights())
    dev.load_weights(w)
    before = dev.global_weights()
    trunk_key = next(k for k in w if k.startswith("backbone.") and not is_top_key(k))
    other = {**w, trunk_key: w[trunk_key] + np.float32(1e-3)}
    x, _ = faces(1, 6, seed=1)
    with pytest.raises(InputError, match="global weights: the trunk differs from the one this scope='top' artifact"):
        dev.train(other, x, codeword=CODEWORD)
    personal = {k: v for k, v in other.items() if not k.startswith("uv_head.")}
    with pytest.raises(InputError, match="personalized weights: the trunk differs"):
        dev.load_weights(w, personal)
    after = dev.global_weights()
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_given_features_are_checked() -> None:
    art, info = _artifact("fedfs")
    dev = OrtDeviceTrainer(art)
    x, _ = faces(1, 6, seed=3)
    y, _ = faces(1, 6, seed=4)
    w = _np(tiny_weights())
    feats = dev.trunk_features(x)
    a = dev.train(w, x, features=feats, seed=1)
    b = dev.train(w, x, seed=1)                                       # computed inside: the same update
    assert all(np.allclose(a.weights[k], b.weights[k], rtol=0, atol=1e-7) for k in w)
    with pytest.raises(InputError, match=r"features must be a float \[6, 64\] array"):
        dev.train(w, x, features=feats[:5])
    with pytest.raises(InputError, match="not this artifact's trunk output of these images"):
        dev.train(w, x, features=dev.trunk_features(y))


def test_export_refuses_a_checkpoint_whose_trunk_is_not_xis() -> None:
    model = FaceNet(TINY)
    weights = dict(tiny_weights())
    key = next(k for k in weights if k.startswith("backbone.") and not is_top_key(k))
    weights[key] = weights[key] + 0.01
    model.load_state_dict(weights)
    with pytest.raises(ExportError, match=r"checkpoint's trunk differs from ξ's \(1 of .*scope\": \"all\""):
        export_training_artifacts("fedfs", model, TMP / "refused-top", xi=xi_model(), scope="top")
    assert not (TMP / "refused-top" / "trunk.onnx").exists()


def test_a_top_artifact_without_its_trunk_is_refused(tmp_path) -> None:
    art, _ = _artifact("feduv")
    copy = tmp_path / "feduv"
    shutil.copytree(art, copy)
    (copy / "trunk.onnx").unlink()
    with pytest.raises(CheckpointError, match="missing trunk.onnx"):
        TrainingArtifact.load(copy)
    info = json.loads((art / "artifact.json").read_text())
    (copy / "artifact.json").write_text(json.dumps({**info, "trunk": None}))
    with pytest.raises(CheckpointError, match="scope='top' artifact without its trunk"):
        TrainingArtifact.load(copy)


def test_the_default_export_trains_the_top_and_the_runtime_runs_the_trunk_once() -> None:
    """`fedfs export --formats onnx,ort-training` with no --train: scope=top artifacts (what a
    default server round asks); the device runtime keeps its photos' trunk features across rounds."""
    from fedfs_sdk.federation.ort_runtime import OrtRuntime

    out, manifest = top_export()
    per_method = manifest["artifacts"]["ort-training"]["methods"]
    assert per_method and {m["scope"] for m in per_method.values()} == {"top"}
    assert any(p.endswith("trunk.onnx") for p in manifest["files"])
    rt = OrtRuntime(out)
    art = TrainingArtifact.load(out / per_method["fedfs+feduv"]["folder"])
    x, _ = faces(1, 5, seed=7)
    y, _ = faces(1, 4, seed=8)
    first = rt.trunk_features(art, x)
    (graph,) = rt._trunks.values()
    calls = []
    real = graph.features
    graph.features = lambda images: calls.append(len(images)) or real(images)
    assert rt.trunk_features(art, x.copy()) is first and calls == []     # the same photos: no second trunk pass
    assert rt.trunk_features(art, y).shape[0] == 4 and calls == [4]


def test_an_artifact_only_device_contributes_xis_statistics_like_a_torch_device(tmp_path) -> None:
    """A statistics round of ξ (``xi.embedding``, ``xi.features``) on the ONNX runtime: embeddings from the
    export's verifier graph with ξ written in, features from the top artifact's trunk.onnx — the same
    contribution as the torch runtime's on the same photos (hold-out excluded), to float32 rounding."""
    from conftest_server import write_images
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_runtime import TorchRuntime
    from fedfs_sdk.federation.ort_runtime import OrtRuntime
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.device_stats import contribution
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.federation.wire_format import sha256_hex
    from fedfs_sdk.stats import EMBEDDING_BOUND, FEATURE_BOUND, feature_length
    from fedfs_sdk.stats.in_domain import EMBEDDING, FEATURES
    from fedfs_sdk.stats.transport import StatSpec, StatsTask
    from conftest_export import checkpoints

    out, _ = top_export()
    xi_file = checkpoints()["xi"]
    sha = sha256_hex(xi_file.read_bytes())
    images = [str(p) for p in write_images(tmp_path / "img", 9, seed=3)]
    task = StatsTask(1, 1, (StatSpec(EMBEDDING, "embedding", 2 * 64 + 1, EMBEDDING_BOUND),
                            StatSpec(FEATURES, "features", feature_length(64), FEATURE_BOUND)),
                     extra={"xi_sha256": sha})
    got = {}
    for name, runtime in (("ort", OrtRuntime(out)), ("torch", TorchRuntime("cpu"))):
        cfg = DeviceConfig(xi_path=xi_file, enroll=True, artifacts=out if name == "ort" else None)
        agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), DeviceState(tmp_path / name), images, cfg,
                            runtime=runtime)
        got[name] = contribution(agent, task)
    assert set(got["ort"]) == {EMBEDDING, FEATURES}
    n = len(images) - len(agent.holdout_split()[1])
    assert got["ort"][EMBEDDING][-1] == got["torch"][EMBEDDING][-1] == n     # the training photos only
    for k in (EMBEDDING, FEATURES):
        scale = max(1.0, float(np.abs(got["torch"][k]).max()))
        assert float(np.abs(got["ort"][k] - got["torch"][k]).max()) / scale <= 1e-5, k
    # … and in a process that cannot import torch, as on a phone
    from conftest_export import run_device_script

    code = f"""
import json, numpy as np
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.ort_runtime import OrtRuntime
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.federation.device_stats import contribution
from fedfs_sdk.federation.server_client import ServerClient
from fedfs_sdk.stats.transport import StatsTask
from pathlib import Path
task = StatsTask.from_json(json.loads({json.dumps(task.to_json())!r}))
agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), DeviceState(Path({str(tmp_path / 'nt')!r})), {images!r},
                    DeviceConfig(xi_path=Path({str(xi_file)!r}), enroll=True, artifacts=Path({str(out)!r})),
                    runtime=OrtRuntime({str(out)!r}))
got = contribution(agent, task)
print(json.dumps({{k: v.tolist() for k, v in got.items()}}))
"""
    no_torch = {k: np.asarray(v) for k, v in json.loads(run_device_script(code).strip().splitlines()[-1]).items()}
    for k in (EMBEDDING, FEATURES):
        assert np.array_equal(no_torch[k], got["ort"][k]), k
    # a device whose ξ is another file than the one the artifacts were exported with: no trunk of it to run
    from fedfs_sdk.nn.checkpoint import save_checkpoint

    other_xi = tmp_path / "other-xi.safetensors"
    save_checkpoint(other_xi, xi_model(), xi_model().config, {"role": "another ξ"})
    other = StatsTask(2, 1, task.stats, extra={"xi_sha256": sha256_hex(other_xi.read_bytes())})
    agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), DeviceState(tmp_path / "o"), images,
                        DeviceConfig(xi_path=other_xi, enroll=True, artifacts=out), runtime=OrtRuntime(out))
    with pytest.raises(InputError, match="no scope='top' ORT artifact exported with the round's ξ"):
        contribution(agent, other)
