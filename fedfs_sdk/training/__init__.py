"""The local step of each method: settings (torch-free), objective and losses, the torch
trainer (``fedfs[train]``) and the ONNX Runtime on-device trainer (``fedfs[ort-training]``,
no torch).
"""
