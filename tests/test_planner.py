"""`_mergekit/planner.plan`: a config planned by mergekit alone (run_merge's preamble), nothing of ours inside:
the planned ramplus tasks carry no rho, no session is made current and the config is not checked by us."""

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from mergekit.plan import MergePlanner

from helpers import config_text

from mergekit_ram import session
from mergekit_ram._mergekit import pipeline, surface, tasks
from mergekit_ram._mergekit.planner import plan
from mergekit_ram.method import resolves_to_ours

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_plan_is_mergekits_planning_alone(qwen_bf16, monkeypatch):
    called = []
    monkeypatch.setattr(pipeline, "prepare", lambda *a, **k: called.append("prepare"))
    monkeypatch.setattr(pipeline, "check_config", lambda *a, **k: called.append("check_config"))
    config = MergeConfiguration.model_validate(yaml.safe_load(config_text(qwen_bf16, "AB")))
    planner = plan(config, MergeOptions(quiet=True, copy_tokenizer=False))
    assert isinstance(planner, MergePlanner)
    assert called == [] and session.current() is None
    found = tasks.planned(tasks.of_planner(planner), resolves_to_ours)
    names = {task.output_weight.name for _, task in found}
    assert names and names <= set(qwen_bf16.family.base)  # every planned ramplus task is a stored tensor
    for _, task in found:  # planned, not prepared: no rho injected
        assert all(params.get("rho") is None for params in task.input_parameters.values())
    assert len(surface.planned(planner)) >= len(found)
