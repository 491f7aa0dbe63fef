"""Counting what the reliability suite tried and what every case asserted.

Every test under tests/reliability/ takes the `rel` fixture (conftest.py), which
records, per test case: its category (from the module), whether it compared a
merge with the float64 reference (and whether that comparison failed: a silent
wrong merge), whether it snapshotted the input folders before and after (and how
many files changed: writes into inputs), and whether it injected a fault. Cases of
the older modules that already cover an item of the issue are counted under their
category too (ELSEWHERE), by node id.

tests/conftest.py forwards pytest's report hooks here. After a run, one summary line
is printed; with MERGEKIT_RAM_RELIABILITY_JSON=FILE the counts are written as JSON,
and with MERGEKIT_RAM_RELIABILITY_MD=RELIABILITY.md the table between the
`<!-- counts -->` markers of that file is regenerated from this run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass

CATEGORIES = {
    "test_tensor_inputs": "tensors",
    "test_parameter_inputs": "parameters",
    "test_file_inputs": "files",
    "test_cache_faults": "cache",
    "test_process_faults": "faults",
    "test_native_build": "native build security",
    "test_plugin_isolation": "plugin isolation",
    "test_outputs": "outputs",
    "test_mergekit_options": "mergekit options",
    "test_verify_cases": "verify",
    "test_flat_inputs": "mergekit-pytorch inputs",
    "test_untrusted_folders": "untrusted folders",
    "test_verdict_matrix": "verdict matrix",
    "test_any_method_matrix": "any-method matrix",
}
ORDER = list(CATEGORIES.values())

# Cases of older modules that cover an item of issue 10: node-id prefix -> category.
ELSEWHERE = {
    "tests/test_method.py::test_merge_matches_reference": "tensors",  # 1 agent, no unique entries, tied...
    "tests/test_method.py::test_identical_agent_warns_and_adds_nothing": "tensors",
    "tests/test_method.py::test_epsilon_zero_counts_every_change": "tensors",
    "tests/test_method.py::test_nan_in_agent_names_tensor_and_model": "tensors",
    "tests/test_method.py::test_agent_stored_in_another_dtype_warns": "tensors",
    "tests/test_kernel.py::test_empty_and_agentless_inputs": "tensors",
    "tests/test_kernel.py::test_non_finite_inputs_are_rejected": "tensors",
    "tests/test_kernel.py::test_shape_mismatch_names_agent_and_tensor": "tensors",
    "tests/test_kernel.py::test_many_agents_do_not_overflow_the_hit_counter": "tensors",
    "tests/test_api.py::test_modules_with_tied_weights_and_buffers": "tensors",
    "tests/test_api.py::test_differing_non_float_buffer_is_an_error": "tensors",
    "tests/test_method.py::test_invalid_parameters_fail_at_plan_time": "parameters",
    "tests/test_method.py::test_unbounded_alpha_is_rejected": "parameters",
    "tests/test_method.py::test_missing_base_model_is_an_error": "parameters",
    "tests/test_method.py::test_two_slice_base_models_are_an_error": "parameters",
    "tests/test_method.py::test_base_listed_among_models_changes_nothing": "parameters",
    "tests/test_method.py::test_rho_for_some_agents_wins_over_prepass": "parameters",
    "tests/test_report.py::test_misspelled_top_level_parameter_fails_before_reading": "parameters",
    "tests/test_report.py::test_misspelled_or_misplaced_parameters": "parameters",
    "tests/test_report.py::test_per_model_r_is_refused_by_a_real_merge": "parameters",
    "tests/test_report.py::test_output_into_an_input_folder_is_refused_before_writing": "files",
    "tests/test_cache.py::test_rewritten_agent_invalidates": "cache",
    "tests/test_cache.py::test_corrupt_entry_warns_recomputes_and_is_rewritten": "cache",
    "tests/test_cache.py::test_entry_with_inconsistent_agents_is_recomputed": "cache",
    "tests/test_cache.py::test_entry_missing_a_tensor_is_not_trusted": "cache",
    "tests/test_cache.py::test_two_processes_merging_at_once_share_one_entry": "cache",
    "tests/test_cache.py::test_concurrent_store_and_load_from_threads": "cache",
    "tests/test_cache.py::test_unwritable_cache_only_warns": "cache",
    "tests/test_cache.py::test_unusable_cache_folder_does_not_claim_a_corrupt_entry": "cache",
    "tests/test_flat.py::test_a_pickle_that_runs_code_is_refused_naming_the_file": "mergekit-pytorch inputs",
    "tests/test_flat.py::test_a_nan_is_named_by_tensor_and_file": "mergekit-pytorch inputs",
    "tests/test_flat.py::test_a_shape_mismatch_is_named_by_tensor_and_file": "mergekit-pytorch inputs",
    "tests/test_flat.py::test_union_refuses_a_tensor_the_base_lacks": "mergekit-pytorch inputs",
    "tests/test_flat.py::test_the_folder_of_an_input_file_is_refused_and_a_new_folder_inside_it_is_not": "outputs",
    "tests/test_finder.py::test_broken_registration_does_not_break_mergekit": "plugin isolation",
    "tests/test_finder.py::test_incompatible_mergekit_disables_prepass_but_not_mergekit": "plugin isolation",
    "tests/test_finder.py::test_name_collision_merge_is_refused_not_run_under_our_name": "plugin isolation",
}


@dataclass
class Case:
    category: str
    outcome: str = "not run"
    merges_compared: int = 0  # merges compared with the float64 reference (isolation: with mergekit's own)
    wrong_merges: int = 0  # of those, comparisons that failed
    inputs_checked: int = 0  # input snapshots compared after the case
    input_writes: int = 0  # files created, changed or removed in input folders
    fault: bool = False  # a fault was injected (kill, full disk, broken build...)
    errors_checked: int = 0  # error messages checked for the name of the culprit
    tracebacks: int = 0  # of those, errors a command would print as a traceback by default (not one line)
    verdicts: int = 0  # verify verdicts checked (a right merge must be exit 0, a changed one exit 1 naming it)
    tampers: int = 0  # of those, on a merge with a tensor changed
    false_verdicts: int = 0  # of those, verdicts that were wrong
    suite: str = "reliability"  # or "older module" (ELSEWHERE)


CASES: dict[str, Case] = {}


def category_of(nodeid: str) -> tuple[str, str] | None:
    found = re.search(r"tests/reliability/(test_\w+)\.py::", nodeid)
    if found and found.group(1) in CATEGORIES:
        return CATEGORIES[found.group(1)], "reliability"
    for prefix, category in ELSEWHERE.items():
        if nodeid == prefix or nodeid.startswith(prefix + "["):
            return category, "older module"
    return None


def case(nodeid: str) -> Case | None:
    found = category_of(nodeid)
    if found is None:
        return None
    if nodeid not in CASES:
        CASES[nodeid] = Case(category=found[0], suite=found[1])
    return CASES[nodeid]


PROPERTY = "mergekit_ram_reliability"  # the name of a case's counts among its report's user_properties


def counts(entry: Case) -> dict:
    return {k: v for k, v in asdict(entry).items() if k not in ("category", "outcome", "suite")}


def logreport(report) -> None:
    entry = case(report.nodeid)
    if entry is None:
        return
    for name, value in getattr(report, "user_properties", ()):
        if name == PROPERTY:  # made where the case ran (this process, or a pytest-xdist worker)
            for key, number in value.items():
                setattr(entry, key, number)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry.outcome = report.outcome
    elif report.when == "teardown" and report.outcome == "failed":
        entry.outcome = "failed"  # the input snapshot is compared at teardown


def summary() -> dict:
    rows = {}
    for category in ORDER:
        cases = [c for c in CASES.values() if c.category == category]
        rows[category] = {
            "cases": len(cases),
            "from_older_modules": sum(c.suite != "reliability" for c in cases),
            "passed": sum(c.outcome == "passed" for c in cases),
            "failed": sum(c.outcome == "failed" for c in cases),
            "skipped": sum(c.outcome == "skipped" for c in cases),
            "merges_compared": sum(c.merges_compared for c in cases),
            "errors_checked": sum(c.errors_checked for c in cases),
            "tracebacks": sum(c.tracebacks for c in cases),
            "verdicts": sum(c.verdicts for c in cases),
            "tampers": sum(c.tampers for c in cases),
            "false_verdicts": sum(c.false_verdicts for c in cases),
            "faults_injected": sum(c.fault for c in cases),
            "faults_survived": sum(c.fault and c.outcome == "passed" for c in cases),
            "wrong_merges": sum(c.wrong_merges for c in cases),
            "inputs_checked": sum(c.inputs_checked for c in cases),
            "input_writes": sum(c.input_writes for c in cases),
        }
    total = {key: sum(row[key] for row in rows.values()) for key in next(iter(rows.values()))}
    return {"categories": rows, "total": total, "cases": {k: asdict(v) for k, v in sorted(CASES.items())}}


COLUMNS = [
    ("cases", "cases tried"),
    ("from_older_modules", "of which in older modules"),
    ("passed", "passed"),
    ("failed", "failed"),
    ("skipped", "skipped"),
    ("merges_compared", "merges checked"),
    ("errors_checked", "errors naming the culprit"),
    ("tracebacks", "of which a traceback by default"),
    ("faults_survived", "faults survived"),
    ("verdicts", "verify verdicts checked"),
    ("tampers", "of which on a changed merge"),
    ("false_verdicts", "false verdicts"),
    ("wrong_merges", "silent wrong merges"),
    ("inputs_checked", "input snapshots compared"),
    ("input_writes", "writes into inputs"),
]


def table(data: dict) -> str:
    head = "| category | " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|---|" + "---|" * len(COLUMNS)
    lines = [head, rule]
    for category, row in [*data["categories"].items(), ("**total**", data["total"])]:
        lines.append(f"| {category} | " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def line(data: dict) -> str:
    t = data["total"]
    return (
        f"reliability: {t['cases']} cases ({t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped), "
        f"{t['merges_compared']} merges checked, {t['tracebacks']} of {t['errors_checked']} errors a traceback, "
        f"{t['faults_survived']}/{t['faults_injected']} faults survived, {t['wrong_merges']} silent wrong merges, "
        f"{t['verdicts']} verify verdicts ({t['tampers']} on changed merges, {t['false_verdicts']} false), "
        f"{t['input_writes']} writes into inputs ({t['inputs_checked']} snapshots)"
    )


def finish(terminalreporter=None) -> None:
    if not CASES:
        return
    data = summary()
    if terminalreporter is not None:
        terminalreporter.write_line(line(data))
    target = os.environ.get("MERGEKIT_RAM_RELIABILITY_JSON")
    if target:
        with open(target, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    md = os.environ.get("MERGEKIT_RAM_RELIABILITY_MD")
    if md:
        with open(md, encoding="utf-8") as f:
            text = f.read()
        start, end = "<!-- counts -->", "<!-- /counts -->"
        if start in text and end in text:
            before, rest = text.split(start, 1)
            after = rest.split(end, 1)[1]
            text = f"{before}{start}\n{table(data)}\n\n{line(data)}\n{end}{after}"
            with open(md, "w", encoding="utf-8") as f:
                f.write(text)
