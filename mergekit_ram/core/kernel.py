"""RAM / RAM+ arithmetic on plain tensors (Eqs. 1, 2, 6, 7 of arXiv 2601.13572).

Knows nothing of mergekit. Both passes stream over the agents one flat chunk at a
time, so scratch memory is a few [N, chunk] buffers whatever the tensor size:
no full-size masks. Deltas are formed in float32 (float64 for
float64 inputs); the result is rounded once, to the requested dtype.

On CPU, bf16/fp16/fp32 inputs go through the fused loops of `native` (one pass
over memory); the torch loops of `torch_loops` are the portable path (GPU, float64,
no C compiler, or an explicit `chunk=`), with identical masks and float32 sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_ram.core import native, torch_loops

# the scalar formulas (Eqs. 2, 6, RAM+s), offered here beside the tensor math
from mergekit_ram.core.formulas import lambda_clip as lambda_clip
from mergekit_ram.core.formulas import lambda_soft as lambda_soft
from mergekit_ram.core.formulas import rho as rho
from mergekit_ram.errors import NonFiniteInputError as NonFiniteInputError
from mergekit_ram.errors import NonFiniteResultError as NonFiniteResultError

#: entries per chunk of the torch path on a CPU. Smaller chunks keep the [N, chunk] buffers nearer the core, but each
#: op must run long beside the Python call around it, or the pool's threads spend their time handing the GIL over
#: and two threads run slower than one; 2**17 weighs the two (the sweep over chunk sizes: benchmarks/README.md,
#: "Without a compiler, on a quiet machine")
CHUNK_CPU = 1 << 17
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
    table, peaks = torch_loops.count_chunks(base, agents, epsilon, _chunk(base, chunk), native.in_pool, diagnose=False)
    _check_finite(peaks, base, agents, names, tensor_name, base_name)
    return table.sum(dim=0).view(n, 3).to(torch.int64)


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
    elif n == 0 or base.numel() == 0:
        ints = torch.zeros(4 * n + 2 * p, dtype=torch.int64, device=base.device)
        sums = torch.zeros(2 * n + 3 * p, dtype=torch.float64, device=base.device)
    else:
        table, peaks = torch_loops.count_chunks(
            base, agents, epsilon, _chunk(base, chunk), native.in_pool, diagnose=True
        )
        _check_finite(peaks, base, agents, names, tensor_name, base_name)
        row = table.sum(dim=0)  # the chunks' rows in chunk order: the same bits for any number of threads
        ints = torch.cat([row[: 4 * n], row[6 * n : 6 * n + 2 * p]]).to(torch.int64)
        sums = torch.cat([row[4 * n : 6 * n], row[6 * n + 2 * p :]])
    per = ints[: 4 * n].view(n, 4)
    return Diagnosis(
        counts=per[:, :3].clone(),
        single=per[:, 3].clone(),
        magnitude=sums[: 2 * n].view(n, 2).clone(),
        pair_counts=ints[4 * n :].view(p, 2).clone(),
        pair_sums=sums[2 * n :].view(p, 3).clone(),
    )


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
        out_dtype = torch_loops.promoted(base, agents)
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
    finite = torch_loops.merge_into(base, agents, lambdas, epsilon, flat_out, _chunk(base, chunk), native.in_pool)
    if not bool(finite):  # a NaN or Inf input, a task vector beyond float32 or a result beyond out_dtype
        _check_finite(
            torch_loops.count_chunks(base, agents, epsilon, _chunk(base, chunk), native.in_pool, diagnose=False)[1],
            base,
            agents,
            names,
            tensor_name,
            base_name,
        )
        _raise_non_finite_result(base, agents, lambdas, epsilon, out, names, tensor_name)
    return out


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
    cdtype = torch_loops.compute_dtype(base, agents)
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
