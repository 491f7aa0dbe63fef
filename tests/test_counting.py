"""`_mergekit/counting.py`: the statistics pass on mergekit's executors, and its cache.

The reverse order counts every target once, last slice first; its progress bar is closed however
the pass ends, so `mergekit-yaml`'s traceback and `inspect`'s error start on a line of their own;
a cache entry serves only the merge it names; the key follows what changes counts, not the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import config_text, forbid_count, planner_of
from mergekit.graph import Task

from mergekit_ram._mergekit import counting, tasks
from mergekit_ram.core import statistics
from mergekit_ram.method import resolves_to_ours

QUIET = SimpleNamespace(quiet=True, device="cpu", low_cpu_memory=False, multi_gpu=False)


class Label(Task[str]):
    """A target that returns its own label (or fails with `error`)."""

    label: str
    error: str | None = None

    def arguments(self):
        return {}

    def group_label(self) -> str | None:
        return self.label

    def execute(self, **_kwargs) -> str:
        if self.error:
            raise ValueError(self.error)
        return self.label


# ---------------------------------------------------------------- the reverse order


@pytest.mark.quick
@pytest.mark.parametrize("n, slices", [(10, 4), (130, counting.SLICES), (3, counting.SLICES), (1, 1)])
def test_reverse_slices_count_every_target_once_last_slice_first(monkeypatch, n, slices):
    monkeypatch.setattr(counting, "SLICES", slices)
    targets = [Label(label=f"t{i:03d}") for i in range(n)]
    done = [value for _, value in counting.run_reversed(targets, QUIET)]
    assert sorted(done) == sorted(t.label for t in targets)  # every target, once
    size = -(-n // slices)
    order = [int(label[1:]) // size for label in done]  # the slice of each, as counted
    assert order == sorted(order, reverse=True)  # the merge's last slice first
    assert len(set(order)) == -(-n // size)  # as many executors as slices


class Bar:
    """Stands in for tqdm: records updates and whether it was closed."""

    made: list[Bar] = []

    def __init__(self, total: int, desc: str, **options):
        self.total, self.desc, self.count, self.closed, self.options = total, desc, 0, False, options
        Bar.made.append(self)

    def update(self, n: int) -> None:
        self.count += n

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    """The bars the statistics pass makes (mergekit's executors keep their own, real ones)."""
    import tqdm

    real = tqdm.tqdm

    def made(*args, **kwargs):
        return Bar(**kwargs) if not args and kwargs.get("desc") == "RAM+ statistics" else real(*args, **kwargs)

    Bar.made = []
    monkeypatch.setattr(tqdm, "tqdm", made)
    return Bar.made


def test_the_bar_counts_every_target_and_is_closed(bars):
    loud = SimpleNamespace(**{**vars(QUIET), "quiet": False})
    list(counting.run_reversed([Label(label=f"t{i}") for i in range(5)], loud))
    assert [(b.desc, b.total, b.count, b.closed) for b in bars] == [("RAM+ statistics", 5, 5, True)]


def test_a_failing_count_closes_its_bar(bars):
    loud = SimpleNamespace(**{**vars(QUIET), "quiet": False})
    targets = [Label(label="a"), Label(label="b", error="NaN in b"), Label(label="c")]
    with pytest.raises(ValueError, match="NaN in b"):
        list(counting.run_reversed(targets, loud))
    assert len(bars) == 1 and bars[0].closed


def test_quiet_makes_no_bar(bars):
    list(counting.run_reversed([Label(label="a")], QUIET))
    assert bars == []


# ---------------------------------------------------------------- the cache


def _named(*names: str):
    return [SimpleNamespace(output_weight=SimpleNamespace(name=n)) for n in names]


@pytest.mark.quick
def test_a_cache_entry_must_name_these_agents_and_only_planned_tensors(caplog):
    entry = {"agents": ["a", "b"], "tensors": [{"name": "w1"}, {"name": "w2"}]}
    assert counting.covers(entry, ["a", "b"], _named("w1", "w2"))
    assert counting.covers(entry, ["a", "b"], _named("w1", "w2", "buffer"))  # an uncounted buffer
    assert not caplog.records
    assert not counting.covers(entry, ["b", "a"], _named("w1", "w2"))  # the agents' order is rho's
    assert not counting.covers(entry, ["a"], _named("w1", "w2"))
    assert not counting.covers(entry, ["a", "b"], _named("w1"))  # a tensor this merge does not plan
    assert len(caplog.records) == 3 and all("recounting" in r.getMessage() for r in caplog.records)


def test_no_cache_key_when_the_cache_is_off(qwen_bf16, monkeypatch):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", "off")
    found = [t for _, t in tasks.planned(tasks.of_planner(planner_of(config_text(qwen_bf16, "AB"))), resolves_to_ours)]
    assert counting.cache_key(found, {}) is None


def test_the_cache_key_follows_counts_not_the_device(qwen_bf16, monkeypatch, tmp_path):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))

    def key(text: str, **options) -> str | None:
        found = [t for _, t in tasks.planned(tasks.of_planner(planner_of(text, **options)), resolves_to_ours)]
        seen: dict[str, dict] = {}
        digest = counting.cache_key(found, seen)
        assert set(seen) == {qwen_bf16.path(m) for m in ("base", "A", "B")}  # each folder identified once
        return digest

    same = key(config_text(qwen_bf16, "AB"))
    assert same is not None and len(same) == 64
    assert key(config_text(qwen_bf16, "AB")) == same
    assert key(config_text(qwen_bf16, "AB"), device="meta") == same  # the device changes no count
    assert key(config_text(qwen_bf16, "AB", parameters="r: 0.3")) == same  # nor r: counts are r-free
    assert key(config_text(qwen_bf16, "AB", parameters="epsilon: 0.001")) != same
    assert key(config_text(qwen_bf16, "AB", dtype="float32")) != same
    assert key(config_text(qwen_bf16, "BA")) != same  # another order of agents


