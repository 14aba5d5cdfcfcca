"""``run_export``: one checkpoint → a folder of phone artifacts + ``manifest.json``.

Everything is validated before any work starts (formats, checkpoint, ξ, training
methods, the output folder, inputs that replacing it would delete), then written into a
hidden sibling folder and swapped with ``out`` only when complete (:func:`_publish`): an
interrupted or failed export leaves ``out`` as it was. Input files are read once; the
manifest hashes the bytes the export was built from.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.training.ort_device import artifact_subdir

from .common import FORMAT_COREML, ExportError, load_for_export, model_version

FORMATS = ("onnx", "onnx-int8", "coreml", "ort-training")
"""Export formats in the order they are produced."""

ONNX_FILE = "onnx/verifier.onnx"
INT8_FILE = "onnx-int8/verifier.int8.onnx"


def parse_formats(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"onnx,coreml"`` → ``("onnx", "coreml")`` in canonical order; unknown names fail."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not items:
        raise InputError(f"no export format given; choose from {', '.join(FORMATS)}")
    unknown = [t for t in items if t not in FORMATS]
    if unknown:
        raise InputError(f"unknown export format(s) {unknown}; choose from {', '.join(FORMATS)}")
    return tuple(f for f in FORMATS if f in items)


def method_dir(method: str) -> str:
    """``ort-training/<this>`` of a method (shared with the device: :func:`fedfs_sdk.training.ort_device.artifact_subdir`)."""
    return artifact_subdir(method)


@dataclass
class ExportOptions:
    """What to export and how.

    Attributes:
        formats: subset of :data:`FORMATS`.
        xi: path of the frozen pre-trained model ``ξ`` (FedFS training artifacts).
        methods: training methods to build artifacts for (default: all the checkpoint supports).
        train: local-training settings, the ``train`` object of a server round task
            (:func:`fedfs_sdk.federation.wire.train_config_from_json`): lr, head_lr, local_epochs,
            batch_size, objective, scope. Defaults are the methods' paper values and the methods'
            default scope (:data:`~fedfs_sdk.training.methods.DEFAULT_SCOPE`, ``top``: the artifact
            trains the top on ``trunk.onnx``'s features, :mod:`export.ort_top`) — what a server's
            round asks unless it names another scope.
        coreml_precisions: ``fp16`` and/or ``fp32``.
        calibration: folder of face images for int8 calibration (default: SynthFaces).
        evaluate_int8: also measure the int8 AUROC change on a SynthFaces set.
        overwrite: replace an existing non-empty ``out`` folder (only once the new one is complete).
    """

    formats: tuple[str, ...] = ("onnx",)
    xi: str | None = None
    methods: tuple[str, ...] | None = None
    train: Mapping[str, Any] | None = None
    coreml_precisions: tuple[str, ...] = ("fp16", "fp32")
    calibration: str | None = None
    evaluate_int8: bool = False
    overwrite: bool = False


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_out(out: Path, overwrite: bool, inputs: Mapping[str, str | os.PathLike[str] | None]) -> Path:
    """The resolved output folder, after refusing what publishing into it would break:
    a file in its place, a non-empty folder without ``overwrite``, the current folder or one
    of its ancestors, and a folder holding one of the ``inputs`` (``{flag: path}``), which
    replacing it would delete."""
    try:
        target = out.resolve()
        cwd = Path.cwd().resolve()
    except (OSError, RuntimeError) as e:
        raise ExportError(f"--out {out} cannot be resolved: {e}") from None
    if _inside(cwd, target):
        raise ExportError(f"--out {out} is the current folder or one of its parents; the export replaces "
                          "--out as a whole, so name a new subfolder (e.g. --out phone-export)")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if target.is_dir():
        outs = {target, Path(os.path.abspath(out))}
        for flag, path in inputs.items():
            if path is None:
                continue
            src = Path(path)
            if any(_inside(s, o) for s in {Path(os.path.abspath(src)), src.resolve()} for o in outs):
                raise ExportError(f"{flag} {path} is inside --out {out}; the export replaces --out as a whole "
                                  "and would delete it: move the input or choose another --out")
        if any(target.iterdir()) and not overwrite:
            raise ExportError(f"--out {out} already exists and is not empty; pass --overwrite to replace it")
    return target


def _train_configs(methods: list[str], train: Mapping[str, Any] | None) -> dict[str, Any]:
    from fedfs_sdk.federation.wire import train_config_from_json

    out = {}
    for m in methods:
        cfg = train_config_from_json(m, dict(train or {}))
        if cfg.momentum or cfg.weight_decay:
            raise InputError("ORT training artifacts use plain SGD: momentum and weight_decay must be 0 "
                             f"(got {cfg.momentum}, {cfg.weight_decay})")
        out[m] = cfg
    return out


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one atomic step (Linux ``renameat2``
    ``RENAME_EXCHANGE``, macOS ``renamex_np`` ``RENAME_SWAP``). False where the system or the
    file system cannot; then nothing was changed."""
    import ctypes
    import errno
    import sys

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform.startswith("linux"):
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            args: tuple = (-100, os.fsencode(a), -100, os.fsencode(b), 2)   # AT_FDCWD, RENAME_EXCHANGE
        elif sys.platform == "darwin":
            fn = libc.renamex_np
            fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            args = (os.fsencode(a), os.fsencode(b), 2)                        # RENAME_SWAP
        else:
            return False
    except (OSError, AttributeError):   # no libc symbol (old glibc, other platforms)
        return False
    fn.restype = ctypes.c_int
    if fn(*args) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False                     # not supported here: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def _sync(path: Path) -> None:
    """fsync ``path`` (file or folder) where the platform allows it."""
    from fedfs_sdk.fileio import fsync_directory, fsync_file

    if path.is_dir():
        fsync_directory(path)
    else:
        fsync_file(path)


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` folder at ``out``, replacing an existing ``out``.

    Everything is flushed to disk first, then the two folders are exchanged in one atomic
    step where the system can (:func:`_exchange`), so ``out`` is at every moment either the
    complete old export or the complete new one. Elsewhere ``out`` is moved to a hidden
    sibling ``.NAME.old-*``, ``tmp`` renamed onto ``out`` and the old one put back if that
    fails; a crash between those two renames leaves the old export in ``.NAME.old-*``. The
    old export is deleted only once the new one is in place.
    """
    for f in sorted(tmp.rglob("*"), reverse=True):     # files before the folders holding them
        if not f.is_symlink():
            _sync(f)
    _sync(tmp)
    if out.exists() or out.is_symlink():
        if _exchange(tmp, out):
            _sync(out.parent)
            shutil.rmtree(tmp, ignore_errors=True)     # tmp now holds the old export
            return
        backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        backup.rmdir()
        os.replace(out, backup)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(backup, out)
            raise
        _sync(out.parent)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out)
        _sync(out.parent)


def run_export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], options: ExportOptions,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Export ``checkpoint`` into ``out``; returns the manifest. See :class:`ExportOptions`."""
    from .ort_training import supported_methods

    step = progress or (lambda _msg: None)
    formats = parse_formats(options.formats)
    out = _check_out(Path(out), options.overwrite, {"--checkpoint": checkpoint, "--xi": options.xi,
                                                     "--calibration": options.calibration})
    bad_prec = [p for p in options.coreml_precisions if p not in ("fp16", "fp32")]
    if "coreml" in formats and (bad_prec or not options.coreml_precisions):
        raise InputError(f"Core ML precisions must be fp16 and/or fp32, got {list(options.coreml_precisions)}")
    if options.calibration is not None and not Path(options.calibration).is_dir():
        raise InputError(f"calibration folder not found: {options.calibration}")
    step("loading checkpoint")
    # each input file is read once: what is built and what the manifest hashes are the same bytes
    source_ckpt = load_for_export(checkpoint)
    model, meta = source_ckpt.model, source_ckpt.meta
    xi_ckpt = load_for_export(options.xi) if options.xi is not None else None
    xi = xi_ckpt.model if xi_ckpt is not None else None
    from fedfs_sdk.nn.checkpoint import verified_model_id
    from fedfs_sdk.nn.model import VerifierNet

    verifier = VerifierNet(model.backbone, model.uv_head).eval()
    mid = verified_model_id(model, meta, checkpoint)   # a model_id in meta must match the weights
    version = model_version(meta)
    methods: list[str] = []
    train_cfgs: dict[str, Any] = {}
    if "ort-training" in formats:
        possible = supported_methods(model, xi)
        methods = list(options.methods) if options.methods else possible
        from fedfs_sdk.training.objective import METHODS

        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise InputError(f"unknown training method(s) {unknown}; choose from {', '.join(METHODS)}")
        if not methods:
            raise CheckpointError("no on-device training method fits this checkpoint: FedUV needs a head "
                                  "(code_length), FedFS needs the extra linear layer (proj_dim) and --xi")
        missing = [m for m in methods if m not in possible]
        if missing:
            why = ("FedUV needs a checkpoint with a FedUV head (code_length); FedFS needs proj_dim and the "
                   "frozen model ξ (--xi)")
            raise CheckpointError(f"cannot build training artifacts for {missing}: {why}")
        train_cfgs = _train_configs(methods, options.train)
        from .ort_training import build_step

        for m in methods:  # dimension checks (ξ vs proj_dim, input sizes) before any file is written
            build_step(m, model, xi=xi, objective=train_cfgs[m].objective, lr=train_cfgs[m].effective_lr,
                       head_lr=train_cfgs[m].head_lr, scope=train_cfgs[m].effective_scope)

    with staged(out) as tmp:
        artifacts: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as scratch:
            fp32_path = tmp / ONNX_FILE if "onnx" in formats else Path(scratch) / "verifier.onnx"
            if "onnx" in formats or "onnx-int8" in formats:
                from .onnx_inference import export_onnx, onnx_vs_torch

                step("ONNX fp32")
                fp32_path.parent.mkdir(parents=True, exist_ok=True)
                export_onnx(verifier, fp32_path, model_version=version)
                parity = onnx_vs_torch(verifier, fp32_path)
                if max(parity.values()) > 1e-4:
                    raise ExportError(f"ONNX output differs from torch by {parity} (> 1e-4)")
                if "onnx" in formats:
                    artifacts["onnx"] = {"file": ONNX_FILE, "model_id": mid, "precision": "fp32",
                                         "opset": _opset(fp32_path), "max_abs_diff_vs_torch": parity}
                if "onnx" in formats and "fedfs+feduv" in methods:
                    step("ONNX fp32 dual verifier (verify=both)")
                    artifacts["onnx-dual"] = _export_dual(model, tmp, version)
            if "onnx-int8" in formats:
                from .quantize import (compare_int8, folder_calibration, quantize_int8,
                                       synthetic_calibration, synthetic_eval_set)

                step("ONNX int8")
                s = verifier.input_size
                if options.calibration:
                    calib, src = folder_calibration(options.calibration, s), f"images from {options.calibration}"
                else:
                    calib, src = synthetic_calibration(s), "SynthFaces"
                (tmp / INT8_FILE).parent.mkdir(parents=True, exist_ok=True)
                info = quantize_int8(fp32_path, tmp / INT8_FILE, calib, calibration_source=src)
                entry = {"file": INT8_FILE, "precision": "int8", **info,
                         "bytes_fp32": fp32_path.stat().st_size, "bytes_int8": (tmp / INT8_FILE).stat().st_size}
                if options.evaluate_int8:
                    imgs, labels = synthetic_eval_set(s)
                    entry["evaluation_synthfaces"] = compare_int8(fp32_path, tmp / INT8_FILE, imgs, labels)
                artifacts["onnx-int8"] = entry
        if "coreml" in formats:
            from .coreml import export_coreml, validate_coreml
            from .onnx_inference import inference_metadata

            md = {**inference_metadata(verifier, model_id=mid, model_version=version),
                  "fedfs.format": FORMAT_COREML}
            outs = {"embedding": int(model.config.embedding_dim)}
            if model.config.code_length:
                outs["uv"] = int(model.config.code_length)
            variants = {}
            for prec in options.coreml_precisions:
                step(f"Core ML {prec}")
                rel = f"coreml/verifier.{prec}.mlpackage"
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                export_coreml(verifier, tmp / rel, precision=prec, metadata=md, model_version=version)
                summary = validate_coreml(tmp / rel, input_size=verifier.input_size, outputs=outs, precision=prec)
                variants[prec] = {"package": rel, **summary}
            artifacts["coreml"] = {"variants": variants, "minimum_deployment_target": "iOS16",
                                   "prediction": "runs natively on macOS/iOS only; here the saved ML Program was executed "
                                                 "in its declared precision (export/coreml_reference.py) and its scores "
                                                 "compared with torch (the export fails if they drift)",
                                   "updatable": False,
                                   "updatable_reason": "MLUpdateTask cannot back-propagate through FedUV's sigma "
                                                       "(L2 normalization) nor use its hinge loss; on-device training "
                                                       "uses the ORT artifacts (see docs/export.md)"}
        if methods:
            from .ort_training import export_training_artifacts

            per_method = {}
            for m in methods:
                step(f"ORT training artifacts: {m}")
                cfg = train_cfgs[m]
                rel = f"ort-training/{method_dir(m)}"
                info = export_training_artifacts(
                    m, model, tmp / rel, xi=xi, objective=cfg.objective, lr=cfg.effective_lr,
                    head_lr=cfg.head_lr, local_epochs=cfg.effective_epochs, batch_size=cfg.batch_size,
                    model_id=mid, model_version=version,
                    xi_sha256=xi_ckpt.sha256 if xi_ckpt is not None else None, scope=cfg.effective_scope)
                per_method[m] = {"folder": rel, "scope": info["scope"], "inputs": info["inputs"], "outputs": info["outputs"],
                                 "lr": info["lr"], "head_lr": info["head_lr"], "local_epochs": info["local_epochs"],
                                 "batch_size": info["batch_size"], "soft_labels": info["soft_labels"]}
            artifacts["ort-training"] = {"methods": per_method, "runtime": "onnxruntime-training 1.19.2 C API "
                                         "(fedfs_sdk.training.ort_device.OrtDeviceTrainer)"}
            if "onnx" in formats and any(v["scope"] == "top" for v in per_method.values()):
                from .ort_top import TOP_FILE, export_top_graph

                step("ONNX top graph (the in-domain check on trunk features)")
                artifacts["onnx-top"] = export_top_graph(verifier.backbone, tmp / TOP_FILE)
        step("manifest")
        source = {"file": source_ckpt.name, "sha256": source_ckpt.sha256, "meta": meta}
        if xi_ckpt is not None:
            source["xi"] = {"file": xi_ckpt.name, "sha256": xi_ckpt.sha256}
        manifest = write_folder_manifest(tmp, model.config, source=source, model_id=mid, model_version=version,
                                         artifacts=artifacts)
    return manifest


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden sibling folder of ``out`` to write an export into; on success it replaces ``out``
    (:func:`_publish`), on any failure it is removed and ``out`` stays as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the published folder gets the usual mode
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_folder_manifest(tmp: Path, cfg: Any, *, source: dict[str, Any], model_id: str, model_version: str,
                          artifacts: dict[str, Any]) -> dict[str, Any]:
    """Build and write ``manifest.json`` of the staged folder ``tmp`` for a model of config ``cfg``."""
    from .manifest import build_manifest, write_manifest

    from fedfs_sdk.nn.backbones import face_alignment

    model_info = {"backbone": cfg.backbone, "input_size": int(cfg.input_size),
                  "embedding_dim": int(cfg.embedding_dim), "code_length": int(cfg.code_length or 0),
                  "proj_dim": int(cfg.proj_dim or 0),
                  **({"face_alignment": face_alignment(cfg.backbone)} if face_alignment(cfg.backbone) else {})}
    manifest = build_manifest(tmp, source=source, model=model_info, model_id=model_id, model_version=model_version,
                              artifacts=artifacts)
    write_manifest(tmp, manifest)
    return manifest


def export_dual_onnx(dual: Any, path: Path, version: str) -> dict[str, Any]:
    """Write a :class:`~fedfs_sdk.nn.model.DualVerifierNet` (``verify=both``: ``unit(W q') ⊕
    unit(W r')``) to ``path`` with the torch-parity check; returns its manifest entry."""
    from fedfs_sdk.nn.checkpoint import model_id_of

    from .onnx_inference import export_onnx, onnx_vs_torch

    path.parent.mkdir(parents=True, exist_ok=True)
    export_onnx(dual, path, model_version=version)
    parity = onnx_vs_torch(dual, path)
    if max(parity.values()) > 1e-4:
        raise ExportError(f"dual ONNX verifier differs from torch by {parity} (> 1e-4)")
    return {"model_id": model_id_of(dual.state_dict(), getattr(dual.backbone, "name", None)), "precision": "fp32", "opset": _opset(path),
            "max_abs_diff_vs_torch": parity, "verify": "both"}


def _export_dual(model: Any, tmp: Path, version: str) -> dict[str, Any]:
    """``onnx/verifier-dual.onnx``: the ``verify=both`` graph of ``fedfs+feduv`` with both
    backbones the checkpoint's; a device swaps in ``θ_c`` and ``w`` (``OrtRuntime.verifier``)."""
    from fedfs_sdk.federation.device_runtime import DUAL_ONNX_FILE
    from fedfs_sdk.nn.model import DualVerifierNet

    dual = DualVerifierNet(model.backbone, copy.deepcopy(model.backbone), model.uv_head).eval()
    return {"file": DUAL_ONNX_FILE, **export_dual_onnx(dual, tmp / DUAL_ONNX_FILE, version)}


def _opset(path: Path) -> int:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return next(i.version for i in m.opset_import if i.domain in ("", "ai.onnx"))
