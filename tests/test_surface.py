"""The one guard over mergekit's surface: empty on the supported mergekit, precise when something changed."""

from __future__ import annotations

import importlib.metadata

import pytest

from mergekit_ram._mergekit import surface

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_installed_mergekit_has_every_name():
    assert surface.problems() == []


def test_every_kind_of_name_is_resolved():
    kinds = {name.kind for name in surface.NAMES}
    assert kinds == {"object", "field", "annotation", "source"}
    for name in surface.NAMES:
        assert surface.resolve(name) is not None, name.label


@pytest.mark.parametrize(
    "name, words",
    [
        (surface.Name("mergekit.plan", "MergePlanner._no_such_method", surface.PREPASS), "is gone"),
        (surface.Name("mergekit.no_such_module", "thing", surface.PREPASS), "is gone"),
        (
            surface.Name("mergekit.merge_methods.task_adapter", "ExecuteMergeMethodTask.no_field", surface.PREPASS,
                         "field"),
            "no such task field",
        ),
        (surface.Name("mergekit.plan", "MergePlanner._no_attribute", surface.PREPASS, "annotation"), "no such attribute"),
        (
            surface.Name("mergekit.io.lazy_tensor_loader", "LazyTensorLoader.get_tensor", surface.LOADING, "source",
                         "0000000000000000"),
            "changed (source",
        ),
    ],
)
def test_a_changed_name_is_reported_by_name(monkeypatch, name, words):
    monkeypatch.setattr(surface, "NAMES", (*surface.NAMES, name))
    found = surface.problems(name.needed_for)
    assert len(found) == 1 and found[0].startswith(name.label) and words in found[0], found
    with pytest.raises(surface.IncompatibleMergekit, match=name.label.replace(".", r"\.")):
        surface.check(name.needed_for)


def test_problems_are_grouped_by_what_needs_them(monkeypatch):
    broken = surface.Name("mergekit.plan", "MergePlanner._gone", surface.LOADING)
    monkeypatch.setattr(surface, "NAMES", (*surface.NAMES, broken))
    assert surface.problems(surface.PREPASS) == []
    assert len(surface.problems(surface.LOADING)) == 1


@pytest.mark.parametrize("found", ["0.2.0", "0.1.4", "1.0.0"])
def test_an_unsupported_version_is_named(monkeypatch, found):
    # mergekit's version only: transformers, first imported here when this test runs first in a process, caches
    # `is_torch_available()` from torch's (torch "1.0.0" is too old: every later import of a model then fails)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found if name == "mergekit" else real(name))
    problems = surface.problems(surface.PUBLIC)
    assert problems and f"mergekit {found} is installed" in problems[0] and surface.SUPPORTED_TEXT in problems[0]


def test_source_hashes_are_of_mergekits_originals_even_when_diverted():
    """`loading` wraps two of the hashed functions: the guard hashes what they wrap."""
    from mergekit_ram._mergekit import loading

    loading.install()
    for name in surface.NAMES:
        if name.kind == "source":
            assert surface.fingerprint(surface.resolve(name)) == name.sha, name.label


def test_wrap_marks_once_and_unwrapped_strips_only_ours():
    class Owner:
        def work(self, x):
            """Mergekit's docstring."""
            return x + 1

    original = Owner.work
    made = []

    def make(inner):
        made.append(inner)
        return lambda self, x: inner(self, x) * 10

    surface.wrap(Owner, "work", make, surface.HOOKED)
    surface.wrap(Owner, "work", make, surface.HOOKED)  # idempotent: one wrapper
    assert made == [original] and Owner().work(1) == 20
    assert surface.marked(Owner.work, surface.HOOKED) and not surface.marked(Owner.work, surface.DIVERTED)
    assert Owner.work.__doc__ == "Mergekit's docstring." and Owner.work.__qualname__ == f"mergekit_ram[{original.__qualname__}]"
    surface.wrap(Owner, "work", lambda inner: lambda self, x: inner(self, x) + 5, surface.DIVERTED)
    assert Owner().work(1) == 25 and surface.unwrapped(Owner.work) is original

    def foreign(self, x):  # another package's wrapper is not ours to strip
        return original(self, x)

    assert surface.unwrapped(foreign) is foreign


def test_plan_as_mergekit_runs_the_original_plan(monkeypatch):
    from mergekit.plan import MergePlanner

    from mergekit_ram._mergekit import hooks

    hooks.install()  # idempotent: ours installed whatever this worker ran before (under -n 2 it was not, at times)

    calls = []

    class Planner(MergePlanner):
        def __init__(self):
            pass

    original = surface.unwrapped(MergePlanner._plan)
    assert original is not MergePlanner._plan  # ours is installed
    assert original.__qualname__ == "MergePlanner._plan" and original.__module__ == "mergekit.plan"
    monkeypatch.setattr(MergePlanner._plan, "__wrapped__", lambda self: calls.append(self))  # mergekit's, recorded
    planner = Planner()
    surface.plan_as_mergekit(planner)
    assert calls == [planner]


def test_the_prepass_verdict_is_kept_where_it_is_written(monkeypatch):
    monkeypatch.setattr(surface, "_prepass_unavailable", None)

    def refuse(needed_for):
        raise surface.IncompatibleMergekit(f"simulated: {needed_for}")

    monkeypatch.setattr(surface, "check", refuse)
    with pytest.raises(surface.IncompatibleMergekit):
        surface.check_prepass()
    assert surface.unavailable_reason() == "simulated: prepass"
    monkeypatch.setattr(surface, "check", lambda needed_for: None)
    surface.check_prepass()
    assert surface.unavailable_reason() is None
