"""``fedfs`` entry point.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``; only
the chosen one is imported, so ``fedfs verify`` with an ONNX model never imports torch and
``fedfs --help`` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import FedFSError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("device_sim.cli_demo", "generate data, pre-train ξ, run FedFS/FedUV/FedFS+FedUV side by side, enroll and verify (CPU)"),
    "simulate": ("device_sim.cli_simulate", "simulate a federation of single-identity clients"),
    "pretrain": ("device_sim.cli_pretrain", "pre-train the frozen model ξ on public identities (margin loss)"),
    "bench": ("device_sim.cli_bench", "measure simulator throughput (sequential vs batched executors)"),
    "serve": ("server_agg.cli", "run the aggregation server (FedAvg rounds over HTTP)"),
    "device": ("fedfs_sdk.cli.device", "run one device against an aggregation server"),
    "export": ("export.cli", "export a checkpoint for phones (ONNX, ORT training, Core ML, int8)"),
    "info": ("fedfs_sdk.cli.info", "list backbones with parameter counts and MFLOPs"),
    "enroll": ("fedfs_sdk.cli.enroll", "enroll the device owner from a folder of images"),
    "verify": ("fedfs_sdk.cli.verify", "verify one image against an enrollment (exit 0 accept, 1 reject)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedfs", description="Federated personalized face verification (FedFS + FedUV).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except FedFSError as e:
        print(f"fedfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
