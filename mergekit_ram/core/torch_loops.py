"""The torch loops of `kernel`: the portable path (GPUs, float64, no C compiler, an explicit `chunk=`).

Same masks and the same float32 arithmetic as `_native.c`, one rounding. The loops are shaped by three things that
cost more than the arithmetic on a CPU (the profiles and figures: benchmarks/README.md, "Without a compiler"):

- torch's own threads. Each elementwise op over more than 32,768 entries opens an OpenMP region on torch's
  threads and waits there for all of them: on a busy machine, for one the scheduler has taken off its core, many
  times the op's own time. On the CPU the chunks are shared out over `native`'s thread pool instead, whose threads
  run torch ops on one thread each, so no op waits for another thread; each thread has its own buffers.
- ops that write bool tensors (`>`, `==`, `torch.where`, `isfinite`), many times slower than the same op into a
  float32 buffer. Masks are float32 (1.0 or 0.0), counts are sums and matrix products of them (exact: integers
  below 2**24), the merge's select of the scaled delta is done on the float bits.
- Python's overhead per op, and the GIL: the agents' deltas, masks and products are done as one op on an
  [N, chunk] buffer. The pool's threads take turns at the GIL between ops, so an op must be long beside its call,
  or two threads run slower than one: hence chunks of `kernel.CHUNK_CPU` entries, not fewer.

Every value that the native loops sum in float32 (total and scaled deltas) is summed here in the same order, agent
by agent from +0. The float64 sums of `diagnose` are per chunk, added in chunk order: the same bits for any number
of threads (not the native loops' bits: they add in another order).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: the integer view of each compute dtype's bits, and the shift that turns 1.0's bits into 1
_BITS = {torch.float32: (torch.int32, 29), torch.float64: (torch.int64, 61)}
#: counts are sums of 1.0s in float32: exact up to 2**24 per chunk
_EXACT = 1 << 24
#: bytes of scratch a CPU thread of the statistics pass may hold: its chunk (2**17 entries for 3 agents, 2**16 for 8)
_SCRATCH = 32 << 20
#: the integer view of each input dtype's bits (the one-step keys)
_KEYS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def promoted(base: torch.Tensor, agents: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = base.dtype
    for a in agents:
        dtype = torch.promote_types(dtype, a.dtype)
    return dtype


def compute_dtype(base: torch.Tensor, agents: Sequence[torch.Tensor]) -> torch.dtype:
    return torch.float64 if promoted(base, agents) == torch.float64 else torch.float32


#: `native.in_pool`, which `kernel` hands in: `fn(i)` for i < n on the process's pool of threads, in order
Pool = Callable[[Callable[[int], Any], int], list]


def _shared_out(numel: int, step: int, device: torch.device, work: Callable[[list], Any], pool: Pool) -> list:
    """`work(chunks)` for each thread's run of chunks, in order; on the CPU in the pool (torch on one thread in
    each), elsewhere inline (a GPU queues its kernels: one host thread is enough)."""
    chunks = [(s, min(s + step, numel)) for s in range(0, numel, step)]
    if device.type != "cpu":
        with torch.no_grad():
            return [work(chunks)]
    threads = max(1, min(torch.get_num_threads(), len(chunks)))
    share = -(-len(chunks) // threads)
    runs = [chunks[i : i + share] for i in range(0, len(chunks), share)]
    return pool(lambda i: _one_thread(work, runs[i]), len(runs))


_local = threading.local()


def _one_thread(work, chunks):
    if not getattr(_local, "single", False):
        torch.set_num_threads(1)  # this thread's ops (and MKL's) on this thread; `native.in_pool` restores the rest
        _local.single = True
    with torch.no_grad():  # grad mode is per thread: the caller's no_grad does not reach here
        return work(chunks)


def _masks(base, agents, start, stop, bk, d, m) -> None:
    """Into the first k = stop - start entries: bk the base in the compute dtype, d[t] agent t's delta (a - b,
    rounded once), m[t] |d|."""
    k = stop - start
    bk[:k].copy_(base[start:stop])
    for t, agent in enumerate(agents):
        d[t, :k].copy_(agent[start:stop])
    d[:, :k].sub_(bk[:k])
    torch.abs(d[:, :k], out=m[:, :k])


def count_chunks(base, agents, epsilon: float, step: int, pool: Pool, *, diagnose: bool) -> tuple[torch.Tensor, ...]:
    """Per chunk, in chunk order: float64 rows of counts, plus each agent's largest |delta| (NaN or Inf when one
    is). With `diagnose`, one row of counts and diagnostics for the whole tensor (`_diagnose_chunks`)."""
    if diagnose:
        return _diagnose_chunks(base, agents, epsilon, step, pool)
    n, numel, device = len(agents), base.numel(), base.device
    cdtype = compute_dtype(base, agents)
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = min(step, _EXACT)

    def work(chunks):
        size = chunks[0][1] - chunks[0][0]
        bk = torch.empty(size, dtype=cdtype, device=device)
        d, m = torch.empty(n, size, dtype=cdtype, device=device), torch.empty(n, size, dtype=cdtype, device=device)
        hits = torch.empty(4, size, dtype=cdtype, device=device)  # ones, ==1, ==2, >=2
        peaks = torch.zeros(n, dtype=cdtype, device=device)
        rows = []
        for start, stop in chunks:
            k = stop - start
            _masks(flat_base, flat_agents, start, stop, bk, d, m)
            mk, hk = m[:, :k], hits[:, :k]
            torch.maximum(peaks, mk.amax(dim=1), out=peaks)
            torch.gt(mk, epsilon, out=mk)
            torch.sum(mk, dim=0, out=hk[0])
            torch.eq(hk[0], 1, out=hk[1])
            torch.eq(hk[0], 2, out=hk[2])
            hk[0].fill_(1)
            rows.append((mk @ hk[:3].T).to(torch.float64).reshape(-1))  # [n, 3]: active, unique, pair (exact)
        return torch.stack(rows), peaks

    found = _shared_out(numel, step, device, work, pool)
    table = torch.cat([rows for rows, _ in found])
    peaks = torch.stack([p for _, p in found]).amax(dim=0)
    return table, peaks


def _diagnose_chunks(base, agents, epsilon: float, step: int, pool: Pool) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts and the diagnostics as one float64 row [counts and single [n, 4], magnitude [n, 2], pair counts
    [P, 2], pair sums [P, 3]] (as `kernel.diagnose` reads it), and each agent's largest |delta|.

    Per chunk, every integer is an entry of one float32 product of the rows [one step, sign, mask] with
    [sign, mask, 1, ==1, ==2] (sums of 0/1 products: exact), and every float64 sum an entry of three float64
    products of the kept deltas, each operand widened once: 4 matrix products a chunk, since widening operands
    again for each sum cost more than the products.
    The float64 sums are per chunk, added in chunk order: the same bits for any number of threads. A chunk's
    scratch is at most `_SCRATCH` bytes a thread."""
    n, numel, device = len(agents), base.numel(), base.device
    cdtype, wide = compute_dtype(base, agents), torch.float64
    key_dtype = promoted(base, agents)
    view = _KEYS[key_dtype]
    width = torch.empty(0, dtype=view).element_size() * 8
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = min(step, _EXACT)
    if device.type == "cpu":  # a thread's scratch at most _SCRATCH bytes, in a power of two of entries
        per_entry = (
            (4 * n + 5) * torch.empty(0, dtype=cdtype).element_size() + 8 * (4 * n + 2) + (n + 1) * width // 8 * 3
        )
        step = min(step, max(1 << 12, 1 << (_SCRATCH // per_entry).bit_length() - 1))

    def work(chunks):
        size, c = chunks[0][1] - chunks[0][0], len(chunks)
        bk, h = torch.empty(size, dtype=cdtype, device=device), torch.empty(size, dtype=cdtype, device=device)
        d = torch.empty(n, size, dtype=cdtype, device=device)
        y = torch.empty(3 * n + 3, size, dtype=cdtype, device=device)  # one step, sign, mask, 1, ==1, ==2
        y[3 * n].fill_(1)
        z = torch.empty(4 * n + 2, size, dtype=wide, device=device)  # |kept|, kept, kept^2, mask, ==1, >=2
        keys = torch.empty(n + 1, size, dtype=view, device=device)  # the agents' and the base's ordered bits
        sign_bits, low_bits = torch.empty_like(keys), torch.empty_like(keys)
        ints = torch.empty(c, 3 * n, 2 * n + 3, dtype=cdtype, device=device)
        magnitude = torch.empty(c, n, 2, dtype=wide, device=device)
        dot, squares = torch.empty(c, n, n, dtype=wide, device=device), torch.empty(c, n, n, dtype=wide, device=device)
        peaks = torch.empty(c, n, dtype=cdtype, device=device)
        for i, (start, stop) in enumerate(chunks):
            k = stop - start
            dk, hk, yk, zk = d[:, :k], h[:k], y[:, :k], z[:, :k]
            step_k, sign_k, mask_k = yk[:n], yk[n : 2 * n], yk[2 * n : 3 * n]
            _masks(flat_base, flat_agents, start, stop, bk, d, y[:n])  # |d| in the rows the one-step flags take next
            torch.amax(step_k, dim=1, out=peaks[i])
            torch.gt(step_k, epsilon, out=mask_k)
            torch.sum(mask_k, dim=0, out=hk)
            torch.eq(hk, 1, out=yk[3 * n + 1])
            torch.eq(hk, 2, out=yk[3 * n + 2])
            dk.mul_(mask_k)  # the kept deltas: d or +-0
            torch.sign(dk, out=sign_k)
            _one_step_flags(
                flat_base,
                flat_agents,
                start,
                stop,
                key_dtype,
                keys[:, :k],
                sign_bits[:, :k],
                low_bits[:, :k],
                width,
                step_k,
            )
            # single: diag(step @ mask^T); agree: sign @ sign^T; common: mask @ mask^T; counts: mask @ [1, ==1, ==2]^T
            torch.mm(yk[: 3 * n], yk[n:].T, out=ints[i])
            size_k, kept_k, square_k, wide_mask_k = zk[:n], zk[n : 2 * n], zk[2 * n : 3 * n], zk[3 * n : 4 * n]
            kept_k.copy_(dk)
            torch.abs(kept_k, out=size_k)
            torch.mul(kept_k, kept_k, out=square_k)  # products of two float32 values: exact in float64
            wide_mask_k.copy_(mask_k)
            zk[4 * n].copy_(yk[3 * n + 1])
            torch.ge(hk, 2, out=zk[4 * n + 1])
            torch.mm(size_k, zk[4 * n :].T, out=magnitude[i])  # sum |d| unique, shared
            torch.mm(kept_k, kept_k.T, out=dot[i])
            torch.mm(square_k, wide_mask_k.T, out=squares[i])  # [i, j]: sum of d_i^2 where both changed
        return ints.to(torch.int64).sum(dim=0), magnitude, dot, squares, peaks.amax(dim=0)

    found = _shared_out(numel, step, device, work, pool)
    ints = torch.stack([f[0] for f in found]).sum(dim=0)
    magnitude, dot, squares = (torch.cat([f[j] for f in found]).sum(dim=0) for j in (1, 2, 3))  # in chunk order
    peaks = torch.stack([f[4] for f in found]).amax(dim=0)
    every = torch.arange(n, device=device)
    i, j = torch.triu_indices(n, n, 1, device=device)
    common = ints[2 * n + i, n + j]
    per_agent = torch.cat([ints[2 * n :, 2 * n :], ints[every, n + every][:, None]], dim=1)  # counts, single
    pair_counts = torch.stack([common, (common + ints[n + i, j]) // 2], dim=1)  # same sign: (common + agree) / 2
    pair_sums = torch.stack([dot[i, j], squares[i, j], squares[j, i]], dim=1)
    row = torch.cat(
        [per_agent.to(wide).reshape(-1), magnitude.reshape(-1), pair_counts.to(wide).reshape(-1), pair_sums.reshape(-1)]
    )
    return row[None], peaks


def _one_step_flags(flat_base, flat_agents, start, stop, key_dtype, keys, sign_bits, low_bits, width, into) -> None:
    """Into `into` [n, k]: 1.0 where an agent's value is one step of `key_dtype` from the base's, else 0.0; `keys`,
    `sign_bits`, `low_bits` [n + 1, k] are scratch of `key_dtype`'s integer view."""
    n, view = len(flat_agents), keys.dtype
    for t, a in enumerate(flat_agents):
        keys[t].copy_(a[start:stop].to(key_dtype).view(view))
    keys[n].copy_(flat_base[start:stop].to(key_dtype).view(view))
    # sign-magnitude bits to ordered integers, adjacent floats one apart (+0 and -0 both 0)
    torch.bitwise_right_shift(keys, width - 1, out=sign_bits)
    torch.bitwise_and(sign_bits, (1 << (width - 1)) - 1, out=low_bits)
    keys.bitwise_xor_(low_bits).sub_(sign_bits)
    gap = torch.sub(keys[:n], keys[n], out=low_bits[:n])  # wraps in the view's width: never to +-1 (see _native.c)
    torch.eq(gap.abs_(), 1, out=into)


def merge_into(base, agents, lambdas: Sequence[float], epsilon: float, flat_out: torch.Tensor, step: int, pool: Pool):
    """Eq. 7 into `flat_out`; returns a 0-dim tensor, 1.0 when every result is finite as rounded into it."""
    n, numel, device = len(agents), base.numel(), base.device
    cdtype = compute_dtype(base, agents)
    view, shift = _BITS[cdtype]
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    lams = torch.tensor([float(x) for x in lambdas], dtype=cdtype, device=device)[:, None]  # float32 like _native.c

    def work(chunks):
        size = chunks[0][1] - chunks[0][0]
        bk = torch.empty(size, dtype=cdtype, device=device)
        both = torch.empty(n, 2, size, dtype=cdtype, device=device)  # [t, 0]: agent t's kept delta, [t, 1]: lambda * it
        m = torch.empty(n, size, dtype=cdtype, device=device)
        sums = torch.empty(2, size, dtype=cdtype, device=device)  # total, scaled
        hits, one = torch.empty_like(bk), torch.empty_like(bk)
        for start, stop in chunks:
            k = stop - start
            dk, mk, sk, hk, ok = both[:, 0, :k], m[:, :k], sums[:, :k], hits[:k], one[:k]
            _masks(flat_base, flat_agents, start, stop, bk, both[:, 0], m)
            torch.gt(mk, epsilon, out=mk)
            dk.mul_(mk)  # the kept deltas: d or +-0 (NaN stays NaN, and makes the result NaN: caught below)
            torch.sum(mk, dim=0, out=hk)
            # lambda * kept rounded on its own, then added: `add_(alpha=)` fuses the two (an FMA: one rounding), which
            # gave -0 where _native.c's +0 + (lambda * tiny kept, rounded to -0) gives +0
            torch.mul(dk, lams, out=both[:, 1, :k])
            sk.zero_()
            for t in range(n):  # in agent order from +0, as _native.c adds them: the total and the scaled at once
                sk.add_(both[t, :, :k])
            tk = sk[0]
            torch.eq(hk, 1, out=ok)
            tk.div_(hk.clamp_(min=1))  # one agent: its scaled delta (selected next); several: their mean
            _select(tk.view(view), sk[1].view(view), ok.view(view), shift)
            tk.add_(bk[:k])
            flat_out[start:stop].copy_(tk)
        # the results as rounded into flat_out, read back once per thread: the extremes are NaN or Inf when one is
        return torch.stack(torch.aminmax(flat_out[chunks[0][0] : chunks[-1][1]]))

    extremes = torch.stack(_shared_out(numel, step, device, work, pool))
    return torch.isfinite(extremes).all().to(cdtype)


def _select(into: torch.Tensor, other: torch.Tensor, flag: torch.Tensor, shift: int) -> None:
    """In place on the float bits: `into` takes `other`'s bits where `flag` holds 1.0's, keeps its own where 0.0's
    (`torch.where` into a float buffer, without the bool mask that costs 10x its arithmetic)."""
    mask = torch.bitwise_right_shift(flag, shift, out=flag).neg_()  # 1.0 -> 1 -> all ones; 0.0 -> 0
    into.bitwise_xor_(torch.bitwise_xor(into, other).bitwise_and_(mask))