@pytest.mark.quick
def test_counted_then_from_the_cache(qwen_bf16, monkeypatch, tmp_path):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    found = [t for _, t in tasks.planned(tasks.of_planner(planner_of(config_text(qwen_bf16, "AB"))), resolves_to_ours)]
    counted, source = counting.statistics_of(QUIET, found, {})
    assert source == "computed" and counted is not None
    assert counted.agents == [qwen_bf16.path("A"), qwen_bf16.path("B")]
    assert [t.name for t in counted.tensors] == [t.output_weight.name for t in found]
    forbid_count(monkeypatch)  # the second time, no tensor is read
    again, source = counting.statistics_of(QUIET, found, {})
    assert source == "cache" and again is not None and again.totals() == counted.totals()
    assert statistics.Statistics.from_json(again.agents, again.to_json()).to_json() == counted.to_json()


# ---------------------------------------------------------------- an error after the bar, end to end


@pytest.mark.parametrize("command", ["mergekit-yaml", "mergekit-ram inspect"])
def test_an_error_in_the_statistics_pass_starts_on_its_own_line(qwen_bf16, tmp_path, command):
    """An agent with a NaN, counted with the progress bar shown: the bar is closed before the error,
    which starts a line (one line of ours from both commands, issue 31)."""
    program, *sub = command.split()
    exe = Path(sys.executable).parent / program
    if not exe.exists():
        pytest.skip(f"the {program} console script is not installed next to this interpreter")
    config = tmp_path / "nan.yml"
    config.write_text(config_text(qwen_bf16, ["B", "NAN"]), encoding="utf-8")
    args = [str(config), str(tmp_path / "out"), "--no-copy-tokenizer"] if program == "mergekit-yaml" else [str(config)]
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}
    done = subprocess.run([str(exe), *sub, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    err = done.stderr
    assert "RAM+ statistics" in err, err[-3000:]  # the bar was shown
    start = "mergekit-yaml: error:" if program == "mergekit-yaml" else "mergekit-ram inspect: error:"
    assert "Traceback" not in err, err[-3000:]
    assert start in err, err[-3000:]
    before = err[: err.index(start)]
    assert before.endswith("\n"), repr(before[-300:])  # not in the middle of the bar's line
    assert "model.layers.1.mlp.down_proj.weight" in err and qwen_bf16.path("NAN") in err
    assert done.returncode == 1, (done.returncode, err[-3000:])
