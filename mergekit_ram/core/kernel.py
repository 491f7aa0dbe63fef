"""RAM / RAM+ arithmetic on plain tensors (Eqs. 1, 2, 6, 7 of arXiv 2601.13572).

Knows nothing of mergekit. Both passes stream over the agents one flat chunk at a
time, so scratch memory is a few chunk-sized buffers whatever the tensor size:
no N x P stacks, no full-size masks. Deltas are formed in float32 (float64 for
float64 inputs); the result is rounded once, to the requested dtype.

On CPU, bf16/fp16/fp32 inputs go through the fused loops of `native` (one pass
over memory instead of ~8 per agent); the torch code below is the portable path
(GPU, float64, no C compiler, or an explicit `chunk=`), with identical masks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_ram.core import native

# the scalar formulas (Eqs. 2, 6, RAM+s), offered here beside the tensor math
from mergekit_ram.core.formulas import lambda_clip as lambda_clip
from mergekit_ram.core.formulas import lambda_soft as lambda_soft
from mergekit_ram.core.formulas import rho as rho
from mergekit_ram.errors import NonFiniteInputError as NonFiniteInputError
from mergekit_ram.errors import NonFiniteResultError as NonFiniteResultError

CHUNK_CPU = 1 << 18
CHUNK_ACCELERATOR = 1 << 24
_FLOAT32_MAX = torch.finfo(torch.float32).max


def active(delta: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Eq. 1: an entry is active when |tau| > epsilon (strict, absolute)."""
    return delta.abs() > epsilon


