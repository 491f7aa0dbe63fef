"""`mergekit-ram inspect`: the statistics pass of a config, without merging.

One body over a door (`door.of_config`: `mergekit-yaml`'s or `mergekit-pytorch`'s). It runs downhill, never
up through a patched mergekit method: the config is checked once (`pipeline.check_config`), the door's inputs
(`check_inputs`), mergekit's own planning runs without our wrapper around it (the door's `plan`), then
`pipeline.prepare` counts. The only hook it needs, linear-time tensor loading, it installs itself
(`loading.install`).

A config is `mergekit-pytorch`'s (`RawPyTorchMergeConfig`, `config_of`) when it has no `slices` or
`modules` and a model or the base is a file (an existing one, or a path ending in `.safetensors`,
`.pt`, `.pth` or `.bin`); otherwise it is `mergekit-yaml`'s.
"""

from __future__ import annotations

import os
from typing import Any

from mergekit_ram._mergekit import loading, pipeline, surface
from mergekit_ram._mergekit.door import of_config
from mergekit_ram.checks import config_checks
from mergekit_ram.errors import InputError, RamError
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import MergeSession, Mode, active

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
    ours = resolves_to_ours(config.merge_method)
    if not ours:
        config = config.model_copy(update={"merge_method": NAME})
    door = of_config(config, options, tensor_union=tensor_union, tensor_intersection=tensor_intersection)
    problems = surface.problems(surface.PREPASS) + surface.problems(door.names)
    if problems:
        raise RuntimeError("mergekit-ram cannot inspect: " + "; ".join(problems))
    current = door.session(Mode.INSPECT, check_parameters=ours)  # for yaml, its --json is a merge's ram_stats.json
    loading.install()
    with active(current):
        pipeline.check_config(current)
        config_checks.check_devices(options)
        try:
            door.check_inputs()
            pipeline.prepare(door.plan(), current)
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
    if current.report is None:
        raise RamError("nothing to inspect: the config plans no tensor")
    return current
