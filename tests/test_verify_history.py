"""`mergekit-ram verify ORG/NAME` of a merge by one of mergekit's own methods whose config names an input at no
revision: the input's commit is inferred from its history up to the merge's own commit time (issue 70, item 3).

On the suite's Hub stand-in (tests/hub_stub.py): `org/agent` has three commits of different weights (A, B, C); the
merge (task_arithmetic, made by mergekit with this plugin disabled) read its head when that was the second, and
was published before the third. verify finds the second and says how (exit 0); with the history before the third
squashed away, it cannot check, naming the input (exit 3). The history module's own tests: tests/test_history.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from helpers import console_script
from hub_stub import HubStub, hub_env

START = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
DAY = timedelta(days=1)
CONFIG = """merge_method: task_arithmetic
base_model: org/base
models:
- model: org/agent
  parameters: {weight: 0.7}
dtype: bfloat16
"""


@pytest.fixture(scope="module")
def made(qwen_bf16, tmp_path_factory):
    """The merge, made when `org/agent`'s head was its second commit."""
    root = tmp_path_factory.mktemp("history")
    cwd = root / "cwd"  # nothing there is named like a hub id
    cwd.mkdir()
    (root / "merge.yml").write_text(CONFIG)
    served = {"org/base": [qwen_bf16.paths["base"]], "org/agent": [qwen_bf16.paths["A"], qwen_bf16.paths["B"]]}
    with HubStub(served, lifetime=600) as stub:
        env = hub_env(stub.url, root / "merge_home") | {"MERGEKIT_RAM_DISABLE": "1"}
        done = subprocess.run(
            [console_script("mergekit-yaml"), str(root / "merge.yml"), str(root / "merged"), "--no-copy-tokenizer",
             "--quiet"],
            capture_output=True, text=True, timeout=600, env=env, cwd=str(cwd),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        second = stub.shas["org/agent"][1]
    return root, second


def _verify(qwen_bf16, root: Path, squashed: bool) -> tuple[int, dict]:
    paths = qwen_bf16.paths
    served = {
        "org/base": [paths["base"]],
        "org/agent": [paths["A"], paths["B"], paths["C"]],
        "org/merged": [root / "merged"],
    }
    with HubStub(served, lifetime=600) as stub:
        for number in (1, 2, 3):
            stub.set_date("org/agent", number, START + (number if number < 3 else 4) * DAY)
        stub.set_date("org/base", 1, START)
        stub.set_date("org/merged", 1, START + 3 * DAY)  # after the second commit, before the third
        if squashed:
            stub.squash("org/agent", 3)
        home = root / ("home-squashed" if squashed else "home")
        done = subprocess.run(
            [console_script("mergekit-ram"), "verify", "org/merged", "--json", "-q"],
            capture_output=True, text=True, timeout=600, env=hub_env(stub.url, home), cwd=str(root / "cwd"),
        )  # fmt: skip
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def test_an_unpinned_input_is_read_at_its_commit_when_the_merge_was_published(made, qwen_bf16):
    root, second = made
    code, said = _verify(qwen_bf16, root, squashed=False)
    assert (code, said["result"]) == (0, "identical"), said["problems"]
    agent = next(row for row in said["inputs"] if row["model"] == "org/agent")
    assert agent["found"]["revision"] == second
    assert agent["detail"] == f"commit {second}, inferred from its history at 2026-03-04T12:00:00Z"


def test_an_input_whose_history_was_squashed_cannot_be_checked(made, qwen_bf16):
    root, _ = made
    code, said = _verify(qwen_bf16, root, squashed=True)
    assert (code, said["result"]) == (3, "cannot check"), (said["problems"], said["checked"], said["inputs"])
    assert "org/agent" in said["error"] and said["tensors"] == []
    assert os.path.isdir(root / "merged")


@pytest.mark.quick
def test_the_verdict_says_how_each_inputs_files_were_chosen():
    from mergekit_ram.verify import driver

    commit = "a" * 40
    assert driver.read_as("org/x", {"revision": commit}, None) == f"commit {commit}, head of its branch today"
    assert driver.read_as(f"org/x@{commit}", {"revision": commit}, None) == f"commit {commit}, pinned in the config"
    how = "inferred from its history at 2026-03-04T12:00:00Z"
    assert driver.read_as("org/x", {"revision": commit}, None, how) == f"commit {commit}, {how}"
    assert driver.read_as("org/x", {"revision": commit}, "/copies/x") == "read from /copies/x, given (--input)"
    assert driver.read_as("/models/x", {}, None).startswith("a local folder")
