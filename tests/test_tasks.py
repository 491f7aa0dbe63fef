"""`_mergekit/tasks.py`: mergekit's planned tasks as plain data, and rho written back into them.

Real tasks come from a planner that mergekit alone planned (`helpers.planner_of`); the rules on
plain data (`plain`, `tied_copies`) also run on hand-made values.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import config_text, planner_of
from pydantic import BaseModel

from mergekit_ram import files
from mergekit_ram._mergekit import surface, tasks
from mergekit_ram.core import statistics
from mergekit_ram.core.params import DEFAULTS
from mergekit_ram.method import resolves_to_ours

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


@pytest.fixture
def planned(qwen_bf16):
    """A planner of base + A, B (B with rho given), planned by mergekit alone, and its ramplus tasks."""
    text = config_text(qwen_bf16, "AB", out_dtype="float32", model_parameters={"B": "rho: 0.5"})
    planner = planner_of(text)
    return planner, tasks.planned(tasks.of_planner(planner), resolves_to_ours)


# ---------------------------------------------------------------- plain data


class Inner(BaseModel):
    name: str
    device: str | None = None
    numbers: tuple[int, ...] = ()


class Outer(BaseModel):
    inner: Inner
    table: dict[str, float]
    dtype: object = None


def test_plain_drops_the_device_and_sorts_maps():
    from mergekit.common import ImmutableMap

    value = Outer(inner=Inner(name="w", device="cuda:1", numbers=(1, 2)), table={"b": 2.0, "a": 1.0}, dtype=torch.float16)
    found = tasks.plain(value)
    assert found == {
        "Outer": {
            "inner": {"Inner": {"name": "w", "numbers": [1, 2]}},
            "table": [["a", 1.0], ["b", 2.0]],
            "dtype": "torch.float16",
        }
    }
    json.dumps(found)  # JSON-able: the cache key's material
    on_cpu = Outer(inner=Inner(name="w", device="cpu", numbers=(1, 2)), table={"a": 1.0, "b": 2.0}, dtype=torch.float16)
    assert tasks.plain(on_cpu) == found  # the device and the order of a map change no count
    mapped = ImmutableMap(data={"y": [1, None], "x": True})
    assert tasks.plain(mapped) == [["x", True], ["y", [1, None]]]


def test_plain_names_a_model_by_its_identity(planned):
    _, found = planned
    _, task = found[0]
    assert tasks.plain(task.base_model) == str(task.base_model)
    gather = tasks.plain(task.gather_tensors)
    assert list(gather) == ["GatherTensors"] and gather["GatherTensors"]["dtype"] == "bfloat16"
    models = [model for model, _ in gather["GatherTensors"]["weight_info"]]
    assert models == sorted(str(m) for m in task.model_order)


def _weight(name: str, tied: tuple[str, ...] | None = None):
    return SimpleNamespace(output_weight=SimpleNamespace(name=name, tied_names=tied))


def test_tied_copies_are_found_only_when_the_output_ties_them():
    planned = [_weight("model.embed_tokens.weight"), _weight("lm_head.weight", ("model.embed_tokens.weight",))]
    tied = SimpleNamespace(tie_word_embeddings=True)
    assert tasks.tied_copies(tied, planned) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tasks.tied_copies(SimpleNamespace(tie_word_embeddings=False), planned) == {}
    nested = SimpleNamespace(get_text_config=lambda: tied)  # a multimodal config: its text config ties
    assert tasks.tied_copies(nested, planned) == {"lm_head.weight": "model.embed_tokens.weight"}


def test_a_tie_to_an_unplanned_tensor_or_to_itself_is_no_copy():
    planned = [
        _weight("lm_head.weight", ("model.embed_tokens.weight",)),  # its target is not planned
        _weight("a", ("a",)),  # tied to itself
        _weight("b", ("c",)),
        _weight("c", ("b",)),  # tied both ways: b is the copy, c the tensor counted
    ]
    assert tasks.tied_copies(SimpleNamespace(tie_word_embeddings=True), planned) == {"b": "c"}


# ---------------------------------------------------------------- planned tasks read


def test_planned_keeps_only_our_method_in_planning_order(planned):
    planner, found = planned
    assert [i for i, _ in found] == list(range(len(surface.planned(planner))))
    assert tasks.planned(tasks.of_planner(planner), lambda name: False) == []


def test_summary_and_who_needs_rho(planned, qwen_bf16):
    _, found = planned
    task = found[0][1]
    summary = tasks.summary(task)
    assert summary.name == task.output_weight.name and summary.base == qwen_bf16.path("base")
    assert summary.agents == (qwen_bf16.path("A"), qwen_bf16.path("B"))
    assert list(summary.parameters) == list(DEFAULTS) and dict(summary.parameters) == DEFAULTS
    assert summary.given_rho == {qwen_bf16.path("A"): None, qwen_bf16.path("B"): 0.5}
    assert {str(m) for m in tasks.needing_rho([t for _, t in found])} == {qwen_bf16.path("A")}
    plain_ram = [t.model_copy(update={"parameters": {**dict(t.parameters.items()), "r": 0.0}}) for _, t in found]
    assert tasks.needing_rho(plain_ram) == set()


def test_stored_row_reads_headers_once(planned, qwen_bf16):
    planner, found = planned
    headers = files.Headers()
    rows = [tasks.of_planner(planner).stored_row(task, headers) for _, task in found]
    assert len(headers) == 3  # one file per model, read once for every tensor
    name, base, vocabulary, stored = rows[0]
    assert name == "model.embed_tokens.weight" and base == qwen_bf16.path("base") and vocabulary
    shape = list(qwen_bf16.family.base[name].shape)
    assert stored == {qwen_bf16.path(m): ("BF16", shape) for m in ("A", "B", "base")}
    assert not rows[1][2]  # a layer's weight is no vocabulary tensor


# ---------------------------------------------------------------- written back


def test_round_once_gives_each_task_the_dtype_it_is_written_in(planned):
    planner, found = planned
    assert all(task.out_dtype is None for _, task in found)
    rounded = tasks.round_once_to_out_dtype(tasks.of_planner(planner), found)
    assert all(task.out_dtype == "float32" for _, task in rounded)
    assert [task for _, task in surface.planned(planner)] == [task for _, task in rounded]


def test_inject_writes_rho_only_where_needed(planned, qwen_bf16):
    planner, found = planned
    a, b = qwen_bf16.path("A"), qwen_bf16.path("B")
    first = found[0][1].output_weight.name
    stats = statistics.Statistics([a, b], [statistics.TensorCounts(first, 10, {a: (5, 2, 0), b: (5, 4, 0)})])
    needs = tasks.needing_rho([t for _, t in found])
    tasks.inject(tasks.of_planner(planner), found, stats, needs, {})
    after = [task for _, task in surface.planned(planner)]
    assert [t.output_weight.name for t in after] == [t.output_weight.name for _, t in found]
    for task in after:
        given = {str(m): dict(p.items()) for m, p in task.input_parameters.items()}
        assert given == {qwen_bf16.path("base"): {}, a: {"rho": 1.5}, b: {"rho": 0.5}}, task.output_weight.name
    # nothing else of a task changes
    for (_, before), task in zip(found, after, strict=True):
        assert before.model_copy(update={"input_parameters": task.input_parameters}) == task


def test_inject_writes_nothing_for_agents_with_rho_given_or_r_zero(planned, qwen_bf16):
    planner, found = planned
    a, b = qwen_bf16.path("A"), qwen_bf16.path("B")
    first = found[0][1].output_weight.name
    stats = statistics.Statistics([a, b], [statistics.TensorCounts(first, 10, {a: (5, 2, 0), b: (5, 4, 0)})])
    tasks.inject(tasks.of_planner(planner), found, stats, set(), {})  # nobody needs a counted rho
    for _, task in surface.planned(planner):
        assert {str(m): dict(p.items()).get("rho") for m, p in task.input_parameters.items()} == {
            qwen_bf16.path("base"): None,
            a: None,
            b: 0.5,
        }


def test_inject_gives_a_tied_copy_the_rho_of_its_target(planned, qwen_bf16):
    planner, found = planned
    a, b = qwen_bf16.path("A"), qwen_bf16.path("B")
    copy, target = found[-1][1].output_weight.name, found[0][1].output_weight.name
    stats = statistics.Statistics(
        [a, b],
        [statistics.TensorCounts(target, 10, {a: (4, 1, 0), b: (2, 2, 0)})],
    )
    tasks.inject(tasks.of_planner(planner), found, stats, {m for m in found[0][1].model_order if str(m) == a}, {copy: target})
    rho = {task.output_weight.name: task.input_parameters for _, task in surface.planned(planner)}
    for model, params in rho[copy].items():
        if str(model) == a:
            assert params["rho"] == 3.0  # its target's: 3 shared / 1 unique


def test_inject_per_layer_rho_follows_each_tensor_to_its_layer(qwen_bf16):
    planner = planner_of(config_text(qwen_bf16, "AB", parameters="rho_scope: layer"))
    found = tasks.planned(tasks.of_planner(planner), resolves_to_ours)
    a, b = qwen_bf16.path("A"), qwen_bf16.path("B")
    names = [task.output_weight.name for _, task in found]
    layer0 = next(n for n in names if n.startswith("model.layers.0."))
    layer1 = next(n for n in names if n.startswith("model.layers.1."))
    stats = statistics.Statistics(
        [a, b],
        [
            statistics.TensorCounts(layer0, 10, {a: (2, 1, 0), b: (1, 1, 0)}),
            statistics.TensorCounts(layer1, 10, {a: (5, 1, 0), b: (1, 1, 0)}),
        ],
    )
    tasks.inject(tasks.of_planner(planner), found, stats, set(found[0][1].model_order) - {found[0][1].base_model}, {})
    given = {
        task.output_weight.name: {str(m): dict(p.items()).get("rho") for m, p in task.input_parameters.items()}
        for _, task in surface.planned(planner)
    }
    for name in names:
        want = {"model.layers.0": 1.0, "model.layers.1": 4.0}.get(statistics.scope_group(name, "layer"))
        assert given[name][a] == want, name  # outside the two counted layers: no group, no rho
