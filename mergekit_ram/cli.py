"""The ``mergekit-ram`` command line.

Each subcommand lives in a ``_add_<name>(subparsers)`` function that
registers its parser and sets ``func``; heavy imports (torch, transformers)
happen inside the handlers so ``mergekit-ram --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

PROG = "mergekit-ram"


class _UsageError(Exception):
    """An error worth one line on stderr and exit code 2, not a traceback."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mergekit-ram")
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------- #
# example
# --------------------------------------------------------------------------- #
def _add_example(subparsers) -> None:
    p = subparsers.add_parser(
        "example",
        help="write a tiny RL-like base model, three agents and ready RAM/RAM+ configs",
        description=(
            "Write a tiny bf16 Qwen2 base model, three sparse RL-like agents "
            "(code 3%, tool 46%, memory 54% of weights changed) and the configs "
            "ramplus.yaml and ram.yaml (absolute paths) into OUT_DIR."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to write (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty")
    p.set_defaults(func=_cmd_example)


def _cmd_example(args: argparse.Namespace) -> int:
    out_dir = args.out_dir.expanduser().resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        raise _UsageError(f"{out_dir} is not empty; pick an empty folder or pass --force")

    from mergekit_ram.synthetic import EXAMPLE_DENSITIES, write_example

    ramplus = write_example(out_dir, overwrite=args.force)
    out = ramplus.parent
    print(f"Wrote an RL-like example workload to {out}:")
    print(f"  base model      {out / 'base'}")
    for name, density in EXAMPLE_DENSITIES.items():
        print(f"  agent {name:<9} {out / 'agents' / name}  ({density:.0%} of weights changed)")
    print(f"  RAM+ config     {ramplus}")
    print(f"  RAM config      {out / 'ram.yaml'}")
    print()
    print("Next, merge with:")
    print(f"  mergekit-yaml {ramplus} {out / 'merged'}")
    return 0


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #
#: Functions that register one subcommand each; extend this list to add more.
SUBCOMMANDS: list[Callable] = [_add_example]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Helpers for RAM / RAM+ merging with mergekit (merge_method: ramplus).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mergekit-ram``; returns the exit code (0 ok, 2 usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, argparse errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (_UsageError, OSError, ValueError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
