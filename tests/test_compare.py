"""`compare.py`: what `mergekit-ram verify` finds in one folder, as text and as JSON (`Outcome`, `dumps`), and
the module verify's users import (the bit comparison and the record's checks re-exported from `bitwise` and
`record_checks`). The `--json` schema against real folders: tests/test_verification.py::test_json_schema.
"""

from __future__ import annotations

import json
import math

import torch

from mergekit_ram import bitwise, compare, record_checks

FOLDER = "/data/merged"


def differing() -> compare.Difference:
    return compare.compare("b.weight", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))


def test_the_public_names_are_where_they_were():
    assert compare.compare is bitwise.compare and compare.Difference is bitwise.Difference
    assert compare.read_report is record_checks.read_report and compare.NotVerifiable is record_checks.NotVerifiable
    assert all(hasattr(compare, name) for name in compare.__all__)
    assert {
        "Outcome", "dumps", "Difference", "compare", "bit_differences", "describe", "NotVerifiable", "Unreadable",
        "InputCheck", "read_report", "merge_record", "damaged_weight_file", "stray_tensors", "plan_mismatches",
        "rho_mismatches", "check_identity", "recorded_inputs", "version_notes", "CONFIG_FILE", "READABLE",
    } <= set(compare.__all__)


def test_an_identical_folder_is_one_line():
    outcome = compare.Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="cache")
    for name in ("a", "b"):
        outcome.add(compare.compare(name, torch.zeros(2), torch.zeros(2)))
    assert outcome.identical and outcome.result == "identical" and outcome.differences == []
    assert outcome.text() == f"{FOLDER}: bit-identical, 2 tensors (rho from the statistics cache)"
    outcome.statistics = "computed"
    assert outcome.text().endswith("2 tensors (rho counted again)")


def test_a_differing_folder_names_each_problem_in_order():
    outcome = compare.Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="computed")
    outcome.add(compare.compare("a.weight", torch.zeros(2), torch.zeros(2)))
    outcome.add(differing())
    outcome.add(compare.Difference("z.extra", "extra", detail="in model.safetensors"))  # not counted as compared
    outcome.add(compare.Difference("a.gone", "missing", 4, recomputed="float32 [4]"))
    outcome.parameters = ["r: mergekit_config.yml plans 0.3, ram_stats.json records 0.1"]
    assert not outcome.identical and outcome.result == "differs" and outcome.compared == 3
    assert outcome.text().splitlines() == [
        f"{FOLDER}: NOT identical (4 problems):",
        "  r: mergekit_config.yml plans 0.3, ram_stats.json records 0.1",
        "  missing: a.gone: planned by the merge, not in the folder",
        "  differs: b.weight: 1 of 2 elements, max |difference| 0.5",
        "  extra: z.extra: in the folder (in model.safetensors), not planned by the merge",
        "  1 of 3 tensors bit-identical (rho counted again)",
    ]


def test_nothing_recomputed_is_said():
    changed = compare.InputCheck("A", "agent", "changed", {"content_id": "x"}, {"content_id": "y"}, "content_id y now")
    outcome = compare.Outcome(folder=FOLDER, entry_point="run_merge", inputs=[changed])
    assert outcome.result == "differs"
    assert outcome.text().splitlines() == [
        f"{FOLDER}: NOT identical (1 problem):",
        "  input A (agent) changed: content_id y now",
        "  (nothing recomputed: the merge was not run again)",
    ]
    # identical tensors alone are no verdict: nothing was merged
    assert not compare.Outcome(folder=FOLDER).identical


def test_json_follows_the_schema():
    outcome = compare.Outcome(folder=FOLDER, entry_point="run_merge", merged=True, statistics="computed")
    outcome.add(compare.compare("c", torch.tensor([1.0]), torch.tensor([math.inf])))
    outcome.add(differing())
    outcome.notes.append("torch 2.14.0 is installed; ...")
    found = json.loads(compare.dumps(outcome))
    assert compare.dumps(outcome).endswith("}\n")
    assert found == {
        "format": "mergekit-ram/verify",
        "format_version": 1,
        "folder": FOLDER,
        "entry_point": "run_merge",
        "result": "differs",
        "merged": True,
        "statistics": "computed",
        "tensors_compared": 2,
        "tensors_identical": 0,
        "inputs": [],
        "parameters": [],
        "tensors": [differing().as_json(), found["tensors"][1]],
        "problems": outcome.problems(),
        "notes": ["torch 2.14.0 is installed; ..."],
    }
    assert found["tensors"][1]["name"] == "c" and found["tensors"][1]["max_abs_difference"] == "inf"


def test_an_error_is_a_result():
    outcome = compare.Outcome(folder=FOLDER, error="the weights in /data/merged cannot be read: x")
    found = json.loads(compare.dumps(outcome))
    assert (found["result"], found["error"], found["merged"], found["entry_point"]) == (
        "error",
        "the weights in /data/merged cannot be read: x",
        False,
        None,
    )
    assert found["problems"] == ["the weights in /data/merged cannot be read: x"]
    assert "error" not in compare.Outcome(folder=FOLDER).as_json()
