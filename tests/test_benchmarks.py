"""Smoke test: benchmarks/run.py end to end on the tiny workload (whole mergekit-yaml processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
METHODS = ["help", "task_arithmetic", "ramplus_cold", "ramplus_warm", "ramplus_stats", "io_floor"]
LABELS = {"help": "mergekit-yaml --help", "task_arithmetic": "| task_arithmetic |", "ramplus_cold": "ramplus cold",
          "ramplus_warm": "ramplus warm", "ramplus_stats": "statistics pass alone", "io_floor": "I/O floor (read"}


@pytest.mark.skipif(not (Path(sys.executable).parent / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
def test_runner_end_to_end_on_tiny(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(RUN), "--workload", "tiny", "--repeats", "1", "--out", str(out),
           "--root", str(tmp_path / "workloads"), "--methods", *METHODS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
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


@pytest.mark.skipif(not (Path(sys.executable).parent / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="--drop-cache needs root")
def test_runner_drop_cache_on_tiny(tmp_path):
    """--drop-cache: the page cache is dropped before every run, results say so and rate ramplus against the floor."""
    out = tmp_path / "out"
    methods = ["task_arithmetic", "ramplus_r0", "io_floor"]
    cmd = [sys.executable, str(RUN), "--workload", "tiny", "--repeats", "1", "--out", str(out), "--no-chart",
           "--root", str(tmp_path / "workloads"), "--drop-cache", "--methods", *methods]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
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