@torch.no_grad()
def count(
    base: torch.Tensor,
    agents: Sequence[torch.Tensor],
    epsilon: float,
    *,
    names: Sequence[str] | None = None,
    tensor_name: str | None = None,
    base_name: str | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Per agent: its active entries, those no other agent changed (unique), and
    those exactly one other agent changed too (pair).

    Returns an int64 tensor of shape [N, 3] (active, unique, pair) on the inputs'
    device; shared = active - unique, shared with two or more others =
    active - unique - pair. Uses the same mask function as `merge`.
    """
    _check_shapes(base, agents, names, tensor_name)
    n = len(agents)
    totals = torch.zeros(n, 3, dtype=torch.int64, device=base.device)
    if n == 0 or base.numel() == 0:
        return totals
    if chunk is None and native.supports(base, agents):
        totals, bad = native.count(base, agents, epsilon, tensor_name)
        if bad:
            _raise_non_finite(base, agents, names, tensor_name, base_name)
        return totals
    cdtype = _compute_dtype(base, agents)
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = _chunk(base, chunk)
    size = min(step, base.numel())
    b = torch.empty(size, dtype=cdtype, device=base.device)
    d = torch.empty_like(b)
    masks = torch.empty(n, size, dtype=torch.bool, device=base.device)
    hits = torch.empty(size, dtype=_counter(n), device=base.device)
    peaks = torch.zeros(n, dtype=cdtype, device=base.device)
    for start in range(0, base.numel(), step):
        stop = min(start + step, base.numel())
        k = stop - start
        bk, dk, mk, hk = b[:k], d[:k], masks[:, :k], hits[:k]
        bk.copy_(flat_base[start:stop])
        hk.zero_()
        for t, agent in enumerate(flat_agents):
            torch.sub(agent[start:stop], bk, out=dk)
            dk.abs_()
            peaks[t] = torch.maximum(peaks[t], dk.max())
            torch.gt(dk, epsilon, out=mk[t])
            hk.add_(mk[t])
        totals[:, 0] += mk.sum(dim=1)
        totals[:, 1] += (mk & (hk == 1)).sum(dim=1)
        totals[:, 2] += (mk & (hk == 2)).sum(dim=1)
    _check_finite(peaks, base, agents, names, tensor_name, base_name)
    return totals


@dataclass(frozen=True)
class Diagnosis:
    """What one statistics pass over a tensor finds, beyond the counts (see `diagnose`).

    counts [N, 3]: active, unique, pair (as `count`); single [N]: active entries that are one
    step of the tensor's dtype away from the base; magnitude [N, 2]: sum of |tau| over the
    agent's unique and over its shared entries; pair_counts [P, 2] for each pair i < j (row
    major): entries both changed, of those with the same sign; pair_sums [P, 3]: sum tau_i tau_j,
    sum tau_i^2, sum tau_j^2 over those entries. Sums in float64.
    """

    counts: torch.Tensor
    single: torch.Tensor
    magnitude: torch.Tensor
    pair_counts: torch.Tensor
    pair_sums: torch.Tensor


def pairs(n: int) -> list[tuple[int, int]]:
    """The agent pairs i < j in the order `diagnose` reports them."""
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


@torch.no_grad()
def diagnose(
    base: torch.Tensor,
    agents: Sequence[torch.Tensor],
    epsilon: float,
    *,
    names: Sequence[str] | None = None,
    tensor_name: str | None = None,
    base_name: str | None = None,
    chunk: int | None = None,
) -> Diagnosis:
    """`count`, plus how the agents' updates relate: one pass, the same masks.

    Tells apart agents whose shared entries are rounding-level noise (one step of the
    dtype, small share of |tau|) from agents that share a real update (same sign,
    cosine near 1), and from conflicting ones (opposite signs).
    """
    _check_shapes(base, agents, names, tensor_name)
    n, p = len(agents), len(agents) * (len(agents) - 1) // 2
    if chunk is None and n and base.numel() and native.supports(base, agents):
        ints, sums, bad = native.diagnose(base, agents, epsilon, tensor_name)
        if bad:
            _raise_non_finite(base, agents, names, tensor_name, base_name)
        per = ints[: 4 * n].view(n, 4)
        return Diagnosis(
            counts=per[:, :3].clone(),
            single=per[:, 3].clone(),
            magnitude=sums[: 2 * n].view(n, 2).clone(),
            pair_counts=ints[4 * n :].view(p, 2).clone(),
            pair_sums=sums[2 * n :].view(p, 3).clone(),
        )
    device = base.device
    counts = torch.zeros(n, 3, dtype=torch.int64, device=device)
    single = torch.zeros(n, dtype=torch.int64, device=device)
    magnitude = torch.zeros(n, 2, dtype=torch.float64, device=device)
    pair_counts = torch.zeros(p, 2, dtype=torch.int64, device=device)
    pair_sums = torch.zeros(p, 3, dtype=torch.float64, device=device)
    if n == 0 or base.numel() == 0:
        return Diagnosis(counts, single, magnitude, pair_counts, pair_sums)
    promoted = _promoted(base, agents)
    cdtype = _compute_dtype(base, agents)
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = _chunk(base, chunk)
    peaks = torch.zeros(n, dtype=cdtype, device=device)
    for start in range(0, base.numel(), step):
        stop = min(start + step, base.numel())
        b = flat_base[start:stop].to(cdtype)
        kb = _keys(flat_base[start:stop].to(promoted))
        deltas = torch.stack([a[start:stop].to(cdtype) - b for a in flat_agents])
        size = deltas.abs()
        peaks = torch.maximum(peaks, size.amax(dim=1))
        masks = size > epsilon
        hits = masks.sum(dim=0)
        unique = masks & (hits == 1)
        counts[:, 0] += masks.sum(dim=1)
        counts[:, 1] += unique.sum(dim=1)
        counts[:, 2] += (masks & (hits == 2)).sum(dim=1)
        for t, a in enumerate(flat_agents):
            gap = _keys(a[start:stop].to(promoted)) - kb
            single[t] += (masks[t] & (gap.abs() == 1)).sum()
        wide = size.to(torch.float64)  # |x| then widening: exact, the same as widening then |x|
        magnitude[:, 0] += (wide * unique).sum(dim=1)
        magnitude[:, 1] += (wide * (masks & (hits >= 2))).sum(dim=1)
        for k, (i, j) in enumerate(pairs(n)):
            both = masks[i] & masks[j]
            u, v = deltas[i][both].to(torch.float64), deltas[j][both].to(torch.float64)
            uv = u * v
            pair_counts[k, 0] += both.sum()
            pair_counts[k, 1] += (uv > 0).sum()
            pair_sums[k, 0] += uv.sum()
            pair_sums[k, 1] += (u * u).sum()
            pair_sums[k, 2] += (v * v).sum()
    _check_finite(peaks, base, agents, names, tensor_name, base_name)
    return Diagnosis(counts, single, magnitude, pair_counts, pair_sums)


_KEY_VIEWS = {
    torch.float64: (torch.int64, (1 << 63) - 1),
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
}


def _keys(values: torch.Tensor) -> torch.Tensor:
    """Ordered integer keys: adjacent floats of one dtype have keys one apart (+0 and -0 both 0)."""
    view, magnitude = _KEY_VIEWS[values.dtype]
    bits = values.view(view).to(torch.int64)
    return torch.where(bits < 0, -(bits & magnitude), bits)


@torch.no_grad()
def merge(
    base: torch.Tensor,
    agents: Sequence[torch.Tensor],
    lambdas: Sequence[float],
    epsilon: float,
    *,
    out_dtype: torch.dtype | None = None,
    names: Sequence[str] | None = None,
    tensor_name: str | None = None,
    base_name: str | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Eq. 7: base where no agent is active, base + lambda_t * tau_t where only
    agent t is, base + the mean of the active deltas where two or more are.

    Sub-threshold deltas are dropped. The result has the base's shape and
    `out_dtype` (default: the inputs' promoted dtype), rounded once. NonFiniteInputError
    when an input holds NaN or Inf; NonFiniteResultError, naming the entry, the agent, its
    lambda and the dtype, when finite inputs merge to a value that dtype cannot hold.
    """
    _check_shapes(base, agents, names, tensor_name)
    if len(lambdas) != len(agents):
        raise ValueError(f"got {len(lambdas)} lambdas for {len(agents)} agents")
    # float32 range, not float64's: the loops scale in float32, where a larger lambda is
    # Inf and 0 * Inf (an agent inactive at an entry) is NaN in the merged weights.
    if not all(math.isfinite(lam) and abs(lam) <= _FLOAT32_MAX for lam in lambdas):
        raise ValueError(f"every lambda must be finite in float32, got {list(lambdas)}")
    if out_dtype is None:
        out_dtype = _promoted(base, agents)
    out = torch.empty(base.shape, dtype=out_dtype, device=base.device)
    if base.numel() == 0:
        return out
    flat_out = out.view(-1)
    if not agents:
        flat_out.copy_(base.reshape(-1))
        return out
    if chunk is None and native.supports(base, agents, out_dtype):
        found = native.merge(base, agents, lambdas, epsilon, flat_out)
        if found & native.NON_FINITE_INPUT:
            _raise_non_finite(base, agents, names, tensor_name, base_name)
        if found & native.NON_FINITE_RESULT:
            _raise_non_finite_result(base, agents, lambdas, epsilon, out, names, tensor_name)
        return out
    cdtype = _compute_dtype(base, agents)
    flat_base, flat_agents = base.reshape(-1), [a.reshape(-1) for a in agents]
    step = _chunk(base, chunk)
    size = min(step, base.numel())
    b = torch.empty(size, dtype=cdtype, device=base.device)
    d, a = torch.empty_like(b), torch.empty_like(b)
    total, scaled = torch.empty_like(b), torch.empty_like(b)
    m = torch.empty(size, dtype=torch.bool, device=base.device)
    hits = torch.empty(size, dtype=_counter(len(agents)), device=base.device)
    peaks = torch.zeros(len(agents), dtype=cdtype, device=base.device)
    finite = torch.ones((), dtype=torch.bool, device=base.device)  # every result, as written
    for start in range(0, base.numel(), step):
        stop = min(start + step, base.numel())
        k = stop - start
        bk, dk, ak, mk, hk = b[:k], d[:k], a[:k], m[:k], hits[:k]
        tk, sk = total[:k], scaled[:k]
        bk.copy_(flat_base[start:stop])
        tk.zero_()
        sk.zero_()
        hk.zero_()
        for t, agent in enumerate(flat_agents):
            torch.sub(agent[start:stop], bk, out=dk)
            torch.abs(dk, out=ak)
            peaks[t] = torch.maximum(peaks[t], ak.max())
            torch.gt(ak, epsilon, out=mk)
            dk.mul_(mk)
            tk.add_(dk)
            sk.add_(dk, alpha=float(lambdas[t]))
            hk.add_(mk)
        # one agent: its scaled delta; several: their mean; none: total is 0.
        tk.div_(hk.clamp(min=1))
        torch.where(hk == 1, sk, tk, out=tk)
        tk.add_(bk)
        flat_out[start:stop].copy_(tk)
        finite &= torch.isfinite(flat_out[start:stop]).all()  # the chunk as rounded once, still in cache
    _check_finite(peaks, base, agents, names, tensor_name, base_name)
    if not bool(finite):
        _raise_non_finite_result(base, agents, lambdas, epsilon, out, names, tensor_name)
    return out


