"""Plan-time checks of a `ramplus` config: one base model, and parameters that exist, sit where
mergekit honours them, and hold values in range (a misspelt or misplaced parameter would
otherwise be silently ignored); device options the machine can honour."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from typing import Any

from mergekit_ram.core import params
from mergekit_ram.errors import RamError

LOG = logging.getLogger("mergekit_ram")


def check_config(config: Any, *, parameters: bool = True) -> None:
    """Plan-time errors for what RAM+ cannot honour or would silently ignore."""
    bases = {config.base_model} if config.base_model else set()
    slices = list(getattr(config, "slices", None) or [])  # a mergekit-pytorch config has no slices or modules
    for module in (getattr(config, "modules", None) or {}).values():
        slices.extend(module.slices or [])
    bases.update(s.base_model for s in slices if s.base_model is not None)
    if not bases:
        raise RamError("ramplus needs `base_model`: task vectors are measured against it")
    if len(bases) > 1:
        raise RamError(
            "ramplus needs one base model for the whole merge (rho is counted over the whole model); "
            f"this config uses {len(bases)}: " + ", ".join(sorted(str(b) for b in bases))
        )
    if parameters:
        _check_parameter_names(config)


def models_in_order(config: Any) -> list[Any]:
    """`config.referenced_models()` in the config's order (the base first, then as its fields and lists hold
    them). mergekit returns a set's list, whose order follows each process's string hashing (`PYTHONHASHSEED`):
    anything that names the first bad input, or writes the models down, walks this instead."""
    order = {model: i for i, model in enumerate(dict.fromkeys(_models_in((config.base_model, config))))}
    return sorted(config.referenced_models(), key=lambda model: (order.get(model, len(order)), str(model)))


def _models_in(value: Any) -> list[Any]:
    """Every model reference in `value` (a config, or anything in it), in the order its fields and lists hold them."""
    from mergekit.common import ModelReference
    from pydantic import BaseModel

    if isinstance(value, ModelReference):
        return [value]
    if isinstance(value, BaseModel):
        return [m for key in type(value).model_fields for m in _models_in(getattr(value, key))]
    if isinstance(value, (list, tuple)):
        return [m for item in value for m in _models_in(item)]
    if isinstance(value, dict):
        return [m for item in value.values() for m in _models_in(item)]
    return []


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
                raise RamError(
                    f"ramplus parameter '{key}' is set under {where}, where mergekit ignores it: it is "
                    f"shared by all models; put it under the top-level `parameters:` (filters allow per-tensor values)"
                )
            if key in OFFICIAL:
                raise RamError(f"ramplus parameter '{key}' under {where} {OFFICIAL[key]((given or {})[key])}")
            close = difflib.get_close_matches(key, sorted(shared | per_model), n=1, cutoff=0.6)
            if close:
                raise RamError(f"unknown ramplus parameter '{key}' under {where}; did you mean '{close[0]}'?")
            LOG.warning(
                "ramplus: parameter '%s' under %s is not a ramplus parameter and is ignored "
                "(ramplus takes %s; per model: %s)",
                key,
                where,
                ", ".join(sorted(shared)),
                ", ".join(sorted(per_model)),
            )


def _rescale(value: Any) -> str:
    what = "is the official ram-main.py's --rescale_factor R (R = 1 + r, alpha effectively 1)"
    number = params.number_or_none(value)
    if number is None:
        return f"{what}: write `r:` (and `alpha: 1` to match the script) instead"
    if number <= 1:
        return f"{what}, and R <= 1 is plain RAM there: write `r: 0`, or `r: {number:g}` if you meant the paper's r"
    return f"{what}: write `r: {number - 1:g}` and `alpha: 1` to match the script, or `r: {number:g}` for the paper's r"


def _mode(value: Any) -> str:
    what = "is the official ram-main.py's --merge_mode"
    instead = {
        "arm": "RAM is `r: 0`",
        "arm-r": "its arm-r (RAM+s) is `lambda_rule: soft`",
        "arm-r-v2": "its arm-r-v2 (RAM+) is ramplus's default (add `alpha: 1` to match the script)",
    }
    return f"{what}: {instead.get(str(value), 'ramplus offers arm, arm-r and arm-r-v2 only')}; remove it"


#: The official script's (ram-main.py) names, refused with what to write instead: a warning would let the merge
#: run with the defaults (`R: 0.2` merged with r = 0.1).
OFFICIAL: dict[str, Callable[[Any], str]] = {
    "R": _rescale,
    "rescale_factor": _rescale,
    "threshold": lambda v: f"is the official ram-main.py's --threshold: write `epsilon: {v}` instead",
    "merge_mode": _mode,
    "target_index": lambda _v: (
        "belongs to the official ram-main.py's arm-unique probe, which ramplus does not offer; remove it"
    ),
}


def _check_value(key: str, setting: Any, where: str) -> None:
    """A value mergekit would coerce or pass on unchecked (a string, a bool, an unknown
    scope) is an error naming the parameter and its place, before any weight is read."""
    for value in _scalars(setting):
        try:
            params.check(key, value, where=where, text=True)
        except ValueError as error:  # params is a leaf below errors: its refusals become ours here
            raise RamError(str(error)) from None


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
        raise RamError("--multi-gpu (also set by --gpu-rich) needs a GPU, and torch sees none on this machine")
    available = {"cuda": torch.cuda.is_available, "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}
    if kind in available and not available[kind]():
        raise RamError(
            f"device {device!r} (--cuda, --gpu-rich or --device) is not available: torch sees no {kind} device "
            "on this machine; merge on the CPU (leave the flag out) or on a machine with one"
        )
