"""`mergekit-ram inspect`: the statistics pass of a config, without merging.

It runs downhill, never up through a patched mergekit method: the config is checked once
(`pipeline.check_config`), mergekit's own planning runs without our wrapper around it
(`surface.plan_as_mergekit`), then `pipeline.prepare` counts. The only hook it needs,
linear-time tensor loading, it installs itself (`loading.install`). `plan` (from `planner`, shared
with `verify`) is run_merge's preamble.
"""

from __future__ import annotations

from typing import Any

from mergekit_ram import config_checks, input_checks, report
from mergekit_ram._mergekit import loading, pipeline, surface
from mergekit_ram._mergekit.planner import plan
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
    record = report.merge_record("run_merge", options)  # its --json is the ram_stats.json a merge would write
    current = MergeSession(config=config, mode="inspect", check_parameters=ours, fast_loading=True, record=record)
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
