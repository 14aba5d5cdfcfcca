"""``fedfs export``: the folder it writes (manifest, Core ML spec, int8) and how it fails."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest_export import checkpoints, faces, full_export
from export.coreml import CoreMLValidationError, validate_coreml
from export.manifest import verify_manifest
from export.onnx_inference import read_metadata
from export.pipeline import ExportOptions, run_export
from export.quantize import compare_int8
from fedfs_sdk.checkpoint import save_checkpoint
from fedfs_sdk.cli.main import main
from fedfs_sdk.model import FaceNet, ModelConfig


def test_manifest_lists_every_file_with_its_hash() -> None:
    out, manifest = full_export()
    assert verify_manifest(out) == []
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for rel in ("onnx/verifier.onnx", "onnx-int8/verifier.int8.onnx", "ort-training/feduv/checkpoint",
                "ort-training/fedfs/training_model.onnx", "ort-training/fedfs_feduv/optimizer_model.onnx"):
        assert rel in manifest["files"]
    assert manifest["input_contract"]["onnx_and_ort_training"]["normalization"] == "(x - 127.5) / 127.5"
    assert "warm-up" in manifest["threshold_semantics"]["threshold"]
    art = manifest["artifacts"]
    assert max(art["onnx"]["max_abs_diff_vs_torch"].values()) <= 1e-4
    assert set(art["ort-training"]["methods"]) == {"feduv", "fedfs", "fedfs+feduv"}
    assert art["ort-training"]["methods"]["fedfs"]["soft_labels"]["output"] == "alpha_next"
    # tampering is detected
    victim = out / "onnx/verifier.onnx"
    original = victim.read_bytes()
    try:
        victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert verify_manifest(out) == ["onnx/verifier.onnx"]
    finally:
        victim.write_bytes(original)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_coreml_package_spec(precision: str) -> None:
    out, manifest = full_export()
    pkg = out / f"coreml/verifier.{precision}.mlpackage"
    summary = validate_coreml(pkg, input_size=32, outputs={"embedding": 64, "uv": 127}, precision=precision,
                              metadata={"fedfs.model_version": "4", "fedfs.input_normalization": "(x - 127.5) / 127.5",
                                        "fedfs.code_length": "127", "fedfs.embedding_dim": "64"})
    assert summary["input"]["scale"] == pytest.approx(1 / 127.5) and summary["input"]["bias"] == [-1.0] * 3
    assert (summary["model_id"] == manifest["model_id"]) == (precision == "fp32")
    with pytest.raises(CoreMLValidationError, match="expected 112x112"):
        validate_coreml(pkg, input_size=112, outputs={"embedding": 64, "uv": 127})
    with pytest.raises(CoreMLValidationError, match="outputs are"):
        validate_coreml(pkg, input_size=32, outputs={"embedding": 64})
    assert manifest["artifacts"]["coreml"]["updatable"] is False


def test_int8_model_and_its_auroc_change() -> None:
    out, manifest = full_export()
    meta = read_metadata(out / "onnx-int8/verifier.int8.onnx")
    assert meta["fedfs.precision"] == "int8" and meta["fedfs.model_id"] == manifest["model_id"] + "-int8"
    entry = manifest["artifacts"]["onnx-int8"]
    assert entry["bytes_int8"] < entry["bytes_fp32"]
    x, labels = faces(12, 4, seed=40)
    res = compare_int8(out / "onnx/verifier.onnx", out / "onnx-int8/verifier.int8.onnx", x, labels)
    print(f"int8 on generated faces: {res}")
    assert res["auroc_fp32"] > 0.6                       # the data is separable at all
    assert abs(res["auroc_change"]) < 0.05
    assert res["min_cosine_fp32_int8"] > 0.9


def _no_leftovers(parent: Path, name: str) -> None:
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], list(parent.iterdir())


def _mismatched_checkpoint(path: Path) -> None:
    """A fedfs header announcing a tiny model over mobilefacenet tensors."""
    mfn = FaceNet(ModelConfig("mobilefacenet"))
    tiny = ModelConfig("tiny").resolved()
    save_file({k: v.contiguous() for k, v in mfn.state_dict().items()}, str(path),
              metadata={"format": "fedfs-checkpoint/1", "model_config": tiny.to_json(), "meta": "{}"})


@pytest.mark.parametrize("case", ["missing", "unknown-format", "other-architecture", "not-fedfs", "xi-mismatch",
                                  "no-training-method"])
def test_bad_input_fails_clearly_and_writes_nothing(case: str, tmp_path, capsys) -> None:
    ck = checkpoints()
    args = ["export", "--checkpoint", str(ck["global"]), "--formats", "onnx", "--out", str(tmp_path / "out")]
    expect = ""
    if case == "missing":
        args[2], expect = str(tmp_path / "nope.safetensors"), "checkpoint not found"
    elif case == "unknown-format":
        args[4], expect = "onnx,tflite", "unknown export format(s) ['tflite']"
    elif case == "other-architecture":
        _mismatched_checkpoint(tmp_path / "bad.safetensors")
        args[2], expect = str(tmp_path / "bad.safetensors"), "does not match its own architecture"
    elif case == "not-fedfs":
        save_file({"w": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
        args[2], expect = str(tmp_path / "foreign.safetensors"), "is not a fedfs checkpoint"
    elif case == "xi-mismatch":
        small_xi = FaceNet(ModelConfig("tiny", embedding_dim=32))
        save_checkpoint(tmp_path / "xi32.safetensors", small_xi, small_xi.config)
        args[4] = "onnx,ort-training"
        args += ["--xi", str(tmp_path / "xi32.safetensors"), "--methods", "fedfs"]
        expect = "needs proj_dim=16"
    elif case == "no-training-method":
        plain = FaceNet(ModelConfig("tiny"))
        save_checkpoint(tmp_path / "plain.safetensors", plain, plain.config)
        args[2], args[4] = str(tmp_path / "plain.safetensors"), "ort-training"
        expect = "no on-device training method fits"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert not (tmp_path / "out").exists()
    _no_leftovers(tmp_path, "out")


def test_failure_midway_leaves_out_untouched(tmp_path, monkeypatch) -> None:
    out = tmp_path / "phone"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def boom(*_a, **_k):
        raise RuntimeError("converter crashed")

    monkeypatch.setattr("export.coreml.export_coreml", boom)
    with pytest.raises(RuntimeError, match="converter crashed"):
        run_export(checkpoints()["global"], out, ExportOptions(formats=("onnx", "coreml"), overwrite=True))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    _no_leftovers(tmp_path, "phone")


def test_cli_exports_and_refuses_to_clobber(tmp_path, capsys) -> None:
    out = tmp_path / "phone"
    args = ["export", "--checkpoint", str(checkpoints()["global"]), "--formats", "onnx", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "manifest.json" in printed and "ONNX vs torch" in printed
    first = json.loads((out / "manifest.json").read_text())
    assert main(args) == 2                                   # not empty, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text()) == first
    assert main(args + ["--overwrite"]) == 0
    assert verify_manifest(out) == []
    _no_leftovers(tmp_path, "phone")
    np.testing.assert_equal(sorted(p.name for p in out.iterdir()), ["manifest.json", "onnx"])
