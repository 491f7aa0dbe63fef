"""An independent float64 reference of RAM / RAM+ (Eqs. 1, 2, 6, 7) over whole models.

Deliberately naive: whole tensors, float64, no chunking, and no import of
mergekit_ram. `names` selects the tensors that take part (mergekit neither merges
nor counts a tied lm_head.weight, and it copies non-float buffers).

Per-tensor epsilon / r (mergekit filters) are given as a number, a mapping
name -> number, or a callable name -> number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Union

import torch

PerTensor = Union[float, Mapping[str, float], Callable[[str], float]]
Agents = Union[Mapping[Hashable, Mapping[str, torch.Tensor]], Sequence[Mapping[str, torch.Tensor]]]


@dataclass(frozen=True)
class RefStats:
    active: int
    shared: int
    unique: int
    pair: int = 0  # active entries exactly one other agent changed too

    @property
    def rho(self) -> float:
        if self.unique == 0:
            return math.inf
        return self.shared / self.unique

    def lam(self, r: float, alpha: float) -> float:
        if r == 0:
            return 1.0
        return 1.0 + r * min(max(self.rho, 0.0), alpha)


def _value(setting: PerTensor, name: str) -> float:
    if callable(setting):
        return float(setting(name))
    if isinstance(setting, Mapping):
        return float(setting[name])
    return float(setting)


def _items(agents: Agents):
    if isinstance(agents, Mapping):
        return list(agents.items())
    return list(enumerate(agents))


def _names(base, names):
    if names is None:
        return [k for k, v in base.items() if v.is_floating_point()]
    return list(names)


def task_vector(base: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
    return agent.to(torch.float64) - base.to(torch.float64)


def reference_masks(
    base: Mapping[str, torch.Tensor], agents: Agents, eps: PerTensor, name: str
) -> torch.Tensor:
    """[N, numel] bool: Eq. 1, |tau| > eps, strict."""
    e = _value(eps, name)
    rows = [task_vector(base[name], sd[name]).reshape(-1).abs() > e for _, sd in _items(agents)]
    return torch.stack(rows) if rows else torch.zeros(0, base[name].numel(), dtype=torch.bool)


def reference_stats(
    base: Mapping[str, torch.Tensor],
    agents: Agents,
    eps: PerTensor = 1e-5,
    names: Optional[Sequence[str]] = None,
) -> Dict[Hashable, RefStats]:
    """Per agent: active / shared / unique entries summed over every named tensor."""
    items = _items(agents)
    totals = {key: [0, 0, 0, 0] for key, _ in items}
    for name in _names(base, names):
        masks = reference_masks(base, agents, eps, name)
        c = masks.sum(dim=0)
        for row, (key, _) in zip(masks, items):
            totals[key][0] += int(row.sum())
            totals[key][1] += int((row & (c >= 2)).sum())
            totals[key][2] += int((row & (c == 1)).sum())
            totals[key][3] += int((row & (c == 2)).sum())
    return {key: RefStats(*v) for key, v in totals.items()}


def reference_merge(
    base: Mapping[str, torch.Tensor],
    agents: Agents,
    eps: PerTensor = 1e-5,
    r: PerTensor = 0.1,
    alpha: float = 2.0,
    names: Optional[Sequence[str]] = None,
    rho: Optional[Mapping[Hashable, Optional[float]]] = None,
    rho_scope: str = "model",
    lambda_rule: str = "clip",
) -> Dict[str, torch.Tensor]:
    """Eq. 7 with the global rho of Eq. 2 (unless given per agent) and lambda of Eq. 6.

    `rho_scope` "layer" / "tensor" counts rho per transformer block / per tensor
    instead (see `reference_group`); `lambda_rule` "soft" is RAM+s (App. E):
    lambda = 1 + r * rho / (1 + rho). Returns float64 tensors for every named tensor."""
    items = _items(agents)
    names = _names(base, names)
    group_rhos = reference_group_rhos(base, agents, eps, names, rho_scope)
    out = {}
    for name in names:
        rhos = {}
        for key, _ in items:
            given = None if rho is None else rho.get(key)
            rhos[key] = group_rhos[reference_group(name, rho_scope)][key] if given is None else float(given)
        rr = _value(r, name)
        b = base[name].to(torch.float64)
        taus = [task_vector(base[name], sd[name]) for _, sd in items]
        e = _value(eps, name)
        masks = [t.abs() > e for t in taus]
        count = torch.zeros_like(b)
        total = torch.zeros_like(b)
        for t, m in zip(taus, masks):
            count += m
            total += torch.where(m, t, torch.zeros_like(t))
        merged = b.clone()
        shared = count >= 2
        merged[shared] = b[shared] + total[shared] / count[shared]
        for (key, _), t, m in zip(items, taus, masks):
            lam = reference_lambda(rhos[key], rr, alpha, lambda_rule)
            only = m & (count == 1)
            merged[only] = b[only] + lam * t[only]
        out[name] = merged
    return out


def reference_lambda(rho: float, r: float, alpha: float, rule: str = "clip") -> float:
    """Eq. 6 (`clip`: 1 + r * clip(rho, 0, alpha)) or RAM+s (`soft`: 1 + r * rho / (1 + rho),
    which tends to 1 + r as rho -> inf)."""
    if r == 0:
        return 1.0
    if rule == "clip":
        return 1.0 + r * min(max(rho, 0.0), alpha)
    if rule == "soft":
        return 1.0 + r * (1.0 if math.isinf(rho) else rho / (1.0 + rho))
    raise ValueError(rule)


def reference_group(name: str, scope: str = "model") -> str:
    """Which tensors share one rho: all of them (`model`), one transformer block
    `...layers.<i>` (`layer`; a tensor outside the blocks is its own group), or
    each tensor alone (`tensor`). Written for the test models' naming only."""
    if scope == "model":
        return ""
    if scope == "tensor":
        return name
    if scope == "layer":
        parts = name.split(".")
        for i in range(len(parts) - 2):
            if parts[i] == "layers" and parts[i + 1].isdigit():
                return ".".join(parts[: i + 2])
        return name
    raise ValueError(scope)


