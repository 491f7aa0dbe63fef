"""Files on disk: safetensors headers (read and checked without loading a tensor), checkpoint indexes
and atomic writes.

One reader of safetensors headers (`read_header`, cached per run by `Headers`) serves the stored-dtype
checks, the cache's identity of a model folder and `verify --sample`'s byte ranges; one table names the
floating dtypes (`FLOAT_NAMES`); one check of a safetensors file (safetensors' own) serves the input checks,
one reader of an index's `weight_map` the input checks and the cache; one atomic writer serves `ram_stats.json`
and the statistics cache.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile

from mergekit_ram.errors import RamError, WriteError

#: bytes per element of the safetensors dtypes (sub-byte floats and others: none)
WIDTHS = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: the floating safetensors dtypes a merge reads and writes -> torch's name of each
FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
MAX_HEADER = 100_000_000  # safetensors' own limit


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw header bytes of a safetensors file and the header parsed ({} when it is not a JSON object).

    Reads the header only, checks nothing but its length: `check_safetensors` checks a file.
    Raises ValueError naming the file when the header length is implausible.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER:
            raise RamError(f"{path}: implausible safetensors header size {size}")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        return raw, {}
    return raw, header if isinstance(header, dict) else {}


class Headers:
    """Safetensors headers, each file's read once: planning, a sample's draw, its byte ranges and its slices read
    the same files' headers, some of them many times."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[int, dict]] = {}

    def get(self, path: str) -> tuple[int, dict]:
        """(the offset where the file's data starts, its header); OSError or ValueError as `read_header`."""
        if path not in self._read:
            raw, header = read_header(path)
            self._read[path] = (8 + len(raw), header)
        return self._read[path]

    def remember(self, path: str, header: dict) -> None:
        """Hold `header` as the header of `path`, a file that has none (what a PyTorch pickle stores, read another
        way: `raw_pytorch.pickled_dtype`)."""
        self._read[path] = (0, header)

    def known(self, path: str) -> bool:
        return path in self._read

    def __len__(self) -> int:
        """How many files' headers are held (each read once)."""
        return len(self._read)

    def entry(self, path: str, name: str) -> dict:
        """Tensor `name`'s entry in the header of `path` ({} when the header has none)."""
        entry = self.get(path)[1].get(name)
        return entry if isinstance(entry, dict) else {}

    def span(self, path: str, name: str) -> tuple[int, int] | None:
        """Where in the file `path` the header places tensor `name`'s bytes, (first, end) from the file's start;
        None when its entry holds no two offsets."""
        offsets = self.entry(path, name).get("data_offsets")
        if not isinstance(offsets, (list, tuple)) or len(offsets) != 2:
            return None
        start = self.get(path)[0]
        return start + int(offsets[0]), start + int(offsets[1])

    def stored(self, path: str, name: str) -> tuple[str | None, list[int] | None]:
        """(dtype, shape) of tensor `name` as `path` stores it; (None, None) outside safetensors, for a header that
        cannot be read, or one that does not say."""
        if not path.lower().endswith(".safetensors"):
            return None, None
        try:
            entry = self.entry(path, name)
        except (OSError, ValueError):
            return None, None
        return (entry["dtype"], list(entry["shape"])) if entry else (None, None)


def check_safetensors(file: str) -> None:
    """ValueError naming `file` and the fix unless safetensors opens it.

    `safe_open` reads the header only and checks it against the bytes that follow: its length,
    JSON, every entry's dtype, shape and offsets, no gap, overlap or trailing byte. Its message is
    kept; where it names no tensor, the entry whose bytes disagree with its dtype and shape is named.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt"):
            pass
    except (MemoryError, OSError) as error:  # safetensors maps the whole file
        if not isinstance(error, MemoryError) and "(os error 12)" not in str(error):  # ENOMEM: an OSError before 0.8
            raise
        size = os.path.getsize(file) / 2**30
        raise RamError(
            f"input file {file} ({size:.1f} GiB) cannot be mapped into memory: is the address space limited "
            "(ulimit -v, a scheduler's memory limit)? mergekit maps each weight file whole"
        ) from error
    except SafetensorError as error:
        reason = str(error).removeprefix("Error while deserializing header: ")
        raise RamError(
            f"input file {file} is not a valid safetensors file: {reason}{_misfit(file)} "
            "(a truncated download? fetch it again)"
        ) from error


def _misfit(file: str) -> str:
    """'; tensor NAME (DTYPE SHAPE) needs N bytes, its offsets span M' for the first header entry whose
    bytes disagree with its dtype and shape, else ''."""
    try:
        for name, info in read_header(file)[1].items():
            width = WIDTHS.get(str(info.get("dtype"))) if isinstance(info, dict) else None
            if width is None:
                continue  # __metadata__, or a dtype without a byte width
            (begin, end), shape = info["data_offsets"], list(info["shape"])
            if not all(isinstance(x, int) for x in [begin, end, *shape]):
                continue
            need = math.prod(shape) * width
            if end - begin != need:
                return f"; tensor {name} ({info['dtype']} {shape}) needs {need} bytes, its offsets span {end - begin}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # safetensors' message says what is wrong
    return ""


def indexed_weight_files(index: str) -> list[str]:
    """The weight files a checkpoint index's `weight_map` names: paths relative to its folder, sorted, each once.

    FileNotFoundError when there is no `index`; ValueError naming it when it is not a readable index.
    """
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise RamError(f"input model index {index} is unreadable: {error!r}") from error


def write_atomic(path: str, text: str, *, mode: int | None = None, private: bool = True) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old file or the new one.

    `private`: readable by the user alone (a cache); else 0666 less the umask, like the files
    mergekit writes beside it. `mode`: exactly these permissions instead.
    A failure names the file and leaves no temporary file behind.
    """
    folder = os.path.dirname(path) or "."
    fd, tmp = _new_file(folder, os.path.basename(path), private)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        raise WriteError(error.errno, f"could not write {path}: {error.strerror or error}") from error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _new_file(folder: str, name: str, private: bool) -> tuple[int, str]:
    if private:
        return tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    while True:  # as mkstemp, but created 0666 less the umask
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666), tmp
        except FileExistsError:
            continue
