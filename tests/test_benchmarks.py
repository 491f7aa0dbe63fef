"""The benchmark runner: benchmarks/run.py end to end on the tiny workload (whole mergekit-yaml processes), and
benchmarks/report.py's tables and targets on hand-written results (no merge run), profile_merge's phases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RUN = BENCH / "run.py"
METHODS = ["help", "task_arithmetic", "ramplus_cold", "ramplus_warm", "ramplus_stats", "io_floor"]
LABELS = {"help": "mergekit-yaml --help", "task_arithmetic": "| task_arithmetic |", "ramplus_cold": "ramplus cold",
          "ramplus_warm": "ramplus warm", "ramplus_stats": "statistics pass alone", "io_floor": "I/O floor (read"}


@pytest.mark.skipif(not (Path(sys.executable).parent / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
def test_runner_end_to_end_on_tiny(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(RUN), "--workload", "tiny", "--repeats", "1", "--out", str(out),
           "--root", str(tmp_path / "workloads"), "--methods", *METHODS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "results.json").read_text())
    assert report["methods"] == METHODS and report["repeats"] == 1
    for key in ("cpu", "cores", "torch", "mergekit", "mergekit-ram", "date"):
        assert report["machine"][key], key
    (res,) = report["workloads"]
    assert res["workload"]["name"] == "tiny" and res["workload"]["num_parameters"] > 0
    assert list(res["methods"]) == METHODS
    for method, entry in res["methods"].items():
        (run,) = entry["runs"]
        assert run["ok"] and run["wall_s"] > 0 and run["maxrss_kib"] > 0, (method, run)
        assert entry["summary"]["wall_s"] == run["wall_s"] and entry["summary"]["rss_gb"] > 0
        # sampled over the process tree: every process here runs for seconds, far longer than the interval
        assert run["rss_samples"] > 0 and 0 < run["peak_rss_anon_kib"] <= run["peak_rss_sampled_kib"], (method, run)
        assert run["read_gb"] >= 0 and run["majflt"] >= 0, (method, run)
        assert entry["summary"]["rss_anon_gb"] == run["peak_rss_anon_kib"] * 1024 / 1e9
    assert res["methods"]["ramplus_warm"]["runs"][0]["cache_hit"] is True
    assert res["methods"]["ramplus_cold"]["config"]["merge_method"] == "ramplus"
    assert res["methods"]["ramplus_stats"]["command"][1] == "inspect"

    md = (out / "results.md").read_text()
    ta = res["methods"]["task_arithmetic"]["summary"]["wall_s"]
    rows = {m: next(line for line in md.splitlines() if LABELS[m] in line and line.startswith("|")) for m in METHODS}
    assert "| task_arithmetic | " in rows["task_arithmetic"] and "| 1.00× |" in rows["task_arithmetic"]
    cold = res["methods"]["ramplus_cold"]["summary"]["wall_s"]
    assert f"| {cold / ta:.2f}× |" in rows["ramplus_cold"]
    assert "Targets:" in md and "cold ≤ 1.2× task_arithmetic" in md
    assert "| peak RssAnon GB | read GB |" in md and "| × I/O floor |" in md
    floor = res["methods"]["io_floor"]["summary"]["wall_s"]
    assert f"| {cold / floor:.2f}× |" in rows["ramplus_cold"] and "| 1.00× |" in rows["io_floor"]
    assert res["page_cache"].startswith("warm") and "I/O-floor targets" not in md  # those are for a dropped cache
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in done.stderr
    else:
        assert (out / "chart.png").stat().st_size > 0

    # --rerender: results.md again from results.json alone (report.py), the same text
    again = subprocess.run([sys.executable, str(RUN), "--rerender", "--out", str(out)], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "results.md").read_text() == md and json.loads((out / "results.json").read_text()) == report


@pytest.mark.skipif(not (Path(sys.executable).parent / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="--drop-cache needs root")
def test_runner_drop_cache_on_tiny(tmp_path):
    """--drop-cache: the page cache is dropped before every run, results say so and rate ramplus against the floor."""
    out = tmp_path / "out"
    methods = ["task_arithmetic", "ramplus_r0", "io_floor"]
    cmd = [sys.executable, str(RUN), "--workload", "tiny", "--repeats", "1", "--out", str(out), "--no-chart",
           "--root", str(tmp_path / "workloads"), "--drop-cache", "--methods", *methods]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["drop_cache"] is True
    (res,) = report["workloads"]
    assert res["page_cache"].startswith("dropped")
    for method in methods:
        (run,) = res["methods"][method]["runs"]
        assert run["ok"] and run["peak_rss_anon_kib"] > 0, (method, run)
    md = (out / "results.md").read_text()
    assert "page cache dropped before every run" in md and "drop_caches" in md
    assert "I/O-floor targets (page cache dropped): ramplus r=0 (no pre-pass) ≤ 1.3× I/O floor" in md
    assert "ramplus peak RssAnon ≤ task_arithmetic's" in md


# --------------------------------------------------------------------------- #
# report.py on hand-written results: the tables and targets without running a merge
# --------------------------------------------------------------------------- #
def _load(name: str):
    """A module of benchmarks/, loaded without leaving benchmarks/ on sys.path or its modules in sys.modules:
    benchmarks/quality has a report.py and a run.py too, which its own tests import by those names."""
    names = {p.stem for p in BENCH.glob("*.py")}
    path, saved = list(sys.path), {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
    return module


@pytest.fixture(scope="module")
def report():
    return _load("report")


def _run(wall, rss_kib=1_000_000, anon_kib=500_000, **extra) -> dict:
    """One measured run as results.json keeps it (the fields report.py reads)."""
    return {"ok": True, "wall_s": wall, "maxrss_kib": rss_kib, "peak_rss_anon_kib": anon_kib, "rss_samples": 10,
            "read_gb": 0.1, "others_cpu_s": 0.0, "user_s": wall - 1.0, "sys_s": 0.5, **extra}


def _marker(name="hand", agents=2) -> dict:
    params = {"arch": "qwen2", "hidden_size": 64, "num_layers": 2, "vocab_size": 256, "tie_word_embeddings": False,
              "densities": [0.03, 0.46, 0.54, 0.25][:agents], "dtype": "bfloat16"}
    return {"name": name, "params": params, "num_parameters": 130_000, "base": "/nonexistent"}


def _workload(report, runs: dict, page_cache="warm (inputs read before every run)", name="hand", agents=2) -> dict:
    methods = {m: {"label": report.METHODS[m][0], "runs": r, "summary": report.summarize(r)} for m, r in runs.items()}
    return {"workload": _marker(name, agents), "methods": methods, "page_cache": page_cache}


def _hand_runs() -> dict:
    return {
        "help": [_run(4.0), _run(5.0), _run(4.1)],
        "task_arithmetic": [_run(10.0, 2_000_000), _run(12.0, 2_000_000, others_cpu_s=0.5), _run(11.0, 2_000_000)],
        "ties": [{"ok": False, "returncode": -9, "wall_s": 3.0, "error": "killed by SIGKILL (out of memory?)"}],
        "ramplus_cold": [_run(9.0, 1_900_000), _run(8.0, 1_900_000), _run(8.5, 1_900_000)],
        "ramplus_warm": [_run(7.0, 1_900_000), _run(20.0, 1_900_000, others_cpu_s=3.0, disturbed=True),
                         _run(7.2, 1_900_000)],
        "io_floor": [_run(2.0), _run(2.0), _run(2.0)],
    }


@pytest.mark.quick
def test_report_summarize_medians_valid_runs_and_failures(report):
    s = report.summarize([_run(7.0), _run(20.0, disturbed=True), _run(7.2), _run(30.0, superseded=True),
                          {**_run(1.0), "priming": True}])
    assert s["ok"] and s["n"] == 2 and s["wall_s"] == pytest.approx(7.1)
    assert (s["wall_min_s"], s["wall_max_s"]) == (7.0, 7.2) and s["invalid_left_out"] == 1 and s["invalid_used"] == 0
    assert s["rss_gb"] == 1_000_000 * 1024 / 1e9 and s["rss_anon_gb"] == 500_000 * 1024 / 1e9 and s["read_gb"] == 0.1
    # every run disturbed: they count after all, and say so
    s = report.summarize([_run(5.0, disturbed=True), _run(6.0, cache_hit=False)])
    assert s["n"] == 2 and s["invalid_used"] == 2 and s["wall_s"] == 5.5
    # a failure, a timeout, and a run of older results (no RssAnon samples, no bytes read)
    assert report.summarize([{"ok": False, "error": "exit status 1"}]) == {"ok": False, "error": "exit status 1"}
    timed = report.summarize([{"ok": False, "timed_out": True, "wall_s": 150.2, "error": "timed out"}])
    assert timed == {"ok": False, "error": "timed out", "timed_out_s": 150.2}
    old = report.summarize([{"ok": True, "wall_s": 3.0, "maxrss_kib": 1_000_000}])
    assert old["rss_anon_gb"] is None and old["read_gb"] is None


def test_report_workload_table_and_targets(report):
    res = _workload(report, _hand_runs())
    md = report.workload_markdown(res)
    lines = md.splitlines()
    assert lines[0] == ("## hand: qwen2, hidden 64, 2 layers, vocab 256, untied, 2 agents (densities 3%, 46%), "
                        "bfloat16, 0.1M params per model")
    assert "Page cache: warm (inputs read before every run)." in lines
    assert ("| method | wall s (median) | peak RSS GB | peak RssAnon GB | read GB | × task_arithmetic | × ram "
            "| × I/O floor | merge phase s | merge phase × task_arithmetic | CPU s (median) | wall s min–max |") in lines
    assert "|---|---|---|---|---|---|---|---|---|---|---|---|" in lines
    for row in (
        "| mergekit-yaml --help (start-up) | 4.10 | 1.02 | 0.51 | 0.1 | — | — | — | — | — | 3.60 | 4.00–5.00 |",
        "| task_arithmetic | 11.00 | 2.05 | 0.51 | 0.1 | 1.00× | — | 5.50× | 6.90 | 1.00× | 10.50 | 10.00–12.00 |",
        "| ties | **failed**: killed by SIGKILL (out of memory?) |" + " — |" * 10,
        "| ramplus cold | 8.50 | 1.95 | 0.51 | 0.1 | 0.77× | — | 4.25× | 4.40 | 0.64× | 8.00 | 8.00–9.00 |",
        "| ramplus warm (cache) | 7.10 | 1.95 | 0.51 | 0.1 | 0.65× | — | 3.55× | 3.00 | 0.43× | 6.60 | 7.00–7.20 "
        "(median of 2; 1 disturbed or cache-miss runs left out) |",
        "| I/O floor (read all, write one) | 2.00 | 1.02 | 0.51 | 0.1 | 0.18× | — | 1.00× | — | — | 1.50 | 2.00–2.00 |",
    ):
        assert row in lines, row
    assert ("Targets: cold ≤ 1.2× task_arithmetic: **met** (0.77× wall, 0.64× merge phase); warm ≤ 1.0× "
            "task_arithmetic: **met** (0.65× wall, 0.43× merge phase); ramplus peak RSS ≤ task_arithmetic's: "
            "**met** (1.95 vs 2.05 GB).") in lines
    assert "Noisy (max/min wall over repeats > 1.2): mergekit-yaml --help (start-up) (1.25×)." in lines
    assert ("Other processes used 3.5 CPU s during the timed runs (most during one ramplus warm (cache) run: "
            "3.0 s).") in lines
    assert "I/O-floor targets" not in md  # warm page cache: the disk-bound targets do not apply

    dropped = report.workload_markdown(_workload(report, _hand_runs(), page_cache="dropped before every run"))
    assert "Page cache: dropped before every run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root)." in dropped
    assert ("I/O-floor targets (page cache dropped): ramplus warm (cache) ≤ 1.3× I/O floor: **MISSED** (3.55×); "
            "ramplus cold ≤ 1.45× I/O floor: **MISSED** (4.25×); ramplus peak RssAnon ≤ task_arithmetic's: **met** "
            "(0.51 vs 0.51 GB).") in dropped.splitlines()


def test_report_targets_variants(report):
    def s(**walls):
        return {m: report.summarize([_run(w)]) for m, w in walls.items()}

    assert report.targets(s(ramplus_cold=5.0), 4.0) == "Targets: not evaluated (no task_arithmetic run)."
    # no warm run: r = 0 stands in; against ties; no start-up row: no merge-phase ratio
    line = report.targets(s(task_arithmetic=10.0, ramplus_r0=11.0, ramplus_cold=13.0, ties=40.0), None)
    assert line == ("Targets: cold ≤ 1.2× task_arithmetic: **MISSED** (1.30× wall, — merge phase); warm (r=0 proxy) "
                    "≤ 1.0× task_arithmetic: **MISSED** (1.10× wall, — merge phase); ramplus peak RSS ≤ "
                    "task_arithmetic's: **met** (1.02 vs 1.02 GB); ramplus cold ≥ 3× faster than ties: **met** "
                    "(3.08× wall, — merge phase).")
    assert report.floor_targets(s(io_floor=2.0)) == "I/O-floor targets (page cache dropped): not evaluated."


def test_report_mergekit_pytorch_rows_compare_with_their_own_task_arithmetic(report):
    runs = {
        "help": [_run(4.0)],
        "task_arithmetic": [_run(10.0)],
        "pytorch_help": [_run(3.0)],
        "pytorch_task_arithmetic": [_run(8.0, anon_kib=900_000)],
        "pytorch_ramplus_cold": [_run(8.4, anon_kib=700_000)],
        "pytorch_ramplus_warm": [_run(9.6, anon_kib=700_000)],
    }
    lines = report.workload_markdown(_workload(report, runs)).splitlines()
    assert "| mergekit-pytorch task_arithmetic | 8.00 | 1.02 | 0.92 | 0.1 | 1.00× | — | 5.00 | 1.00× | 7.50 | 8.00–8.00 |" in lines
    assert "| mergekit-pytorch ramplus cold | 8.40 | 1.02 | 0.72 | 0.1 | 1.05× | — | 5.40 | 1.08× | 7.90 | 8.40–8.40 |" in lines
    assert "| mergekit-pytorch --help (start-up) | 3.00 | 1.02 | 0.51 | 0.1 | — | — | — | — | 2.50 | 3.00–3.00 |" in lines
    assert ("mergekit-pytorch targets: mergekit-pytorch ramplus cold ≤ 1.1× its task_arithmetic: **met** (1.05× wall, "
            "1.08× merge phase); its peak RssAnon ≤ task_arithmetic's: **met** (0.72 vs 0.92 GB); mergekit-pytorch "
            "ramplus warm (cache) ≤ 1.1× its task_arithmetic: **MISSED** (1.20× wall, 1.32× merge phase); its peak "
            "RssAnon ≤ task_arithmetic's: **met** (0.72 vs 0.92 GB).") in lines
    assert report.flat_targets({}, None) == (
        "mergekit-pytorch targets: not evaluated (no mergekit-pytorch task_arithmetic run).")


def test_report_reads_older_results(report):
    """results.json from before RssAnon sampling and the I/O floor: the table of that time, no new columns."""
    walls = {"help": 4.0, "task_arithmetic": 8.0}
    old = {m: [{"ok": True, "wall_s": w, "maxrss_kib": 2_000_000}] for m, w in walls.items()}
    md = report.workload_markdown({"workload": _marker(), "methods": {
        m: {"label": report.METHODS[m][0], "runs": r, "summary": report.summarize(r)} for m, r in old.items()}})
    assert md.splitlines()[2:5] == [
        "| method | wall s (median) | peak RSS GB | × task_arithmetic | × ram | merge phase s | wall s min–max |",
        "|---|---|---|---|---|---|---|",
        "| mergekit-yaml --help (start-up) | 4.00 | 2.05 | — | — | — | 4.00–4.00 |",
    ]
    assert "Page cache" not in md


def _report_dict(report, workloads: list[dict], scaling=None) -> dict:
    machine = {"date": "2026-01-02T03:04:05+00:00", "cpu": "Test CPU", "cores": 2, "ram_gb": 8.0, "torch": "2.13.0",
               "mergekit": "0.1.5", "mergekit-ram": "0.1.0", "git_commit": "0123456789abcdef", "git_dirty": True,
               "mergekit_ram_sources_sha256": "feedfacefeedface"}
    methods = list(workloads[0]["methods"])
    return {"command": "python benchmarks/run.py --workload hand", "argv": [], "repeats": 3, "methods": methods,
            "scaling": scaling, "no_chart": True, "drop_cache": False, "sample_s": 0.2, "machine": machine,
            "workloads": workloads, "total_wall_s": 123.4}


@pytest.mark.quick
def test_report_header_and_scaling_fit(report):
    runs = {"N2": (4.0, 5.0, 4.0), "N3": (4.0, 7.0, 4.5), "N4": (4.0, None, 5.0)}  # task_arithmetic timed out on N4
    wls = []
    for i, (name, (start, ta, cold)) in enumerate(runs.items()):
        ta_runs = [_run(ta)] if ta else [{"ok": False, "timed_out": True, "wall_s": 150.0, "error": "timed out"}]
        wls.append(_workload(report, {"help": [_run(start)], "task_arithmetic": ta_runs, "ramplus_cold": [_run(cold)]},
                             name=name, agents=2 + i))
    rep = _report_dict(report, wls, scaling="agents")
    header = report.header_markdown(rep).splitlines()
    assert header[0] == "# mergekit-ram benchmark (2026-01-02T03:04:05+00:00)"
    assert header[2] == ("Machine: Test CPU, 2 cores, 8.0 GB RAM; torch 2.13.0, mergekit 0.1.5, mergekit-ram 0.1.0; "
                         "commit 0123456789ab (dirty tree), mergekit_ram sources feedfacefeedface.")
    assert header[3] == ("Command: `python benchmarks/run.py --workload hand`; 3 repeats, methods round-robin, "
                         "medians; whole processes, warm page cache; peak RssAnon sampled every 0.2 s over the process "
                         "tree. Total benchmark wall time 123 s.")
    md = report.scaling_markdown(rep).splitlines()
    assert md[:7] == ["## Scaling over agents", "", "| workload | agents N | task_arithmetic s | ramplus cold s |",
                      "|---|---|---|---|", "| N2 | 2 | 5.00 | 4.00 |", "| N3 | 3 | 7.00 | 4.50 |",
                      "| N4 | 4 | > 150 | 5.00 |"]
    assert "- task_arithmetic: a = 1.000 s, b = 2.0000 s per agent, R² = 1.0000" in md
    assert "- ramplus cold: a = 3.000 s, b = 0.5000 s per agent, R² = 1.0000" in md
    assert report.fit([1, 2, 3], [2, 4, 7]) == pytest.approx((-2 / 3, 2.5, 1 - (1 / 6) / (114 / 9)))


def test_report_write_and_rerender(report, tmp_path):
    rep = _report_dict(report, [_workload(report, _hand_runs())])
    report.write(rep, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert md == report.header_markdown(rep) + report.workload_markdown(rep["workloads"][0])
    assert json.loads((tmp_path / "results.json").read_text()) == rep and not (tmp_path / "chart.png").exists()
    # --rerender recomputes the summaries from the runs: the same files
    stale = json.loads((tmp_path / "results.json").read_text())
    for v in stale["workloads"][0]["methods"].values():
        v["summary"] = {}
    (tmp_path / "results.json").write_text(json.dumps(stale))
    report.rerender(tmp_path)
    assert (tmp_path / "results.md").read_text() == md
    assert json.loads((tmp_path / "results.json").read_text()) == rep
    pytest.importorskip("matplotlib")
    report.chart(rep, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0


def test_profile_phases_follow_the_statistics_pass_split():
    """The statistics pass is classed by _mergekit/counting.py, tasks.py and pipeline.py (planning.py and, before it,
    prepass.py in older profiles); mergekit's own io/tasks.py, under the executor, is the merge."""
    profile = _load("profile_merge")
    root = ["<module> (/venv/bin/mergekit-yaml:8)", "run_merge (/venv/site-packages/mergekit/merge.py:60)"]
    for file in ("_mergekit/counting", "_mergekit/tasks", "_mergekit/pipeline", "_mergekit/planning", "prepass"):
        stack = [*root, f"prepare (/repo/mergekit_ram/{file}.py:40)", "sum (/venv/torch/_tensor.py:9)"]
        assert profile.phase(stack) == "3 statistics pass", file
    merge = [*root, "execute (/venv/site-packages/mergekit/graph.py:300)",
             "execute (/venv/site-packages/mergekit/io/tasks.py:80)"]
    assert profile.phase(merge) == "4 merge (executor)"
    assert profile.phase([*root, "save (/venv/site-packages/mergekit/io/tensor_writer.py:50)"]) == "5 writer"
    assert profile.classify(merge) == "other Python: execute"


