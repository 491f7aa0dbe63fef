"""`_mergekit/inspection.py`: `inspect` runs downhill.

It checks the config once, lets mergekit plan without our wrapper around `MergePlanner._plan`
(which would call back into `hooks` and check again), then runs `pipeline.prepare` itself;
what reading the inputs finds wrong is an `InputError` (exit code 1 of `mergekit-ram inspect`).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import yaml
from helpers import config_text, planner_of

from mergekit_ram import errors
from mergekit_ram._mergekit import inspection, pipeline, surface
from mergekit_ram.checks import config_checks
from mergekit_ram.session import Mode


def _config(text: str):
    from mergekit.config import MergeConfiguration

    return MergeConfiguration.model_validate(yaml.safe_load(text))


def _options(**options):
    from mergekit.options import MergeOptions

    return MergeOptions(**{"quiet": True, "copy_tokenizer": False, **options})


@pytest.fixture
def calls(monkeypatch):
    """Every config check, `pipeline.check_config` and `pipeline.prepare`, with the files `prepare` was called from."""
    found: dict[str, list] = {"config_checks": [], "check_config": [], "prepare": []}
    real = config_checks.check_config, pipeline.check_config, pipeline.prepare

    def check(*args, **kwargs):
        found["config_checks"].append(args)
        return real[0](*args, **kwargs)

    def once(current):
        found["check_config"].append(current)
        return real[1](current)

    def prepare(planner, current):
        found["prepare"].append([Path(frame.filename).name for frame in traceback.extract_stack()])
        return real[2](planner, current)

    monkeypatch.setattr(config_checks, "check_config", check)
    monkeypatch.setattr(pipeline, "check_config", once)
    monkeypatch.setattr(pipeline, "prepare", prepare)
    return found


def test_the_config_is_checked_once_and_nothing_calls_back_through_the_planner(qwen_bf16, calls):
    from mergekit.plan import MergePlanner

    assert surface.marked(MergePlanner._plan, surface.HOOKED)  # the wrapper is there: inspect goes round it
    done = inspection.inspect(_config(config_text(qwen_bf16, "AB")), _options())
    assert done.report is not None and done.source == "computed" and done.mode is Mode.INSPECT
    assert len(calls["config_checks"]) == 1 and len(calls["check_config"]) == 1
    assert len(calls["prepare"]) == 1
    stack = calls["prepare"][0]
    assert "inspection.py" in stack and "hooks.py" not in stack, stack  # called downhill, not from the wrapper
    assert stack[-2:] == ["inspection.py", "test_inspection.py"]  # inspection called it directly


def test_plan_runs_mergekits_planning_alone(qwen_bf16, calls):
    planner = planner_of(config_text(qwen_bf16, "AB"))
    assert surface.planned(planner)  # planned by mergekit
    assert calls == {"config_checks": [], "check_config": [], "prepare": []}  # nothing of ours ran
    assert all(task.out_dtype is None for _, task in surface.planned(planner))  # not rounded for a merge


def test_another_methods_config_is_planned_as_ramplus_without_judging_its_parameters(qwen_bf16):
    text = config_text(qwen_bf16, "AB", method="task_arithmetic", model_parameters={"A": "weight: 1.0"})
    done = inspection.inspect(_config(text), _options())
    assert done.config.merge_method == "ramplus" and not done.check_parameters
    assert done.report is not None and done.report["method"] == "ramplus"


@pytest.mark.quick
def test_what_the_inputs_hold_is_an_input_error(qwen_bf16):
    with pytest.raises(errors.InputError, match="model.layers.1.mlp.down_proj.weight") as info:
        inspection.inspect(_config(config_text(qwen_bf16, ["B", "NAN"])), _options())
    assert qwen_bf16.path("NAN") in str(info.value)
    from mergekit_ram.core.kernel import NonFiniteInputError

    assert isinstance(info.value.__cause__, NonFiniteInputError)  # the kernel's own error, kept
    assert isinstance(info.value, ValueError)  # still a ValueError to any caller that catches those


@pytest.mark.quick
def test_a_missing_input_folder_file_is_an_input_error(qwen_bf16, tmp_path):
    empty = tmp_path / "no-config"
    empty.mkdir()
    text = config_text(qwen_bf16, "A").replace("models:\n", f"models:\n  - model: {empty}\n", 1)
    with pytest.raises(errors.InputError, match="has no config.json"):
        inspection.inspect(_config(text), _options())


@pytest.mark.quick
def test_what_the_config_asks_is_no_input_error(qwen_bf16):
    no_base = "merge_method: ramplus\ndtype: bfloat16\nmodels:\n" + "".join(
        f"  - model: {qwen_bf16.path(a)}\n" for a in ("base", "A")
    )
    with pytest.raises(ValueError, match="base_model") as info:
        inspection.inspect(_config(no_base), _options())
    assert not isinstance(info.value, errors.InputError)
    bad = config_text(qwen_bf16, "AB", parameters="r: -1")
    with pytest.raises(ValueError, match="'r'") as info:
        inspection.inspect(_config(bad), _options())
    assert not isinstance(info.value, errors.InputError)
