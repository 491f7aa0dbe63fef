"""`mergekit-ram inspect`: the statistics pass of a config, without merging.

It runs downhill, never up through a patched mergekit method: the config is checked once
(`pipeline.check_config`), mergekit's own planning runs without our wrapper around it
(`surface.plan_as_mergekit`), then `pipeline.prepare` counts. The only hook it needs,
linear-time tensor loading, it installs itself (`loading.install`).
"""

from __future__ import annotations

from typing import Any

from mergekit_ram import config_checks, input_checks
from mergekit_ram._mergekit import loading, pipeline, surface
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import MergeSession, active


class InputError(ValueError):
    """The input models cannot be counted: a file, a tensor (NaN, shape, dtype), not the command or the config."""


def inspect(config: Any, options: Any) -> MergeSession:
    """Plan `config` as ramplus and count its statistics without merging; returns the finished session.

    Any config with a base model can be inspected: another method's config is planned as `ramplus`
    (its own parameters are not ours to judge). The config, the device flags and the method's owner
    are checked before anything is read (ValueError); what reading the inputs finds wrong is an
    `InputError`.
    """
    refuse_foreign(NAME)  # inspect plans as ramplus
    problems = surface.problems(surface.PREPASS) + surface.problems(surface.MERGE)
    if problems:
        raise RuntimeError("mergekit-ram cannot inspect: " + "; ".join(problems))
    ours = resolves_to_ours(config.merge_method)
    if not ours:
        config = config.model_copy(update={"merge_method": NAME})
    current = MergeSession(config=config, mode="inspect", check_parameters=ours, fast_loading=True)
    loading.install()
    with active(current):
        pipeline.check_config(current)
        config_checks.check_devices(options)
        try:
            _count(current, options)
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
    if current.report is None:
        raise ValueError("nothing to inspect: the config plans no tensor")
    return current


def _count(current: MergeSession, options: Any) -> None:
    """Check the input files, plan with mergekit, count (`pipeline.prepare`)."""
    input_checks.check_input_files(current.config)
    pipeline.prepare(plan(current.config, options), current)


def plan(config: Any, options: Any) -> Any:
    """A `MergePlanner` of `config`, planned by mergekit alone, as `run_merge` plans before merging
    (architecture, every model's loader warmed, the output config): nothing of ours runs."""
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    arch_info = get_architecture_info(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in config.referenced_models():
        loaders.get(model)
    out_config = surface.model_out_config(config, arch_info, options)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    surface.plan_as_mergekit(planner)
    return planner
