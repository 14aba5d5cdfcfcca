"""Phone artifacts are checked where they are used (issue 13, defect 9): edited ONNX metadata,
a forged int8 id, an export folder that differs from its manifest, damaged ORT training files
and a Core ML package's format label — each a clear CheckpointError naming the file, never a
raw ONNX Runtime error later."""
from __future__ import annotations

import shutil

import onnx
import pytest

from conftest_export import full_export
from fedfs_sdk.federation.ort_runtime import OrtRuntime
from fedfs_sdk.errors import CheckpointError
from fedfs_sdk.runtime.onnx_backend import OnnxBackend
from fedfs_sdk.training.ort_device import OrtDeviceTrainer


def _edited(src, dst, **props: str):
    model = onnx.load(str(src))
    for prop in model.metadata_props:
        if prop.key in props:
            prop.value = props[prop.key]
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize("key,value,needle", [
    ("fedfs.input_size", "64", "fedfs.input_size 64"),
    ("fedfs.embedding_dim", "128", "fedfs.embedding_dim 128"),
    ("fedfs.code_length", "255", "fedfs.code_length 255"),
])
def test_edited_metadata_is_refused_before_it_reaches_onnx_runtime(tmp_path, key, value, needle) -> None:
    out, _ = full_export()
    OnnxBackend(out / "onnx" / "verifier.onnx")                      # the export itself loads
    bad = _edited(out / "onnx" / "verifier.onnx", tmp_path / "v.onnx", **{key: value})
    with pytest.raises(CheckpointError, match=needle):
        OnnxBackend(bad)


def test_an_int8_id_must_name_a_real_fp32_id(tmp_path) -> None:
    out, _ = full_export()
    src = out / "onnx-int8" / "verifier.int8.onnx"
    good = OnnxBackend(src).model_id
    forged = "x" * 16 + good[16:]                                   # right suffix, not an fp32 id
    with pytest.raises(CheckpointError, match="model_id"):
        OnnxBackend(_edited(src, tmp_path / "i8.onnx", **{"fedfs.model_id": forged}))


def _copy(tmp_path):
    out, _ = full_export()
    dst = tmp_path / "export"
    shutil.copytree(out, dst)
    return dst


def test_the_device_refuses_an_export_that_differs_from_its_manifest(tmp_path) -> None:
    root = _copy(tmp_path)
    assert OrtRuntime(root).check(enroll=True) == 32                # intact: accepted
    _edited(root / "onnx" / "verifier.onnx", root / "onnx" / "verifier.onnx", **{"fedfs.score": "x"})
    with pytest.raises(CheckpointError, match="onnx/verifier.onnx"):
        OrtRuntime(root).check(enroll=True)
    (root / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        OrtRuntime(root).check()


def test_a_swapped_training_graph_is_named(tmp_path) -> None:
    root = _copy(tmp_path)
    art = root / "ort-training" / "feduv"
    (art / "checkpoint").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot load the training artifact"):
        OrtDeviceTrainer(art)
    root2 = _copy(tmp_path / "b")
    art2 = root2 / "ort-training" / "feduv"
    shutil.copy(root2 / "ort-training" / "fedfs" / "training_model.onnx", art2 / "training_model.onnx")
    with pytest.raises(CheckpointError):
        OrtDeviceTrainer(art2)


def test_coreml_packages_say_they_are_coreml() -> None:
    import coremltools as ct

    out, manifest = full_export()
    assert set(manifest["artifacts"]["coreml"]["variants"]) == {"fp16", "fp32"}
    for pkg in (out / "coreml").iterdir():
        meta = ct.models.MLModel(str(pkg), skip_model_load=True).user_defined_metadata
        assert meta["fedfs.format"] == "fedfs-coreml/1", pkg
