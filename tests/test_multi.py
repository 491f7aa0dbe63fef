"""`mergekit-multi` (mergekit's multi-stage recipes) with a `ramplus` stage, as a user runs it.

One YAML file, two documents with `name:`: stage `ram` merges A and B with `ramplus`;
stage `blend` (`linear`, 0.75 / 0.25) merges `ram` (mergekit-multi replaces the name with
`<intermediate dir>/ram`) with C. Run as the installed console script, in a subprocess:

* `ram`'s tensors equal the float64 reference (tests/reference.py) up to the one output
  rounding, and its folder holds `ram_stats.json` and the card's "RAM+ statistics" section;
* `blend` read `ram`'s output (its tensors are 0.75 * ram + 0.25 * C, not anything else)
  and has no RAM+ report of its own;
* a second run in mergekit-multi's default (lazy) mode skips both stages: its log says so
  and not one file in the intermediate folder changed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import models
import reference as R
from helpers import console_script
from helpers import BF16, check_against_reference, closed_form, read_stats, validate_schema

LOG_SKIP = "INFO:multimerge:Model already exists at {}, skipping"
LOG_RUN = "INFO:multimerge:Running merge for {}"


_exe = console_script


def recipe(written) -> str:
    """Two named stages; the second names the first."""
    return f"""\
name: ram
merge_method: ramplus
base_model: {written.path("base")}
models:
  - model: {written.path("A")}
  - model: {written.path("B")}
dtype: bfloat16
---
name: blend
merge_method: linear
models:
  - model: ram
    parameters:
      weight: 0.75
  - model: {written.path("C")}
    parameters:
      weight: 0.25
dtype: bfloat16
"""


def run_multi(config: Path, inter: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}  # no kernel build on the way
    return subprocess.run(
        [_exe("mergekit-multi"), str(config), "--intermediate-dir", str(inter), "--no-copy-tokenizer", "--quiet", "-v"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(cwd),
    )


@pytest.fixture(scope="module")
def multi(qwen_bf16, tmp_path_factory):
    """The recipe run once, then once more (lazy), with each run's log and the files in between."""
    root = tmp_path_factory.mktemp("multi")
    cwd = root / "cwd"  # no folder named like a stage where the process runs
    cwd.mkdir()
    config = root / "recipe.yml"
    config.write_text(recipe(qwen_bf16), encoding="utf-8")
    inter = root / "intermediate"
    first = run_multi(config, inter, cwd)
    assert first.returncode == 0, first.stderr[-4000:]
    files = models.snapshot([inter])
    second = run_multi(config, inter, cwd)
    assert second.returncode == 0, second.stderr[-4000:]
    return SimpleNamespace(
        inter=inter, ram=inter / "ram", blend=inter / "blend", first=first, second=second, files=files,
        after=models.snapshot([inter]),
    )


@pytest.mark.quick
def test_ramplus_stage_matches_the_float64_reference(multi, qwen_bf16):
    assert LOG_RUN.format("ram") in multi.first.stderr
    assert "RAM+ statistics (computed)" in multi.first.stderr  # the pre-pass ran (the statistics cache is off)
    run = SimpleNamespace(tensors=models.load_checkpoint(multi.ram))
    check_against_reference(run, qwen_bf16, "AB")
    # the same stage merged by itself (tests/test_method.py's case) gives the same statistics
    report = read_stats(multi.ram)
    _, totals = closed_form(qwen_bf16.family, "AB")
    rows = {row["model"]: row for row in report["agents"]}
    assert set(rows) == {qwen_bf16.path("A"), qwen_bf16.path("B")}
    for agent in "AB":
        row = rows[qwen_bf16.path(agent)]
        assert (row["active"], row["shared"], row["unique"]) == (
            totals[agent]["active"], totals[agent]["shared"], totals[agent]["unique"],
        ), agent


def test_ramplus_stage_writes_its_report_in_its_own_folder(multi, qwen_bf16):
    report = read_stats(multi.ram)
    validate_schema(report)
    assert report["statistics"] == "computed"
    assert report["base_model"]["model"] == qwen_bf16.path("base")
    card = (multi.ram / "README.md").read_text(encoding="utf-8")
    assert card.count("## RAM+ statistics") == 1
    section = card[card.index("## RAM+ statistics") :]
    for agent in "AB":
        assert f"| agent | {qwen_bf16.path(agent)} | content id `" in section
    # mergekit-multi gives each stage its normalized configuration: ramplus is what ran
    assert "merge_method: ramplus" in (multi.ram / "mergekit_config.yml").read_text(encoding="utf-8")


@pytest.mark.quick
def test_second_stage_ran_on_the_ramplus_output(multi, qwen_bf16):
    assert LOG_RUN.format("blend") in multi.first.stderr
    stage_config = (multi.blend / "mergekit_config.yml").read_text(encoding="utf-8")
    assert f"model: {multi.ram}" in stage_config, stage_config  # the name became the stage's folder
    ram = models.load_checkpoint(multi.ram)
    c = qwen_bf16.stored("C")
    out = models.load_checkpoint(multi.blend)
    assert set(out) == set(ram) == set(c)
    a_instead = False  # would the result be the same had it read A instead of the ramplus output?
    for name, tensor in out.items():
        assert tensor.dtype == BF16, name
        ref = 0.75 * ram[name].double() + 0.25 * c[name].double()
        mags = 0.75 * ram[name].double().abs() + 0.25 * c[name].double().abs()
        R.assert_rounded_equal(tensor, ref, mags, label=name)  # linear: float32 sums, one bf16 rounding
        other = (0.75 * qwen_bf16.stored("A")[name].double() + 0.25 * c[name].double()).to(BF16)
        a_instead |= not torch.equal(other, tensor)
    assert a_instead
    # a plain stage: no RAM+ report
    assert not (multi.blend / "ram_stats.json").exists()
    assert "RAM+ statistics" not in (multi.blend / "README.md").read_text(encoding="utf-8")


def test_lazy_rerun_skips_both_stages(multi):
    log = multi.second.stderr
    assert LOG_SKIP.format(multi.ram) in log and LOG_SKIP.format(multi.blend) in log, log[-3000:]
    assert "Running merge for" not in log and "RAM+ statistics" not in log
    assert multi.after == multi.files  # every file, same size and mtime: nothing rewritten
    assert {Path(p).parent.name for p in multi.files} == {"ram", "blend"}
    assert {Path(p).name for p in multi.files if Path(p).parent.name == "ram"} >= {
        "model.safetensors", "config.json", "README.md", "ram_stats.json",
    }
