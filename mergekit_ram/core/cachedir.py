"""Where mergekit-ram keeps files between runs: one cache root for the statistics cache and the compiled kernel.

`MERGEKIT_RAM_CACHE=/path` moves the root; an off value (`off`, `0`, `false`, `no`, `none`, or
empty, any case) turns the statistics cache off, and the compiled kernel then stays in the default
root: `$XDG_CACHE_HOME/mergekit-ram`, or `~/.cache/mergekit-ram` without XDG_CACHE_HOME.

`read_only()`: while inside (in this thread or task), nothing is written under the root: the statistics
cache is neither read (it is a hint for merges, never evidence) nor stored into, and the compiled kernel is
loaded if it is already built, never built (`mergekit-ram verify`, which writes nothing).

A leaf: imports nothing of the package, so `cache` and `native` both ask it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

OFF = frozenset({"off", "0", "false", "no", "none", ""})
#: inside `read_only()`: what its users looked up once for the scope (the kernel found built, or not)
_read_only: ContextVar[dict | None] = ContextVar("mergekit_ram_cache_read_only", default=None)


@contextlib.contextmanager
def read_only() -> Iterator[None]:
    """While inside, `writable()` is False: nothing is written under the cache root."""
    token = _read_only.set({})
    try:
        yield
    finally:
        _read_only.reset(token)


def writable() -> bool:
    """Whether files may be written under the cache root now (not inside `read_only()`)."""
    return _read_only.get() is None


def looked_up() -> dict:
    """Inside `read_only()`: a dict for what is looked up once per scope; outside: a fresh one (nothing kept)."""
    return _read_only.get() or {}


def default() -> Path:
    """The root when MERGEKIT_RAM_CACHE names no folder."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mergekit-ram"


def statistics() -> Path | None:
    """The statistics cache folder, or None when caching is off."""
    value = os.environ.get("MERGEKIT_RAM_CACHE")
    if value is None:
        return default()
    return None if value.strip().lower() in OFF else Path(value).expanduser()


def native() -> Path:
    """The compiled kernel's folder: `native` in the statistics cache folder, or in the default
    root when the statistics cache is off (the kernel still needs a home)."""
    folder = statistics()
    return (default() if folder is None else folder) / "native"
