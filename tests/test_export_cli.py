"""``fedfs export``: the folder it writes (manifest, Core ML spec, int8) and how it fails."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest_export import checkpoints, faces, full_export
from export.coreml import CoreMLValidationError, validate_coreml
from export.manifest import verify_manifest
from export.onnx_inference import read_metadata
from export import pipeline
from export.pipeline import ExportOptions, run_export
from export.quantize import compare_int8, quantize_int8
from fedfs_sdk.nn.checkpoint import load_verifier, model_id_of, save_checkpoint
from fedfs_sdk.errors import CheckpointError
from fedfs_sdk.cli.main import main
from fedfs_sdk.nn.model import FaceNet, ModelConfig


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
    entry = manifest["artifacts"]["onnx-int8"]
    assert meta["fedfs.precision"] == "int8" and meta["fedfs.model_id"] == entry["model_id"]
    assert re.fullmatch(re.escape(manifest["model_id"]) + r"-int8-[0-9a-f]{16}", entry["model_id"])
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
                                  "no-training-method", "lambda-neg-fedfs", "forged-model-id"])
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
    elif case == "lambda-neg-fedfs":      # ℓ_neg is exported for feduv only: a clear error, not a ValueError
        args[4] = "onnx,ort-training"
        args += ["--xi", str(ck["xi"]), "--methods", "fedfs+feduv", "--train", '{"objective": {"lambda_neg": 0.5}}']
        expect = "λ_neg (objective.lambda_neg=0.5) is exported only for the feduv method"
    elif case == "forged-model-id":       # a model_id in the checkpoint's meta must be the weights' id
        model = FaceNet(ModelConfig("tiny", code_length=127))
        save_checkpoint(tmp_path / "forged.safetensors", model, model.config, {"model_id": "0123456789abcdef"})
        args[2], expect = str(tmp_path / "forged.safetensors"), "records model_id '0123456789abcdef' but its weights hash"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.startswith("fedfs export: error: ")], err
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
    printed, err = capsys.readouterr()
    assert "manifest.json" in printed and "ONNX vs torch" in printed
    # stderr is not a terminal here: whole progress lines, no \r frames of a bar
    assert "\r" not in err and "export: done" in err, err
    first = json.loads((out / "manifest.json").read_text())
    assert main(args) == 2                                   # not empty, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text()) == first
    assert main(args + ["--overwrite"]) == 0
    assert verify_manifest(out) == []
    _no_leftovers(tmp_path, "phone")
    np.testing.assert_equal(sorted(p.name for p in out.iterdir()), ["manifest.json", "onnx"])


def test_server_published_checkpoint_keeps_its_version_and_quiet_prints_no_progress(tmp_path, capsys) -> None:
    """``fedfs serve`` writes ``meta = {"version": N, …}`` into models/vNNNNNN: the export
    carries N as its model_version (not "unversioned"); ``--quiet`` drops the progress."""
    from server_agg.rounds import Coordinator
    from server_agg.store import Layout

    coord = Coordinator(Layout(tmp_path / "server"))
    coord.install_model(checkpoints()["global"].read_bytes())
    coord.install_model(checkpoints()["global"].read_bytes())
    published, _ = coord.model_file(2)
    coord.close()
    out = tmp_path / "phone"
    assert main(["export", "--checkpoint", str(published), "--formats", "onnx", "--out", str(out), "--quiet"]) == 0
    printed, err = capsys.readouterr()
    assert "(version 2)" in printed and err == "", err
    assert json.loads((out / "manifest.json").read_text())["model_version"] == "2"
    assert read_metadata(out / "onnx" / "verifier.onnx")["fedfs.model_version"] == "2"


def test_int8_model_id_depends_on_the_calibration(tmp_path) -> None:
    """The int8 id hashes the quantized weights, scales and zero points: other calibration
    images → another id (thresholds must not carry over); the same images → the same id."""
    out, manifest = full_export()
    fp32 = out / "onnx/verifier.onnx"
    a, _ = faces(3, 2, seed=1)
    b, _ = faces(3, 2, seed=2)
    ids = [quantize_int8(fp32, tmp_path / f"{i}.onnx", calib)["model_id"] for i, calib in enumerate((a, a, b))]
    assert ids[0] == ids[1] != ids[2]
    assert all(i.startswith(manifest["model_id"] + "-int8-") for i in ids)
    assert read_metadata(tmp_path / "2.onnx")["fedfs.model_id"] == ids[2]


def test_checkpoint_model_id_must_match_its_weights(tmp_path) -> None:
    model = FaceNet(ModelConfig("tiny"))
    forged = tmp_path / "forged.safetensors"
    save_checkpoint(forged, model, model.config, {"model_id": "0123456789abcdef"})
    # (export refusing it: test_bad_input_fails_clearly_and_writes_nothing[forged-model-id])
    with pytest.raises(CheckpointError, match="records model_id '0123456789abcdef'"):
        load_verifier(forged)
    true_id = model_id_of(model.state_dict())
    honest = tmp_path / "honest.safetensors"
    save_checkpoint(honest, model, model.config, {"model_id": true_id})
    assert load_verifier(honest)[1] == true_id


def test_manifest_hashes_the_bytes_the_export_was_built_from(tmp_path, monkeypatch) -> None:
    """The checkpoint is read once: replacing the file during the build changes neither what
    is built nor the sha256 the manifest records."""
    ckpt = tmp_path / "global.safetensors"
    shutil.copyfile(checkpoints()["global"], ckpt)
    original = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    other = FaceNet(ModelConfig("tiny", proj_dim=32, code_length=127))
    import export.onnx_inference as onnx_inference

    real = onnx_inference.export_onnx

    def export_then_swap(*a, **k):
        result = real(*a, **k)
        save_checkpoint(ckpt, other, other.config)          # the source changes mid-build
        return result

    monkeypatch.setattr(onnx_inference, "export_onnx", export_then_swap)
    manifest = run_export(ckpt, tmp_path / "out", ExportOptions())
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() != original
    assert manifest["source_checkpoint"]["sha256"] == original
    assert manifest["model_id"] == full_export()[1]["model_id"]
    assert read_metadata(tmp_path / "out/onnx/verifier.onnx")["fedfs.model_id"] == manifest["model_id"]


@pytest.mark.parametrize("where", ["checkpoint", "xi", "calibration", "out-is-input-folder"])
def test_overwrite_never_deletes_an_input(where: str, tmp_path, capsys) -> None:
    """--overwrite replaces --out as a whole, so an input inside --out is refused up front."""
    ck = checkpoints()
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    ckpt, xi = ck["global"], ck["xi"]
    args = ["export", "--formats", "onnx", "--overwrite"]
    if where == "checkpoint":
        ckpt = out / "ckpt.safetensors"
        shutil.copyfile(ck["global"], ckpt)
        flag, victim = "--checkpoint", ckpt
    elif where == "xi":
        xi = out / "sub" / "xi.safetensors"
        xi.parent.mkdir()
        shutil.copyfile(ck["xi"], xi)
        flag, victim = "--xi", xi
    elif where == "calibration":
        (out / "calib").mkdir()
        args += ["--calibration", str(out / "calib")]
        flag, victim = "--calibration", out / "calib"
    else:                                   # --out names the folder the checkpoint is in (via a symlink)
        shutil.copyfile(ck["global"], out / "ckpt.safetensors")
        ckpt = out / "ckpt.safetensors"
        os.symlink(out, tmp_path / "link")
        out = tmp_path / "link"
        flag, victim = "--checkpoint", ckpt
    args += ["--checkpoint", str(ckpt), "--xi", str(xi), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{flag} " in err and "is inside --out" in err and "would delete it" in err, err
    assert "Traceback" not in err, err
    assert victim.exists() and (tmp_path / "out" / "old.txt").exists()
    _no_leftovers(tmp_path, "out")


@pytest.mark.parametrize("out", [".", "..", "sub/.."])
def test_out_must_not_be_the_current_folder_or_its_parent(out: str, tmp_path, monkeypatch, capsys) -> None:
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    args = ["export", "--checkpoint", str(checkpoints()["global"]), "--out", out, "--overwrite"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "is the current folder or one of its parents" in err and "Traceback" not in err, err
    assert (work / "keep.txt").read_text() == "mine" and (work / "sub").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def _can_exchange(folder: Path) -> bool:
    """Whether Linux renameat2(RENAME_EXCHANGE) works in ``folder`` (probed with two scratch folders)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    a, b = folder / ".probe-a", folder / ".probe-b"
    a.mkdir()
    b.mkdir()
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
        return fn is not None and fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0
    finally:
        a.rmdir()
        b.rmdir()


