"""In-memory RAM+ for notebooks and evolution loops: state dicts in, state dict out.

Same kernel and the same whole-model rho as `merge_method: ramplus`, without
files or mergekit's planner. Non-float buffers are copied when every input
agrees. Keys that share storage in every input (tied embeddings) are counted
and merged once, as mergekit counts a tied lm_head once.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from mergekit_ram.core import kernel, params, statistics
from mergekit_ram.core.params import DEFAULTS
from mergekit_ram.errors import RamError

StateDict = Mapping[str, torch.Tensor]
StateDictLike = StateDict | torch.nn.Module
Agents = Mapping[Hashable, StateDictLike] | Sequence[StateDictLike]


def agent_statistics(
    base: StateDictLike, agents: Agents, *, epsilon: float = DEFAULTS["epsilon"]
) -> dict[Hashable, statistics.AgentStats]:
    """Whole-model counts per agent (density, unique, shared, rho)."""
    epsilon = _checked("epsilon", epsilon, label="epsilon")
    base_sd, named = _inputs(base, agents)
    totals = _count(base_sd, named, epsilon).totals()
    return {name: totals[str(name)] for name, _ in named}


def _checked(name: str, value: Any, **how: Any) -> Any:
    """`params.check`, its refusal a `RamError` (params is a leaf below `errors`)."""
    try:
        return params.check(name, value, **how)
    except ValueError as error:
        raise RamError(str(error)) from None


def _count(base_sd: StateDict, named, epsilon: float) -> statistics.Statistics:
    labels = [str(n) for n, _ in named]
    stats = statistics.Statistics(labels)
    with torch.no_grad():
        for key in _float_keys(base_sd, named):
            counts = kernel.count(
                base_sd[key], [sd[key] for _, sd in named], epsilon, names=labels, tensor_name=key
            ).tolist()
            stats.tensors.append(
                statistics.TensorCounts(
                    key, base_sd[key].numel(), dict(zip(labels, map(tuple, counts), strict=True)), epsilon
                )
            )
    return stats


def merge_state_dicts(
    base: StateDictLike,
    agents: Agents,
    *,
    epsilon: float = DEFAULTS["epsilon"],
    r: float = DEFAULTS["r"],
    alpha: float = DEFAULTS["alpha"],
    rho: Mapping[Hashable, float] | Sequence[float] | None = None,
    rho_scope: str = DEFAULTS["rho_scope"],
    lambda_rule: str = DEFAULTS["lambda_rule"],
    out_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Merge agents into base with RAM+ (r = 0: plain RAM).

    rho is counted over the whole model (or per layer / tensor with
    `rho_scope`) unless given for every agent, e.g. from `agent_statistics`,
    to sweep r without recounting. Returns new tensors; inputs are untouched.
    """
    epsilon, r, alpha = (_checked(n, v, label=n) for n, v in (("epsilon", epsilon), ("r", r), ("alpha", alpha)))
    _checked("rho_scope", rho_scope, label="rho_scope")
    _checked("lambda_rule", lambda_rule, label="lambda_rule")
    base_sd, named = _inputs(base, agents)
    names = [n for n, _ in named]
    given = _rho_values(rho, names)
    scoped: dict[str, dict[str, float]] = {}
    if r != 0 and any(v is None for v in given):
        scoped = _count(base_sd, named, epsilon).rho(rho_scope)

    def lambdas_for(key: str) -> list[float]:
        if r == 0:
            return [1.0] * len(names)
        group = scoped.get(statistics.scope_group(key, rho_scope), {})
        rhos = [group.get(str(n), 0.0) if v is None else v for n, v in zip(names, given, strict=True)]
        return [statistics.lambda_for(v, r, alpha, lambda_rule) for v in rhos]

    merged: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}
    with torch.no_grad():
        for key, tensor in base_sd.items():
            inputs = [sd[key] for _, sd in named]
            if not all(t.is_floating_point() for t in [tensor, *inputs]):
                merged[key] = _copy_buffer(key, tensor, inputs, names)
                continue
            alias = _storage_key(tensor, inputs)
            if alias in done:
                merged[key] = done[alias]
                continue
            merged[key] = done[alias] = kernel.merge(
                tensor,
                inputs,
                lambdas_for(key),
                epsilon,
                out_dtype=out_dtype,
                names=[str(n) for n in names],
                tensor_name=key,
            )
    return merged


def _inputs(base: StateDictLike, agents: Agents):
    base_sd = _as_state_dict(base, "base")
    items = list(agents.items()) if isinstance(agents, Mapping) else list(enumerate(agents))
    if not items:
        raise RamError("at least one agent is required")
    named = [(name, _as_state_dict(sd, f"agent {name!r}")) for name, sd in items]
    if len({str(name) for name, _ in named}) != len(named):
        raise RamError("agent names must be distinct as strings")
    for name, sd in named:
        missing, extra = set(base_sd) - set(sd), set(sd) - set(base_sd)
        if missing or extra:
            raise RamError(
                f"agent {name!r} does not match the base: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
            )
    return base_sd, named


def _as_state_dict(model: StateDictLike, label: str) -> StateDict:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if not isinstance(model, Mapping) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise TypeError(f"{label} must be a torch.nn.Module or a mapping of name to tensor")
    return model


def _float_keys(base_sd: StateDict, named) -> list[str]:
    keys, seen = [], set()
    for key, tensor in base_sd.items():
        inputs = [sd[key] for _, sd in named]
        if not all(t.is_floating_point() for t in [tensor, *inputs]):
            continue
        alias = _storage_key(tensor, inputs)
        if alias not in seen:
            seen.add(alias)
            keys.append(key)
    return keys


def _storage_key(tensor: torch.Tensor, inputs: Sequence[torch.Tensor]) -> tuple:
    return tuple(
        (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        for t in [tensor, *inputs]
    )


def _copy_buffer(key, tensor, inputs, names) -> torch.Tensor:
    if tensor.is_floating_point():  # the base holds floats: name the agents that do not
        odd = [
            f"{name!r} ({other.dtype})"
            for name, other in zip(names, inputs, strict=True)
            if not other.is_floating_point()
        ]
        raise RamError(f"tensor {key} is {tensor.dtype} in the base but not a float in agent {', '.join(odd)}")
    for name, other in zip(names, inputs, strict=True):
        if other.dtype != tensor.dtype or not torch.equal(other, tensor):
            raise RamError(f"non-float tensor {key} differs between the base and agent {name!r}")
    return tensor.clone()


def _rho_values(rho, names) -> list[float | None]:
    if rho is None:
        return [None] * len(names)
    if isinstance(rho, Mapping):
        values = [rho.get(n) for n in names]
    else:
        values = list(rho)
        if len(values) != len(names):
            raise RamError(f"rho has {len(values)} values for {len(names)} agents")
    return [
        None if v is None else _checked("rho", v, label=f"rho for agent {n!r}")
        for n, v in zip(names, values, strict=True)
    ]
