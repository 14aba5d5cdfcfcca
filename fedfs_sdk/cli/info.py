"""``fedfs info``: backbones with parameter counts and MFLOPs."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backbone", action="append", help="only these backbones (repeatable)")
    p.add_argument("--code-length", type=int, default=None, help="add a FedUV head of this code length")


def run(args: argparse.Namespace) -> int:
    from ..nn.backbones import BACKBONES
    from ..nn.model import ModelConfig
    from ..nn.profile import profile_model

    names = args.backbone or list(BACKBONES)
    w = max(len("backbone"), *(len(n) for n in names)) + 2
    print(f"{'backbone':<{w}}{'input':>8}{'emb':>6}{'params':>12}{'MFLOPs':>10}{'MMACs':>9}")
    for name in names:
        prof = profile_model(ModelConfig(name, code_length=args.code_length))
        print(f"{name:<{w}}{prof.input_size:>5}x{prof.input_size:<3}{prof.embedding_dim:>5}"
              f"{prof.params:>12,}{prof.mflops:>10.1f}{prof.mflops / 2:>9.1f}")
    print("MFLOPs = 2 × multiply-adds of convolutions and matmuls (torch FlopCounterMode), one image.")
    return 0
