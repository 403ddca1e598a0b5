"""The `mtplxd` command line.

Each subcommand is two small functions, one adding its arguments and one
running it (returning the exit code), registered in COMMANDS. To add one:

    def _doctor_args(p: argparse.ArgumentParser) -> None: ...
    def _doctor(args: argparse.Namespace) -> int: ...
    COMMANDS["doctor"] = Command("check the installation", _doctor_args, _doctor)

Import what a subcommand needs inside its run function, so that `mtplxd
--help` and quick commands stay fast.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint folder (Hugging Face layout)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _inspect(args: argparse.Namespace) -> int:
    from mtplxd import inspect_cmd

    return inspect_cmd.run(args.path, args.json)


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _doctor(args: argparse.Namespace) -> int:
    from mtplxd import doctor

    return doctor.run(args.json)


COMMANDS: dict[str, Command] = {
    "inspect": Command(
        "classify a checkpoint: family, MTP heads, depth range, status "
        "(exit 0 supported, 3 ar-only, 4 unsupported, 2 unreadable)",
        _inspect_args,
        _inspect,
    ),
    "doctor": Command(
        "check the installation: MLX device, which BLAS serves it, measured matmul GFLOP/s",
        _doctor_args,
        _doctor,
    ),
    # "start", "stop", "status", "lsp", "mcp", "bench", "train": added here.
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplxd", description="Local MLX inference daemon with multi-token-prediction decoding."
    )
    parser.add_argument("--version", action="version", version=f"mtplxd {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return COMMANDS[args.command].run(args)
