"""The fused CPU loops of `_native.c`: built on first use, loaded with ctypes.

Optional by design: without a C compiler (or with `MERGEKIT_RAM_NATIVE=0`) the
kernel uses its torch path, which gives the same results, more slowly. The
library is compiled for this machine (`-march=native`) into the cache folder,
keyed by source, compiler and CPU, and replaced atomically, so concurrent
first runs are safe. Work is split over torch's thread count; ctypes releases
the GIL during each call.

Loading a shared library runs its code, so it is built into and loaded from
a folder owned by the user and writable by no one else (as is the folder above
it), and only a regular file owned by the user and writable by no one else is
loaded: a library planted by another user, or a cache folder others can write
to, is refused with one warning and the torch path runs instead. A library that
does not load (corrupt, foreign) is deleted and rebuilt once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mergekit_ram.core import cachedir
from mergekit_ram.errors import UnsafeLocation

LOG = logging.getLogger("mergekit_ram")

SOURCE = Path(__file__).with_name("_native.c")
_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_MIN_SPLIT = 1 << 20  # below this, one thread: splitting costs more than it saves
#: `diagnose` sums each span of this many entries on its own, then the spans in order: its float64 sums are then
#: the same bits for any number of threads, which share out whole spans (a multiple of _native.c's BLOCK)
SPAN = 1 << 18
_NO_MEMORY = -1  # what count_* and diagnose_* return when their scratch cannot be allocated (_native.c)
_lock = threading.Lock()
_lib = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None


def enabled() -> bool:
    return os.environ.get("MERGEKIT_RAM_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def supports(base: torch.Tensor, agents: Sequence[torch.Tensor], out_dtype: torch.dtype | None = None) -> bool:
    """True when the fused loops apply: CPU, one float dtype of 16/32 bits, < 255 agents."""
    if not enabled() or base.device.type != "cpu" or base.dtype not in _NAMES or len(agents) >= 255:
        return False
    if out_dtype is not None and out_dtype not in _NAMES:
        return False
    return all(a.dtype == base.dtype and a.device == base.device for a in agents) and library() is not None


def library():
    """The loaded library, building it once; None (with one warning) if it cannot be. Inside
    `cachedir.read_only()`: the library if it is built already, never built (None otherwise)."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    if not cachedir.writable():
        memo = cachedir.looked_up()
        if "native" not in memo:
            memo["native"] = _built()
        return memo["native"]
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _load()
            except Exception as error:  # no compiler, read-only cache, unsafe folder, odd platform
                _failed = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
                LOG.warning(
                    "mergekit-ram: fast CPU kernel unavailable (%s); using the torch kernel "
                    "(same results, slower). Set MERGEKIT_RAM_NATIVE=0 to silence.",
                    _failed,
                )
    return _lib


def count(base: torch.Tensor, agents: Sequence[torch.Tensor], epsilon: float, tensor_name: str | None = None) -> tuple:
    """(int64 [N, 3] counts, any_non_finite); MemoryError naming `tensor_name` when the loops get no scratch."""
    lib, name = library(), _NAMES[base.dtype]
    base, agents = _flat(base), [_flat(a) for a in agents]
    pointers = (ctypes.c_void_p * len(agents))(*[a.data_ptr() for a in agents])
    parts = _ranges(base.numel())
    results = [torch.zeros(len(agents), 3, dtype=torch.int64) for _ in parts]
    size = base.element_size()

    def run(i):
        start, stop = parts[i]
        shifted = (ctypes.c_void_p * len(agents))(*[p + start * size for p in pointers])
        return getattr(lib, f"count_{name}")(
            base.data_ptr() + start * size,
            shifted,
            len(agents),
            ctypes.c_float(epsilon),
            stop - start,
            results[i].data_ptr(),
        )

    bad = _map(run, len(parts))
    _allocated(bad, lib.count_scratch(len(agents)), "agent masks", "counting", tensor_name)
    return sum(results[1:], results[0]), any(b != 0 for b in bad)


