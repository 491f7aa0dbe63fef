"""The torch loops of `kernel`: the portable path (GPUs, float64, no C compiler, an explicit `chunk=`).

Same masks and the same float32 arithmetic as `_native.c`, one rounding. The shape of the loops comes from a
profile on a 2-core CPU (issue 53), where three things cost more than the arithmetic:

- torch's own threads. Each elementwise op over more than 32,768 entries opens an OpenMP region on torch's
  threads; on a busy machine each region waited for a descheduled thread, ~10-20 ms per op (700x the op). On the
  CPU the chunks are shared out over `native`'s thread pool instead, whose threads run torch ops on one thread
  each, so no op ever waits for another thread; each thread has its own buffers.
- ops that write bool tensors (`>`, `==`, `torch.where`, `isfinite`): 10-60x slower than the same op into a
  float32 buffer. Masks are float32 (1.0 or 0.0), counts are sums and matrix products of them (exact: integers
  below 2**24), the merge's select of the scaled delta is done on the float bits.
- Python's overhead per op: the agents' deltas, masks and products are done as one op on an [N, chunk] buffer.

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
    """Per chunk, in chunk order: float64 rows of counts (and, with `diagnose`, of the diagnostics), plus each
    agent's largest |delta| (NaN or Inf when one is)."""
    n, numel, device = len(agents), base.numel(), base.device
    cdtype = compute_dtype(base, agents)
    key_dtype = promoted(base, agents)
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = min(step, _EXACT)
    upper = torch.triu_indices(n, n, 1, device=device)

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
            mk, dk, hk = m[:, :k], d[:, :k], hits[:, :k]
            torch.maximum(peaks, mk.amax(dim=1), out=peaks)
            size_k = mk.clone() if diagnose else None  # |d|, for the magnitude sums
            torch.gt(mk, epsilon, out=mk)
            torch.sum(mk, dim=0, out=hk[0])
            torch.eq(hk[0], 1, out=hk[1])
            torch.eq(hk[0], 2, out=hk[2])
            torch.ge(hk[0], 2, out=hk[3])
            hk[0].fill_(1)
            counts = mk @ hk[:3].T  # [n, 3]: active, unique, pair (integer sums, exact)
            if not diagnose:
                rows.append(counts.to(torch.float64).reshape(-1))
                continue
            rows.append(_diagnostics(flat_base, flat_agents, start, stop, key_dtype, mk, dk, size_k, hk, counts, upper))
        return torch.stack(rows), peaks

    found = _shared_out(numel, step, device, work, pool)
    table = torch.cat([rows for rows, _ in found])
    peaks = torch.stack([p for _, p in found]).amax(dim=0)
    return table, peaks


def _diagnostics(flat_base, flat_agents, start, stop, key_dtype, mk, dk, size_k, hk, counts, upper) -> torch.Tensor:
    """One chunk's row: counts [n, 3], single [n], magnitude [n, 2], pair counts [P, 2], pair sums [P, 3]."""
    wide_mask = mk.to(torch.float64)
    kept = dk.mul(mk).to(torch.float64)  # each active delta, 0 elsewhere: products of two are exact in float64
    magnitude = (size_k.mul_(mk).to(torch.float64)) @ hk[[1, 3]].to(torch.float64).T  # sum |d| unique, shared
    common = mk @ mk.T  # entries both changed (exact)
    signs = torch.sign(dk).mul_(mk)
    agree = signs @ signs.T  # same sign minus opposite sign, over those entries
    dot = kept @ kept.T
    squares = (kept * kept) @ wide_mask.T  # [i, j]: sum of d_i^2 where both changed
    i, j = upper[0], upper[1]
    pair_counts = torch.stack([common[i, j], (common[i, j] + agree[i, j]) / 2], dim=1)
    pair_sums = torch.stack([dot[i, j], squares[i, j], squares[j, i]], dim=1)
    single = _one_step(flat_base, flat_agents, start, stop, key_dtype, mk).mul_(mk).sum(dim=1)
    return torch.cat(
        [
            torch.cat([counts, single[:, None]], dim=1).to(torch.float64).reshape(-1),
            magnitude.reshape(-1),
            pair_counts.to(torch.float64).reshape(-1),
            pair_sums.reshape(-1),
        ]
    )


