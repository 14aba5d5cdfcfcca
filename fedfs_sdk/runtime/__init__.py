"""The verification runtime — what ``pip install fedfs`` alone runs (no torch).

Preprocessing and five-point alignment, FedUV codewords, enrollment with the warm-up
threshold and verification, and the inference backends (ONNX Runtime; torch where
installed).
"""
