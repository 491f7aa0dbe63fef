"""Every `ramplus` parameter negative, NaN, inf, a string or huge; unknown choices; filters.

Decided behaviour: any value that is not a number in range (r and alpha at most 1000;
epsilon any finite number >= 0; rho any number >= 0, inf included) is an error naming the
parameter, before any tensor is read. A huge epsilon or rho is a valid request and merges
as the reference says. Older cases counted here: tests/test_method.py (epsilon -1e-5 and
NaN, r -0.1 and inf, alpha -2 and inf, rho -1, no base model, two base models, base also
listed as an agent, rho for some agents only) and tests/test_report.py (typos,
misplaced shared parameters).
"""

from __future__ import annotations

import math

import pytest
from helpers import config_yaml, forbid_count, inputs, no_weights

# (parameter, value) pairs already in tests/test_method.py, not repeated here
ELSEWHERE = {
    ("epsilon", -1e-5),
    ("epsilon", "nan"),
    ("r", -0.1),
    ("r", "inf"),
    ("alpha", -2),
    ("alpha", "inf"),
    ("rho", -1),
}
BAD = {"negative": -1.0, "nan": math.nan, "inf": math.inf, "string": "abc", "huge": 1e300, "bool": True}
HUGE_IS_FINE = {"epsilon", "rho"}


def _cases():
    for name in ("epsilon", "r", "alpha", "rho"):
        for kind, value in BAD.items():
            if kind == "huge" and name in HUGE_IS_FINE:
                continue
            if kind == "inf" and name == "rho":
                continue  # rho = inf is meaningful (no unique entries): merged below
            if (name, kind) in ELSEWHERE:
                continue
            yield pytest.param(name, value, id=f"{name}-{kind}")
    for name, value in [("rho_scope", "global"), ("rho_scope", 1), ("lambda_rule", "hard"), ("lambda_rule", "")]:
        yield pytest.param(name, value, id=f"{name}-{value!r}")


def _config(qwen, name, value):
    agents = [qwen.path("A"), qwen.path("B")]
    if name == "rho":
        return config_yaml(qwen.path("base"), agents, model_parameters={1: {"rho": value}})
    return config_yaml(qwen.path("base"), agents, parameters={name: value})


@pytest.mark.parametrize("name, value", list(_cases()))
def test_bad_value_names_the_parameter(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch, name, value):
    forbid_count(monkeypatch)
    rel.watch(*qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(_config(qwen_bf16, name, value), out=tmp_path / "o")
    rel.names(info, f"parameter '{name}'")
    assert "the statistics pre-pass ran" not in str(info.value)
    no_weights(tmp_path / "o")


@pytest.mark.parametrize(
    "setting",
    [[{"filter": "mlp", "value": -1}, {"value": 1e-5}], [{"filter": "self_attn", "value": "x"}, {"value": 1e-5}]],
    ids=["filtered-negative", "filtered-string"],
)
def test_bad_value_inside_a_filter_names_the_parameter(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch, setting):
    forbid_count(monkeypatch)
    rel.watch(*qwen_bf16.paths.values())
    text = config_yaml(
        qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")], parameters={"epsilon": setting}
    )
    with pytest.raises(Exception) as info:
        run_yaml(text, out=tmp_path / "o")
    rel.names(info, "parameter 'epsilon'")
    no_weights(tmp_path / "o")


def test_huge_epsilon_merges_to_the_base(rel, qwen_bf16, run_yaml):
    """epsilon 1e300: no entry changes by more, every agent is 'identical to the base'."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    rel.watch(*qwen_bf16.paths.values())
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents, parameters={"epsilon": 1e300}))
    base, sds = inputs(qwen_bf16.path("base"), agents)
    rel.matches_reference(run.tensors, base, sds, eps=1e300)


@pytest.mark.parametrize("rho", [1e300, math.inf, "2.5"], ids=["huge", "inf", "number-as-string"])
def test_given_rho_any_size_merges_as_the_reference(rel, qwen_bf16, run_yaml, rho):
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    rel.watch(*qwen_bf16.paths.values())
    text = config_yaml(qwen_bf16.path("base"), agents, model_parameters={0: {"rho": rho}, 1: {"rho": 0.5}})
    run = run_yaml(text)
    base, sds = inputs(qwen_bf16.path("base"), agents)
    rel.matches_reference(run.tensors, base, sds, rho={agents[0]: float(rho), agents[1]: 0.5})


def test_r_and_alpha_at_their_bound_merge(rho_one, rel, qwen_bf16, run_yaml):
    """r = alpha = 1000 (the largest accepted) still gives finite weights equal to the reference
    (rho = 1 given, so lambda = 1001 exactly and the float32 arithmetic is exact)."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B"), qwen_bf16.path("C")]
    rel.watch(*qwen_bf16.paths.values())
    params = {"r": 1000.0, "alpha": 1000.0}
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents, parameters=params, model_parameters=rho_one))
    base, sds = inputs(qwen_bf16.path("base"), agents)
    rel.matches_reference(run.tensors, base, sds, r=1000.0, alpha=1000.0, rho=dict.fromkeys(agents, 1.0))


@pytest.fixture
def rho_one():
    return {i: {"rho": 1.0} for i in range(3)}


@pytest.mark.quick
@pytest.mark.parametrize("name", ["epsilon", "r", "alpha"])
@pytest.mark.parametrize("value", ["1e-5", None, True], ids=["string", "none", "bool"])
def test_api_parameter_of_the_wrong_type_names_it(rel, name, value):
    """The Python API: a value that is not a number is an error naming the parameter, not a bare
    TypeError from a comparison."""
    import torch

    import mergekit_ram

    base = {"w": torch.zeros(4)}
    agents = [{"w": torch.tensor([0.1, 0.0, 0.0, 0.0])}]
    for call in (mergekit_ram.merge_state_dicts, mergekit_ram.agent_statistics):
        if call is mergekit_ram.agent_statistics and name != "epsilon":
            continue
        with pytest.raises((TypeError, ValueError)) as info:
            call(base, agents, **{name: value})
        rel.names(info, name, "must be a number")


# ---------------------------------------------------------------- the official script's names (issue 31)
OFFICIAL = [
    # (name, value, what the error must say instead)
    ("R", 0.2, ["`r: 0`", "`r: 0.2`", "--rescale_factor"]),
    ("R", 1.2, ["`r: 0.2`", "`alpha: 1`"]),
    ("rescale_factor", 1.1, ["`r: 0.1`", "`alpha: 1`"]),
    ("threshold", 1e-4, ["`epsilon: 0.0001`"]),
    ("merge_mode", "arm", ["`r: 0`"]),
    ("merge_mode", "arm-r", ["`lambda_rule: soft`"]),
    ("merge_mode", "arm-r-v2", ["default", "`alpha: 1`"]),
    ("target_index", 1, ["arm-unique", "remove it"]),
]


@pytest.mark.parametrize("name, value, instead", OFFICIAL, ids=[f"{n}-{v}" for n, v, _ in OFFICIAL])
def test_official_script_name_is_an_error_saying_what_to_write(
    rel, qwen_bf16, run_yaml, tmp_path, monkeypatch, name, value, instead
):
    """`R: 0.2` was a warning and the merge ran with r = 0.1 (exit 0): now an error before any weight is read,
    naming the parameter and what to write instead."""
    forbid_count(monkeypatch)
    rel.watch(*qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(_config(qwen_bf16, name, value), out=tmp_path / "o")
    rel.names(info, f"parameter '{name}'", "ram-main.py", *instead)
    no_weights(tmp_path / "o")
