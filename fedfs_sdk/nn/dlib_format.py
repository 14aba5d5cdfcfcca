"""Reader for dlib's serialized DNNs (``dlib::serialize(net, out)``), numpy only.

dlib writes a network as nested objects, outermost (the loss) first. Every ``add_layer`` writes
its version, then its *whole subnetwork*, then its own layer details and state; so the file holds
the layers' version headers top-down and their contents bottom-up (the input layer's first).
Nothing in the stream says which kind of wrapper comes next (a tag, a skip, a layer), so the
reader is told the network's structure (:class:`Wrapper` list, outermost first) and checks every
layer's own name string (``con_6``, ``affine_2``, ``bn_con2``, …) against it: a file of another
architecture is refused at the first layer that differs, naming it.

Encodings (dlib/serialize.h, dlib/float_details.h, dlib/cuda/tensor.h):

* integers: one control byte (low nibble = number of little-endian bytes that follow, 0x80 =
  negative), then those bytes;
* ``bool``: the character ``'0'`` or ``'1'``; strings: integer length, then the bytes;
* ``float``/``double``: ``mantissa`` (int64) and ``exponent`` (int16) as integers, value
  ``mantissa · 2^exponent`` (exponents 32000/32001/32002 = +inf/−inf/NaN);
* ``resizable_tensor``: version 2, four integers (n, k, nr, nc), then n·k·nr·nc little-endian
  IEEE float32 values; ``alias_tensor`` (a view into a layer's ``params``): version 1 and the
  four sizes only.

Layer contents read here (dlib/dnn/layers.h, input.h, loss.h): ``con_4``–``con_6``, ``fc_2``/``fc_3``,
``affine_``/``affine_2``, ``bn_con2``/``bn_fc2`` (a trained BatchNorm, which dlib itself folds to
an affine when it loads it into an ``affine`` network), ``relu_``/``relu_2``, ``max_pool_2``,
``avg_pool_2``, ``add_prev_``, ``input_rgb_image[_sized]`` and ``loss_metric_[2]``.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError


class DlibFormatError(CheckpointError):
    """The file is not a dlib network of the expected structure (names the offset and layer)."""


class _Stream:
    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.pos = 0
        self.name = name

    def fail(self, what: str) -> DlibFormatError:
        return DlibFormatError(f"{self.name}: {what} (at byte {self.pos} of {len(self.data)}); "
                               "not the dlib network this reader expects")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.fail(f"file ends inside a value ({n} bytes wanted)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def int(self) -> int:
        ctrl = self.take(1)[0]
        size = ctrl & 0x0F
        if size == 0 or size > 8 or ctrl & 0x70:
            raise self.fail(f"bad integer control byte 0x{ctrl:02x}")
        v = int.from_bytes(self.take(size), "little")
        return -v if ctrl & 0x80 else v

    def bool(self) -> bool:
        c = self.take(1)
        if c not in (b"0", b"1"):
            raise self.fail(f"bad bool byte {c!r}")
        return c == b"1"

    def str(self) -> str:
        n = self.int()
        if not 0 <= n <= 4096:
            raise self.fail(f"implausible string length {n}")
        return self.take(n).decode("latin-1")

    def float(self) -> float:
        mantissa, exponent = self.int(), self.int()
        if exponent == 32000:
            return math.inf
        if exponent == 32001:
            return -math.inf
        if exponent == 32002:
            return math.nan
        return math.ldexp(float(mantissa), exponent)

    def tensor(self) -> np.ndarray:
        """A ``resizable_tensor``: ``[n, k, nr, nc]`` float32."""
        if (v := self.int()) != 2:
            raise self.fail(f"tensor version {v}, expected 2")
        shape = tuple(self.int() for _ in range(4))
        if any(d < 0 for d in shape):
            raise self.fail(f"negative tensor size {shape}")
        count = int(np.prod(shape))
        return np.frombuffer(self.take(4 * count), dtype="<f4").reshape(shape).astype(np.float32)

    def alias(self) -> tuple[int, int, int, int]:
        """An ``alias_tensor``: its four sizes (it has no data of its own)."""
        if (v := self.int()) != 1:
            raise self.fail(f"alias_tensor version {v}, expected 1")
        return tuple(self.int() for _ in range(4))  # type: ignore[return-value]


@dataclass(frozen=True)
class Wrapper:
    """One level of a dlib network type, outermost first: ``kind`` is ``"layer"`` (``add_layer``
    of a layer whose contents start with one of ``names``), ``"tag"`` or ``"skip"``; ``"input"``
    and ``"loss"`` are the two ends."""

    kind: str
    names: tuple[str, ...] = ()


@dataclass
class DlibLayer:
    """A parsed layer, bottom-up index ``index`` (0 = the input layer). ``name``: its version
    string (``con_6``, ``bn_con2``, …); ``values``: its scalars and arrays by name."""

    index: int
    name: str
    values: dict[str, Any] = field(default_factory=dict)


def _read_details(s: _Stream, expected: tuple[str, ...], index: int) -> DlibLayer:
    name = s.str()
    if not any(name == e or name.startswith(e) for e in expected):
        raise s.fail(f"layer {index} is {name!r}, expected one of {list(expected)}")
    v: dict[str, Any] = {}
    if name.startswith("con_"):
        params = s.tensor()
        v["num_filters"] = s.int()
        v["nr"], v["nc"], v["stride_y"], v["stride_x"] = s.int(), s.int(), s.int(), s.int()
        v["padding_y"], v["padding_x"] = s.int(), s.int()
        filters, biases = s.alias(), s.alias()
        for k in ("lr_mult", "wd_mult", "bias_lr_mult", "bias_wd_mult"):
            v[k] = s.float()
        v["use_bias"] = s.bool() if name in ("con_5", "con_6") else True
        v["use_relu"] = s.bool() if name == "con_6" else False
        flat = params.reshape(-1)
        nw = int(np.prod(filters))
        if flat.size < nw:
            raise s.fail(f"con_ params hold {flat.size} values, its filters {filters} need {nw}")
        v["filters"] = flat[:nw].reshape(filters)
        v["biases"] = flat[nw:nw + int(np.prod(biases))].copy() if v["use_bias"] and np.prod(biases) else None
    elif name.startswith("fc_"):
        v["num_outputs"], v["num_inputs"] = s.int(), s.int()
        params = s.tensor()
        weights, biases = s.alias(), s.alias()
        v["bias_mode"] = s.int()
        for k in ("lr_mult", "wd_mult", "bias_lr_mult", "bias_wd_mult"):
            v[k] = s.float()
        v["use_bias"] = s.bool() if name == "fc_3" else True
        flat = params.reshape(-1)
        nw = int(np.prod(weights))
        v["weights"] = flat[:nw].reshape(v["num_inputs"], v["num_outputs"])     # out = x · W
        nb = int(np.prod(biases))
        v["biases"] = flat[nw:nw + nb].copy() if nb else None
    elif name in ("affine_", "affine_2"):
        params = s.tensor()
        gamma, beta = s.alias(), s.alias()
        v["mode"] = s.int()
        v["disabled"] = s.bool() if name == "affine_2" else False
        flat, n = params.reshape(-1), int(np.prod(gamma))
        v["gamma"], v["beta"] = flat[:n].copy(), flat[n:n + int(np.prod(beta))].copy()
    elif name in ("bn_con2", "bn_fc2"):
        params = s.tensor()
        gamma, beta = s.alias(), s.alias()
        s.tensor(), s.tensor()                                  # batch means / invstds (training state)
        v["running_means"], v["running_variances"] = s.tensor().reshape(-1), s.tensor().reshape(-1)
        v["num_updates"], v["window"] = s.int(), s.int()
        for k in ("lr_mult", "wd_mult", "bias_lr_mult", "bias_wd_mult"):
            v[k] = s.float()
        v["eps"] = s.float()
        flat, n = params.reshape(-1), int(np.prod(gamma))
        v["gamma"], v["beta"] = flat[:n].copy(), flat[n:n + int(np.prod(beta))].copy()
    elif name in ("relu_", "relu_2"):
        v["disabled"] = s.bool() if name == "relu_2" else False
    elif name in ("max_pool_2", "avg_pool_2"):
        v["nr"], v["nc"], v["stride_y"], v["stride_x"] = s.int(), s.int(), s.int(), s.int()
        v["padding_y"], v["padding_x"] = s.int(), s.int()
    elif name == "add_prev_":
        pass
    elif name.startswith("input_rgb_image"):
        v["avg"] = (s.float(), s.float(), s.float())            # red, green, blue
        if name == "input_rgb_image_sized":
            v["nr"], v["nc"] = s.int(), s.int()
    elif name.startswith("loss_metric_"):
        v["margin"], v["dist_thresh"] = (s.float(), s.float()) if name == "loss_metric_2" else (0.1, 0.75)
    else:  # pragma: no cover - guarded by ``expected``
        raise s.fail(f"no reader for layer {name!r}")
    return DlibLayer(index, name, v)


def _layer_state(s: _Stream, version: int) -> None:
    """What an ``add_layer`` writes after its details: setup/stale/disabled flags and its cached
    tensors (empty in a saved network, read and dropped)."""
    s.bool(), s.bool(), s.bool()
    s.tensor(), s.tensor()
    if version >= 2:
        s.tensor()


def read_dlib_net(path: str | os.PathLike[str], structure: list[Wrapper]) -> tuple[DlibLayer, list[DlibLayer]]:
    """Parse a dlib network file of the given ``structure`` (outermost first: ``loss``, the
    layers/tags/skips, ``input``). Returns the loss layer and the other layers **bottom-up**
    (``[0]`` = the input layer, then the layer right above it, …; tags and skips are not
    layers and are left out). Raises :class:`DlibFormatError` naming the first mismatch."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read dlib model {p}: {e}") from None
    s = _Stream(data, str(p))
    if not structure or structure[0].kind != "loss" or structure[-1].kind != "input":
        raise ValueError("structure must start with the loss and end with the input layer")
    if (v := s.int()) != 1:
        raise s.fail(f"add_loss_layer version {v}, expected 1")
    loss = _read_details(s, structure[0].names, -1)
    # top-down: each wrapper's version header, until the bottom add_layer (which holds the input)
    versions: list[tuple[Wrapper, int]] = []
    for w in structure[1:-1]:
        v = s.int()
        ok = {"tag": (1,), "skip": (1,), "layer": (1, 2, 3)}[w.kind]
        if v not in ok:
            raise s.fail(f"{w.kind} wrapper {len(versions)} from the top has version {v}, expected {ok}")
        versions.append((w, v))
    if not versions or versions[-1][0].kind != "layer":
        raise ValueError("the layer right above the input must be an add_layer")
    input_layer = _read_details(s, structure[-1].names, 0)
    layers: list[DlibLayer] = [input_layer]
    # bottom-up: each add_layer's details and state; the bottom one has its own format
    for depth, (w, v) in enumerate(reversed(versions)):
        if w.kind != "layer":
            continue
        layer = _read_details(s, w.names, len(layers))
        if depth == 0:          # add_layer over the input layer: flags, x_grad, cached_output, grad_final[, factor]
            s.bool(), s.bool(), s.bool()
            s.tensor(), s.tensor(), s.tensor()
            if v >= 3:
                s.int()
        else:
            _layer_state(s, v)
        layers.append(layer)
    if s.pos != len(data):
        raise s.fail(f"{len(data) - s.pos} bytes left after the network")
    return loss, layers


def float32_le(values: np.ndarray) -> bytes:  # pragma: no cover - helper for writers in tests
    """``values`` as dlib writes tensor data (little-endian float32)."""
    return struct.pack(f"<{values.size}f", *np.asarray(values, np.float32).reshape(-1))
