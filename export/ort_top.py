"""``scope="top"`` ORT training artifacts: the device trains the top on its trunk's features.

Under ``scope="top"`` (the methods' default, :data:`fedfs_sdk.training.methods.DEFAULT_SCOPE`) the
trunk of ϕ(w), ϕ(θ_c) and ξ is ξ's and never changes (the server keeps it exact:
``server_agg/frozen_trunk.py``). So, as the torch device does (:class:`~fedfs_sdk.training.trainer.LocalTrainer`
with ``trunk_features``), an artifact-only device

1. runs ``trunk.onnx`` (images ``x`` ``[N,3,S,S]`` → ``features`` ``[N,F]``, eval mode, the exported
   trunk's weights inside) once over its photos, and
2. trains the small training graph whose first input is ``features``: the same losses
   (FedFS Eq. 7–9, FedUV ℓ_pos) over :class:`~fedfs_sdk.training.scope.TopFaceNet` models — the
   embedding layer, its normalization, FedFS's projection and FedUV's head; ξ is its top alone.

The parameters keep their state-dict names (``backbone.embed.weight`` …), so ``artifact.json``'s
``trainable`` lists are the top's keys and ``state_shapes`` still the whole model's: the device
receives and uploads whole models, with the trunk as received. ``artifact.json`` records the
trunk's :func:`~fedfs_sdk.training.top_keys.trunk_sha256`; a device refuses a model whose trunk
differs (its features would be another network's).
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from fedfs_sdk.nn.model import FaceNet
from fedfs_sdk.training.scope import EmbeddingTop, TopFaceNet, Trunk, check_splittable
from fedfs_sdk.training.top_keys import is_top_key, trunk_sha256

from .common import OPSET, ExportError
from .onnx_inference import check_runtime_compatible

TRUNK_FILE = "trunk.onnx"
TRUNK_INPUT = "x"
TRUNK_OUTPUT = "features"
FEATURES_INPUT = "features"
"""The training graph's first input under ``scope="top"`` (``x`` under ``scope="all"``)."""


def xi_backbone(xi: nn.Module | None) -> nn.Module | None:
    return xi.backbone if isinstance(xi, FaceNet) else xi


def check_top_exportable(global_model: FaceNet, xi: nn.Module | None) -> None:
    """:class:`ExportError` unless ``global_model`` splits into trunk and top and (FedFS) ξ has its
    trunk bit for bit — one ``trunk.onnx`` then feeds ξ, the global and the personalized model."""
    try:
        check_splittable(global_model.backbone)
    except Exception as e:  # InputError from check_splittable: say it in the export's terms
        raise ExportError(f"scope='top' artifacts: {e}; export with --train '{{\"scope\": \"all\"}}'") from None
    xb = xi_backbone(xi)
    if xb is None:
        return
    mine, theirs = global_model.backbone.state_dict(), xb.state_dict()
    trunk = [k for k in mine if not is_top_key("backbone." + k)]
    differ = [k for k in trunk if k not in theirs or theirs[k].shape != mine[k].shape or not torch.equal(mine[k], theirs[k])]
    if differ:
        raise ExportError(f"scope='top' artifacts train on ξ's trunk, but the checkpoint's trunk differs from ξ's "
                          f"({len(differ)} of {len(trunk)} tensors, e.g. {differ[0]}): export the server's model "
                          "(its trunk is ξ's under scope='top'), or export with --train '{\"scope\": \"all\"}'")


def feature_dim(backbone: nn.Module) -> int:
    """``F``: the width of the trunk's output."""
    size = int(backbone.input_size)
    with torch.no_grad():
        return int(Trunk(copy.deepcopy(backbone).eval())(torch.zeros(1, 3, size, size)).shape[1])


def top_models(global_model: FaceNet, personal: FaceNet | None, xi: nn.Module | None
               ) -> tuple[TopFaceNet, TopFaceNet | None, EmbeddingTop | None]:
    """The step's models seen from the trunk's output (their own modules, state-dict names kept)."""
    xb = xi_backbone(xi)
    return (TopFaceNet(global_model), TopFaceNet(personal) if personal is not None else None,
            EmbeddingTop(xb) if xb is not None else None)