def reference_group_rhos(
    base: Mapping[str, torch.Tensor],
    agents: Agents,
    eps: PerTensor = 1e-5,
    names: Optional[Sequence[str]] = None,
    scope: str = "model",
) -> Dict[str, Dict[Hashable, float]]:
    """group -> agent -> rho of Eq. 2 counted over the group's tensors only."""
    names = _names(base, names)
    groups: Dict[str, List[str]] = {}
    for name in names:
        groups.setdefault(reference_group(name, scope), []).append(name)
    out = {}
    for group, members in groups.items():
        stats = reference_stats(base, agents, eps, members)
        out[group] = {key: s.rho for key, s in stats.items()}
    return out


def reference_magnitudes(
    base: Mapping[str, torch.Tensor], agents: Agents, names: Optional[Sequence[str]] = None
) -> Dict[str, torch.Tensor]:
    """|base| + 2 * sum_t |tau_t|: the size of every intermediate value of Eq. 7
    (lambda <= 2 in the tests), for an accumulation-error allowance."""
    out = {}
    for name in _names(base, names):
        b = base[name].to(torch.float64)
        acc = b.abs()
        for _, sd in _items(agents):
            acc = acc + 2 * task_vector(base[name], sd[name]).abs()
        out[name] = acc
    return out


# ---------------------------------------------------------------- comparisons

_PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |x| (float64 result; subnormal spacing at 0)."""
    x = x.to(torch.float64).abs()
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps
    _, e = torch.frexp(x)
    spacing = torch.ldexp(torch.ones_like(x), e - _PRECISION[dtype])
    return torch.where(x == 0, torch.full_like(x, tiny), spacing.clamp(min=tiny))


def rounding_report(
    out: torch.Tensor,
    ref64: torch.Tensor,
    magnitude: Optional[torch.Tensor] = None,
    *,
    acc_dtype: torch.dtype = torch.float32,
    acc_ulps: float = 4.0,
):
    """(max excess over the bound, fraction exactly equal to ref64 rounded once)."""
    o = out.to(torch.float64)
    ref64 = ref64.to(torch.float64)
    if magnitude is None:
        magnitude = ref64.abs()
    bound = 0.5 * ulp(torch.maximum(ref64.abs(), o.abs()), out.dtype) + acc_ulps * ulp(
        magnitude, acc_dtype
    )
    excess = ((o - ref64).abs() - bound).max().item() if o.numel() else -1.0
    # an output wider than the arithmetic carries the arithmetic's precision only
    narrow = out.dtype if _PRECISION[out.dtype] <= _PRECISION[acc_dtype] else acc_dtype
    same = out.to(narrow) == ref64.to(narrow)
    exact = same.double().mean().item() if o.numel() else 1.0
    return excess, exact


def assert_rounded_equal(
    out: torch.Tensor,
    ref64: torch.Tensor,
    magnitude: Optional[torch.Tensor] = None,
    *,
    label: str = "",
    acc_dtype: torch.dtype = torch.float32,
    acc_ulps: float = 4.0,
    min_exact: Optional[float] = None,
) -> None:
    """`out` equals the float64 reference up to the single output rounding.

    |out - ref| <= 0.5 ULP of out.dtype at ref, plus `acc_ulps` ULPs of `acc_dtype`
    at the magnitudes involved (float32 accumulation), and at least `min_exact` of
    the entries equal ref64.to(out.dtype) exactly. NaN or Inf never passes.

    `min_exact` defaults to 0.99 when the output is narrower than the accumulation
    dtype (bf16/fp16 from float32, float32 from float64): then one rounding
    dominates. When both are the same (float32 in, float32 out), float32 arithmetic
    rounds several times, so only the ULP bound is strict and 85% must be exact
    (compared at the arithmetic's precision when the output is wider)."""
    if min_exact is None:
        min_exact = 0.99 if _PRECISION[out.dtype] < _PRECISION[acc_dtype] else 0.85
    assert out.shape == ref64.shape, f"{label}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert bool(torch.isfinite(out).all()), f"{label}: non-finite output"
    excess, exact = rounding_report(out, ref64, magnitude, acc_dtype=acc_dtype, acc_ulps=acc_ulps)
    if excess > 0:
        o = out.to(torch.float64)
        i = int(((o - ref64).abs()).reshape(-1).argmax())
        raise AssertionError(
            f"{label}: |out - ref| exceeds the rounding bound by {excess:.3g} "
            f"(worst at flat {i}: out={o.reshape(-1)[i].item()!r}, ref={ref64.reshape(-1)[i].item()!r})"
        )
    assert exact >= min_exact, f"{label}: only {100 * exact:.2f}% of entries equal ref rounded once"


def assert_state_dict_matches(
    out: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    magnitudes: Optional[Mapping[str, torch.Tensor]] = None,
    **kwargs,
) -> None:
    assert set(out) == set(ref), f"tensor names differ: {sorted(set(out) ^ set(ref))}"
    for name in ref:
        assert_rounded_equal(
            out[name], ref[name], None if magnitudes is None else magnitudes[name], label=name, **kwargs
        )


def names_list(base: Mapping[str, torch.Tensor], exclude: Sequence[str] = ()) -> List[str]:
    return [k for k, v in base.items() if v.is_floating_point() and k not in exclude]


# ---------------------------------------------------------------- diagnostics (issue 17)


def _ranks(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Position of each value among all finite numbers of `dtype`, in order (+0 and -0 one number).

    bf16 and fp16 by enumerating every bit pattern; float32 by counting nextafter steps is
    too slow, so float32 ranks come from `single_steps` below instead."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float64)
    table = torch.unique(every[torch.isfinite(every)])  # sorted, -0 == +0
    return torch.searchsorted(table, values.to(torch.float64))


def single_steps(base: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
    """bool: the agent's value is the representable neighbour of the base's, in their dtype."""
    if base.dtype in (torch.bfloat16, torch.float16):
        return (_ranks(agent, base.dtype) - _ranks(base, base.dtype)).abs() == 1
    towards = torch.nextafter(base, torch.where(agent >= base, torch.full_like(base, math.inf), torch.full_like(base, -math.inf)))
    return (agent == towards) & (agent != base)


def reference_diagnostics(base: torch.Tensor, agents: Sequence[torch.Tensor], eps: float) -> dict:
    """The diagnostics of one tensor from the definitions, in float64:
    single[t], magnitude[t] = (sum |tau| unique, sum |tau| shared),
    pairs[(i, j)] = (common, same sign, sum tau_i tau_j, sum tau_i^2, sum tau_j^2)."""
    taus = [task_vector(base, a).reshape(-1) for a in agents]
    masks = [t.abs() > eps for t in taus]
    hits = torch.stack(masks).sum(dim=0) if masks else None
    out = {"single": [], "magnitude": [], "pairs": {}}
    for tau, mask, agent in zip(taus, masks, agents):
        out["single"].append(int((mask & single_steps(base.reshape(-1), agent.reshape(-1))).sum()))
        out["magnitude"].append(
            (float(tau[mask & (hits == 1)].abs().sum()), float(tau[mask & (hits >= 2)].abs().sum()))
        )
    for i in range(len(agents)):
        for j in range(i + 1, len(agents)):
            both = masks[i] & masks[j]
            u, v = taus[i][both], taus[j][both]
            out["pairs"][(i, j)] = (
                int(both.sum()), int((u * v > 0).sum()), float((u * v).sum()), float((u * u).sum()),
                float((v * v).sum()),
            )
    return out
