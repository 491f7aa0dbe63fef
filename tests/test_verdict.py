"""`verdict.py`: what `mergekit-ram verify` finds in one folder, as text and as JSON (`Outcome`, `dumps`), its
results and exit codes. The `--json` schema against real folders: tests/test_verification.py::test_json_schema.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mergekit_ram.verify.bitwise import Difference, compare
from mergekit_ram.verify.record_checks import InputCheck
from mergekit_ram.verify.verdict import Outcome, dumps

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

FOLDER = "/data/merged"


def differing() -> Difference:
    return compare("b.weight", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))


def test_an_identical_folder_is_a_headline_and_what_was_checked():
    outcome = Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="cache")
    for name in ("a", "b"):
        outcome.add(compare(name, torch.zeros(2), torch.zeros(2)))
    outcome.checked += ["2 tensors bit for bit", "config.json"]
    outcome.not_checked.append("vocab.json (no check covers it)")
    assert outcome.identical and outcome.result == "identical" and outcome.differences == []
    assert outcome.exit_code == 0
    assert outcome.text().splitlines() == [
        f"{FOLDER}: bit-identical, 2 tensors (rho from the statistics cache)",
        "checked:",
        "  2 tensors bit for bit",
        "  config.json",
        "not checked:",
        "  vocab.json (no check covers it)",
    ]
    outcome.statistics = "computed"
    assert outcome.headline().endswith("2 tensors (rho counted again)")


def test_a_differing_folder_names_each_problem_in_order():
    outcome = Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="computed")
    outcome.add(compare("a.weight", torch.zeros(2), torch.zeros(2)))
    outcome.add(differing())
    outcome.add(Difference("z.extra", "extra", detail="in model.safetensors"))  # not counted as compared
    outcome.add(Difference("a.gone", "missing", 4, recomputed="float32 [4]"))
    outcome.parameters = ["r: mergekit_config.yml plans 0.3, ram_stats.json records 0.1"]
    assert not outcome.identical and outcome.result == "differs" and outcome.compared == 3
    assert outcome.text().splitlines() == [
        f"{FOLDER}: NOT identical (4 problems):",
        "  r: mergekit_config.yml plans 0.3, ram_stats.json records 0.1",
        "  missing: a.gone: planned by the merge, not in the folder",
        "  differs: b.weight: 1 of 2 elements, max |difference| 0.5",
        "  extra: z.extra: in the folder (in model.safetensors), not planned by the merge",
        "  1 of 3 tensors bit-identical (rho counted again)",
        "checked: nothing",
    ]
    assert outcome.exit_code == 1


def test_a_changed_input_is_cannot_check_and_nothing_recomputed_is_said():
    """Not the recorded input: the folder cannot be checked (exit 3), which is not "differs" (exit 1)."""
    changed = InputCheck("A", "agent", "changed", {"content_id": "x"}, {"content_id": "y"}, "content_id y now")
    outcome = Outcome(folder=FOLDER, entry_point="run_merge", inputs=[changed])
    outcome.checked.append("the identities of 1 input(s)")
    assert outcome.result == "cannot check" and outcome.exit_code == 3
    assert outcome.text().splitlines() == [
        f"{FOLDER}: CANNOT CHECK (1 reason):",
        "  input A (agent) changed: content_id y now",
        "  (nothing recomputed: the merge was not run again)",
        "checked:",
        "  the identities of 1 input(s)",
    ]
    # identical tensors alone are no verdict: nothing was merged
    assert not Outcome(folder=FOLDER).identical
    assert Outcome(folder=FOLDER).result == "cannot check"


def test_each_result_has_its_headline_and_exit_code():
    refused = Outcome(folder=FOLDER, cannot_check=["ram_stats.json records trust_remote_code: true; ..."])
    assert (refused.result, refused.exit_code) == ("cannot check", 3)
    assert refused.headline() == f"{FOLDER}: CANNOT CHECK (1 reason):"
    assert dumps(refused).count('"exit_code": 3') == 1
    differs = Outcome(folder=FOLDER, merged=True, files=["config.json: rope_theta is 2.0, the merge writes 1.0"])
    assert (differs.result, differs.exit_code, differs.headline()) == ("differs", 1, f"{FOLDER}: NOT identical (1 problem):")
    # a difference found beside something not checkable: the folder is shown to differ
    differs.cannot_check.append("tokenizer.json cannot be read")
    assert differs.result == "differs" and "  tokenizer.json cannot be read (so it was not checked)" in differs.text()


def test_json_follows_the_schema():
    outcome = Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="computed", method="ties")
    outcome.environment = {"device": "cpu", "threads": 2}
    outcome.add(compare("c", torch.tensor([1.0]), torch.tensor([math.inf])))
    outcome.add(differing())
    outcome.notes.append("torch 2.14.0 is installed; ...")
    found = json.loads(dumps(outcome))
    assert dumps(outcome).endswith("}\n")
    assert found == {
        "format": "mergekit-ram/verify",
        "format_version": 4,
        "folder": FOLDER,
        "hub": None,
        "entry_point": "run_merge",
        "method": "ties",
        "result": "differs",
        "exit_code": 1,
        "headline": f"{FOLDER}: NOT identical (2 problems):",
        "merged": True,
        "statistics": "computed",
        "tensors_compared": 2,
        "tensors_identical": 0,
        "inputs": [],
        "parameters": [],
        "files": [],
        "tensors": [differing().as_json(), found["tensors"][1]],
        "cannot_check": [],
        "checked": [],
        "not_checked": [],
        "problems": outcome.problems(),
        "notes": ["torch 2.14.0 is installed; ..."],
        "environment": {"device": "cpu", "threads": 2},
        "rounding": None,
    }
    assert found["tensors"][1]["name"] == "c" and found["tensors"][1]["max_abs_difference"] == "inf"


def test_an_error_is_a_result():
    outcome = Outcome(folder=FOLDER, error="the weights in /data/merged cannot be read: x")
    found = json.loads(dumps(outcome))
    assert (found["result"], found["exit_code"], found["error"], found["merged"], found["entry_point"]) == (
        "cannot check",
        3,
        "the weights in /data/merged cannot be read: x",
        False,
        None,
    )
    assert found["problems"] == ["the weights in /data/merged cannot be read: x"]
    assert "error" not in Outcome(folder=FOLDER).as_json()


def test_a_sampled_pass_is_never_result_identical():
    """issue 59: `--json`'s `result` tells a sample from a full check without reading `sample` (format_version 3)."""
    from mergekit_ram.verify.sample import draw

    full = Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="computed")
    full.add(compare("a", torch.tensor([1.0]), torch.tensor([1.0])))
    sampled = Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="recorded")
    sampled.sample = draw({"a": (4, 1), "b": (4, 1)}, 0.5, 1)
    sampled.add(compare("a", torch.tensor([1.0]), torch.tensor([1.0])))
    assert (full.as_json()["result"], full.exit_code) == ("identical", 0)
    assert (sampled.as_json()["result"], sampled.exit_code) == ("no difference in sample", 0)
    sampled.add(compare("b", torch.tensor([1.0]), torch.tensor([2.0])))
    assert (sampled.as_json()["result"], sampled.exit_code) == ("differs", 1)
