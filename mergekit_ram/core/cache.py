"""On-disk cache of the pre-pass counts, so re-running a merge reads no tensor twice.

An entry holds per-tensor, per-agent counts. Its key covers everything that
changes them: each input's identity (its files, and every file its index names in
a sub-folder: names, sizes, mtimes, ctimes,
inodes, safetensors headers and sixteen 64 KiB samples of each weight file; a
hub snapshot's folder names its revision; a `mergekit-pytorch` input is one file,
identified alone: `file_identity`),
the planned tensors with their inputs, dtype, vocabulary alignment and
per-tensor epsilon, and the format version. Writes are atomic (temp file +
rename), so concurrent merges never see half an entry.

The cache is a hint for merges, never evidence: an entry is authenticated by an HMAC-SHA256 keyed with a
random secret kept in the cache folder (`SECRET`, created 0600 once, atomically, by the first merge), so an
entry edited by hand, even with its checksum recomputed, or written by another user, is ignored with a warning
naming it and recounted. A cache folder that is not the user's or that others may write, or a secret that is
not the user's or that others may read, is not used at all (one warning). Every file is opened without
blocking and without following a link, and read only once it is seen to be a regular file: a FIFO or a device
at an entry's name is a warning, never a hang. `verify` reads no entry (`cachedir.read_only`): it counts again.

`MERGEKIT_RAM_CACHE=/path` moves it; `MERGEKIT_RAM_CACHE=off` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mergekit_ram import files
from mergekit_ram.core import cachedir

LOG = logging.getLogger("mergekit_ram")

FORMAT = 4  # 4: authenticated (`mac`); 3: a checksum anyone could recompute (entries of format 3 have another key)
#: the cache folder's secret: the HMAC key of its entries
SECRET = "secret.key"
_SECRET_BYTES = 32


def directory() -> Path | None:
    """The cache folder, or None when caching is off (`cachedir` reads the environment)."""
    return cachedir.statistics()


def folder_identity(path: str) -> dict:
    """What identifies a model folder's content without reading its tensors."""
    path = os.path.realpath(path)
    entries = {}
    for name in sorted(set(os.listdir(path)) | indexed_files(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        entries[name] = _file_entry(full, sampled=name.endswith(".safetensors"))
    identity = {"path": path, "files": entries}
    parent = os.path.basename(os.path.dirname(path))
    if parent == "snapshots":  # a Hugging Face hub snapshot: the folder name is the revision
        identity["revision"] = os.path.basename(path)
    return identity


def file_identity(path: str) -> dict:
    """What identifies one weight file (a `mergekit-pytorch` input) without reading its tensors: of the
    shape of `folder_identity`, whose `files` holds this file alone. A file of another format than
    safetensors (a PyTorch pickle) has no header to hash: its samples tell it apart.
    """
    path = os.path.realpath(path)
    return {"path": path, "files": {os.path.basename(path): _file_entry(path, sampled=True)}}


def _file_entry(path: str, *, sampled: bool) -> dict[str, int | str]:
    """One file's entry in an identity: size, times and inode (`os.stat` follows hub symlinks to their blobs); a
    safetensors file's header hash; sixteen samples of its bytes when `sampled`."""
    st = os.stat(path)
    entry: dict[str, int | str] = {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }
    if path.endswith(".safetensors"):
        entry["header_sha256"] = _safetensors_header_hash(path)
    if sampled:
        entry["sample_sha256"] = _sample_hash(path, st.st_size)
    return entry


def indexed_files(path: str) -> set[str]:
    """Weight files the folder's indexes name (relative paths), sub-folders included: a merge reads them."""
    found: set[str] = set()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            found.update(files.indexed_weight_files(os.path.join(path, index)))
        except FileNotFoundError:
            continue
    return found


def key(parts: Any) -> str:
    """A stable digest of JSON-serialisable key material."""
    blob = json.dumps({"format": FORMAT, "parts": parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def load(digest: str) -> dict | None:
    """The cached entry for `digest`, or None (missing, corrupt, edited, foreign, or read only: `verify`)."""
    folder = directory()
    if folder is None or not cachedir.writable():  # off, or verify: it counts again, never takes an entry's word
        return None
    if not folder.is_dir():
        return None
    key_ = secret(folder)  # an unusable secret: the cache is not used, said once
    if key_ is None:
        return None
    path = folder / f"{digest}.json"
    try:
        text = read_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as error:  # a special file, a link, another user's
        LOG.warning("mergekit-ram: ignoring unreadable statistics cache entry %s (%s)", path, error)
        return None
    try:
        entry = json.loads(text.decode("utf-8"))
        if entry.get("format") != FORMAT or entry.get("key") != digest:
            raise ValueError("format or key mismatch")
        validate(entry["agents"], entry["tensors"])
        if not hmac.compare_digest(str(entry.get("mac")), _mac(key_, digest, entry["agents"], entry["tensors"])):
            raise ValueError("keyed checksum mismatch: edited, or not written by your mergekit-ram")
        return entry
    except Exception as error:  # corrupt, truncated, edited: recompute
        LOG.warning("mergekit-ram: ignoring unreadable statistics cache entry %s (%s)", path, error)
        return None


def store(digest: str, agents: list, tensors: list) -> Path | None:
    """Write an entry atomically; a cache that cannot be written is only a warning."""
    folder = directory()
    if folder is None or not cachedir.writable():  # off, or read only (verify)
        return None
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        key_ = secret(folder, quiet=True)  # an unusable secret was named when the entry was looked up; OSError: said
        if key_ is None:
            return None
        entry = {"format": FORMAT, "key": digest, "agents": agents, "mac": _mac(key_, digest, agents, tensors)}
        files.write_atomic(str(folder / f"{digest}.json"), json.dumps({**entry, "tensors": tensors}))
        return folder / f"{digest}.json"
    except OSError as error:
        LOG.warning("mergekit-ram: could not write the statistics cache in %s: %s", folder, error)
        return None


def read_regular(path: str | Path, secret_of: int = 0) -> bytes:
    """The bytes of the regular file at `path`, this user's: opened without blocking (a FIFO does not wait for a
    writer) and without following a link, and read only once seen to be a regular file (`fstat`); a secret of
    `secret_of` bytes (at most one more is read) must be the user's alone to read. ValueError naming what it is
    otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not a regular file") from error
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"written by uid {st.st_uid}, not by you")
        if secret_of and st.st_mode & 0o077:
            raise ValueError(f"others may read it (mode {st.st_mode & 0o777:o})")
        return f.read(secret_of + 1 if secret_of else -1)


def secret(folder: Path, *, quiet: bool = False) -> bytes | None:
    """The HMAC key of the entries in `folder` (created by the first merge, 0600, atomically: written whole, then
    linked in place). None, with a warning unless `quiet`, when the folder is not the user's or others may write
    it, or the secret is not the user's, others may read it, or it cannot be made."""
    path = folder / SECRET
    try:
        st = os.stat(folder)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ValueError(f"the folder is uid {st.st_uid}'s, mode {st.st_mode & 0o777:o}: not yours alone to write")
        if not os.path.lexists(path):
            _make_secret(folder, path)
        found = read_regular(path, _SECRET_BYTES)
        if len(found) != _SECRET_BYTES:
            raise ValueError(f"it holds {len(found)} bytes, not {_SECRET_BYTES}")
        return found
    except (OSError, ValueError) as error:
        if quiet and isinstance(error, OSError):
            raise  # the cache cannot be written: `store` says so
        if not quiet:
            LOG.warning("mergekit-ram: not using the statistics cache %s: %s", path, error)
        return None


def _make_secret(folder: Path, path: Path) -> None:
    """A new random secret at `path`, unless another process made one first."""
    tmp = folder / f".{SECRET}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(_SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another merge made one meanwhile: that one is kept
            os.link(tmp, path)  # atomic: the secret appears whole
    finally:
        os.unlink(tmp)


def _mac(key_: bytes, digest: str, agents: list, tensors: list) -> str:
    blob = json.dumps({"key": digest, "agents": agents, "tensors": tensors}, sort_keys=True)
    return hmac.new(key_, blob.encode(), hashlib.sha256).hexdigest()


def _safetensors_header_hash(path: str) -> str:
    return hashlib.sha256(files.read_header(path)[0]).hexdigest()


#: the width of each sampled window of a weight file (`_sample_hash`), and how many
SAMPLE, WINDOWS = 1 << 16, 16


def sample_offsets(size: int) -> list[int]:
    """Where the sampled windows of a file of `size` bytes start (each `SAMPLE` bytes, or to the file's end)."""
    return [max(0, (size - SAMPLE) * i // (WINDOWS - 1)) for i in range(WINDOWS)]


def _sample_hash(path: str, size: int) -> str:
    """sha256 of evenly spaced 64 KiB windows: tells apart agents of one base
    (an RL agent changes thousands of entries per window) without a full read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for start in sample_offsets(size):
            f.seek(start)
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def validate(agents: Any, tensors: Iterable) -> None:
    """ValueError unless `tensors` are per-tensor counts of `agents` as an entry holds them (`verify --sample` reads
    ram_stats.json's so)."""
    if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
        raise ValueError("malformed agent list")
    for item in tensors:
        name, numel, counts = item["name"], item["numel"], item["counts"]
        if not isinstance(name, str) or not isinstance(numel, int) or not isinstance(counts, dict):
            raise ValueError("malformed tensor record")
        if set(counts) != set(agents):
            raise ValueError(f"counts of {name} do not name the entry's agents")
        for row in counts.values():
            if len(row) != 3 or not all(isinstance(x, int) and 0 <= x <= numel for x in row):
                raise ValueError(f"malformed counts for {name}")
        _validate_diagnostics(name, numel, agents, item.get("diagnostics"))


def _validate_diagnostics(name: str, numel: int, agents: list, found: Any) -> None:
    if found is None:
        return
    if set(found["single"]) != set(agents) or set(found["magnitude"]) != set(agents):
        raise ValueError(f"diagnostics of {name} do not name the entry's agents")
    if not all(isinstance(x, int) and 0 <= x <= numel for x in found["single"].values()):
        raise ValueError(f"malformed diagnostics for {name}")
    numbers = [x for pair in found["magnitude"].values() for x in pair]
    if len(found["pairs"]) != len(agents) * (len(agents) - 1) // 2:
        raise ValueError(f"diagnostics of {name} miss a pair of agents")
    for row in found["pairs"]:
        a, b, common, same, *sums = row
        if a not in agents or b not in agents or not (0 <= same <= common <= numel) or len(sums) != 3:
            raise ValueError(f"malformed pair diagnostics for {name}")
        numbers.extend(sums)
    if not all(isinstance(x, (int, float)) and x == x and abs(x) != float("inf") for x in numbers):
        raise ValueError(f"malformed diagnostics for {name}")
