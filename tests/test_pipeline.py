"""`_mergekit/pipeline.py`: checks once, count or cache, inject rho, report, `ram_stats.json` written last.

On planners that mergekit alone planned (`helpers.planner_of`), so each step is seen on its own;
`tests/test_method.py` and `tests/test_report.py` run the same pipeline through `run_merge`.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import config_text, planner_of, validate_schema

from mergekit_ram._mergekit import pipeline, surface, tasks
from mergekit_ram.checks import config_checks
from mergekit_ram.reporting import report
from mergekit_ram.session import MergeSession, Mode

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def _rho_given(planner) -> dict[str, dict[str, float | None]]:
    """tensor -> agent -> the rho its planned task holds."""
    return {
        task.output_weight.name: {str(m): dict(p.items()).get("rho") for m, p in task.input_parameters.items()}
        for _, task in surface.planned(planner)
        if hasattr(task, "input_parameters")
    }


def test_the_config_is_checked_once_per_session(monkeypatch):
    calls = []
    monkeypatch.setattr(config_checks, "check_config", lambda config, parameters: calls.append((config, parameters)))
    config = object()
    current = MergeSession(config=config, check_parameters=False)
    pipeline.check_config(current)
    pipeline.check_config(current)
    assert calls == [(config, False)] and current.config_checked
    pipeline.check_config(MergeSession(config=config))
    assert calls == [(config, False), (config, True)]  # another session checks again


def test_a_merge_counts_and_injects_rho_where_needed(qwen_bf16, capsys):
    planner = planner_of(config_text(qwen_bf16, "AB", model_parameters={"B": "rho: 0.5"}), quiet=False)
    current = MergeSession(config=planner.config)
    pipeline.prepare(tasks.of_planner(planner), current)
    assert current.source == "computed" and current.stats is not None
    a = qwen_bf16.path("A")
    counted = current.stats.totals()[a].rho
    for name, rho in _rho_given(planner).items():
        assert rho == {qwen_bf16.path("base"): None, a: counted, qwen_bf16.path("B"): 0.5}, name
    validate_schema(current.report)
    assert [p.name for p in current.planned] == list(_rho_given(planner))
    assert "RAM+ statistics (computed):" in capsys.readouterr().err  # not quiet, and rho was needed


def test_a_merge_without_need_for_rho_counts_nothing(qwen_bf16, capsys, caplog):
    planner = planner_of(config_text(qwen_bf16, "AB", parameters="r: 0"), quiet=False)
    current = MergeSession(config=planner.config)
    caplog.set_level("INFO", logger="mergekit_ram")
    pipeline.prepare(tasks.of_planner(planner), current)
    assert (current.stats, current.source) == (None, "not computed")
    assert all(set(rho.values()) == {None} for rho in _rho_given(planner).values())
    assert current.report is not None and current.report["statistics"] == "not computed"
    assert "no statistics pre-pass" in caplog.text
    assert "RAM+ statistics" not in capsys.readouterr().err


def test_inspect_mode_counts_always_and_changes_no_task(qwen_bf16, capsys):
    planner = planner_of(config_text(qwen_bf16, "AB", parameters="r: 0"), quiet=False)
    current = MergeSession(config=planner.config, mode=Mode.INSPECT)
    pipeline.prepare(tasks.of_planner(planner), current)
    assert current.source == "computed" and current.stats is not None  # r = 0: inspect counts anyway
    assert all(set(rho.values()) == {None} for rho in _rho_given(planner).values())
    assert "RAM+ statistics (" not in capsys.readouterr().err  # its bar only: inspect prints its own table
    validate_schema(current.report)


def test_another_methods_plan_is_left_alone(qwen_bf16):
    text = config_text(qwen_bf16, "AB", method="task_arithmetic", model_parameters={"A": "weight: 1", "B": "weight: 1"})
    planner = planner_of(text)
    before = list(surface.planned(planner))
    current = MergeSession(config=planner.config)
    pipeline.prepare(tasks.of_planner(planner), current)
    assert current.report is None and current.stats is None and current.planned == []
    assert list(surface.planned(planner)) == before


def test_statistics_are_queued_after_the_model(qwen_bf16, tmp_path):
    """Inside run_merge, ram_stats.json waits in the session; a planner driven directly gets a task after
    mergekit's FinalizeModel."""
    from mergekit.io.tasks import FinalizeModel, TensorWriterTask

    planner = planner_of(config_text(qwen_bf16, "AB"))
    current = MergeSession(config=planner.config, in_run_merge=True)
    pipeline.prepare(tasks.of_planner(planner), current)
    assert current.report is not None
    pipeline.queue_statistics(current, [], str(tmp_path))
    assert current.pending == [(str(tmp_path), report.dumps(current.report))]

    direct = MergeSession(config=planner.config, report=current.report)
    finalize = FinalizeModel(tensor_save_tasks=(), writer_task=TensorWriterTask(out_path="x", max_shard_size=1))
    planned = [finalize]  # what mergekit's plan_to_disk returns ends with its FinalizeModel
    pipeline.queue_statistics(direct, planned, str(tmp_path / "out"))
    assert len(planned) == 2 and direct.pending == []
    written = planned[-1]
    assert isinstance(written, pipeline.WriteStatistics) and written.after is finalize
    assert written.arguments() == {"after": written.after} and written.main_thread_only()
    written.execute()
    assert json.loads((tmp_path / "out" / "ram_stats.json").read_text()) == current.report


def test_write_statistics_writes_the_file_whole(tmp_path):
    folder = tmp_path / "new" / "folder"
    pipeline.write_statistics(str(folder), '{"a": 1}\n')
    assert sorted(os.listdir(folder)) == ["ram_stats.json"]  # no temporary file left
    assert (folder / "ram_stats.json").read_text() == '{"a": 1}\n'
    assert (folder / "ram_stats.json").stat().st_mode & 0o044 == 0o044  # readable like mergekit's files


def test_a_failed_write_names_the_file_and_leaves_nothing(tmp_path):
    (tmp_path / "ram_stats.json" / "in-the-way").mkdir(parents=True)  # a folder where the file goes
    with pytest.raises(OSError, match="could not write .*ram_stats.json"):
        pipeline.write_statistics(str(tmp_path), "{}\n")
    assert sorted(os.listdir(tmp_path)) == ["ram_stats.json"]  # no temporary file left
