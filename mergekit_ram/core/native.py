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
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mergekit_ram import environment
from mergekit_ram.core import build, cachedir
from mergekit_ram.core.build import SOURCE as SOURCE
from mergekit_ram.core.build import find_compiler as find_compiler
from mergekit_ram.core.build import target as target

if TYPE_CHECKING:
    import torch  # imported where a call needs it: `status` (`mergekit-ram --version`) runs without torch

LOG = logging.getLogger("mergekit_ram")

_NAMES = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}  # by str(dtype)
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
    return environment.flag(environment.NATIVE, default=True)


def supports(base: torch.Tensor, agents: Sequence[torch.Tensor], out_dtype: torch.dtype | None = None) -> bool:
    """True when the fused loops apply: CPU, one float dtype of 16/32 bits, < 255 agents."""
    if not enabled() or base.device.type != "cpu" or str(base.dtype) not in _NAMES or len(agents) >= 255:
        return False
    if out_dtype is not None and str(out_dtype) not in _NAMES:
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
                _failed = build._why(error)
                LOG.warning("mergekit-ram: fast CPU kernel unavailable: %s; %s", _failed, COST)
    return _lib


#: what running without the fused loops means on any machine: the same bits, more slowly. How much more slowly
#: depends on the machine, its load and the model, so the figures live in docs/benchmarks.md, not in the warning
COST = (
    "the torch kernel runs instead: the same results, more slowly (how much depends on the machine: "
    "docs/benchmarks.md, the rows without a compiler; MERGEKIT_RAM_NATIVE=0 silences this)"
)


def status() -> str:
    """One line for `mergekit-ram --version`: whether the fused loops are in use, will be built on first use,
    or cannot be built, and why. Builds nothing and imports no torch (asks the compiler its version only)."""
    if not enabled():
        return "off (MERGEKIT_RAM_NATIVE=0): the torch kernel runs, the same results, slower"
    if _lib is not None:
        return "built, in use"
    if _failed is not None:
        return f"cannot be built: {_failed}; the torch kernel runs, the same results, slower"
    try:
        compiler, _, target = build._recipe()
        built = os.path.lexists(target)
        build._check_folders(target, present_only=True)
    except Exception as error:
        return f"cannot be built: {build._why(error)}; the torch kernel runs, the same results, slower"
    return f"built ({target}), used on CPU tensors" if built else f"will be built on first use with {compiler}"


def count(base: torch.Tensor, agents: Sequence[torch.Tensor], epsilon: float, tensor_name: str | None = None) -> tuple:
    """(int64 [N, 3] counts, any_non_finite); MemoryError naming `tensor_name` when the loops get no scratch."""
    import torch

    lib, name = library(), _NAMES[str(base.dtype)]
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
    import torch

    lib, name = library(), _NAMES[str(base.dtype)]
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
    fn = getattr(lib, f"merge_{_NAMES[str(base.dtype)]}_{_NAMES[str(out.dtype)]}")
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
    import torch

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
    sets torch to one thread of its own, which torch also records as the default for threads started later; this
    puts the caller's back)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return list(_workers(n).map(fn, range(n)))
    finally:
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
        target = build._recipe()[2]
        if not os.path.lexists(target):
            LOG.info("mergekit-ram: the fast CPU kernel is not built and is not built now; using the torch kernel")
            return None
        build._check_folders(target)
        with _lock:
            if _lib is None:
                _lib = _declare(ctypes.CDLL(str(target)))
        return _lib
    except Exception as error:  # no compiler, unsafe or foreign file: the torch kernel, same results
        LOG.info("mergekit-ram: the built fast CPU kernel is not used (%s); using the torch kernel", error)
        return None


def _load():
    """Build (or find) the library and load it; a cached one that does not load is rebuilt once."""
    compiler, flags, target = build._recipe()
    fresh = build._build(compiler, flags, target)
    try:
        return _declare(ctypes.CDLL(str(target)))
    except (OSError, AttributeError) as error:  # not a library, or not ours: never keep loading it
        if fresh:
            raise
        LOG.warning("mergekit-ram: the compiled kernel %s does not load (%s); rebuilding it", target, error)
        target.unlink()
        build._build(compiler, flags, target)
        return _declare(ctypes.CDLL(str(target)))
