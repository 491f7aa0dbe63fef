"""`mergekit-legacy` (mergekit's command-line merge without a YAML file) with `--method ramplus`.

It builds a `MergeConfiguration` from its flags and calls `run_merge`, so it is one more door to the
same pipeline: the statistics pass with the global rho, the table, `ram_stats.json` and the card. Run as
the installed console script: the result equals the float64 reference (tests/reference.py) up to the
one output rounding, the counts equal the closed form, and `mergekit-ram verify` accepts the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import models
from helpers import check_against_reference, closed_form, read_stats, validate_schema


def _exe(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        pytest.skip(f"the {name} console script is not installed next to this interpreter")
    return str(exe)


@pytest.fixture(scope="module")
def legacy(qwen_bf16, tmp_path_factory):
    out = tmp_path_factory.mktemp("legacy") / "out"
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}
    args = [_exe("mergekit-legacy"), str(out), "--method", "ramplus", "--base-model", qwen_bf16.path("base"), "--bf16"]
    for agent in "ABC":
        args += ["--merge", qwen_bf16.path(agent)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return SimpleNamespace(out=out, stderr=done.stderr)


@pytest.mark.quick
def test_legacy_ramplus_is_the_global_rho_merge(legacy, qwen_bf16):
    assert "RAM+ statistics (computed)" in legacy.stderr  # the pre-pass ran, so rho is the whole model's
    check_against_reference(SimpleNamespace(tensors=models.load_checkpoint(legacy.out)), qwen_bf16, "ABC")
    report = read_stats(legacy.out)
    validate_schema(report)
    assert report["merge"]["entry_point"] == "run_merge"
    _, totals = closed_form(qwen_bf16.family, "ABC")
    rows = {row["model"]: row for row in report["agents"]}
    for agent in "ABC":
        row = rows[qwen_bf16.path(agent)]
        assert (row["active"], row["shared"], row["unique"]) == (
            totals[agent]["active"], totals[agent]["shared"], totals[agent]["unique"],
        ), agent


def test_legacy_output_verifies(legacy):
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}
    done = subprocess.run(
        [_exe("mergekit-ram"), "verify", str(legacy.out), "-q"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-identical" in done.stdout
