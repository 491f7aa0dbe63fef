"""Files on disk: safetensors headers (read and checked without loading a tensor), checkpoint indexes
and atomic writes.

One reader of safetensors headers serves the input checks, the stored-dtype
checks and the cache's identity of a model folder; one reader of an index's
`weight_map` the input checks and the cache; one atomic writer serves
`ram_stats.json` and the statistics cache.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile

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
MAX_HEADER = 100_000_000  # safetensors' own limit


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw header bytes of a safetensors file and the header parsed ({} when it is not a JSON object).

    Raises ValueError naming the file when the header length is implausible.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER:
            raise ValueError(f"{path}: implausible safetensors header size {size}")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        return raw, {}
    return raw, header if isinstance(header, dict) else {}


def check_safetensors(file: str) -> None:
    """ValueError naming `file` unless its header describes exactly the bytes that follow it."""

    def bad(reason: str) -> ValueError:
        return ValueError(
            f"input file {file} is not a valid safetensors file: {reason} (a truncated download? fetch it again)"
        )

    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER):
            raise bad(f"the header claims {n} bytes, the file holds {size - 8} after the length field")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise bad(f"the header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in [*shape, begin, end]) or end < begin:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name}: malformed entry {info!r}") from None
        width = WIDTHS.get(dtype)
        if width is None:
            return  # a dtype we do not size (sub-byte floats...): safetensors checks it
        need = math.prod(shape) * width
        if end - begin != need:
            raise bad(f"tensor {name} ({dtype} {shape}) needs {need} bytes, its offsets span {end - begin}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise bad(f"tensor {name} starts at byte {begin} of the data, expected {position} (overlap or gap)")
        position = end
    data = size - 8 - n
    if position != data:
        what = "truncated" if position > data else "trailing bytes"
        raise bad(f"the tensors need {position} bytes of data, the file holds {data} ({what})")


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
        raise ValueError(f"input model index {index} is unreadable: {error!r}") from error


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
        raise OSError(error.errno, f"could not write {path}: {error.strerror or error}") from error
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