def test_publish_replaces_out_in_one_step(tmp_path, monkeypatch) -> None:
    """Replacing an export never leaves --out missing or half-written: the folders are swapped
    atomically (renameat2 RENAME_EXCHANGE / renamex_np RENAME_SWAP)."""
    if not _can_exchange(tmp_path):
        pytest.skip("this system or file system cannot exchange two paths atomically")
    out, tmp = tmp_path / "phone", tmp_path / ".phone.partial-x"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    states = []
    for name in ("replace", "rename", "rmdir"):
        real = getattr(os, name)

        def watched(*a, _real=real, **k):
            result = _real(*a, **k)
            states.append(sorted(p.name for p in out.iterdir()) if out.is_dir() else None)
            return result

        monkeypatch.setattr(os, name, watched)
    pipeline._publish(tmp, out)
    monkeypatch.undo()
    assert None not in states, states                  # --out existed after every step
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phone"]


def test_publish_fallback_restores_the_old_export(tmp_path, monkeypatch) -> None:
    """Where no atomic exchange exists: two renames, and the old export comes back if the second fails."""
    out, tmp = tmp_path / "phone", tmp_path / ".phone.partial-x"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    monkeypatch.setattr(pipeline, "_exchange", lambda a, b: False, raising=False)
    real = os.replace

    def failing(src, dst):
        if Path(src) == tmp:
            raise OSError("disk on fire")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk on fire"):
        pipeline._publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    monkeypatch.setattr(os, "replace", real)
    pipeline._publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phone"]


def test_verify_manifest_reports_what_it_does_not_list(tmp_path) -> None:
    """A file dropped into an export folder (an app might load it) fails verification."""
    src, _ = full_export()
    out = tmp_path / "export"
    shutil.copytree(src, out, symlinks=True)
    assert verify_manifest(out) == []
    (out / "onnx" / "evil.onnx").write_bytes(b"not from the export")
    (out / "ort-training" / "feduv" / "manifest.json").write_text("{}")
    os.symlink(out / "onnx" / "verifier.onnx", out / "onnx-int8" / "link.onnx")
    assert verify_manifest(out) == ["onnx-int8/link.onnx", "onnx/evil.onnx", "ort-training/feduv/manifest.json"]
