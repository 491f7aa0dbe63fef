"""What the `mergekit-ram` commands share: the program's name, its exit codes and the two exceptions a command
ends with. Plain Python: help, ``--version`` and usage errors import it before anything heavy.

The exit codes live here, once; `verify`'s three (0, 1, 3) are `verify.verdict.EXIT`'s, named here without
importing `verdict` (which imports torch), and tests/test_cli.py checks that the two agree. They are not
`errors.CANNOT_CHECK`, which is the tuple of exception types that make `verify` exit `EXIT_CANNOT_CHECK`.
"""

from __future__ import annotations

PROG = "mergekit-ram"

#: done: the command did what it was asked; `verify`: bit-identical
EXIT_OK = 0
#: an input model that cannot be read or counted (a damaged file, a NaN, a shape or dtype mismatch:
#: `errors.InputError`)
EXIT_BAD_INPUT = 1
#: `verify`: the folder is not what its record says it is (each difference named)
EXIT_NOT_IDENTICAL = 1
#: a usage error: an option, the config, a missing file named on the command line
EXIT_USAGE = 2
#: `verify` cannot check: an input missing or changed, a file or option refused, the Hub unreachable or contradicting;
#: also differences no larger than the method's bits move between machines (`verdict.LAST_BITS`, `verdict.MACHINE`)
EXIT_CANNOT_CHECK = 3
#: interrupted (Ctrl-C), as a shell reports SIGINT
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """An error worth one line on stderr (`PROG COMMAND: error: ...`) and `EXIT_USAGE`, not a traceback. Ours, not
    click's `click.UsageError` (which prints the usage above its message)."""


class VerdictExit(Exception):
    """`verify` has said its verdict (not identical, or cannot check) and exits with `code`
    (`EXIT_NOT_IDENTICAL` or `EXIT_CANNOT_CHECK`)."""

    def __init__(self, code: int = EXIT_NOT_IDENTICAL):
        super().__init__(code)
        self.code = code
