"""The `ramplus` merge method: one declarative mergekit definition.

RAM+ with the paper's global rho_t. The planner hook (`mergekit_ram.prepass`)
counts every tensor first and fills in `rho` for each agent (over the whole
model, or per layer/tensor with `rho_scope`); a user may also give `rho` per
model. With r = 0 (plain RAM) rho is never needed.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from pydantic import AfterValidator
from typing_extensions import Annotated

from mergekit.merge_methods import (
    BasePolicy,
    InputContract,
    PerNonBase,
    TensorGroup,
    merge_method,
)

from mergekit_ram import kernel, statistics

NAME = "ramplus"


def _non_negative(name: str, *, finite: bool = True):
    def check(value: float) -> float:
        if math.isnan(value) or value < 0 or (finite and math.isinf(value)):
            kind = "a finite number >= 0" if finite else "a number >= 0"
            raise ValueError(f"ramplus parameter '{name}' must be {kind}, got {value}")
        return value

    return AfterValidator(check)


Epsilon = Annotated[float, _non_negative("epsilon")]
R = Annotated[float, _non_negative("r")]
Alpha = Annotated[float, _non_negative("alpha")]
Rho = Optional[Annotated[float, _non_negative("rho", finite=False)]]


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
        missing = [name for entry, name in zip(agents, names) if rho[entry.id] is None]
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
    )


def _missing_rho_message(tensor: Optional[str], missing) -> str:
    from mergekit_ram import prepass

    reason = prepass.unavailable_reason()
    return (
        f"ramplus: no global rho for {', '.join(missing)} (tensor {tensor}). RAM+ needs "
        "rho over the whole model, which only the statistics pre-pass of `mergekit-yaml` "
        "(or mergekit_ram.merge_state_dicts) computes; this entry point merges one tensor "
        "at a time. Set `r: 0` for plain RAM, or give `rho` for every model."
        + (f" The pre-pass is unavailable: {reason}" if reason else "")
    )
