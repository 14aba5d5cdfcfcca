"""Export a fedfs checkpoint for phones (``fedfs export``, ``docs/export.md``).

Modules, one job each:

* :mod:`export.onnx_inference` — the verifier as ONNX (embedding + FedUV head), metadata;
* :mod:`export.training_graphs` — the local losses as exportable torch modules;
* :mod:`export.ort_training` — ONNX Runtime on-device training artifacts per method;
* :mod:`export.coreml` — Core ML ``.mlpackage`` (fp16/fp32) and its spec check;
* :mod:`export.quantize` — int8 ONNX and its AUROC check;
* :mod:`export.manifest` — ``manifest.json``;
* :mod:`export.pipeline` — all of it into one folder, atomically; :mod:`export.cli` — the command.

The device-side counterparts live in ``fedfs_sdk`` (``onnx_backend``, ``ort_device``) and
never import torch.
"""
