"""A faithful fp16 reference for Core ML ML Programs, runnable on Linux.

Core ML prediction needs macOS/iOS, and coremltools on Linux can convert and inspect a
model but not run it. This module executes the *saved* ``.mlpackage`` itself: it loads its
MIL program (``coremltools.converters.mil.frontend.milproto.load`` — the ops, weights and
dtypes Core ML receives, after every coremltools graph pass and the fp16 casts) and evaluates
it op by op with numpy/torch:

* every tensor is **stored in the dtype the program declares** for it (fp16 in an fp16
  program): each op's result is rounded to that dtype, so a value above 65504 becomes
  ``inf`` and a tiny one flushes towards 0, exactly where Core ML's storage would;
* the arithmetic *inside* one op (a convolution's or a reduction's accumulator) runs in
  float32, like GPU/ANE kernels that accumulate wider than they store.

It is not bit-exact to any Apple engine (their accumulation order and fused kernels
differ), but it reproduces what breaks fp16 models — overflow and underflow of stored
intermediates (issue 13: ``Σ x²`` of the FedUV head above 65504 turned ``uv`` into 0 and
accepted everyone). Unknown ops are an error, never skipped.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import ExportError


class CoreMLReferenceError(ExportError):
    """The reference cannot evaluate a program (an op it does not implement)."""


def _ct_modules():
    import logging

    logging.getLogger("coremltools").setLevel(logging.ERROR)
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    from coremltools.converters.mil.mil import types
    return ct, milproto_load, types


def _t(a: Any) -> "torch.Tensor":
    """An input as a float32 tensor (the op's arithmetic precision)."""
    import torch

    if isinstance(a, torch.Tensor):
        return a.float()
    return torch.as_tensor(np.asarray(a, dtype=np.float32))


def _raw(a: Any) -> "torch.Tensor":
    """An input as a tensor of its own dtype (for ops that move data, not compute)."""
    import torch

    return a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))


def _ints(v: Any) -> list[int]:
    return [int(x) for x in np.atleast_1d(np.asarray(v))]


def _reduce(name: str) -> Callable[[dict[str, Any]], Any]:
    def run(a: dict[str, Any]) -> Any:
        x = _t(a["x"])
        axes = a.get("axes")
        dims = list(range(x.dim())) if axes is None else _ints(axes)
        keep = bool(a.get("keep_dims", False))
        if name == "sum":
            return x.sum(dim=dims, keepdim=keep)
        if name == "mean":
            return x.mean(dim=dims, keepdim=keep)
        return (x.amax if name == "max" else x.amin)(dim=dims, keepdim=keep)
    return run


