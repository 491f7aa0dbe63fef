"""The files of a folder `mergekit-ram verify` is given, read as a stranger's: on plain data, knowing nothing
of mergekit.

A published folder is untrusted. One rule for every file a loader reads, wherever it lies (the folder's own
entries, the weight files an index names at any depth): it is opened only when it is a regular file inside
the folder (a link may point into the folder, or into a hub cache's blobs beside a snapshot: `homes`); a
FIFO, a device, a socket, a link leading elsewhere, dangling or looping is refused by name without being
opened (`checked_path`, `check_entries`), and no byte of a refused or unreadable file is echoed. Our own
reads open with O_NONBLOCK and check the opened file again. JSON and YAML are read with a bounded size and
nesting. Which files each loader reads is `loader_files`'; `published_checks` compares what they hold with what
the merge makes.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from mergekit_ram.errors import Unreadable, yaml_said

#: what verify reads of a metadata file at most (ram_stats.json of a large model is a few MB)
JSON_LIMIT = 256 << 20
TEXT_LIMIT = 16 << 20
#: nesting verify reads in JSON or YAML (what mergekit-ram writes is 6 deep)
DEPTH = 64


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return "not a regular file"


def homes(folder: str) -> list[str]:
    """Where a file read from `folder` may lie, links resolved: the folder; for a Hugging Face hub cache's
    snapshot (`.../models--org--name/snapshots/<revision>`, whose files are links to `../../blobs/<hash>`), also
    its repository's `blobs`."""
    real = os.path.realpath(folder)
    found = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        found.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return found


def checked_path(folder: str, name: str) -> str:
    """`folder/name` (`name` relative, at any depth) if it is a regular file inside the folder, links resolved
    into it (or a hub cache's blobs: `homes`); Unreadable naming it otherwise, without opening it: absent, a
    FIFO, a device, a socket, a folder, a name or link leading out of the folder, a dangling link, a loop."""
    path = os.path.join(folder, name)
    if leaves(name):
        raise Unreadable(f"{path} lies outside {folder}: not read")
    target = os.path.realpath(path)
    if not any(os.path.commonpath([home, target]) == home for home in homes(folder)):
        raise Unreadable(f"{path} is a link out of {folder}: not read")
    try:
        st = os.stat(path)
    except OSError as error:
        link = os.path.islink(path) or target != os.path.abspath(path)
        why = {errno.ENOENT: "a link to nothing" if link else "absent", errno.ELOOP: "a loop of links"}
        said = why.get(error.errno or 0, error.strerror or "unreadable")
        raise Unreadable(f"{path} is {said}: not read") from error
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(f"{path} is {_kind(st.st_mode)}: not read")
    return path


def leaves(name: str) -> bool:
    """Whether the relative name `name` leads out of its folder by itself (absolute, or up through `..`)."""
    return os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir


def check_entries(folder: str) -> None:
    """Every entry directly in `folder` (subfolders aside) is one `checked_path` accepts: before anything opens one
    (the weight files an index names, at any depth: `loader_files.check_files`)."""
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if os.path.isdir(full) and not os.path.islink(full):
            continue
        if name.startswith(".") and name.endswith(".tmp"):
            continue  # a write in flight (ours, or mergekit's)
        checked_path(folder, name)


def read_bytes(folder: str, name: str, limit: int = TEXT_LIMIT) -> bytes:
    """The bytes of `folder/name` (`checked_path`), at most `limit`: Unreadable naming the file beyond that."""
    path = checked_path(folder, name)
    try:  # O_NONBLOCK: a FIFO put there since the check is not waited for, and refused
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # changed since it was checked
                raise Unreadable(f"{path} is not a regular file: not read")
            data = f.read(limit + 1)
    except OSError as error:
        raise Unreadable(f"{path} cannot be read ({error.strerror or type(error).__name__})") from error
    if len(data) > limit:
        raise Unreadable(f"{path} is larger than {limit >> 20} MiB: not read")
    return data


def read_json(folder: str, name: str, limit: int = JSON_LIMIT) -> Any:
    """`folder/name` parsed as JSON, bounded in size and nesting; Unreadable naming the file (never its bytes)."""
    path = os.path.join(folder, name)
    data = read_bytes(folder, name, limit)
    _check_depth(path, data, b"[{", b"]}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        where = f" (line {error.lineno}, column {error.colno})" if isinstance(error, json.JSONDecodeError) else ""
        raise Unreadable(f"{path} is not valid JSON{where}: is the folder damaged?") from error


def read_yaml(folder: str, name: str, limit: int = TEXT_LIMIT) -> Any:
    """`folder/name` parsed as YAML (safe_load), bounded in size and nesting; Unreadable naming the file and
    where YAML stopped (never its bytes)."""
    import yaml

    path = os.path.join(folder, name)
    data = read_bytes(folder, name, limit)
    _check_depth(path, data, b"[{", b"]}")
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as error:
        raise Unreadable(f"{path} is not YAML verify can read ({type(error).__name__})") from error
    except yaml.YAMLError as error:
        raise Unreadable(f"{path} is {yaml_said(error) or 'not valid YAML'}") from error


def _check_depth(path: str, data: bytes, opening: bytes, closing: bytes) -> None:
    """Unreadable when brackets nest deeper than DEPTH (counted on the bytes: strings may hold brackets too, which
    only ever over-counts a file no mergekit-ram writes)."""
    depth = deepest = 0
    table = dict.fromkeys(opening, 1) | dict.fromkeys(closing, -1)
    for byte in data.translate(None, bytes(set(range(256)) - set(opening) - set(closing))):
        depth += table[byte]
        deepest = max(deepest, depth)
        if deepest > DEPTH:
            raise Unreadable(f"{path} nests deeper than {DEPTH} levels: not read")


def files_under(folder: str, limit: int = 10_000) -> list[str]:
    """Every file under `folder` (relative paths; links not followed into folders), at most `limit`."""
    found: list[str] = []
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(top, folder)
        found += [name if rel == "." else os.path.join(rel, name) for name in sorted(names)]
        found += [os.path.join(rel, d) if rel != "." else d for d in dirs if os.path.islink(os.path.join(top, d))]
        if len(found) >= limit:
            return found[:limit]
    return found


def listed(names: list[str], limit: int) -> str:
    """The first `limit` of `names`, and how many more: how a verdict names files."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
