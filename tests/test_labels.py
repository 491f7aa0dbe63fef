"""Each input named once (issue 40, items 3 and 4), on the example merge the README starts with
(`mergekit-ram example DIR && mergekit-yaml DIR/ramplus.yaml DIR/merged`, through the console scripts).

* The card's RAM+ section names each input's path once (its inputs table) and `ram_stats.json` at most twice (its
  inputs table, and a mergekit-pytorch record's config); everywhere else, a short label. Before (main at
  4a22594): 5 times in the section and 138 times in `ram_stats.json` per agent, 415 paths in all.
* verify maps inputs moved elsewhere by their recorded folder (`--inputs-from`) or by label (`--input-dir`).
* A folder written in `ram_stats.json`'s format 3, before labels (`tests/fixtures/format-3/`: the
  `ram_stats.json` and `README.md` mergekit-ram wrote at 4a22594 for this example merged from /tmp/ex-main, the
  example's models being the same bytes on every machine), still verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import console_script, read_stats, strict_json

from mergekit_ram.reporting import labels

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "format-3"
#: where the fixture's example was written (4a22594's merge recorded these paths)
FIXTURE_ROOT = "/tmp/ex-main"
INPUTS = {"base": "base", "code": "agents/code", "tool": "agents/tool", "memory": "agents/memory"}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A console script, with no statistics cache (each verify counts again)."""
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off"}
    return subprocess.run([console_script(args[0]), *args[1:]], capture_output=True, text=True, timeout=900,
                          cwd=str(cwd), env=env)  # fmt: skip


