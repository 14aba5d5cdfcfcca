"""The prelude of every "torch-free device" subprocess in the tests.

Prepended to a ``python -c`` program: any attempt to import torch raises, so a device path that
reaches for torch fails loudly instead of silently working on a machine that has it.
"""
from __future__ import annotations

NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch must not be imported on the device path")
        return None
sys.meta_path.insert(0, _NoTorch())
"""