def diagnose(
    base: torch.Tensor, agents: Sequence[torch.Tensor], epsilon: float, tensor_name: str | None = None
) -> tuple:
    """(int64 [4N + 2P] counts, float64 [2N + 3P] sums, any_non_finite): see `diagnose_*` in _native.c.

    MemoryError naming `tensor_name` when the loops get no scratch."""
    lib, name = library(), _NAMES[base.dtype]
    n, pairs = len(agents), len(agents) * (len(agents) - 1) // 2
    base, agents = _flat(base), [_flat(a) for a in agents]
    pointers = (ctypes.c_void_p * n)(*[a.data_ptr() for a in agents])
    numel, size = base.numel(), base.element_size()
    spans = max(1, -(-numel // SPAN))
    rows = torch.zeros(spans, 2 * n + 3 * pairs, dtype=torch.float64)  # each span's sums
    groups = _ranges(spans, numel >= _MIN_SPLIT)  # whole spans per thread
    ints = [torch.zeros(4 * n + 2 * pairs, dtype=torch.int64) for _ in groups]

    def run(i):
        first, last = groups[i]
        start, stop = first * SPAN, min(last * SPAN, numel)
        shifted = (ctypes.c_void_p * n)(*[p + start * size for p in pointers])
        return getattr(lib, f"diagnose_{name}")(
            base.data_ptr() + start * size,
            shifted,
            n,
            ctypes.c_float(epsilon),
            stop - start,
            SPAN,
            ints[i].data_ptr(),
            rows[first].data_ptr(),
        )

    bad = _map(run, len(groups))
    _allocated(bad, lib.diagnose_scratch(n), "agent masks and deltas", "diagnosing", tensor_name)
    sums = rows[0].clone()
    for row in rows[1:]:  # in span order, one add at a time: the same bits for any split
        sums += row
    return sum(ints[1:], ints[0]), sums, any(b != 0 for b in bad)


#: what `merge` returns, or'd: a delta is NaN or Inf (an input is not finite), a result is not finite in `out`'s dtype
NON_FINITE_INPUT, NON_FINITE_RESULT = 1, 2


def merge(base, agents, lambdas, epsilon: float, out: torch.Tensor) -> int:
    """Write Eq. 7 into `out` (contiguous, CPU); returns NON_FINITE_INPUT | NON_FINITE_RESULT as found (0: none)."""
    lib = library()
    fn = getattr(lib, f"merge_{_NAMES[base.dtype]}_{_NAMES[out.dtype]}")
    base, agents = _flat(base), [_flat(a) for a in agents]
    pointers = [a.data_ptr() for a in agents]
    lams = (ctypes.c_float * len(agents))(*[float(x) for x in lambdas])
    parts = _ranges(base.numel())
    size, osize = base.element_size(), out.element_size()

    def run(i):
        start, stop = parts[i]
        shifted = (ctypes.c_void_p * len(agents))(*[p + start * size for p in pointers])
        return fn(
            base.data_ptr() + start * size,
            shifted,
            len(agents),
            lams,
            ctypes.c_float(epsilon),
            stop - start,
            out.data_ptr() + start * osize,
        )

    found = 0
    for flags in _map(run, len(parts)):
        found |= flags
    return found


def _allocated(codes: list[int], size: int, what: str, doing: str, tensor_name: str | None) -> None:
    """MemoryError saying what could not be allocated when a call of the loops returned NO_MEMORY
    (its other codes, 0 and 1 for NaN or Inf, are the caller's)."""
    if any(code == _NO_MEMORY for code in codes):
        where = f"tensor {tensor_name}" if tensor_name else "a tensor"
        raise MemoryError(
            f"mergekit-ram: the native kernel could not allocate {size} bytes for its {what} while {doing} {where}"
        )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _ranges(n: int, split: bool | None = None):
    """[start, stop) of each thread's share of n items: one per thread when `split` (default: n >= _MIN_SPLIT)."""
    threads = max(1, torch.get_num_threads()) if (n >= _MIN_SPLIT if split is None else split) else 1
    step = -(-n // threads)
    return [(s, min(s + step, n)) for s in range(0, n, step)] or [(0, 0)]


def _map(fn, n: int):
    if n == 1:
        return [fn(0)]
    return list(_workers(n).map(fn, range(n)))


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < n:
        _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mergekit-ram")
    return _pool


def in_pool(fn, n: int) -> list:
    """[fn(0), ..., fn(n - 1)] on the pool's threads, even for n = 1 (the torch path's loops: each of its threads
    sets torch to one thread of its own, which torch also records as the default; this puts the caller's back)."""
    threads = torch.get_num_threads()
    try:
        return list(_workers(n).map(fn, range(n)))
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _declare(lib):
    int64, vp, fl = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for src in _NAMES.values():
        getattr(lib, f"count_{src}").argtypes = [vp, vp, ctypes.c_int, fl, int64, vp]
        getattr(lib, f"diagnose_{src}").argtypes = [vp, vp, ctypes.c_int, fl, int64, int64, vp, vp]
        for dst in _NAMES.values():
            getattr(lib, f"merge_{src}_{dst}").argtypes = [vp, vp, ctypes.c_int, vp, fl, int64, vp]
    for scratch in (lib.count_scratch, lib.diagnose_scratch):
        scratch.argtypes, scratch.restype = [ctypes.c_int], int64
    return lib


def _built():
    """The library if it is built and safe to load, loaded; None otherwise (nothing is built or removed)."""
    global _lib
    try:
        target = _recipe()[2]
        if not os.path.lexists(target):
            LOG.info("mergekit-ram: the fast CPU kernel is not built and is not built now; using the torch kernel")
            return None
        _check_private(target.parent.parent, "cache folder", follow=True)
        _check_private(target.parent, "kernel folder")
        _check_private(target, "compiled kernel")
        with _lock:
            if _lib is None:
                _lib = _declare(ctypes.CDLL(str(target)))
        return _lib
    except Exception as error:  # no compiler, unsafe or foreign file: the torch kernel, same results
        LOG.info("mergekit-ram: the built fast CPU kernel is not used (%s); using the torch kernel", error)
        return None


def _load():
    """Build (or find) the library and load it; a cached one that does not load is rebuilt once."""
    compiler, flags, target = _recipe()
    fresh = _build(compiler, flags, target)
    try:
        return _declare(ctypes.CDLL(str(target)))
    except (OSError, AttributeError) as error:  # not a library, or not ours: never keep loading it
        if fresh:
            raise
        LOG.warning("mergekit-ram: the compiled kernel %s does not load (%s); rebuilding it", target, error)
        target.unlink()
        _build(compiler, flags, target)
        return _declare(ctypes.CDLL(str(target)))


def target() -> Path:
    """Where the library for this source, compiler and CPU lives (built or not)."""
    return _recipe()[2]


def find_compiler() -> str | None:
    """The C compiler a build would use: `$CC`, else `cc` or `gcc` on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _recipe() -> tuple[str, list[str], Path]:
    compiler = find_compiler()
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC", "-std=gnu11"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        # AVX-512 where the CPU has it (gcc and clang default to 256 bits): the merge and count loops 1.5x as
        # fast, the same bits (no reassociation: the lanes are fixed in the source)
        flags.insert(2, "-mprefer-vector-width=512")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(
        "\n".join([SOURCE.read_text(), compiler, version, " ".join(flags), platform.machine(), _cpu()]).encode()
    ).hexdigest()[:16]
    return compiler, flags, cachedir.native() / f"ramkernel-{digest}.so"


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    """Compile into `target` unless a safe one is there; True when it was compiled now."""
    folder = target.parent
    if not folder.parent.exists():
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not folder.exists():
        folder.mkdir(mode=0o700, exist_ok=True)
    _check_private(folder.parent, "cache folder", follow=True)
    _check_private(folder, "kernel folder")
    if os.path.lexists(target):
        _check_private(target, "compiled kernel")
        return False
    fd, tmp = tempfile.mkstemp(prefix=".ramkernel-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} with {compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _check_private(target, "compiled kernel")
    return True


def _check_private(path: Path, what: str, *, follow: bool = False) -> None:
    """UnsafeLocation unless `path` is owned by this user and writable by no one else
    (and, unless `follow`, not a symbolic link)."""
    st = os.stat(path) if follow else os.lstat(path)
    uid = os.geteuid()
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symbolic link"
    elif st.st_uid != uid:
        problem = f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"others can write to it (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w {path}` fixes that)"
    elif what == "compiled kernel" and not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif what != "compiled kernel" and not stat.S_ISDIR(st.st_mode):
        problem = "it is not a folder"
    if problem:
        raise UnsafeLocation(f"refusing the {what} {path}: {problem}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()