def _conv(a: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    x, w = _t(a["x"]), _t(a["weight"])
    k = w.shape[2:]
    if len(k) != 2:
        raise CoreMLReferenceError(f"only 2-D conv is implemented, got a {len(k)}-D kernel")
    strides = _ints(a["strides"]) if a.get("strides") is not None else [1, 1]
    dil = _ints(a["dilations"]) if a.get("dilations") is not None else [1, 1]
    pad_type = str(a.get("pad_type", "valid"))
    if pad_type == "custom":
        p = _ints(a["pad"])                                            # [top, bottom, left, right]
        x = F.pad(x, (p[2], p[3], p[0], p[1]))
    elif pad_type in ("same", "same_lower"):
        pads = []
        for size, kk, st, d in zip(x.shape[2:], k, strides, dil):
            total = max((-(-size // st) - 1) * st + (kk - 1) * d + 1 - size, 0)
            lo = total // 2 if pad_type == "same" else total - total // 2
            pads.append((lo, total - lo))
        x = F.pad(x, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
    elif pad_type != "valid":
        raise CoreMLReferenceError(f"conv pad_type {pad_type!r} is not implemented")
    b = a.get("bias")
    return F.conv2d(x, w, None if b is None else _t(b), stride=strides, dilation=dil,
                    groups=int(a.get("groups", 1)))


def _reshape(a: dict[str, Any]) -> Any:
    x = _raw(a["x"])
    shape = _ints(a["shape"])
    # The program is traced at batch 1; evaluating a batch keeps the leading (batch) axis.
    if x.dim() and shape and shape[0] == 1 and x.shape[0] > 1:
        shape[0] = x.shape[0]
    return x.reshape(shape)


def _linear(a: dict[str, Any]) -> Any:
    out = _t(a["x"]) @ _t(a["weight"]).T
    return out + _t(a["bias"]) if a.get("bias") is not None else out


def _matmul(a: dict[str, Any]) -> Any:
    x, y = _t(a["x"]), _t(a["y"])
    if a.get("transpose_x", False):
        x = x.transpose(-1, -2)
    if a.get("transpose_y", False):
        y = y.transpose(-1, -2)
    return x @ y


def _avg_pool(a: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    if str(a.get("pad_type", "valid")) != "valid":
        raise CoreMLReferenceError("avg_pool with padding is not implemented")
    return F.avg_pool2d(_t(a["x"]), _ints(a["kernel_sizes"]), _ints(a["strides"]),
                        ceil_mode=bool(a.get("ceil_mode", False)))


def _max_pool(a: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    x = _t(a["x"])
    pad_type = str(a.get("pad_type", "valid"))
    if pad_type == "custom":
        p = _ints(a["pad"])                                            # [top, bottom, left, right]
        x = F.pad(x, (p[2], p[3], p[0], p[1]), value=float("-inf"))
    elif pad_type != "valid":
        raise CoreMLReferenceError(f"max_pool pad_type {pad_type!r} is not implemented")
    return F.max_pool2d(x, _ints(a["kernel_sizes"]), _ints(a["strides"]), ceil_mode=bool(a.get("ceil_mode", False)))


def _pad(a: dict[str, Any]) -> Any:
    """MIL ``pad``: ``pad`` = (before, after) pairs for the *last* N dims, first of them first."""
    import torch.nn.functional as F

    mode = str(a.get("mode", "constant"))
    if mode != "constant":
        raise CoreMLReferenceError(f"pad mode {mode!r} is not implemented")
    p = _ints(a["pad"])
    pairs = [(p[2 * i], p[2 * i + 1]) for i in range(len(p) // 2)]
    flat = [v for before_after in reversed(pairs) for v in before_after]     # F.pad: last dim first
    return F.pad(_t(a["x"]), flat, value=float(a.get("constant_val", 0.0) or 0.0))


def _cast(a: dict[str, Any]) -> Any:
    import torch

    dtypes = {"fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32, "bool": torch.bool}
    return _raw(a["x"]).to(dtypes[str(a["dtype"])])


def _batch_norm(a: dict[str, Any]) -> Any:
    """MIL ``batch_norm`` (channel axis 1): ``(x − mean)/sqrt(variance + ε)·γ + β``.

    coremltools' ``fuse_elementwise_to_batchnorm`` pass turns the per-channel ``mul`` + ``add``
    of a trained group norm's affine into this op (an untrained one, γ = 1 and β = 0, is
    removed as identity instead), so every trained model's program has ~50 of them."""
    x = _t(a["x"])
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - _t(a["mean"]).reshape(shape)) / (_t(a["variance"]).reshape(shape) + _eps(a, 1e-5)).sqrt()
    if a.get("gamma") is not None:
        y = y * _t(a["gamma"]).reshape(shape)
    if a.get("beta") is not None:
        y = y + _t(a["beta"]).reshape(shape)
    return y


def _eps(a: dict[str, Any], default: float) -> float:
    return float(a["epsilon"]) if a.get("epsilon") is not None else default


OPS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "add": lambda a: _t(a["x"]) + _t(a["y"]),
    "sub": lambda a: _t(a["x"]) - _t(a["y"]),
    "mul": lambda a: _t(a["x"]) * _t(a["y"]),
    "real_div": lambda a: _t(a["x"]) / _t(a["y"]),
    "maximum": lambda a: _t(a["x"]).maximum(_t(a["y"])),
    "minimum": lambda a: _t(a["x"]).minimum(_t(a["y"])),
    "pow": lambda a: _t(a["x"]).pow(_t(a["y"])),
    "sqrt": lambda a: _t(a["x"]).sqrt(),
    "rsqrt": lambda a: (_t(a["x"]) + _eps(a, 1e-12)).rsqrt(),
    "inverse": lambda a: 1.0 / (_t(a["x"]) + _eps(a, 1e-4)),
    "square": lambda a: _t(a["x"]).square(),
    "abs": lambda a: _t(a["x"]).abs(),
    "relu": lambda a: _t(a["x"]).relu(),
    "exp": lambda a: _t(a["x"]).exp(),
    "tanh": lambda a: _t(a["x"]).tanh(),
    "sigmoid": lambda a: _t(a["x"]).sigmoid(),
    "clip": lambda a: _t(a["x"]).clamp(float(a["alpha"]), float(a["beta"])),
    "reduce_sum": _reduce("sum"),
    "reduce_mean": _reduce("mean"),
    "reduce_max": _reduce("max"),
    "reduce_min": _reduce("min"),
    "conv": _conv,
    "linear": _linear,
    "matmul": _matmul,
    "avg_pool": _avg_pool,
    "max_pool": _max_pool,
    "pad": _pad,
    "batch_norm": _batch_norm,
    "reshape": _reshape,
    "transpose": lambda a: _raw(a["x"]).permute(_ints(a["perm"])),
    "squeeze": lambda a: (_raw(a["x"]).squeeze() if a.get("axes") is None
                          else _raw(a["x"]).squeeze(tuple(_ints(a["axes"])))),
    "expand_dims": lambda a: _expand_many(a),
    "concat": lambda a: __import__("torch").cat([_raw(v) for v in a["values"]], dim=int(a["axis"])),
    "identity": lambda a: _raw(a["x"]),
    "cast": _cast,
}
"""MIL op → evaluator of its inputs (float32 arithmetic; the caller rounds to the output dtype)."""


def _expand_many(a: dict[str, Any]) -> Any:
    x = _raw(a["x"])
    for ax in sorted(_ints(a["axes"])):
        x = x.unsqueeze(ax if ax >= 0 else x.dim() + 1 + ax)
    return x


class CoreMLReference:
    """Evaluates a saved ``.mlpackage``'s ML Program in its declared precision (see module doc).

    ``run(pixels)`` takes RGB pixel values ``[N, 3, S, S]`` (0–255, what the ``ImageType``
    input receives; the program's own scale/bias ops normalize them) and returns every
    output as float32.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        ct, milproto_load, types = _ct_modules()
        p = Path(path)
        spec = ct.utils.load_spec(str(p))
        if spec.WhichOneof("Type") != "mlProgram":
            raise CoreMLReferenceError(f"{p} is not an ML Program")
        prog = milproto_load(spec, spec.specificationVersion,
                             file_weights_dir=str(p / "Data" / "com.apple.CoreML" / "weights"))
        self._fn = prog.functions["main"]
        self._types = types
        unknown = sorted({op.op_type for op in self._fn.operations} - set(OPS) - {"const"})
        if unknown:
            raise CoreMLReferenceError(f"{p}: the fp16 reference does not implement MIL ops {unknown}")
        multi = sorted({op.op_type for op in self._fn.operations if len(op.outputs) != 1})
        if multi:
            raise CoreMLReferenceError(f"{p}: the fp16 reference evaluates single-output ops only, got {multi}")
        self.input_names = list(self._fn.inputs)
        self.output_names = [v.name for v in self._fn.outputs]
        self.op_types = sorted({op.op_type for op in self._fn.operations})
        # Free every computed tensor after its last reader: a batch of 112×112 images would
        # otherwise hold all of MobileFaceNet's activations at once (GBs).
        last: dict[str, int] = {}
        for i, op in enumerate(self._fn.operations):
            for v in op.inputs.values():
                for u in (v if isinstance(v, (list, tuple)) else [v]):
                    last[u.name] = i
        self._free_after: dict[int, list[str]] = {}
        for name, i in last.items():
            if name not in self.output_names:
                self._free_after.setdefault(i, []).append(name)

    def _torch_dtype(self, var: Any) -> Any:
        import torch

        return {np.float16: torch.float16, np.float32: torch.float32, np.int32: torch.int32,
                np.bool_: torch.bool}.get(self._types.nptype_from_builtin(var.dtype), torch.float32)

    def run(self, pixels: np.ndarray, chunk: int = 32) -> dict[str, np.ndarray]:
        x = np.asarray(pixels, dtype=np.float32)
        parts = [self._run(x[i:i + chunk]) for i in range(0, len(x), chunk)]
        return {o: np.concatenate([p[o] for p in parts]) for o in self.output_names}

    def _run(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        import torch

        if len(self.input_names) != 1:
            raise CoreMLReferenceError(f"expected one input, the program has {self.input_names}")
        name = self.input_names[0]
        x = torch.as_tensor(np.asarray(pixels, dtype=np.float32))
        env: dict[str, Any] = {name: x.to(self._torch_dtype(self._fn.inputs[name]))}

        def value(v: Any) -> Any:
            if isinstance(v, (list, tuple)):
                return [value(u) for u in v]
            return env[v.name] if v.name in env else v.val

        with torch.no_grad():
            for i, op in enumerate(self._fn.operations):
                out = op.outputs[0]
                if op.op_type == "const":
                    env[out.name] = out.val
                    continue
                result = OPS[op.op_type]({k: value(v) for k, v in op.inputs.items()})
                env[out.name] = _raw(result).to(self._torch_dtype(out))   # stored in the declared dtype
                for name in self._free_after.get(i, ()):
                    env.pop(name, None)
        return {o: _raw(env[o]).float().numpy() for o in self.output_names}