@pytest.mark.quick
def test_input_labels_are_short_distinct_and_the_same_everywhere():
    """Issue 40: the merge's table named agents by path, `inspect` by folder name (or by path when two folders
    shared a name), the card and ram_stats.json by path in every table. A label is the last part, with parent
    parts until it is told apart, then a number; the same inputs get the same labels on any machine."""
    assert labels.input_labels(["/home/alice/runs/base", "/home/alice/runs/agents/code", "/tmp/tool"]) == {
        "/home/alice/runs/base": "base", "/home/alice/runs/agents/code": "code", "/tmp/tool": "tool",
    }
    # one folder name twice: told apart by the parent; files of one name (mergekit-pytorch): by their folders
    assert labels.input_labels(["/m/base", "/m/a/x", "/n/b/x"]) == {"/m/base": "base", "/m/a/x": "a/x", "/n/b/x": "b/x"}
    assert list(labels.input_labels(["/r/base/p.pt", "/r/a/p.pt"]).values()) == ["base/p.pt", "a/p.pt"]
    # hub ids: the repository's name, no revision; one repository at two revisions: numbered in order
    hub = labels.input_labels(["org/base", "org/agent-a@0123abcd", "org/agent-a", "other/agent-b"])
    assert hub == {"org/base": "base", "org/agent-a@0123abcd": "agent-a", "org/agent-a": "agent-a-2",
                   "other/agent-b": "agent-b"}  # fmt: skip
    # a hub cache snapshot folder is named as its repository; two repositories of one name by their orgs
    snapshot = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-7B/snapshots/" + "a" * 40
    assert labels.input_labels([snapshot, "x/Qwen2.5-7B"]) == {snapshot: "Qwen/Qwen2.5-7B", "x/Qwen2.5-7B": "x/Qwen2.5-7B"}
    # labels chosen before (verify: the recorded ones) are kept, the others told apart from them
    assert labels.input_labels(["/a/x", "/b/x", "/c/x-2"], given={"/a/x": "x"}) == {
        "/a/x": "x", "/b/x": "b/x", "/c/x-2": "x-2",
    }


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The README's example merge: DIR with base/, agents/{code,tool,memory}/, ramplus.yaml and merged/."""
    root = tmp_path_factory.mktemp("example") / "ex"
    done = run("mergekit-ram", "example", str(root), cwd=root.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run("mergekit-yaml", str(root / "ramplus.yaml"), str(root / "merged"), "--quiet", cwd=root.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def verify(folder: Path, *args: str) -> tuple[int, dict]:
    done = run("mergekit-ram", "verify", str(folder), "--json", "-q", *args, cwd=folder.parent)
    return done.returncode, strict_json(done.stdout) if done.stdout else {"stderr": done.stderr}


def test_the_example_names_each_input_path_once_in_the_card_and_at_most_twice_in_ram_stats(example):
    card = (example / "merged" / "README.md").read_text(encoding="utf-8")
    section = card[card.index("## RAM+ statistics") :]
    stats = (example / "merged" / "ram_stats.json").read_text(encoding="utf-8")
    counts = {label: (section.count(str(example / path)), stats.count(str(example / path)))
              for label, path in INPUTS.items()}  # fmt: skip
    assert counts == dict.fromkeys(INPUTS, (1, 1)), counts  # before: (1, 1) for the base, (5, 138) per agent
    report = json.loads(stats)
    assert list(report["inputs"]) == list(INPUTS) and [row["label"] for row in report["agents"]] == list(INPUTS)[1:]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert max(map(len, rows)) < 120, max(rows, key=len)  # no 160-character rows of paths


def test_verify_reads_moved_inputs_by_folder_or_by_label(example, tmp_path):
    """The merge's inputs moved elsewhere: one `--inputs-from` maps every input under their recorded folder, one
    `--input-dir` every input by its label; before, four `--input` flags of full paths (a common prefix refused)."""
    copies = tmp_path / "elsewhere"
    shutil.copytree(example, copies, ignore=shutil.ignore_patterns("merged"))
    by_label = tmp_path / "by-label"
    for label, path in INPUTS.items():
        shutil.copytree(example / path, by_label / label)
    published = Path(shutil.copytree(example / "merged", tmp_path / "published"))
    moved = example.with_name("ex-moved")
    example.rename(moved)
    try:
        code, found = verify(published)
        assert code == 3 and "--input-dir DIR" in found["cannot_check"][0], found
        code, found = verify(published, "--inputs-from", f"{example}={copies}")
        assert code == 0 and found["result"] == "identical", found
        code, found = verify(published, "--input-dir", str(by_label))
        assert code == 0 and found["result"] == "identical", found
        assert [row["label"] for row in found["inputs"]] == list(INPUTS)
        code, found = verify(published, "--input-dir", str(by_label), "--input", f"code={by_label / 'code'}")
        assert code == 2 and "both map" in found["stderr"], found
    finally:
        moved.rename(example)


def test_a_folder_written_before_labels_still_verifies(example, tmp_path):
    """ram_stats.json format 3 (every input by path, in every table), read in the labelled shape: the weights,
    statistics and identities checked; its card section, which this mergekit-ram no longer writes, named as not
    checked. Its inputs map by the labels a merge of them gets now."""
    old = Path(shutil.copytree(example / "merged", tmp_path / "old"))
    # The example's files differ between releases of torch, safetensors and transformers (config.json records
    # transformers' version), and so do their content ids. Write the ids this environment's example has, so the
    # check is about reading format 3, not about where the fixture was made; the tensors and statistics it records
    # are still compared with a recount.
    now = {row["model"]: row["identity"]["content_id"] for row in read_stats(example / "merged")["inputs"].values()}
    recorded = strict_json((FIXTURE / "ram_stats.json").read_text(encoding="utf-8"))
    ids = {
        row["identity"]["content_id"]: now[row["model"].replace(FIXTURE_ROOT, str(example))]
        for row in (recorded["base_model"], *recorded["agents"])
    }
    for name in ("ram_stats.json", "README.md"):
        text = (FIXTURE / name).read_text(encoding="utf-8").replace(FIXTURE_ROOT, str(example))
        for fixture_id, this_id in ids.items():
            text = text.replace(fixture_id, this_id).replace(fixture_id[:16], this_id[:16])
        (old / name).write_text(text, encoding="utf-8")
    assert strict_json((old / "ram_stats.json").read_text(encoding="utf-8"))["format_version"] == 3
    code, found = verify(old)
    assert code == 0, found
    assert any(line.startswith("ram_stats.json's statistics (recomputed") for line in found["checked"])
    assert found["not_checked"] == [
        "the card's RAM+ section (ram_stats.json is format_version 3, whose section this mergekit-ram does not write)"
    ]
    assert [(row["label"], row["model"]) for row in found["inputs"]] == [
        (label, str(example / path)) for label, path in INPUTS.items()
    ]
    by_label = tmp_path / "by-label"
    for label, path in INPUTS.items():
        shutil.copytree(example / path, by_label / label)
    code, found = verify(old, "--input-dir", str(by_label))
    assert code == 0 and all(row["status"] == "same" for row in found["inputs"]), found
    # an edited count in the old file is still a difference
    stats = json.loads((old / "ram_stats.json").read_text(encoding="utf-8"))
    stats["agents"][0]["active"] += 1
    (old / "ram_stats.json").write_text(json.dumps(stats), encoding="utf-8")
    code, found = verify(old)
    assert code == 1 and found["files"][0].startswith("ram_stats.json: agents[0].active: "), found