def _counter(n: int) -> torch.dtype:
    return torch.uint8 if n < 255 else torch.int32


def _promoted(base: torch.Tensor, agents: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = base.dtype
    for a in agents:
        dtype = torch.promote_types(dtype, a.dtype)
    return dtype


def _compute_dtype(base: torch.Tensor, agents: Sequence[torch.Tensor]) -> torch.dtype:
    return torch.float64 if _promoted(base, agents) == torch.float64 else torch.float32


def _chunk(base: torch.Tensor, chunk: int | None) -> int:
    if chunk is not None:
        if chunk < 1:
            raise ValueError("chunk must be positive")
        return chunk
    return CHUNK_CPU if base.device.type == "cpu" else CHUNK_ACCELERATOR


def _label(names: Sequence[str] | None, index: int) -> str:
    return names[index] if names is not None else f"agent #{index}"


def _check_shapes(base, agents, names, tensor_name) -> None:
    if names is not None and len(names) != len(agents):
        raise ValueError(f"got {len(names)} names for {len(agents)} agents")
    where = f" in tensor {tensor_name}" if tensor_name else ""
    for i, a in enumerate(agents):
        if a.shape != base.shape:
            raise ValueError(
                f"shape mismatch{where}: {_label(names, i)} has {tuple(a.shape)}, base has {tuple(base.shape)}"
            )
        if a.device != base.device:
            raise ValueError(f"device mismatch{where}: {_label(names, i)} is on {a.device}")
        if not a.is_floating_point():
            raise TypeError(f"{_label(names, i)}{where} is not floating point ({a.dtype})")
    if not base.is_floating_point():
        raise TypeError(f"base{where} is not floating point ({base.dtype})")


def _check_finite(peaks, base, agents, names, tensor_name, base_name) -> None:
    # max() propagates NaN and Inf, so one small sync per tensor covers every entry.
    if not bool(torch.isfinite(peaks).all()):
        _raise_non_finite(base, agents, names, tensor_name, base_name)


#: the dtype to suggest when a result does not fit the one it is written in
_WIDER = {torch.float16: "float32", torch.bfloat16: "float32", torch.float32: "float64"}


def _raise_non_finite_result(base, agents, lambdas, epsilon, out, names, tensor_name) -> None:
    """NonFiniteResultError naming the first entry of `out` (inputs finite) that is not finite: who changed it,
    by how much, with which lambda, and what to do."""
    flat = out.reshape(-1)
    bad = ~torch.isfinite(flat)
    index, count = int(bad.nonzero()[0]), int(bad.sum())
    cdtype = _compute_dtype(base, agents)
    b = float(base.reshape(-1)[index].to(cdtype))
    deltas = [float(a.reshape(-1)[index].to(cdtype)) - b for a in agents]
    active = [t for t, d in enumerate(deltas) if abs(d) > epsilon]
    dtype = str(out.dtype).removeprefix("torch.")
    if len(active) == 1:
        (t,) = active
        why = (
            f"only {_label(names, t)} changed it (by {deltas[t]:g}), and its lambda = {lambdas[t]:.6g} makes "
            f"base + lambda * tau = {b + lambdas[t] * deltas[t]:g}"
        )
    elif active:
        why = f"{', '.join(_label(names, t) for t in active)} changed it; their mean update makes it too large"
    else:
        why = f"no agent changed it, and the base's value {b:g} is too large"
    where = f"tensor {tensor_name}" if tensor_name else "the tensor"
    wider = _WIDER.get(out.dtype)
    fix = f"in a wider dtype (`dtype` or `out_dtype: {wider}`) or with a smaller `r`" if wider else "with a smaller `r`"
    raise NonFiniteResultError(
        f"{where}: the merge of finite inputs is not finite in {dtype} at {count:,} entr{'y' if count == 1 else 'ies'}"
        f"; at entry {index}, {why}, beyond {dtype}'s largest value {torch.finfo(out.dtype).max:g}. Merge {fix}",
        tensor=tensor_name,
    )


def _raise_non_finite(base, agents, names, tensor_name, base_name) -> None:
    where = f"tensor {tensor_name}" if tensor_name else "the tensor"
    if not bool(torch.isfinite(base).all()):
        label = f"the base model {base_name}" if base_name else "the base model"
        raise NonFiniteInputError(f"{where} of {label} contains NaN or Inf")
    for i, a in enumerate(agents):
        if not bool(torch.isfinite(a).all()):
            raise NonFiniteInputError(f"{where} of {_label(names, i)} contains NaN or Inf")
    raise NonFiniteInputError(f"{where}: a task vector overflows to Inf")