def _one_step(flat_base, flat_agents, start, stop, key_dtype, like: torch.Tensor) -> torch.Tensor:
    """[n, k] in `like`'s dtype: 1.0 where an agent's value is one step of `key_dtype` from the base's."""
    view = _KEYS[key_dtype]
    keys = torch.stack([a[start:stop].to(key_dtype) for a in flat_agents]).view(view)
    kb = flat_base[start:stop].to(key_dtype).view(view)
    gap = _ordered(keys).sub_(_ordered(kb.clone()))  # wraps in the view's width: never to +-1 (see _native.c)
    return torch.eq(gap.abs_(), 1, out=torch.empty_like(like))


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """In place: sign-magnitude bits to ordered integers, adjacent floats one apart (+0 and -0 both 0)."""
    width = bits.element_size() * 8
    sign = torch.bitwise_right_shift(bits, width - 1)  # -1 for a negative value, 0 otherwise
    magnitude = (1 << (width - 1)) - 1
    return bits.bitwise_xor_(sign.bitwise_and(magnitude)).sub_(sign)


def merge_into(base, agents, lambdas: Sequence[float], epsilon: float, flat_out: torch.Tensor, step: int, pool: Pool):
    """Eq. 7 into `flat_out`; returns a 0-dim tensor, 1.0 when every result is finite as rounded into it."""
    n, numel, device = len(agents), base.numel(), base.device
    cdtype = compute_dtype(base, agents)
    view, shift = _BITS[cdtype]
    largest = torch.finfo(cdtype).max
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    lams = torch.tensor([float(x) for x in lambdas], dtype=cdtype, device=device)[:, None]  # float32 like _native.c

    def work(chunks):
        size = chunks[0][1] - chunks[0][0]
        bk = torch.empty(size, dtype=cdtype, device=device)
        d, m = torch.empty(n, size, dtype=cdtype, device=device), torch.empty(n, size, dtype=cdtype, device=device)
        total, scaled = torch.empty_like(bk), torch.empty_like(bk)
        hits, one = torch.empty_like(bk), torch.empty_like(bk)
        fine = torch.ones_like(bk)  # 1.0 while every result written at this position was finite
        for start, stop in chunks:
            k = stop - start
            _masks(flat_base, flat_agents, start, stop, bk, d, m)
            dk, mk = d[:, :k], m[:, :k]
            tk, sk, hk, ok = total[:k], scaled[:k], hits[:k], one[:k]
            torch.gt(mk, epsilon, out=mk)
            dk.mul_(mk)  # the kept deltas: d or +-0 (NaN stays NaN, and makes the result NaN: caught below)
            torch.sum(mk, dim=0, out=hk)
            # lambda * kept rounded on its own, then added: `add_(alpha=)` fuses the two (an FMA: one rounding), which
            # gave -0 where _native.c's +0 + (lambda * tiny kept, rounded to -0) gives +0
            torch.mul(dk, lams, out=mk)
            tk.zero_()
            sk.zero_()
            for t in range(n):  # in agent order from +0, as _native.c adds them
                tk.add_(dk[t])
                sk.add_(mk[t])
            torch.eq(hk, 1, out=ok)
            tk.div_(hk.clamp_(min=1))  # one agent: its scaled delta (selected next); several: their mean
            _select(tk.view(view), sk.view(view), ok.view(view), shift)
            tk.add_(bk[:k])
            flat_out[start:stop].copy_(tk)
            ok.copy_(flat_out[start:stop]).abs_()  # the result as rounded once, read back exactly
            fine[:k].mul_(torch.le(ok, largest, out=ok))  # NaN: 0.0
        return fine.amin()

    return torch.stack(_shared_out(numel, step, device, work, pool)).amin()


def _select(into: torch.Tensor, other: torch.Tensor, flag: torch.Tensor, shift: int) -> None:
    """In place on the float bits: `into` takes `other`'s bits where `flag` holds 1.0's, keeps its own where 0.0's
    (`torch.where` into a float buffer, without the bool mask that costs 10x its arithmetic)."""
    mask = torch.bitwise_right_shift(flag, shift, out=flag).neg_()  # 1.0 -> 1 -> all ones; 0.0 -> 0
    into.bitwise_xor_(torch.bitwise_xor(into, other).bitwise_and_(mask))
