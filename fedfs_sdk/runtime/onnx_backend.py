"""ONNX Runtime inference backend — what a phone (or a torch-free process) verifies with.

:class:`OnnxBackend` implements :class:`fedfs_sdk.runtime.inference.InferenceBackend` over a model
written by ``fedfs export --formats onnx`` (or ``onnx-int8``); the input contract, the
model id and the outputs are read from the file's ``metadata_props``, so nothing about the
model has to be configured by hand. No torch import anywhere on this path.

Why :func:`import_onnxruntime`: the ``onnxruntime-training`` wheel's package ``__init__``
validates its optional PyTorch integration (``ORTModule``) and so imports torch whenever
torch is installed. A phone has no torch; to run the same way here, the first import of
onnxruntime is done with torch marked unavailable, which makes ORT skip that optional part
(inference and the on-device training C API do not use it). torch stays importable
afterwards for code that really wants it.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Mapping

import numpy as np

from ..errors import CheckpointError, InputError
from .inference import check_batch

FORMATS = ("fedfs-onnx/1",)
PARAM_PREFIXES = ("backbone.", "global_backbone.", "uv_head.")


def import_onnxruntime() -> ModuleType:
    """Import :mod:`onnxruntime` without pulling in torch (see the module docstring).

    If torch is already loaded (a simulator process), this is a plain import.
    """
    if "onnxruntime" in sys.modules or "torch" in sys.modules:
        import onnxruntime
        return onnxruntime
    # A ``None`` entry in sys.modules makes ``import torch`` raise ImportError and
    # ``importlib.util.find_spec("torch")`` return None — ORT then treats torch as absent.
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import onnxruntime
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return onnxruntime


SALTED_ARCHITECTURES = frozenset({"mobilefacenet-affine", "mobilefacenet-affine-112x96", "mobilefacenet-relu6"})
"""Backbones whose tensor names and shapes are another backbone's (``mobilefacenet-affine``'s
per-channel affines have GroupNorm's ``weight``/``bias`` of ``mobilefacenet``): their weights
alone do not say which function they compute, so their model id also hashes the architecture's
name (issue 29: a verifier loaded into the wrong architecture carried the right one's id).
Every other architecture's id stays what it was (names, shapes, bytes), so enrollments and
exports made before keep theirs."""


def architecture_salt(architecture: str | None) -> bytes:
    """What the model id hashes first for ``architecture`` (empty unless it is salted)."""
    return f"architecture={architecture}\n".encode() if architecture in SALTED_ARCHITECTURES else b""


def weights_id(weights: Mapping[str, np.ndarray], architecture: str | None = None) -> str:
    """Content hash of a verifier's weights; equals
    :func:`fedfs_sdk.nn.checkpoint.model_id_of` of the same tensors and architecture (without torch)."""
    h = hashlib.sha256(architecture_salt(architecture))
    for k in sorted(weights):
        a = np.ascontiguousarray(weights[k])
        h.update(k.encode())
        h.update(str(tuple(int(d) for d in a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def graph_digest(model) -> str:
    """16 hex of the sha256 of an ONNX graph's initializers (name, dtype, shape, bytes, sorted
    by name) and nodes (op, inputs, outputs, attributes); metadata is not hashed. The int8
    model id is ``<fp32 id>-int8-<graph_digest>`` (quantization rewrites the weights, so the
    fp32 weights id no longer applies)."""
    from onnx import numpy_helper

    h = hashlib.sha256()
    for init in sorted(model.graph.initializer, key=lambda t: t.name):
        arr = np.ascontiguousarray(numpy_helper.to_array(init))
        h.update(init.name.encode())
        h.update(str(arr.dtype).encode())
        h.update(str(tuple(arr.shape)).encode())
        h.update(arr.tobytes())
    for node in model.graph.node:
        h.update(f"{node.domain}:{node.op_type}({','.join(node.input)})->({','.join(node.output)})".encode())
        for attr in sorted(node.attribute, key=lambda a: a.name):
            h.update(attr.SerializeToString(deterministic=True))
    return h.hexdigest()[:16]


INT8_SUFFIX = "-int8"


def int8_model_id(model, fp32_id: str) -> str:
    """``<fp32_id>-int8-<graph_digest>``: the id of an int8 model quantized from ``fp32_id``."""
    return f"{fp32_id}{INT8_SUFFIX}-{graph_digest(model)}"


def model_id_problem(model) -> str | None:
    """Why the ``fedfs.model_id`` an ONNX verifier records is not the one its content implies
    (None when it is, or when the file records none): fp32 → :func:`weights_id` of its
    parameters; int8 → ends in ``-int8-<graph_digest>``. Enrollments and thresholds are bound
    to the id, so it is recomputed rather than read from the (editable) metadata."""
    from onnx import numpy_helper

    meta = {p.key: p.value for p in model.metadata_props}
    recorded = meta.get("fedfs.model_id")
    precision = meta.get("fedfs.precision", "fp32")
    if recorded is None or precision not in ("fp32", "int8"):
        return None
    if precision == "int8":
        implied = f"{INT8_SUFFIX}-{graph_digest(model)}"
        prefix = recorded[:-len(implied)] if recorded.endswith(implied) else ""
        # the fp32 id it was quantized from cannot be recomputed here, but it must be one
        ok = len(prefix) == 16 and all(c in "0123456789abcdef" for c in prefix)
    else:
        implied = weights_id({i.name: numpy_helper.to_array(i) for i in model.graph.initializer
                              if i.name.startswith(PARAM_PREFIXES)}, meta.get("fedfs.backbone"))
        ok = recorded == implied
    return None if ok else f"records fedfs.model_id {recorded!r} but its weights imply {implied.lstrip('-')!r}"


def metadata_vs_graph(meta: Mapping[str, str], session) -> list[str]:
    """Where a verifier's ``fedfs.*`` metadata (input size, output names, embedding and code
    dims) disagrees with the graph ONNX Runtime loaded; empty when they agree. Symbolic
    (dynamic) dims are not compared."""
    def static(dim) -> int | None:
        return dim if isinstance(dim, int) else None

    out: list[str] = []
    inputs = {i.name: i for i in session.get_inputs()}
    name = meta.get("fedfs.input_name", next(iter(inputs), ""))
    if name not in inputs:
        return [f"input {name!r} is not a graph input ({sorted(inputs)})"]
    shape = list(inputs[name].shape)
    size = meta.get("fedfs.input_size")
    if len(shape) != 4 or static(shape[1]) not in (3, None):
        out.append(f"input shape {shape} is not [N, 3, S, S]")
    elif size is not None and any(static(d) not in (int(size), None) for d in shape[2:]):
        out.append(f"fedfs.input_size {size} but the graph takes {shape[2]}x{shape[3]}")
    dims = {"embedding": meta.get("fedfs.embedding_dim"), "uv": meta.get("fedfs.code_length")}
    for o in session.get_outputs():
        want = dims.get(o.name)
        got = static(o.shape[-1]) if o.shape else None
        if want is not None and got is not None and got != int(want):
            key = "fedfs.embedding_dim" if o.name == "embedding" else "fedfs.code_length"
            out.append(f"{key} {want} but output {o.name!r} has {got}")
    return out


def session_options(intra_op_threads: int | None = None):
    """``SessionOptions`` with all graph optimizations; ``intra_op_threads`` pins the
    thread count (1 = the single-core figure a benchmark reports)."""
    ort = import_onnxruntime()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if intra_op_threads is not None:
        so.intra_op_num_threads = int(intra_op_threads)
        so.inter_op_num_threads = 1
    return so


def with_weights(path: str | os.PathLike[str], weights: Mapping[str, np.ndarray],
                 complete: bool = False) -> tuple[bytes, str]:
    """A fedfs ONNX verifier with its parameters (FaceNet state-dict names) replaced by
    ``weights`` — e.g. a device's personalized backbone ``θ_c`` with the global head ``W`` —
    as model bytes whose ``fedfs.model_id`` is the id of these weights, and that id. The bytes
    are a complete verifier: save them, and an :class:`OnnxBackend` of the file verifies
    against enrollments made with these weights. ``complete``: every parameter of the graph must
    be in ``weights`` (none keeps the export's value)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    params = {i.name: i for i in model.graph.initializer if i.name.startswith(PARAM_PREFIXES)}
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise InputError(f"weights {unknown[:5]} are not parameters of {Path(path).name}")
    missing = sorted(set(params) - set(weights)) if complete else []
    if missing:
        raise InputError(f"the weights lack {missing[:5]} of {Path(path).name}")
    final: dict[str, np.ndarray] = {}
    for name, init in params.items():
        if name in weights:
            arr = np.ascontiguousarray(weights[name], dtype=np.float32)
            if arr.shape != tuple(init.dims):
                raise InputError(f"weight {name} has shape {list(arr.shape)}, the model expects {list(init.dims)}")
            if not np.isfinite(arr).all():
                raise InputError(f"weight {name} contains NaN or Inf")
            init.CopyFrom(numpy_helper.from_array(arr, name))
            final[name] = arr
        else:
            final[name] = numpy_helper.to_array(init)
    model_id = weights_id(final, {p.key: p.value for p in model.metadata_props}.get("fedfs.backbone"))
    for prop in model.metadata_props:
        if prop.key == "fedfs.model_id":
            prop.value = model_id
    return model.SerializeToString(), model_id


class OnnxBackend:
    """Run a fedfs ONNX verifier with ONNX Runtime (CPU by default).

    Args:
        path: ``.onnx`` file written by ``fedfs export`` (fp32 or int8).
        intra_op_threads: ORT intra-op thread count (None = ORT's default).
        providers: ORT execution providers (default ``["CPUExecutionProvider"]``).
        batch_size: largest batch sent to ORT at once.
        weights: optional parameters replacing the file's (FaceNet state-dict names, e.g. a
            device's personalized backbone ``θ_c`` plus the global head ``W``: FedFS
            verifies with ``q'``); ``model_id`` then identifies these weights.

    Attributes (the :class:`~fedfs_sdk.runtime.inference.InferenceBackend` protocol):
        input_size, model_id, outputs, alignment (``fedfs.face_alignment``: the face crop the
        model needs, e.g. ``"dlib-chip"``, or None); plus ``metadata`` (all ``fedfs.*`` props) and
        ``precision`` (``fp32`` / ``int8``).
    """

    def __init__(self, path: str | os.PathLike[str], *, weights: Mapping[str, np.ndarray] | None = None,
                 intra_op_threads: int | None = None, providers: list[str] | None = None,
                 batch_size: int = 64) -> None:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"ONNX model not found: {p}")
        ort = import_onnxruntime()
        source: str | bytes = str(p)
        override_id = None
        if weights:
            source, override_id = with_weights(p, weights)
        else:
            source = self._checked_bytes(p)
        try:
            self.session = ort.InferenceSession(source, sess_options=session_options(intra_op_threads),
                                                providers=providers or ["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own Fail/InvalidProtobuf types
            raise CheckpointError(f"ONNX Runtime cannot load {p}: {e}") from e
        meta = dict(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = meta
        if meta.get("fedfs.format") not in FORMATS:
            raise CheckpointError(f"{p} is not a fedfs ONNX verifier (fedfs.format={meta.get('fedfs.format')!r}); "
                                  "export one with `fedfs export --formats onnx`")
        try:
            self.input_size = int(meta["fedfs.input_size"])
            self.model_id = meta["fedfs.model_id"]
            self.outputs = tuple(meta["fedfs.outputs"].split(","))
            mean, std = float(meta["fedfs.input_mean"]), float(meta["fedfs.input_std"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{p} has incomplete fedfs metadata: {e}") from e
        if (meta.get("fedfs.input_layout"), meta.get("fedfs.input_dtype"), meta.get("fedfs.input_color"),
                mean, std) != ("NCHW", "float32", "RGB", 127.5, 127.5):
            # fedfs_sdk.runtime.preprocess produces exactly this; anything else would be silently wrong.
            raise CheckpointError(f"{p} declares input {meta.get('fedfs.input_layout')}/{meta.get('fedfs.input_dtype')}/"
                                  f"{meta.get('fedfs.input_color')} (x-{mean:g})/{std:g}, but fedfs preprocessing "
                                  "produces NCHW/float32/RGB (x-127.5)/127.5")
        self.precision = meta.get("fedfs.precision", "fp32")
        self.alignment: str | None = meta.get("fedfs.face_alignment") or None
        if override_id is not None:
            if self.precision != "fp32":
                raise InputError(f"weights can only replace those of an fp32 model, {p} is {self.precision}")
            self.model_id = override_id
        self.input_name = meta.get("fedfs.input_name", self.session.get_inputs()[0].name)
        graph_outputs = {o.name for o in self.session.get_outputs()}
        missing = [o for o in self.outputs if o not in graph_outputs]
        if missing:
            raise CheckpointError(f"{p} metadata lists outputs {missing} that the graph does not have")
        problems = metadata_vs_graph(meta, self.session)
        if problems:
            # the model id covers the weights, not the metadata: an edited key must not reach ORT
            raise CheckpointError(f"{p}: its fedfs metadata disagrees with its graph ({'; '.join(problems)}); "
                                  "edited or mislabelled model: export again")
        self.batch_size = int(batch_size)

    @staticmethod
    def _checked_bytes(p: Path) -> bytes:
        """The file's bytes, after checking that its recorded ``fedfs.model_id`` is the one its
        weights imply (a file whose weights were changed must not inherit enrollments)."""
        import onnx

        data = p.read_bytes()
        try:
            model = onnx.load_from_string(data)
        except Exception as e:  # DecodeError and friends
            raise CheckpointError(f"cannot load {p}: not a readable ONNX model ({e})") from e
        problem = model_id_problem(model)
        if problem is not None:
            raise CheckpointError(f"{p} {problem} (tampered or mislabelled model)")
        return data

    @property
    def embedding_dim(self) -> int:
        return int(self.metadata["fedfs.embedding_dim"])

    @property
    def code_length(self) -> int:
        return int(self.metadata.get("fedfs.code_length", "0"))

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """``batch`` float32 ``[N, 3, S, S]`` → ``{"embedding": [N, D]}`` (+ ``"uv": [N, c]``)."""
        check_batch(batch, self.input_size)
        chunks: dict[str, list[np.ndarray]] = {k: [] for k in self.outputs}
        for s in range(0, batch.shape[0], self.batch_size):
            res = self.session.run(list(self.outputs), {self.input_name: np.ascontiguousarray(batch[s:s + self.batch_size])})
            for name, arr in zip(self.outputs, res):
                chunks[name].append(arr)
        return {k: np.concatenate(v) for k, v in chunks.items()}

    def __repr__(self) -> str:
        return (f"OnnxBackend(model_id={self.model_id!r}, input_size={self.input_size}, "
                f"outputs={self.outputs}, precision={self.precision!r})")
