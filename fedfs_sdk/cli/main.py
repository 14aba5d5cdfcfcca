"""``fedfs`` entry point.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``; only
the chosen one is imported, so ``fedfs verify`` with an ONNX model never imports torch and
``fedfs --help`` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Torch's CPU threads (libgomp) busy-wait between parallel regions by default: on a loaded 2-core
# machine two threads then burned 3.5–4× the CPU time of one and ran 2–3× slower; with waiting
# threads that sleep they cost what one thread costs and run as fast as the free cores allow
# (issue 31, dlib-resnet forward, 32 chips). Read by libgomp when torch loads, so it is set before
# any command imports torch; a value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ..errors import FedFSError
from ..extras import MissingExtraError, missing_extra

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("device_sim.cli_demo", "generate data, pre-train ξ, run FedFS/FedUV/FedFS+FedUV side by side, enroll and verify (CPU)"),
    "simulate": ("device_sim.cli_simulate", "simulate a federation of single-identity clients"),
    "pretrain": ("device_sim.cli_pretrain", "pre-train the frozen model ξ on public identities (margin loss)"),
    "bench": ("device_sim.cli_bench", "measure simulator throughput (sequential vs batched executors)"),
    "serve": ("server_agg.cli", "run the aggregation server (FedAvg rounds over HTTP)"),
    "device": ("fedfs_sdk.cli.device", "run one device against an aggregation server"),
    "export": ("export.cli", "export a checkpoint for phones (ONNX, ORT training, Core ML, int8)"),
    "info": ("fedfs_sdk.cli.info", "list backbones with parameter counts and MFLOPs"),
    "import-model": ("fedfs_sdk.cli.import_model", "import a pre-trained face recognizer (ONNX or torch state dict) "
                                                   "as a fedfs checkpoint (ξ / pre-trained model)"),
    "enroll": ("fedfs_sdk.cli.enroll", "enroll the device owner from a folder of images"),
    "ca": ("fedfs_sdk.cli.ca", "operator CA for device identities (secure aggregation against an active server): "
                               "init, request (on the device), sign, revoke, tls-cert"),
    "impostors": ("fedfs_sdk.cli.impostors", "build the public impostor set that ships with a model (photos of "
                                             "public identities; for enroll --far and the do-no-harm check)"),
    "verify": ("fedfs_sdk.cli.verify", "verify an image (or each image of a folder) against an enrollment "
                                       "(exit 0 accept, 1 reject, 2 error)"),
}


COMMAND_EXTRA: dict[str, str] = {"demo": "sim", "simulate": "sim", "pretrain": "sim", "bench": "sim",
                                 "serve": "server", "device": "train", "export": "export", "info": "train",
                                 "import-model": "train"}
"""The extra each command needs (``enroll``/``verify`` with an ONNX model need only the core)."""

SIMULATOR_COMMANDS = frozenset({"demo", "simulate", "pretrain", "bench"})
"""Commands that keep freed memory mapped (:mod:`fedfs_sdk.malloc_policy`); a device's do not."""

SHOW_DEFAULTS = frozenset({"demo", "simulate", "pretrain", "bench", "serve", "export"})
"""Commands whose ``--help`` appends each option's default (see :class:`DefaultsHelpFormatter`)."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: …)`` to an option's help unless its text already speaks of a
    default, or the default is empty (None, False): so ``--help`` shows every real default
    without repeating the ones a help text explains itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return action.help
        default = action.default
        shown = " ".join(map(str, default)).replace("%", "%%") if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _import_command(name: str):
    """The module of command ``name``; a missing optional dependency becomes one line that names
    the extra to install (:mod:`fedfs_sdk.extras`) instead of a traceback."""
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        err = missing_extra(e, f"fedfs {name}", COMMAND_EXTRA.get(name))
        if err is None:
            raise
        raise err from None


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedfs", description="Federated personalized face verification (FedFS + FedUV).",
                                     epilog="exit status: 0 success (verify: accepted), 1 rejected (verify), "
                                            "2 error — bad input, missing or unreadable file; one line on stderr "
                                            "names it — 130 interrupted")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        fmt = DefaultsHelpFormatter if name in SHOW_DEFAULTS else argparse.HelpFormatter
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=fmt)
        if name == command:
            _import_command(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command if command in COMMANDS else None)
    except MissingExtraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = _import_command(args.command)
    if args.command in SIMULATOR_COMMANDS:
        from ..malloc_policy import keep_freed_memory

        keep_freed_memory()     # the kernel's page faults were a third of a real-folder run's CPU time
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as e:      # a lazily imported optional dependency
        err = missing_extra(e, f"fedfs {args.command}", COMMAND_EXTRA.get(args.command))
        if err is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FedFSError as e:
        print(f"fedfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:          # a file system or network refusal: say what, not a traceback
        print(f"fedfs {args.command}: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def os_error_message(e: OSError) -> str:
    """``<path>: <reason>`` for an :class:`OSError` (``[Errno …]`` noise dropped)."""
    if e.strerror is None:
        return str(e) or type(e).__name__
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    return f"{' → '.join(map(str, paths))}: {e.strerror}" if paths else e.strerror


if __name__ == "__main__":
    sys.exit(main())
