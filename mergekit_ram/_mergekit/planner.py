"""A config planned by mergekit alone, as `run_merge` plans before merging: what `inspect` counts and `verify`
runs again, downhill (nothing of ours runs inside mergekit's planning: the caller checks and counts)."""

from __future__ import annotations

from typing import Any

from mergekit_ram._mergekit import surface
from mergekit_ram.checks import config_checks


def plan(config: Any, options: Any) -> Any:
    """A `MergePlanner` of `config`, planned by mergekit alone, as `run_merge` plans before merging
    (architecture, every model's loader warmed, the output config): nothing of ours runs."""
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    arch_info = get_architecture_info(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in config_checks.models_in_order(config):  # a missing input fails the same way every run
        loaders.get(model)
    out_config = surface.model_out_config(config, arch_info, options)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    surface.plan_as_mergekit(planner)
    return planner