@pytest.mark.quick
def test_runner_help(capsys):
    """`run.py --help` prints (a bare % in a help text made argparse fail on it)."""
    run = _load("run")
    with pytest.raises(SystemExit) as done:
        run.parse(["--help"])
    assert done.value.code == 0
    assert "other CPU use drops below 15%" in " ".join(capsys.readouterr().out.split())


def test_startup_benchmark_measures_the_hook(tmp_path):
    """benchmarks/startup.py (the start-up time moved out of the suite: a figure, not an assertion on the clock)
    finds mergekit_ram's import in a fresh interpreter's start-up and writes what it measured."""
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(BENCH / "startup.py"), "--samples", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["samples_ms"]) == 2 and all(s > 0 for s in result["samples_ms"])
    assert result["median_ms"] == pytest.approx(sum(result["samples_ms"]) / 2) and result["target_ms"] == 20
    assert f"median {result['median_ms']:.2f} ms" in done.stdout


# --------------------------------------------------------------------------- #
# methods.py and determinism.py (issue 70, item 1)
# --------------------------------------------------------------------------- #
@pytest.mark.quick
def test_methods_give_a_valid_config_for_every_registered_method():
    """benchmarks/methods.py covers mergekit's registered methods (all but this plugin's ramplus), every variant's
    config is one mergekit's MergeConfiguration accepts, in both dtypes and with an out_dtype."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge_methods import registered_methods

    methods = _load("methods")
    assert set(methods.METHODS) == {m.spec.name for m in registered_methods()} - {"ramplus"}
    assert set(methods.METHOD.values()) == set(methods.METHODS) and set(methods.KIND) == set(methods.VARIANTS)
    assert set(methods.KIND.values()) == {"element", "row", "whole"} and methods.RANDOM <= set(methods.VARIANTS)
    for dtype, out_dtype in (("bfloat16", None), ("float32", None), ("float32", "bfloat16")):
        cfgs = methods.configs("/m/base", ["/m/a", "/m/b", "/m/c"], dtype, out_dtype)
        assert set(cfgs) == set(methods.VARIANTS)
        for variant, cfg in cfgs.items():
            parsed = MergeConfiguration.model_validate(cfg)
            assert parsed.merge_method == methods.METHOD[variant] and parsed.dtype == dtype, variant
            assert parsed.out_dtype == out_dtype, variant
    with pytest.raises(ValueError):
        methods.configs("/m/base", ["/m/a"])


@pytest.mark.stage_one  # two real interpreter starts; the benchmark's, not the package's
def test_determinism_runs_on_tiny(tmp_path):
    """benchmarks/determinism.py end to end on its tiny model: one element-wise and one random method, the reference
    process and a second one (two real interpreters: about 10 s each to start)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "determinism.py"), "--models", "tiny", "--variants", "linear", "dare_ties",
           "--dtypes", "bfloat16", "--environments", "B", "--root", str(tmp_path / "root"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    (res,) = report["results"]
    assert list(res["environments"]) == ["A", "B"] and res["environments"]["A"]["env"]["seed"] == 1
    lin, dare = res["variants"]["linear/bfloat16"], res["variants"]["dare_ties/bfloat16"]
    assert (lin["kind"], lin["random"], dare["kind"], dare["random"]) == ("element", False, "whole", True)
    # the same seed in a second process: the same bits; the element-wise slice equals the whole tensor's elements
    assert lin["B"]["identical"] and dare["B"]["identical"] and lin["B"]["tensors"] > 0
    assert lin["slice"]["identical"] and "slice" not in dare
    md = (out / "results.md").read_text()
    assert "| linear | bfloat16 | element | no | = | – |" in md and "| dare_ties | bfloat16 | whole | yes | = |" in md
    assert not (tmp_path / "root" / "runs-tiny").exists()  # merges are removed unless --keep


@pytest.mark.quick
def test_determinism_counts_differences_in_ulp():
    """determinism.diff: bits compared, the largest difference in units in the last place of the tensors' dtype
    (across zero too), +0 against -0 a difference of 0 ulp."""
    import torch

    det = _load("determinism")
    one = torch.tensor([1.0, 0.0, -1.0, 2.0], dtype=torch.bfloat16)
    assert det.diff(one, one.clone()) is None
    up = (one.view(torch.int16) + torch.tensor([1, 0, 0, 3], dtype=torch.int16)).view(torch.bfloat16)
    assert det.diff(one, up) == {"share": 0.5, "elements": 2, "max_ulp": 3}
    neg_zero = torch.tensor([-0.0, 0.0, -1.0, 2.0], dtype=torch.bfloat16)
    assert det.diff(one, neg_zero) == {"share": 0.25, "elements": 1, "max_ulp": 0x3F80}  # 1.0 (bf16 bits 0x3F80) vs -0.0
    assert det.diff(neg_zero, torch.tensor([0.0, 0.0, -1.0, 2.0], dtype=torch.bfloat16))["max_ulp"] == 0
    tiny = torch.tensor([1e-45, -1e-45], dtype=torch.float32)  # the smallest subnormals either side of zero
    assert det.diff(tiny, tiny.flip(0))["max_ulp"] == 2


@pytest.mark.skipif(not (Path(sys.executable).parent / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
@pytest.mark.stage_one  # real interpreter starts; the benchmark's, not the package's
def test_verify_any_method_benchmark_on_tiny(tmp_path):
    """benchmarks/verify_any_method.py (issue 70's time target) on `tiny`, slerp alone and one round to stay short:
    a merge by mergekit with the plugin disabled, verified (each timed process exits 0), its medians and ratio."""
    out = tmp_path / "verify.json"
    cmd = [sys.executable, str(BENCH / "verify_any_method.py"), "--workload", "tiny", "--repeats", "1",
           "--methods", "slerp", "--root", str(tmp_path / "workloads"), "--scratch", str(tmp_path), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"merge slerp", "verify slerp"}
    for key, (run,) in result["runs"].items():
        assert run["ok"] and run["wall_s"] > 0 and run["peak_rss_anon_kib"] > 0, (key, run)
    merge, verify = result["medians"]["merge slerp"], result["medians"]["verify slerp"]
    assert result["ratios"]["slerp"]["wall"] == pytest.approx(verify["wall_s"] / merge["wall_s"])
    assert f"verify / merge, slerp: {verify['wall_s'] / merge['wall_s']:.2f}x wall" in done.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("verify-any-")] == []  # its scratch removed


@pytest.mark.quick
def test_gpu_machine_plan_is_what_the_benchmarks_accept(tmp_path):
    """benchmarks/gpu_machine.py's device commands (run on a lent GPU machine, never here) name flags, methods and
    workloads that run.py accepts: a renamed option fails here, not in the minutes a machine is held."""
    gpu, run, workloads = _load("gpu_machine"), _load("run"), _load("workloads")
    plan = {step.name: step for step in gpu.steps(False, tmp_path / "root", tmp_path / "work", 16)}
    assert set(gpu.DEFAULT) < set(plan) and "suite" not in gpu.DEFAULT
    assert {step.log for step in plan.values()} <= {"steps.txt", "facts.txt", "suite.txt"}  # $OUT returns 8 files
    benches = [step for step in plan.values() if step.argv[1].endswith("run.py")]
    assert {s.name for s in benches} == {"g1-cuda", "g1-threads", "r3-cuda", "r3-threads"}
    root = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    for step in benches:
        args = run.parse([a for a in step.argv[2:] if root or a != "--drop-cache"])
        assert args.workload in workloads.WORKLOADS and args.cuda == step.name.endswith("cuda"), step
        assert args.no_chart and args.timeout > 0 and args.methods, step
    assert {a for s in benches for a in s.argv if a.startswith("--")} >= {"--cuda", "--drop-cache"}
    assert plan["g1-build"].argv[-1] == "G1" and plan["r3-build"].argv[-1] == "R3" and "--jobs" in plan["r3-build"].argv
    assert plan["suite"].argv[-2:] == ("-n", "16")
    assert plan["verify-cuda"].argv[-1] == "--cuda" and "verify-cuda" not in gpu.DEFAULT


@pytest.mark.quick
def test_gpu_machine_kills_a_step_with_its_children_at_its_time(tmp_path):
    """A step past its time is killed with its whole process group (run.py's merges are its grandchildren), and
    what it printed is kept."""
    gpu = _load("gpu_machine")
    pid_file = tmp_path / "pid"
    spawn = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '60'])"
    code = f"{spawn}; open(sys.argv[1], 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    step = gpu.Step("slow", (sys.executable, "-c", code, str(pid_file)), cap=60, least=1)
    status, took = gpu._run_step(step, 6, tmp_path)  # 6 s: time for the child to start on a loaded machine
    assert status is None and took < 30, (status, took)
    assert "started" in (tmp_path / "steps.txt").read_text()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the grandchild outlived its step"


@pytest.mark.quick
def test_gpu_machine_skips_the_steps_the_budget_cannot_hold(tmp_path):
    """With too little budget left a step is not started, and the log says which and why; the run then fails."""
    gpu = _load("gpu_machine")
    out = tmp_path / "out"
    assert gpu.run(["facts", "g1-build"], 4, out, True, tmp_path / "root", 1) == 1
    log = (out / "log.txt").read_text()
    assert "facts: skipped" in log and "g1-build: skipped" in log and "needs 30" in log, log
    assert gpu.run(["nonsense"], 100, out, True, tmp_path / "root", 1) == 2
