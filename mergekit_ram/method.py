"""The `ramplus` merge method: one declarative mergekit definition.

RAM+ with the paper's global rho_t. The statistics pass (`mergekit_ram._mergekit.pipeline`,
run from the planner hook in `mergekit_ram._mergekit.hooks`) counts every tensor first and
fills in `rho` for each agent (over the whole model, or per layer/tensor with
`rho_scope`); a user may also give `rho` per model. With r = 0 (plain RAM) rho
is never needed.

This module imports nothing of the seam (`mergekit_ram._mergekit`): the seam
depends on it, not the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

import torch
from mergekit.merge_methods import (
    BasePolicy,
    InputContract,
    PerNonBase,
    TensorGroup,
    merge_method,
)
from pydantic import AfterValidator

from mergekit_ram import session
from mergekit_ram.core import kernel, params, statistics
from mergekit_ram.core.params import DEFAULTS
from mergekit_ram.errors import RamError, RhoUnavailable
from mergekit_ram.reporting import versions

NAME = "ramplus"


def _valid(name: str):
    return AfterValidator(lambda value: params.check(name, value))


Epsilon = Annotated[float, _valid("epsilon")]
R = Annotated[float, _valid("r")]
Alpha = Annotated[float, _valid("alpha")]
Rho = Annotated[float, _valid("rho")] | None


@merge_method(
    name=NAME,
    pretty_name="RAM+ (Reinforced Agent Merging, global ρ)",
    reference_url="https://arxiv.org/abs/2601.13572",
    contract=InputContract(base=BasePolicy.REQUIRED, min_non_base=1),
)
def ramplus(
    group: TensorGroup,
    epsilon: Epsilon = DEFAULTS["epsilon"],
    r: R = DEFAULTS["r"],
    alpha: Alpha = DEFAULTS["alpha"],
    rho_scope: params.Scope = DEFAULTS["rho_scope"],
    lambda_rule: params.LambdaRule = DEFAULTS["lambda_rule"],
    rho: PerNonBase[Rho] = None,
) -> torch.Tensor:
    agents = group.non_base
    names = [str(entry.id) for entry in agents]
    if r == 0:
        lambdas = [1.0] * len(agents)
    else:
        missing = [name for entry, name in zip(agents, names, strict=True) if rho[entry.id] is None]
        if missing:
            raise RhoUnavailable(_missing_rho_message(group.metadata.name, missing))
        lambdas = [statistics.lambda_for(rho[e.id], r, alpha, lambda_rule) for e in agents]
    return kernel.merge(
        group.base.tensor,
        [entry.tensor for entry in agents],
        lambdas,
        epsilon,
        out_dtype=session.out_dtype(),
        names=names,
        tensor_name=group.metadata.name,
        base_name=str(group.base.id),
    )


def is_ours(method: Any) -> bool:
    """True for this package's methods, also across a reload of its modules."""
    return origin(method) == __name__


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


def origin(method: Any) -> str:
    """The module that defines a registered merge method."""
    return str(getattr(getattr(method, "implementation", method), "__module__", "?"))


def refuse_foreign(name: str) -> None:
    """Raise when `merge_method: name` is our name but mergekit would run another package's method.

    A mergekit fork (or another plugin) may register its own `ramplus` first; mergekit then runs
    that method, with other parameters and rules, under the name users chose for this package.
    """
    from mergekit import merge_methods

    if name != NAME:
        return
    try:
        owner = merge_methods.get(name)
    except RuntimeError:
        return  # not registered at all: mergekit's own error names the method
    if is_ours(owner):
        return
    module = origin(owner)
    raise RamError(
        f"merge_method '{NAME}' is registered by {module} ({_distribution(module)}), not by mergekit-ram, so "
        f"mergekit would run that package's method under this name. To merge with mergekit-ram's RAM+, install "
        f"PyPI's mergekit, which defines no '{NAME}' (pip install --force-reinstall 'mergekit==0.1.5'; a fork may "
        f"call itself mergekit 0.1.5 too) or uninstall the other package; to run the other package's '{NAME}', "
        "set MERGEKIT_RAM_DISABLE=1."
    )


def _distribution(module: str) -> str:
    """'package NAME VERSION' of the installed distribution providing `module`, as well as it can be told."""
    from importlib import metadata

    top = module.split(".")[0]
    try:
        names = metadata.packages_distributions().get(top, [])
        return ", ".join(f"package {n} {versions.installed(n)}" for n in sorted(set(names))) or f"module {top}"
    except Exception:
        return f"module {top}"


def _not_told() -> str | None:
    return None


#: Says why the statistics pre-pass is unavailable (None: installed, or not tried). The seam owns that
#: verdict and hands this module the function that tells it (`ask_why_prepass_unavailable`).
_why_unavailable: Callable[[], str | None] = _not_told


def ask_why_prepass_unavailable(reason: Callable[[], str | None]) -> None:
    """Where the error below learns why the pre-pass is unavailable (the seam calls this when it installs)."""
    global _why_unavailable
    _why_unavailable = reason


def _missing_rho_message(tensor: str | None, missing: Sequence[str]) -> str:
    unavailable = _why_unavailable()
    return (
        f"ramplus: no global rho for {', '.join(missing)} (tensor {tensor}). RAM+ needs rho over the whole "
        "model, which the statistics pre-pass of `mergekit-yaml` and `mergekit-pytorch` computes (in memory: "
        "mergekit_ram.merge_state_dicts); this entry point (mergekit's merge_tensors or merge_state_dicts) merges "
        "one tensor at a time. Set `r: 0` for plain RAM, or give `rho` for every model."
        + (f" The pre-pass is unavailable: {unavailable}" if unavailable else "")
    )
