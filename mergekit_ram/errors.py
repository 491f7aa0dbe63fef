"""The plugin's own refusals, and how a command shows one: one line, no traceback.

Every check of ours that refuses an input (the config and its parameters, an input file, a
tensor: NaN, shape, dtype; the output folder) raises a `RamError`, a `ValueError` whose message
names the thing and the fix. mergekit's commands (`mergekit-yaml`, `mergekit-pytorch`,
`mergekit-multi`, `mergekit-legacy`) do not catch errors: an uncaught `RamError` reaches Python's
`sys.excepthook`, which the seam replaces (`_mergekit/hooks.py`, once mergekit is loaded) by
`excepthook`: one line on stderr, exit status 1. `MERGEKIT_RAM_TRACEBACK=1`, or `-v` (mergekit's
verbose logging, the root logger at INFO or below), shows the traceback as before. Only an uncaught
`RamError` itself, or a YAML error in a config (its line and column, `yaml_said`), is shortened, and only
when the hook that was there is Python's own: any other exception (one a program raised `from` a RamError
included) and, for a program that set its own hook (a crash reporter), every exception go to that hook
untouched. A script calling `run_merge` gets the same line when it does not catch the error; Python code
catches `RamError` (or `ValueError`).

Every error class of the package is defined here (`RamError` and its kinds; the few that are no
one-line refusal: `NotVerifiable`, `Unreadable` and its `InputUnavailable`, `UnsafeLocation`,
`IncompatibleMergekit`); the modules that raise them import them from here.

No torch, no mergekit: `inspect`'s command line and the reliability suite's harness use
`one_line` too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from mergekit_ram import environment

#: Set (to anything but "", "0") to see the traceback of a `RamError` in a command.
TRACEBACK_ENV = environment.TRACEBACK


class RamError(ValueError):
    """A refusal of mergekit-ram's own (config, parameter, input file, tensor, output folder): the message is
    one line that names the culprit and the fix."""


class WriteError(RamError, OSError):
    """A file of ours that could not be written (a full disk, no permission): an `OSError` too, naming the file."""


class InputError(RamError):
    """The input models cannot be counted or read (a file, a tensor: NaN, shape, dtype; what `verify` must
    read: an input, the folder's config), not the command or the config: `inspect` and `verify` exit 1 / 3."""


class NonFiniteInputError(RamError):
    """An input tensor holds NaN or Inf; merging it would spread NaN silently."""


class NonFiniteResultError(RamError):
    """A merge of finite inputs whose result is not finite in the dtype it is written in (lambda scaled an update
    past that dtype's largest value): stopped before the tensor is written. `tensor`: its name."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class RhoUnavailable(RamError, RuntimeError):
    """r > 0 without rho for an agent and no statistics pass to count it (mergekit's per-tensor API, or a
    mergekit whose insides changed): the message says what to give instead."""


# --------------------------------------------------------------------------- #
# Not one-line refusals of an input: the command that meets one decides
# --------------------------------------------------------------------------- #
class NotVerifiable(ValueError):
    """The folder is not one verify can check (no such folder, no ram_stats.json, another method's): a usage error."""


class Unreadable(ValueError):
    """A file verify needs cannot be read or is refused (damaged, special, a link out of the folder, too large or
    too deep), or an input cannot be checked: verify cannot check the folder (exit 3)."""


class InputUnavailable(Unreadable):
    """An unpinned Hub input whose commit at the merge's publication cannot be found (`verify.history`): the
    repository deleted or private (`reason` "missing"), gated ("gated"), renamed ("renamed", `renamed_to` the id
    the Hub now gives), its history before the merge squashed away ("squashed"), no weights up to then
    ("no-weights"), its branch gone ("no-revision"), or the Hub not answering or contradicting itself
    ("unreachable"). Cannot check (exit 3), never a difference: `input` is the id the config names."""

    def __init__(self, message: str, *, input: str, reason: str, renamed_to: str | None = None):
        super().__init__(message)
        self.input, self.reason, self.renamed_to = input, reason, renamed_to


class UnsafeLocation(RuntimeError):
    """The kernel's folder or file could be written by someone else: loading it could run their code."""


class IncompatibleMergekit(RuntimeError):
    """mergekit's private surface is not what this release was built for."""


#: what stops `verify` from checking a folder (its verdict "cannot check", exit 3), as against a usage error
#: (`NotVerifiable`): the one choice verify's driver and the command line both make
CANNOT_CHECK: tuple[type[BaseException], ...] = (Unreadable, InputError, OSError)


def said(error: BaseException) -> str:
    """`error`'s message on one line (its type's name when it has none): how every message of ours quotes one."""
    return _flat(str(error)) or type(error).__name__


def said_with_type(error: BaseException, limit: int = 200) -> str:
    """'Type: message' on one line, the message cut at `limit` characters (a library's error, quoted as a detail)."""
    message = _flat(str(error))[:limit]
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _flat(text: str) -> str:
    return " ".join(text.split())


def yaml_said(error: BaseException) -> str | None:
    """A YAML parser's error (PyYAML's, with a mark) on one line: where it stopped, line and column, and why;
    None for another error."""
    mark = getattr(error, "problem_mark", None)
    if mark is None or not type(error).__module__.startswith("yaml"):
        return None
    problem = _flat(str(getattr(error, "problem", "") or "")) or type(error).__name__
    return f"not valid YAML (line {mark.line + 1}, column {mark.column + 1}: {problem})"


def one_line(error: BaseException, prog: str | None = None) -> str | None:
    """The one line a command prints for `error`, or None when it would show a traceback (not a `RamError` nor a
    config's YAML error: an error raised from one is the raiser's, with its own type and message)."""
    yaml_error = yaml_said(error)
    if not isinstance(error, RamError) and yaml_error is None:
        return None
    message = said(error) if yaml_error is None else f"the config is {yaml_error}"
    prog = prog or os.path.basename(sys.argv[0] or "") or "mergekit"
    return f"{prog}: error: {message}"


def wants_traceback() -> bool:
    """`MERGEKIT_RAM_TRACEBACK` set, or logging at INFO or below (mergekit's `-v`)."""
    if environment.flag(TRACEBACK_ENV):
        return True
    return logging.getLogger().getEffectiveLevel() <= logging.INFO


Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def excepthook(previous: Hook) -> Hook:
    """A `sys.excepthook` that prints a `RamError` as one line (`one_line`) when `previous` is Python's own hook,
    and leaves everything else to `previous`: another exception, and every exception when a program set its
    own hook before (a crash reporter sees our errors too)."""

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> Any:
        line = None if previous is not sys.__excepthook__ or wants_traceback() else one_line(error)
        if line is None:
            return previous(kind, error, tb)
        print(line, file=sys.stderr, flush=True)
        return None

    return hook


# --------------------------------------------------------------------------- #
# What a command prints beside its answer
# --------------------------------------------------------------------------- #
#: transformers' line at every run, caused by mergekit (its configs name `torch_dtype`), with the plugin off too
DEPRECATED_DTYPE = "`torch_dtype` is deprecated! Use `dtype` instead!"
#: the transformers modules that say it (their loggers)
DEPRECATED_DTYPE_FROM = ("transformers.configuration_utils", "transformers.modeling_utils")
#: the prefix of the plugin's warnings in a command: `mergekit-ram: warning: ...`
SHOWN_AS = "mergekit-ram"


class _DropDeprecatedDtype(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != DEPRECATED_DTYPE


def quiet_deprecated_dtype() -> None:
    """Silence transformers' `torch_dtype` deprecation line, and only that line (idempotent)."""
    for name in DEPRECATED_DTYPE_FROM:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDeprecatedDtype) for f in logger.filters):
            logger.addFilter(_DropDeprecatedDtype())


class _Stderr(logging.StreamHandler):
    """The plugin's log records as `mergekit-ram: warning: ...` on the stderr of the moment."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Shown())

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _Shown(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().removeprefix(f"{SHOWN_AS}: ")
        return f"{SHOWN_AS}: {record.levelname.lower()}: {message}"


def show_warnings_as_lines() -> None:
    """In a command's process (`mergekit-yaml`, `mergekit-pytorch`, `mergekit-multi`, `mergekit-ram`), show the
    plugin's warnings as `mergekit-ram: warning: ...`, not Python logging's `WARNING:mergekit_ram:`. A program that
    imports mergekit (a test, a notebook) keeps its own logging. Idempotent."""
    if not os.path.basename(sys.argv[0] if sys.argv else "").startswith("mergekit"):
        return
    logger = logging.getLogger("mergekit_ram")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
        logger.propagate = False
