"""Where mergekit-ram keeps files between runs: one cache root for the statistics cache and the compiled kernel.

`MERGEKIT_RAM_CACHE=/path` moves the root; an off value (`off`, `0`, `false`, `no`, `none`, or
empty, any case) turns the statistics cache off, and the compiled kernel then stays in the default
root: `$XDG_CACHE_HOME/mergekit-ram`, or `~/.cache/mergekit-ram` without XDG_CACHE_HOME.

A leaf: imports nothing of the package, so `cache` and `native` both ask it.
"""

from __future__ import annotations

import os
from pathlib import Path

OFF = frozenset({"off", "0", "false", "no", "none", ""})


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
