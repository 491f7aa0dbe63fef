"""`mergekit-ram inspect`: the statistics pass of a config, without merging.

It runs downhill, never up through a patched mergekit method: the config is checked once
(`pipeline.check_config`), mergekit's own planning runs without our wrapper around it
(`surface.plan_as_mergekit`, or for a `mergekit-pytorch` config `surface.plan_flat_as_mergekit`),
then `pipeline.prepare` counts. The only hook it needs, linear-time tensor loading, it installs
itself (`loading.install`).

A config is `mergekit-pytorch`'s (`RawPyTorchMergeConfig`, `config_of`) when it has no `slices` or
`modules` and a model or the base is a file (an existing one, or a path ending in `.safetensors`,
`.pt`, `.pth` or `.bin`); otherwise it is `mergekit-yaml`'s.
`plan` (from `planner`, shared with `verify`) is run_merge's preamble.
"""

from __future__ import annotations

import os
from typing import Any

from mergekit_ram import config_checks
from mergekit_ram._mergekit import loading, pipeline, surface, tasks
from mergekit_ram._mergekit.flat import check_inputs, merge_session, of_flat, planning
from mergekit_ram._mergekit.planner import plan
from mergekit_ram.errors import InputError, RamError
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import MergeSession, active

#: what a model file of `mergekit-pytorch` is called
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def is_flat(data: Any) -> bool:
    """Whether a loaded YAML config is `mergekit-pytorch`'s: no slices or modules, and a model (or the base)
    that is a file."""
    if not isinstance(data, dict) or data.get("slices") or data.get("modules"):
        return False
    paths = [m.get("model") for m in data.get("models") or [] if isinstance(m, dict)] + [data.get("base_model")]
    return any(
        isinstance(p, str) and (os.path.isfile(p) or (p.lower().endswith(FILE_SUFFIXES) and not os.path.isdir(p)))
        for p in paths
    )


def config_of(data: Any) -> Any:
    """The config a loaded YAML file holds: a `RawPyTorchMergeConfig` (`is_flat`) or a `MergeConfiguration`."""
    if is_flat(data):
        from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig

        return RawPyTorchMergeConfig.model_validate(data)
    from mergekit.config import MergeConfiguration

    return MergeConfiguration.model_validate(data)


def inspect(
    config: Any, options: Any, *, tensor_union: bool = False, tensor_intersection: bool = False
) -> MergeSession:
    """Plan `config` as ramplus and count its statistics without merging; returns the finished session.

    Any config with a base model can be inspected: another method's config is planned as `ramplus`
    (its own parameters are not ours to judge). The config, the device flags and the method's owner
    are checked before anything is read (ValueError); what reading the inputs finds wrong is an
    `InputError`. `tensor_union`, `tensor_intersection`: `mergekit-pytorch`'s flags, for its configs only.
    """
    refuse_foreign(NAME)  # inspect plans as ramplus
    flat = _flat(config)
    if not flat and (tensor_union or tensor_intersection):
        raise RamError(
            "--tensor-union and --tensor-intersection are mergekit-pytorch's: they apply to a config whose "
            "models are files"
        )
    problems = surface.problems(surface.PREPASS) + surface.problems(surface.FLAT if flat else surface.MERGE)
    if problems:
        raise RuntimeError("mergekit-ram cannot inspect: " + "; ".join(problems))
    ours = resolves_to_ours(config.merge_method)
    if not ours:
        config = config.model_copy(update={"merge_method": NAME})
    if flat:
        current = merge_session(
            config, options, tensor_union, tensor_intersection, mode="inspect", check_parameters=ours
        )
    else:  # its --json is the ram_stats.json a merge would write
        current = pipeline.merge_session(config, options, mode="inspect", check_parameters=ours, fast_loading=True)
    loading.install()
    with active(current):
        pipeline.check_config(current)
        config_checks.check_devices(options)
        try:
            if flat:
                _count_flat(current, options, tensor_union, tensor_intersection)
            else:
                _count(current, options)
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
    if current.report is None:
        raise RamError("nothing to inspect: the config plans no tensor")
    return current


def _flat(config: Any) -> bool:
    from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig

    return isinstance(config, RawPyTorchMergeConfig)


def _count(current: MergeSession, options: Any) -> None:
    """Check the input models and files, plan with mergekit, count (`pipeline.prepare`)."""
    pipeline.check_inputs(current.config, options, card=False)
    pipeline.prepare(tasks.of_planner(plan(current.config, options)), current)


def _count_flat(current: MergeSession, options: Any, tensor_union: bool, tensor_intersection: bool) -> None:
    """Check the input files, plan with mergekit-pytorch's planner, count (`pipeline.prepare`)."""
    check_inputs(current.config)
    with planning(options):
        planned = surface.plan_flat_as_mergekit(current.config, tensor_union, tensor_intersection, options)
    plan = of_flat(planned, current.config, options, resolves_to_ours, intersection=tensor_intersection)
    pipeline.prepare(plan, current)
