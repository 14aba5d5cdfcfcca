"""ONNX inference export: parity with torch, metadata contract, ONNX backend behaviour."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from conftest_export import TMP, faces
from export.onnx_inference import export_onnx, onnx_vs_torch, read_metadata
from fedfs_sdk.nn.checkpoint import model_id_of
from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.onnx_backend import OnnxBackend, weights_id


def _verifier(cfg: ModelConfig, seed: int = 0) -> VerifierNet:
    torch.manual_seed(seed)
    m = FaceNet(cfg).eval()
    for p in m.parameters():           # move norm/PReLU weights off their init so parity is not trivial
        p.data += 0.05 * torch.randn_like(p)
    return VerifierNet(m.backbone, m.uv_head).eval()


@pytest.mark.parametrize("cfg", [ModelConfig("tiny", code_length=127), ModelConfig("mobilefacenet", code_length=255)],
                         ids=["tiny", "mobilefacenet"])
def test_onnx_fp32_matches_torch(cfg: ModelConfig) -> None:
    v = _verifier(cfg)
    path = export_onnx(v, TMP / f"parity-{cfg.backbone}.onnx")
    s = v.input_size
    batch = np.random.default_rng(1).uniform(-1, 1, size=(3, 3, s, s)).astype(np.float32)
    diff = onnx_vs_torch(v, path, batch)
    assert set(diff) == {"embedding", "uv"}
    assert max(diff.values()) <= 1e-4, diff
    model = onnx.load(str(path))
    assert model.ir_version <= 10
    assert max(i.version for i in model.opset_import if i.domain in ("", "ai.onnx")) <= 21


def test_dynamic_batch_and_metadata_contract() -> None:
    v = _verifier(ModelConfig("tiny", code_length=127), seed=3)
    path = export_onnx(v, TMP / "meta.onnx", model_version="7")
    meta = read_metadata(path)
    assert meta["fedfs.input_normalization"] == "(x - 127.5) / 127.5"
    assert (meta["fedfs.input_layout"], meta["fedfs.input_dtype"], meta["fedfs.input_color"]) == ("NCHW", "float32", "RGB")
    assert (meta["fedfs.embedding_dim"], meta["fedfs.code_length"], meta["fedfs.input_size"]) == ("64", "127", "32")
    mid = model_id_of(v.state_dict())
    assert (meta["fedfs.model_id"], meta["fedfs.model_version"]) == (mid, "7")
    b = OnnxBackend(path)
    assert (b.input_size, b.model_id, b.outputs) == (32, mid, ("embedding", "uv"))
    x, _ = faces(2, 3)
    one = b.run(x[:1])
    five = b.run(x[:5])
    assert five["embedding"].shape == (5, 64) and five["uv"].shape == (5, 127)
    np.testing.assert_allclose(one["embedding"][0], five["embedding"][0], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(five["uv"], axis=1), np.sqrt(127), rtol=1e-4)


def test_weights_override_is_a_personalized_verifier() -> None:
    """A device swaps its own θ_c into the exported graph: same numbers as torch with θ_c,
    and the model id is the checkpoint hash of those weights."""
    base = _verifier(ModelConfig("tiny", code_length=127), seed=4)
    path = export_onnx(base, TMP / "override.onnx")
    personal = _verifier(ModelConfig("tiny", code_length=127), seed=5)
    weights = {k: t.detach().numpy() for k, t in personal.state_dict().items()}
    b = OnnxBackend(path, weights=weights)
    x, _ = faces(2, 2)
    with torch.no_grad():
        ref = personal(torch.from_numpy(x))
    np.testing.assert_allclose(b.run(x)["embedding"], ref[0].numpy(), atol=1e-4)
    assert b.model_id == weights_id(weights) == model_id_of(personal.state_dict())
    assert b.model_id != model_id_of(base.state_dict())
    with pytest.raises(InputError, match="not parameters"):
        OnnxBackend(path, weights={"proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(InputError, match="shape"):
        OnnxBackend(path, weights={"uv_head.weight": np.zeros((3, 64), np.float32)})


def test_backend_refuses_what_it_cannot_run(tmp_path) -> None:
    with pytest.raises(InputError, match="not found"):
        OnnxBackend(tmp_path / "missing.onnx")
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(CheckpointError, match="cannot load"):
        OnnxBackend(bad)
    # a valid ONNX model that is not a fedfs verifier
    plain = tmp_path / "plain.onnx"
    torch.onnx.export(torch.nn.Linear(3, 2), (torch.zeros(1, 3),), str(plain), dynamo=False)
    with pytest.raises(CheckpointError, match="not a fedfs ONNX verifier"):
        OnnxBackend(plain)
    v = _verifier(ModelConfig("tiny"), seed=6)
    b = OnnxBackend(export_onnx(v, tmp_path / "v.onnx"))
    assert b.outputs == ("embedding",)
    with pytest.raises(InputError, match=r"shape \[N, 3, 32, 32\]"):
        b.run(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(InputError, match="float32"):
        b.run(np.zeros((1, 3, 32, 32), np.float64))


def test_backend_recomputes_the_model_id_from_the_weights(tmp_path) -> None:
    """Enrollments are bound to the model id: a file whose weights changed while its
    metadata kept the old id is refused (fp32 and int8)."""
    from onnx import numpy_helper

    from export.quantize import quantize_int8

    v = _verifier(ModelConfig("tiny", code_length=127), seed=7)
    path = export_onnx(v, tmp_path / "v.onnx")
    assert OnnxBackend(path).model_id == model_id_of(v.state_dict())

    def tamper(src, dst, pick):
        model = onnx.load(str(src))
        init = next(i for i in model.graph.initializer if pick(i))
        arr = numpy_helper.to_array(init).copy()
        arr.flat[0] = arr.flat[0] + 1 if arr.dtype.kind == "f" else arr.flat[0] ^ 1
        init.CopyFrom(numpy_helper.from_array(arr, init.name))
        onnx.save(model, str(dst))
        return dst

    bad = tamper(path, tmp_path / "bad.onnx", lambda i: i.name.startswith("backbone."))
    with pytest.raises(CheckpointError, match="tampered or mislabelled"):
        OnnxBackend(bad)

    x, _ = faces(1, 8)
    int8 = tmp_path / "v.int8.onnx"
    quantize_int8(path, int8, x)
    assert OnnxBackend(int8).model_id == read_metadata(int8)["fedfs.model_id"]
    bad8 = tamper(int8, tmp_path / "bad.int8.onnx", lambda i: numpy_helper.to_array(i).dtype == np.int8)
    with pytest.raises(CheckpointError, match="tampered or mislabelled"):
        OnnxBackend(bad8)
