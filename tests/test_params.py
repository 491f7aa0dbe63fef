"""One validator for every `ramplus` parameter: ranges, choices, and messages that name the parameter."""

from __future__ import annotations

import math

import pytest

from mergekit_ram.core import params

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


@pytest.mark.parametrize(
    "name, value",
    [("epsilon", 0), ("epsilon", 1e300), ("r", 0), ("r", 1000), ("alpha", 2.0), ("rho", math.inf), ("rho", 0.0)],
)
def test_values_in_range_come_back_as_floats(name, value):
    assert params.check(name, value) == float(value)
    assert isinstance(params.check(name, value), float)


@pytest.mark.parametrize(
    "name, value",
    [
        ("epsilon", -1e-5), ("epsilon", math.nan), ("epsilon", math.inf), ("r", -0.1), ("r", 1000.5),
        ("r", math.inf), ("alpha", math.nan), ("alpha", 1e300), ("rho", -1.0), ("rho", math.nan),
        ("r", True), ("epsilon", "1e-5"), ("alpha", None), ("rho", [1.0]),
    ],
)
def test_bad_values_name_the_parameter(name, value):
    with pytest.raises(ValueError, match=f"ramplus parameter '{name}' must be"):
        params.check(name, value)


def test_numbers_as_text_only_where_mergekit_coerces_them():
    assert params.check("rho", "2.5", text=True) == 2.5
    with pytest.raises(ValueError, match="'rho'"):
        params.check("rho", "2.5")
    with pytest.raises(ValueError, match="'r'"):
        params.check("r", "abc", text=True)


@pytest.mark.parametrize("name, value", [("rho_scope", "global"), ("rho_scope", 1), ("lambda_rule", "")])
def test_choices(name, value):
    with pytest.raises(ValueError, match=f"'{name}'.*must be one of"):
        params.check(name, value)
    for good in params.CHOICES[name]:
        assert params.check(name, good) == good


def test_where_and_label_name_the_place():
    with pytest.raises(ValueError, match=r"'r' under models\[1\] \(x\)\.parameters must be"):
        params.check("r", -1, where="models[1] (x).parameters")
    with pytest.raises(ValueError, match=r"^--alpha must be a finite number >= 0 and <= 1000, got inf$"):
        params.check("alpha", math.inf, label="--alpha")


def test_defaults_are_valid_and_match_the_method():
    from mergekit_ram.method import ramplus

    for name, value in params.DEFAULTS.items():
        assert params.check(name, value) == value
    declared = {p.name: p.default for p in ramplus.spec.shared_parameters}
    assert {k: declared[k] for k in params.DEFAULTS} == params.DEFAULTS
    # the names the config checks accept are the method's, shared and per model
    assert set(declared) == set(params.DEFAULTS)
    assert {p.name for p in ramplus.spec.input_parameters} == set(params.PER_MODEL)


def test_the_api_and_the_cli_take_the_same_defaults_and_choices():
    import inspect

    from mergekit_ram import api, cli

    for function in (api.merge_state_dicts, api.agent_statistics):
        given = {k: p.default for k, p in inspect.signature(function).parameters.items() if k in params.DEFAULTS}
        assert given == {k: params.DEFAULTS[k] for k in given}, function.__name__
    assert params.SCOPES == ("model", "layer", "tensor") and params.LAMBDA_RULES == ("clip", "soft")
    command = cli.COMMANDS["inspect"][1]()
    rule = next(p for p in command.params if p.name == "lambda_rule")
    assert tuple(rule.type.choices) == params.LAMBDA_RULES


def test_unknown_parameter():
    with pytest.raises(ValueError, match="unknown ramplus parameter 'lambda'"):
        params.check("lambda", 1.0)
