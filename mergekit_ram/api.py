"""In-memory RAM+ for notebooks and evolution loops: state dicts in, state dict out.

Same kernel and the same whole-model rho as `merge_method: ramplus`, without
files or mergekit's planner. Non-float buffers are copied when every input
agrees. Keys that share storage in every input (tied embeddings) are counted
and merged once, as mergekit counts a tied lm_head once.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from mergekit_ram import kernel, statistics

StateDict = Mapping[str, torch.Tensor]
StateDictLike = Union[StateDict, torch.nn.Module]
Agents = Union[Mapping[Hashable, StateDictLike], Sequence[StateDictLike]]


def agent_statistics(
    base: StateDictLike, agents: Agents, *, epsilon: float = 1e-5
) -> Dict[Hashable, statistics.AgentStats]:
    """Whole-model counts per agent (density, unique, shared, rho)."""
    _check_non_negative(epsilon=epsilon)
    base_sd, named = _inputs(base, agents)
    names = [n for n, _ in named]
    per_tensor = []
    with torch.no_grad():
        for key in _float_keys(base_sd, named):
            counts = kernel.count(
                base_sd[key],
                [sd[key] for _, sd in named],
                epsilon,
                names=[str(n) for n in names],
                tensor_name=key,
            ).tolist()
            per_tensor.append(
                (base_sd[key].numel(), {n: (c[0], c[1]) for n, c in zip(names, counts)})
            )
    return statistics.reduce_counts(per_tensor, names)


def merge_state_dicts(
    base: StateDictLike,
    agents: Agents,
    *,
    epsilon: float = 1e-5,
    r: float = 0.1,
    alpha: float = 2.0,
    rho: Optional[Union[Mapping[Hashable, float], Sequence[float]]] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Dict[str, torch.Tensor]:
    """Merge agents into base with global RAM+ (r = 0: plain RAM).

    rho is computed over the whole model unless given for every agent (e.g.
    from `agent_statistics`, to sweep r without recounting). Returns new
    tensors; inputs are never modified.
    """
    _check_non_negative(epsilon=epsilon, r=r, alpha=alpha)
    base_sd, named = _inputs(base, agents)
    names = [n for n, _ in named]
    rhos = _rho_values(rho, names)
    if r != 0 and any(v is None for v in rhos):
        stats = agent_statistics(base_sd, dict(named), epsilon=epsilon)
        rhos = [stats[n].rho if v is None else v for n, v in zip(names, rhos)]
    lambdas = [1.0 if r == 0 else kernel.lambda_clip(v, r, alpha) for v in rhos]

    merged: Dict[str, torch.Tensor] = {}
    done: Dict[Tuple, torch.Tensor] = {}
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
                lambdas,
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
        raise ValueError("at least one agent is required")
    named = [(name, _as_state_dict(sd, f"agent {name!r}")) for name, sd in items]
    for name, sd in named:
        missing, extra = set(base_sd) - set(sd), set(sd) - set(base_sd)
        if missing or extra:
            raise ValueError(
                f"agent {name!r} does not match the base: missing {sorted(missing)[:5]}, "
                f"extra {sorted(extra)[:5]}"
            )
    return base_sd, named


def _as_state_dict(model: StateDictLike, label: str) -> StateDict:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if not isinstance(model, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in model.values()
    ):
        raise TypeError(f"{label} must be a torch.nn.Module or a mapping of name to tensor")
    return model


def _float_keys(base_sd: StateDict, named) -> List[str]:
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


def _storage_key(tensor: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Tuple:
    return tuple(
        (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        for t in [tensor, *inputs]
    )


def _copy_buffer(key, tensor, inputs, names) -> torch.Tensor:
    for name, other in zip(names, inputs):
        if other.dtype != tensor.dtype or not torch.equal(other, tensor):
            raise ValueError(f"non-float tensor {key} differs between the base and agent {name!r}")
    return tensor.clone()


def _rho_values(rho, names) -> List[Optional[float]]:
    if rho is None:
        return [None] * len(names)
    if isinstance(rho, Mapping):
        values = [rho.get(n) for n in names]
    else:
        values = list(rho)
        if len(values) != len(names):
            raise ValueError(f"rho has {len(values)} values for {len(names)} agents")
    for name, value in zip(names, values):
        if value is not None and not value >= 0:
            raise ValueError(f"rho for agent {name!r} must be >= 0, got {value}")
    return values


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0 or (name != "alpha" and value == float("inf")):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
