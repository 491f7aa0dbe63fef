"""The ``mergekit-ram`` command line: `main` (the console script's entry point) and the group of its commands.

On click, like mergekit's own commands. The group lives here, each command in a module of its own:

- `example`: ``mergekit-ram example``, a tiny RL-like workload and its configs;
- `inspect`: ``mergekit-ram inspect``, the statistics pass of a config without merging;
- `verify`: ``mergekit-ram verify``, a finished merge recomputed and compared bit for bit;
- `common`: what they share: `PROG`, the exit codes (`EXIT_*`), the usage error and verify's verdict exit;
- `grouped_help`: a click command whose --help lists its options under headings (verify's);
- `__main__`: ``python -m mergekit_ram.cli``.

``inspect`` and ``verify`` take mergekit's merge options, declared without importing mergekit
(`_mergekit.options`, checked against mergekit's own), less those of writing a model. A command is built only
when it runs, and torch and mergekit are imported only once it starts working, so help, ``--version`` and usage
errors answer at once (tests/test_cli.py checks that they import neither). Like `mergekit_ram/__init__.py`, this
folder's `__init__` is an entry point: it imports its commands, where other folders' import nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import click

from mergekit_ram import errors
from mergekit_ram.cli import example, inspect, verify
from mergekit_ram.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    UsageError,
    VerdictExit,
)
from mergekit_ram.reporting import versions

#: name -> (one-line help, a function that builds the command): built only when run.
COMMANDS: dict[str, tuple[str, Callable[[], click.Command]]] = {
    "example": ("write a tiny RL-like base model, three agents and ready RAM/RAM+ configs", example.command),
    "inspect": ("count (or reuse cached) RAM+ statistics of a config without merging", inspect.command),
    "verify": ("recompute a ramplus merge from its folder or the Hub and compare it bit for bit", verify.command),
}


class _Commands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        return entry[1]() if entry else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (text, _) in COMMANDS.items()])


def _version(ctx: click.Context, _param: click.Parameter, wanted: bool) -> None:
    """The version, then the fused CPU kernel's state (`native.status`: nothing is built, torch is not imported)."""
    if not wanted or ctx.resilient_parsing:
        return
    from mergekit_ram.core import native

    click.echo(f"{PROG} {versions.installed('mergekit-ram')}\nfused CPU kernel: {native.status()}")
    ctx.exit()


@click.group(PROG, cls=_Commands, help="Helpers for RAM / RAM+ merging with mergekit (merge_method: ramplus).")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_version,
    help="Show the version, and whether the fused CPU kernel is in use, and exit.",
)
def _group() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mergekit-ram``; returns the exit code (`common.EXIT_*`): 0 ok, 1 an input model that cannot be read or
    counted (a damaged file, a NaN, a shape or dtype mismatch) or a folder ``verify`` finds not identical, 2 a usage
    error (an option, the config, a missing file named on the command line), 3 ``verify`` cannot check, 130
    interrupted."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        click.echo(_group.get_help(click.Context(_group, info_name=PROG)), err=True)
        return EXIT_USAGE
    command = args[0]
    errors.show_warnings_as_lines()
    errors.quiet_deprecated_dtype()
    try:
        _group.main(args, prog_name=PROG, standalone_mode=False)
        return EXIT_OK
    except click.exceptions.Exit as done:  # --help, --version
        return int(done.exit_code or EXIT_OK)
    except click.ClickException as error:  # usage errors
        error.show()
        return EXIT_USAGE
    except VerdictExit as verdict:
        return verdict.code
    except click.exceptions.Abort:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UsageError, OSError, ValueError) as error:
        if errors.wants_traceback():  # -v or MERGEKIT_RAM_TRACEBACK=1
            import traceback

            traceback.print_exc()
        message = errors.said(error)
        print(f"{PROG} {command}: error: {message}", file=sys.stderr)
        # an input model that cannot be read or counted, else a usage error
        return EXIT_BAD_INPUT if isinstance(error, errors.InputError) else EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
