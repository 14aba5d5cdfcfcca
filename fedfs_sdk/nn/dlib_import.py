"""dlib's face recognizer ``.dat`` → the ``dlib-resnet`` backbone, exactly.

:func:`read_dlib_resnet` parses the file (:mod:`fedfs_sdk.nn.dlib_format`, told the network type
of ``dlib_face_recognition_resnet_model_v1``) and :func:`convert_dlib_resnet` maps it onto
:class:`~fedfs_sdk.nn.backbones.dlib_resnet.DlibResNet`, layer by layer in forward order, checking
every convolution's kernel, stride and padding and every pool against the module:

* dlib's ``affine`` layers (its BatchNorms, folded by dlib when it saved the deploy network; a
  ``bn_con2`` still holding running statistics is folded here the way dlib does,
  ``a = γ/sqrt(σ² + ε)``, ``b = β − a·μ``) become :class:`ChannelAffine` ``(a, b)``;
* each convolution's bias ``c`` (dlib's ``con_`` has one; the project's convs do not) moves into
  the affine after it: ``a·(Wx + c) + b = a·Wx + (b + a·c)``;
* dlib's input layer feeds ``(x − mean_c)/256`` (``mean`` = 122.782, 117.001, 104.298 for R, G, B,
  stored in the file); fedfs feeds ``u = (x − 127.5)/127.5``. Since ``x = 127.5·u + 127.5``, the
  stem conv becomes ``W·127.5/256`` and its constant ``Σ W·(127.5 − mean_c)/256`` joins the bias
  above — exact because dlib's 7×7/2 stem has no padding (checked);
* ``fc_no_bias`` (``out = x · W``, W stored ``[256, 128]``) becomes ``Linear.weight = Wᵀ``.

Nothing here needs dlib itself: the parity against dlib's own forward pass is a test
(``tests/test_dlib_resnet.py``) and a benchmark (``benchmarks/dlib_parity.py``).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import CheckpointError
from .backbones.dlib_resnet import STAGES, DlibResNet
from .backbones.layers import ChannelAffine
from .dlib_format import DlibLayer, Wrapper, read_dlib_net
from .model import FaceNet, ModelConfig

_L = Wrapper
_CON = _L("layer", ("con_",))
_AFFINE = _L("layer", ("affine_", "bn_con2"))
_RELU = _L("layer", ("relu_",))
_ADD = _L("layer", ("add_prev_",))


def _unit(down: bool) -> list[Wrapper]:
    """dlib's ``ares`` / ``ares_down`` (outermost first): relu<add_prev<[avg_pool<skip<tag<]
    affine<con<relu<affine<con<tag<…>>>>>>>[>>>]>>."""
    block = [_AFFINE, _CON, _RELU, _AFFINE, _CON]
    if down:
        return [_RELU, _ADD, _L("layer", ("avg_pool_2",)), _L("skip"), _L("tag"), *block, _L("tag")]
    return [_RELU, _ADD, *block, _L("tag")]


def dlib_resnet_structure() -> list[Wrapper]:
    """The network type of ``dlib_face_recognition_resnet_model_v1`` (``anet_type`` in dlib's
    ``face_recognition.cpp``), outermost first, for :func:`~fedfs_sdk.nn.dlib_format.read_dlib_net`."""
    units: list[Wrapper] = []
    for level, (_, repeats) in enumerate(STAGES):          # bottom-up levels → collected top-down below
        level_units = [_unit(False) for _ in range(repeats)] + ([_unit(True)] if level > 0 else [])
        units = [w for u in level_units for w in u] + units
    return [_L("loss", ("loss_metric_",)), _L("layer", ("fc_",)), _L("layer", ("avg_pool_2",)), *units,
            _L("layer", ("max_pool_2",)), _RELU, _AFFINE, _CON, _L("input", ("input_rgb_image",))]


def read_dlib_resnet(path: str | os.PathLike[str]) -> tuple[DlibLayer, list[DlibLayer]]:
    """The loss layer and the layers (bottom-up) of a dlib face recognizer file."""
    return read_dlib_net(path, dlib_resnet_structure())


def _affine_of(layer: DlibLayer) -> tuple[np.ndarray, np.ndarray]:
    v = layer.values
    if layer.name.startswith("bn_"):
        # what dlib's affine_(const bn_&) does when it loads a trained bn_ into an affine network
        a = v["gamma"] / np.sqrt(v["running_variances"] + np.float32(v["eps"]))
        return a.astype(np.float32), (v["beta"] - a * v["running_means"]).astype(np.float32)
    if v.get("disabled"):
        return np.ones_like(v["gamma"]), np.zeros_like(v["beta"])
    return v["gamma"], v["beta"]


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckpointError(f"dlib model does not match dlib-resnet: {what}")


def convert_dlib_resnet(path: str | os.PathLike[str]) -> tuple[FaceNet, dict[str, Any]]:
    """A :class:`FaceNet` (backbone ``dlib-resnet``, 150 px, 128-d) with the file's weights, and
    the meta a checkpoint of it records (``imported_from``, the file's sha256, what was folded,
    ``input_convention``, dlib's loss settings)."""
    p = Path(path)
    loss, layers = read_dlib_resnet(p)
    inp = layers[0]
    size = int(inp.values.get("nr", 150))
    model = FaceNet(ModelConfig("dlib-resnet", embedding_dim=128, input_size=size))
    net: DlibResNet = model.backbone  # type: ignore[assignment]
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    affines = [m for m in net.modules() if isinstance(m, ChannelAffine)]
    pools = [u for u in net.units if u.down]
    con_layers = [lyr for lyr in layers if lyr.name.startswith("con_")]
    aff_layers = [lyr for lyr in layers if lyr.name.startswith(("affine_", "bn_"))]
    _expect(len(con_layers) == len(convs) == len(aff_layers) == len(affines),
            f"{len(con_layers)} conv / {len(aff_layers)} affine layers, the module has {len(convs)}")
    mean = np.asarray(inp.values["avg"], np.float64)            # R, G, B
    folded: list[str] = []
    state: dict[str, torch.Tensor] = {}
    names = {m: n for n, m in net.named_modules()}
    for i, (con, conv, aff_layer, aff) in enumerate(zip(con_layers, convs, aff_layers, affines)):
        v = con.values
        _expect(tuple(v["filters"].shape) == tuple(conv.weight.shape),
                f"conv {i} holds filters {tuple(v['filters'].shape)}, module {tuple(conv.weight.shape)}")
        _expect((v["stride_y"], v["stride_x"], v["padding_y"], v["padding_x"]) ==
                (*conv.stride, *conv.padding),
                f"conv {i} stride/padding {(v['stride_y'], v['stride_x'], v['padding_y'], v['padding_x'])}, "
                f"module {(*conv.stride, *conv.padding)}")
        w = v["filters"].astype(np.float64)
        bias = np.zeros(w.shape[0]) if v["biases"] is None else v["biases"].astype(np.float64)
        if i == 0:
            _expect(v["padding_y"] == v["padding_x"] == 0, "the stem conv is padded (the input absorption "
                    "below is exact only without padding)")
            bias = bias + (w * ((127.5 - mean) / 256.0)[None, :, None, None]).sum(axis=(1, 2, 3))
            w = w * (127.5 / 256.0)
        a, b = _affine_of(aff_layer)
        _expect(a.shape == (aff.num_channels,), f"affine {i} has {a.shape[0]} channels, module {aff.num_channels}")
        state[names[conv] + ".weight"] = torch.from_numpy(w.astype(np.float32))
        state[names[aff] + ".weight"] = torch.from_numpy(a.astype(np.float32))
        state[names[aff] + ".bias"] = torch.from_numpy((b.astype(np.float64) + a * bias).astype(np.float32))
        folded.append(f"{names[aff]} ← dlib {aff_layer.name} + {con.name} bias")
    mp = next(lyr for lyr in layers if lyr.name == "max_pool_2").values
    _expect((mp["nr"], mp["nc"], mp["stride_y"], mp["padding_y"]) == (3, 3, 2, 0), f"stem max pool {mp}")
    avg = [lyr.values for lyr in layers if lyr.name == "avg_pool_2"]
    _expect(len(avg) == len(pools) + 1 and all((a["nr"], a["stride_y"], a["padding_y"]) == (2, 2, 0) for a in avg[:-1])
            and avg[-1]["nr"] == 0, "average pools differ from 2×2/2 shortcuts + a global pool")
    fc = next(lyr for lyr in layers if lyr.name.startswith("fc_")).values
    _expect(fc["biases"] is None, "the fc layer has a bias (dlib-resnet's is fc_no_bias)")
    _expect(tuple(fc["weights"].shape) == (net.embed.in_features, net.embed.out_features),
            f"fc weights {tuple(fc['weights'].shape)}")
    state["embed.weight"] = torch.from_numpy(np.ascontiguousarray(fc["weights"].T))
    missing = set(net.state_dict()) - set(state)
    _expect(not missing, f"module tensors left without weights: {sorted(missing)}")
    net.load_state_dict(state)
    meta = {
        "kind": "xi",
        "imported_from": p.name,
        "source_sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        "source_format": "dlib dnn (anet_type of dlib's face_recognition.cpp)",
        "mapping": {"folded_batchnorm": folded, "mapped": len(state)},
        "input_convention": {"source": f"RGB, (x − mean)/256, mean (R, G, B) = {tuple(round(m, 3) for m in mean)}",
                             "fedfs": "RGB, (x − 127.5)/127.5",
                             "absorbed": "into the stem convolution (unpadded: exact)"},
        "face_alignment": net.face_alignment,
        "dlib_loss": {"name": loss.name, **{k: float(x) for k, x in loss.values.items()}},
    }
    return model.eval(), meta
