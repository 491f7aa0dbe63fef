"""Plan-time checks of a `ramplus` config: one base model, and parameters that exist, sit where
mergekit honours them, and hold values in range (a misspelt or misplaced parameter would
otherwise be silently ignored); device options the machine can honour."""

from __future__ import annotations

import difflib
import logging
from typing import Any

from mergekit_ram import params

LOG = logging.getLogger("mergekit_ram")


def check_config(config: Any, *, parameters: bool = True) -> None:
    """Plan-time errors for what RAM+ cannot honour or would silently ignore."""
    bases = {config.base_model} if config.base_model else set()
    slices = list(getattr(config, "slices", None) or [])  # a mergekit-pytorch config has no slices or modules
    for module in (getattr(config, "modules", None) or {}).values():
        slices.extend(module.slices or [])
    bases.update(s.base_model for s in slices if s.base_model is not None)
    if not bases:
        raise ValueError("ramplus needs `base_model`: task vectors are measured against it")
    if len(bases) > 1:
        raise ValueError(
            "ramplus needs one base model for the whole merge (rho is counted over the whole model); "
            f"this config uses {len(bases)}: " + ", ".join(sorted(str(b) for b in bases))
        )
    if parameters:
        _check_parameter_names(config)


def _check_parameter_names(config: Any) -> None:
    shared, per_model = set(params.DEFAULTS), set(params.PER_MODEL)  # the method's, as tests/test_params.py checks
    places: list[tuple[str, dict | None, bool]] = [("parameters", config.parameters, True)]
    for i, m in enumerate(config.models or []):
        places.append((f"models[{i}] ({m.model}).parameters", m.parameters, False))
    modules = getattr(config, "modules", None) or {}
    groups = [("", getattr(config, "slices", None) or [])] + [
        (f"modules.{name}.", module.slices or []) for name, module in modules.items()
    ]
    for name, module in modules.items():
        places.append((f"modules.{name}.parameters", module.parameters, True))
        for i, m in enumerate(module.models or []):
            places.append((f"modules.{name}.models[{i}] ({m.model}).parameters", m.parameters, False))
    for prefix, slices in groups:
        for i, s in enumerate(slices):
            places.append((f"{prefix}slices[{i}].parameters", s.parameters, True))
            for j, src in enumerate(s.sources):
                places.append((f"{prefix}slices[{i}].sources[{j}] ({src.model}).parameters", src.parameters, False))
    for where, given, allows_shared in places:
        for key in given or {}:
            if key in per_model or (allows_shared and key in shared):
                _check_value(key, (given or {})[key], where)
                continue
            if key in shared:
                raise ValueError(
                    f"ramplus parameter '{key}' is set under {where}, where mergekit ignores it: it is "
                    f"shared by all models; put it under the top-level `parameters:` (filters allow per-tensor values)"
                )
            close = difflib.get_close_matches(key, sorted(shared | per_model), n=1, cutoff=0.6)
            if close:
                raise ValueError(f"unknown ramplus parameter '{key}' under {where}; did you mean '{close[0]}'?")
            LOG.warning(
                "ramplus: parameter '%s' under %s is not a ramplus parameter and is ignored "
                "(ramplus takes %s; per model: %s)",
                key,
                where,
                ", ".join(sorted(shared)),
                ", ".join(sorted(per_model)),
            )


def _check_value(key: str, setting: Any, where: str) -> None:
    """A value mergekit would coerce or pass on unchecked (a string, a bool, an unknown
    scope) is an error naming the parameter and its place, before any weight is read."""
    for value in _scalars(setting):
        params.check(key, value, where=where, text=True)


def _scalars(setting: Any) -> list[Any]:
    """Every value a setting holds, through mergekit's filters and gradients."""
    if isinstance(setting, dict) and "value" in setting:
        return _scalars(setting["value"])
    if hasattr(setting, "filter") and hasattr(setting, "value"):
        return _scalars(setting.value)
    if isinstance(setting, (list, tuple)):
        return [v for item in setting for v in _scalars(item)]
    return [setting]


def check_devices(options: Any) -> None:
    """`--cuda`, `--device`, `--multi-gpu`, `--gpu-rich` on a machine without that device: an error
    naming the flag before any weight is read (torch and mergekit's executor fail later, naming neither)."""
    import torch

    if options is None:
        return
    device = str(getattr(options, "device", None) or "cpu")
    kind = device.split(":")[0]
    # a device count (torch.accelerator: torch >= 2.6, the declared floor, and what mergekit's multi-GPU executor
    # asks), not the build's accelerator type: a CUDA build of torch names "cuda" on a machine without one
    none = torch.accelerator.device_count() == 0
    if getattr(options, "multi_gpu", False) and none:
        raise ValueError("--multi-gpu (also set by --gpu-rich) needs a GPU, and torch sees none on this machine")
    available = {"cuda": torch.cuda.is_available, "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}
    if kind in available and not available[kind]():
        raise ValueError(
            f"device {device!r} (--cuda, --gpu-rich or --device) is not available: torch sees no {kind} device "
            "on this machine; merge on the CPU (leave the flag out) or on a machine with one"
        )
