"""The `ramplus` merge method: one declarative mergekit definition.

RAM+ with the paper's global rho_t. The statistics pass (`mergekit_ram.prepass`,
run from the planner hook in `mergekit_ram.hook`) counts every tensor first and
fills in `rho` for each agent (over the whole model, or per layer/tensor with
`rho_scope`); a user may also give `rho` per model. With r = 0 (plain RAM) rho
is never needed.

This module imports nothing of the hook, the pass or the start-up code: they
depend on it, not the other way round.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from mergekit.merge_methods import (
    BasePolicy,
    InputContract,
    PerNonBase,
    TensorGroup,
    merge_method,
)
from pydantic import AfterValidator

from mergekit_ram import kernel, statistics

NAME = "ramplus"


def _non_negative(name: str, *, finite: bool = True, bounded: bool = False):
    def check(value: float) -> float:
        if finite:
            statistics.check_parameter(name, value, upper=bounded)
        elif math.isnan(value) or value < 0:
            raise ValueError(f"ramplus parameter '{name}' must be a number >= 0, got {value}")
        return value

    return AfterValidator(check)


Epsilon = Annotated[float, _non_negative("epsilon")]
R = Annotated[float, _non_negative("r", bounded=True)]
Alpha = Annotated[float, _non_negative("alpha", bounded=True)]
Rho = Annotated[float, _non_negative("rho", finite=False)] | None


@merge_method(
    name=NAME,
    pretty_name="RAM+ (Reinforced Agent Merging, global ρ)",
    reference_url="https://arxiv.org/abs/2601.13572",
    contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1),
)
def ramplus(
    group: TensorGroup,
    epsilon: Epsilon = 1e-5,
    r: R = 0.1,
    alpha: Alpha = 2.0,
    rho_scope: Literal["model", "layer", "tensor"] = "model",
    lambda_rule: Literal["clip", "soft"] = "clip",
    rho: PerNonBase[Rho] = None,
) -> torch.Tensor:
    agents = group.non_base
    names = [str(entry.id) for entry in agents]
    if r == 0:
        lambdas = [1.0] * len(agents)
    else:
        missing = [name for entry, name in zip(agents, names, strict=True) if rho[entry.id] is None]
        if missing:
            raise RuntimeError(_missing_rho_message(group.metadata.name, missing))
        lambdas = [statistics.lambda_for(rho[e.id], r, alpha, lambda_rule) for e in agents]
    return kernel.merge(
        group.base.tensor,
        [entry.tensor for entry in agents],
        lambdas,
        epsilon,
        names=names,
        tensor_name=group.metadata.name,
        base_name=str(group.base.id),
    )


def is_ours(method: Any) -> bool:
    """True for this package's methods, also across a reload of its modules."""
    return _origin(method) == __name__


def resolves_to_ours(name: str) -> bool:
    """Whether mergekit runs this package's method for `merge_method: name`
    (not another plugin's that took the same name first)."""
    from mergekit import merge_methods

    if name != NAME:
        return False
    try:
        return is_ours(merge_methods.get(name))
    except RuntimeError:
        return False


def _origin(method: Any) -> str:
    return str(getattr(getattr(method, "implementation", method), "__module__", "?"))


def _missing_rho_message(tensor: str | None, missing: Sequence[str]) -> str:
    hook = sys.modules.get("mergekit_ram.hook")  # not imported: no hook loaded means none failed
    reason = hook.unavailable_reason() if hook is not None else None
    return (
        f"ramplus: no global rho for {', '.join(missing)} (tensor {tensor}). RAM+ needs "
        "rho over the whole model, which only the statistics pre-pass of `mergekit-yaml` "
        "(or mergekit_ram.merge_state_dicts) computes; this entry point merges one tensor "
        "at a time. Set `r: 0` for plain RAM, or give `rho` for every model."
        + (f" The pre-pass is unavailable: {reason}" if reason else "")
    )
