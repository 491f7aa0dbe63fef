"""The `ramplus` parameters, defaults and ranges: one validator for the method, the API, the CLI and config checks.

Every bad value is a ValueError that names the parameter (and where it was set),
raised before any weight is read.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, get_args

#: Largest accepted `r` and `alpha`. The paper's lambda is about 1.2; beyond this,
#: lambda * tau is no longer a weight update, and lambda itself (or 0 * lambda for an
#: agent without unique entries) can leave float32's range and turn merged values into
#: Inf or NaN.
PARAMETER_MAX = 1000.0
#: The choices of `rho_scope` and `lambda_rule`, as the method's types (mergekit validates them) and as tuples.
Scope = Literal["model", "layer", "tensor"]
LambdaRule = Literal["clip", "soft"]
SCOPES: tuple[str, ...] = get_args(Scope)
LAMBDA_RULES: tuple[str, ...] = get_args(LambdaRule)
CHOICES = {"rho_scope": SCOPES, "lambda_rule": LAMBDA_RULES}
#: The shared parameters and their defaults: the method's signature, the API's and the CLI's take them from here.
DEFAULTS: dict[str, Any] = {"epsilon": 1e-5, "r": 0.1, "alpha": 2.0, "rho_scope": "model", "lambda_rule": "clip"}
#: The per-model parameters (no default: counted when not given).
PER_MODEL = ("rho",)
#: numbers: (upper bound or None, whether +inf is allowed)
_RANGES = {"epsilon": (None, False), "r": (PARAMETER_MAX, False), "alpha": (PARAMETER_MAX, False), "rho": (None, True)}


def check(name: str, value: Any, *, where: str | None = None, label: str | None = None, text: bool = False) -> Any:
    """Return `value` (a float for numbers) or raise ValueError naming the parameter.

    `where`: the config place it was set (`parameters`, `models[1] (...).parameters`);
    `label`: how to name it instead of "ramplus parameter 'NAME'" (a CLI flag);
    `text`: accept numbers written as strings (YAML `"2.5"`, which mergekit coerces).
    """
    what = label or f"ramplus parameter '{name}'"
    if where:
        what += f" under {where}"
    if name in CHOICES:
        if value not in CHOICES[name]:
            raise ValueError(f"{what} must be one of {', '.join(CHOICES[name])}, got {value!r}")
        return value
    if name not in _RANGES:
        raise ValueError(f"unknown ramplus parameter '{name}'")
    upper, infinite = _RANGES[name]
    number = _number(value, text)
    bound = f" and <= {upper:g}" if upper is not None else ""
    if number is None:
        raise ValueError(f"{what} must be a number >= 0{bound}, got {value!r}")
    if not number >= 0 or (number == math.inf and not infinite) or (upper is not None and number > upper):
        finite = "" if infinite else "finite "
        raise ValueError(f"{what} must be a {finite}number >= 0{bound}, got {value}")
    return number


def number_or_none(value: Any) -> float | None:
    """`value` as a float (a number, or one written as text), else None."""
    return _number(value, True)


def _number(value: Any, text: bool) -> float | None:
    if isinstance(value, bool):
        return None  # `r: yes` is not 1.0
    if isinstance(value, numbers.Real):  # int, float, numpy scalars
        return float(value)
    if text and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