def _export_checked(module: nn.Module, probe: np.ndarray, path: Path, names: tuple[str, str],
                    what: str, reference: nn.Module | None = None) -> tuple[float, tuple[int, ...]]:
    """Export ``module`` (eval mode, one input, one output, dynamic batch) to ``path`` and check ONNX
    Runtime against torch — ``reference`` (default: ``module`` itself) — on ``probe``; :class:`ExportError`
    above 1e-4 (relative to the output's scale). Returns the difference and the output's shape on ``probe``."""
    import onnxruntime as ort

    (name_in, name_out), module = names, module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # group norm's per-image statistics export as InstanceNormalization "in train mode": that is its
        # function in eval too (the twin keeps them: they cannot fold), not a training-mode leak
        warnings.filterwarnings("ignore", message=".*'instance_norm' is set to train=True.*")
        torch.onnx.export(module, (torch.from_numpy(probe[:2]),), str(path), dynamo=False, opset_version=OPSET,
                          input_names=[name_in], output_names=[name_out], do_constant_folding=False,
                          dynamic_axes={name_in: {0: "batch"}, name_out: {0: "batch"}})
    check_runtime_compatible(onnx.load(str(path)), what)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {name_in: probe})[0]
    with torch.no_grad():
        ref = (module if reference is None else reference.eval())(torch.from_numpy(probe)).numpy()
    err = float(np.abs(got - ref).max() / max(1.0, float(np.abs(ref).max())))
    if got.shape != ref.shape or not err <= 1e-4:
        raise ExportError(f"{what} differs from torch by {err:.2e} (> 1e-4)")
    return err, tuple(ref.shape)


def export_trunk(backbone: nn.Module, out_dir: Path, what: str) -> dict[str, Any]:
    """Write ``trunk.onnx`` (``x → features``, eval mode, dynamic batch) of ``backbone`` into
    ``out_dir`` and check it against torch on random inputs. Returns ``artifact.json``'s ``trunk``."""
    size = int(backbone.input_size)
    probe = np.random.default_rng(0).uniform(-1, 1, (3, 3, size, size)).astype(np.float32)
    # The graph is the backbone's inference twin (export.inference_graph: group norm as a per-channel
    # affine ORT folds into the convolution, native PReLU): the trainable layers' decomposed ops made
    # trunk.onnx ~1.7× slower than the verifier graph's same layers (benchmarks/ort_enroll_cost.py).
    # It is checked against the backbone itself.
    from .inference_graph import inference_twin

    _, shape = _export_checked(Trunk(inference_twin(backbone)), probe, out_dir / TRUNK_FILE,
                               (TRUNK_INPUT, TRUNK_OUTPUT), f"{what}/{TRUNK_FILE}",
                               reference=Trunk(copy.deepcopy(backbone).eval()))
    return {"file": TRUNK_FILE, "input": TRUNK_INPUT, "output": TRUNK_OUTPUT, "feature_dim": int(shape[1]),
            "sha256": trunk_sha256({f"backbone.{k}": t for k, t in backbone.state_dict().items()})}


TOP_FILE = "onnx/top.onnx"
"""The verifier backbone's top (``features → embedding``; initializers ``backbone.embed*``): with the
artifacts' ``trunk.onnx`` the whole backbone. A device writes a candidate's top weights in and runs it on
its photos' trunk features and on impostor features drawn in the federation's conditions
(:mod:`fedfs_sdk.federation.ort_check`): the in-domain check, torch-free."""


class _TopOfBackbone(nn.Module):
    """``backbone.embed*`` naming for the top graph's initializers (the verifier's state-dict names)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = EmbeddingTop(backbone)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.backbone(f)


def export_top_graph(backbone: nn.Module, path: Path) -> dict[str, Any]:
    """Write ``top.onnx`` of ``backbone`` (eval mode, dynamic batch) and check it against torch on
    random features. Returns the manifest entry."""
    width = feature_dim(backbone)
    probe = np.random.default_rng(1).normal(0, 1, (5, width)).astype(np.float32)
    err, _ = _export_checked(_TopOfBackbone(copy.deepcopy(backbone).eval()), probe, path, (FEATURES_INPUT, "embedding"),
                          path.name)
    names = sorted(i.name for i in onnx.load(str(path)).graph.initializer if i.name.startswith("backbone."))
    return {"file": TOP_FILE, "input": FEATURES_INPUT, "output": "embedding", "feature_dim": width,
            "parameters": names, "max_abs_diff_vs_torch": err}


__all__ = ["TOP_FILE", "export_top_graph", "TRUNK_FILE", "TRUNK_INPUT", "TRUNK_OUTPUT", "FEATURES_INPUT", "check_top_exportable", "feature_dim",
           "top_models", "export_trunk"]
