"""Paths as people write them: relative (read from the folder a command runs in, not the config's), named like hub
ids (`agents/code`), with `~`. What every door's input check and `verify` say of a path that is not there, in one
place: where it was looked for, the same path read from the config's folder where that exists, and the nearest
existing path of the same kind (a folder for a folder, a file for a file).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence

#: what a line about a relative path adds: where it was read from
READ_HERE = "paths are read from the folder you run in"
#: the suffixes of a config file named on a command line
CONFIG_SUFFIXES = (".yml", ".yaml")


def is_relative(path: str) -> bool:
    """Whether `path` is read from the working folder (not absolute, not `~`)."""
    return not os.path.isabs(path) and not path.startswith("~")


def hub_id_form(path: str) -> bool:
    """Whether `path` could be a hub id (`name`, `org/name`) by the Hub's own rule; `./x`, `../x`, `a/b/c`, `~/x`
    and absolute paths cannot, and are never passed to the Hub."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except ValueError:
        return False
    return True


def config_folder(argv: Sequence[str] | None = None) -> str | None:
    """The folder of the config file named on the command line (`mergekit-yaml CONFIG OUT`, `mergekit-multi CONFIG`,
    `mergekit-ram inspect CONFIG`): the first argument that names a YAML file. None when there is none."""
    for arg in (sys.argv if argv is None else argv)[1:]:
        if arg.lower().endswith(CONFIG_SUFFIXES) and os.path.isfile(arg):
            return os.path.dirname(os.path.abspath(arg))
    return None


def where(path: str, kind: str = "folder", config_dir: str | None = None) -> str:
    """What a line about a missing `path` (a `kind`: "folder" or "file") says after it: where it was looked for
    (`looked`), then the nearest existing `kind` (`nearest`)."""
    return looked(path, kind, config_dir) + nearest(path, kind)


def looked(path: str, kind: str = "folder", config_dir: str | None = None) -> str:
    """For a relative `path`, ' in WORKING_FOLDER', and the same path read from the config's folder where it is a
    `kind` there; '' for another path."""
    if not is_relative(path):
        return ""
    said = f" in {os.getcwd()}"
    there = os.path.join(config_dir, path) if config_dir else None
    if there and os.path.abspath(config_dir or "") != os.getcwd() and _is(there, kind):
        said += f" ({READ_HERE}; from the config's folder it is {os.path.normpath(there)})"
    return said


def nearest(path: str, kind: str = "folder") -> str:
    """'; did you mean X?' for the existing path nearest to `path`, each missing part matched among the entries of
    the folder above it (difflib: folders for the parts above the last, a `kind` for the last); else '; the nearest
    existing folder is X'; '' when there is none."""
    home = os.path.expanduser(path)
    if home != path and _is(home, kind):
        return f"; did you mean {home}? (mergekit does not expand ~)"
    found = os.sep if os.path.isabs(path) else ""
    parts = [part for part in os.path.normpath(path).split(os.sep) if part]
    for i, part in enumerate(parts):
        step = os.path.join(found, part)
        last = i == len(parts) - 1
        if not (_is(step, kind) if last else os.path.isdir(step)):
            close = difflib.get_close_matches(part, _entries(found, kind if last else "folder"), n=1, cutoff=0.6)
            if not close:
                return f"; the nearest existing folder is {found}" if found not in ("", os.sep) else ""
            step = os.path.join(found, close[0])
        found = step
    return f"; did you mean {found}?"


def _entries(folder: str, kind: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder or os.curdir))
    except OSError:
        return []
    return [name for name in names if _is(os.path.join(folder, name), kind)]


def _is(path: str, kind: str) -> bool:
    return os.path.isdir(path) if kind == "folder" else os.path.isfile(path) if kind == "file" else os.path.exists(path)


def missing_input(path: str, kind: str, otherwise: str) -> str:
    """verify's line for a recorded input `path` (a `kind`) that is not here: for a relative one, the folder it was
    looked for in and how to point at a copy; `otherwise` for another path."""
    if not is_relative(path):
        return otherwise
    return (
        f"no such {kind} in {os.getcwd()} (a recorded relative input is read from the folder you run in: run verify "
        "where the merge ran, or give its copies with --input-dir DIR, each named by its label)"
    )


def neither(target: str, hub_said: str) -> str:
    """`verify TARGET`'s line for an `org/name` that is no folder here and that the Hub did not give (`hub_said`)."""
    return f"{hub_said}; nor is {target} a folder{where(target)}"
