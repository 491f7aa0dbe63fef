"""The statistics pass of two source trees, in one run: is a change to the pass within its time budget?

Runs `mergekit-ram inspect CONFIG --quiet` (cache off: every tensor counted) on a workload,
alternating the package of a baseline tree (on PYTHONPATH) and the installed one, and reports
medians of wall time and child peak RSS with their ratio. Example (the diagnostics change):

    git worktree add /tmp/before <commit before the change>
    python benchmarks/stats_ab.py --workload W1 --baseline /tmp/before --repeats 5 \
        --out benchmarks/results/stats-diagnostics/W1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402  (the launcher that reads the child's own peak RSS)
import workloads  # noqa: E402


def _git(tree: Path, *args: str) -> str:
    out = measure.git(*args, tree=tree)
    return "?" if out is None else out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--baseline", required=True, type=Path, help="a source tree whose mergekit_ram is the baseline")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", help="workload folder (see workloads.py)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    wl, _ = workloads.get(args.workload, args.root)
    cfg = measure.config(wl, "ramplus", measure.RAMPLUS)  # the runner's ramplus config
    exe = str(Path(sys.executable).parent / "mergekit-ram")
    trees = {"baseline": args.baseline.resolve(), "current": HERE.parent}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "ramplus.yaml")
        config.write_text(yaml.safe_dump(cfg))
        envs = {
            "baseline": {**os.environ, "MERGEKIT_RAM_CACHE": "off", "PYTHONPATH": str(trees["baseline"])},
            "current": {**os.environ, "MERGEKIT_RAM_CACHE": "off"},
        }
        for name, env in envs.items():  # untimed: each tree's kernel built, the inputs in the page cache
            measure.build_native(env, check=True)
            subprocess.run([exe, "inspect", str(config), "--quiet"], env=env, check=True, capture_output=True)
        runs: dict[str, list[dict]] = {name: [] for name in envs}
        for _ in range(args.repeats):
            for name, env in envs.items():  # alternating: drift hits both alike
                result = measure.measure([exe, "inspect", str(config), "--quiet"], env)
                if not result["ok"]:
                    raise SystemExit(f"{name} failed: {result.get('log_tail', '')}")
                runs[name].append(result)
    summary = {
        name: {
            "wall_s_median": statistics.median(r["wall_s"] for r in rs),
            "wall_s": [r["wall_s"] for r in rs],
            "maxrss_gb_median": statistics.median(r["maxrss_kib"] for r in rs) / 2**20,
            "others_cpu_s": [r["others_cpu_s"] for r in rs],
            "loadavg_1m": [r["loadavg_1m"] for r in rs],
        }
        for name, rs in runs.items()
    }
    ratio = summary["current"]["wall_s_median"] / summary["baseline"]["wall_s_median"]
    rss = summary["current"]["maxrss_gb_median"] / summary["baseline"]["maxrss_gb_median"]
    meta = {
        "workload": args.workload,
        "repeats": args.repeats,
        "baseline": {"tree": str(trees["baseline"]), "commit": _git(trees["baseline"], "rev-parse", "HEAD")},
        "current": {"tree": str(trees["current"]), "commit": _git(trees["current"], "rev-parse", "HEAD"),
                    "dirty": bool(_git(trees["current"], "status", "--porcelain", "mergekit_ram"))},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "mergekit-ram inspect CONFIG --quiet (MERGEKIT_RAM_CACHE=off)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "ratio_wall": ratio,
                                                       "ratio_maxrss": rss}, indent=2) + "\n")
    lines = [
        f"# Statistics pass, {args.workload}: baseline vs current (one run, alternating, {args.repeats} repeats)",
        "",
        f"Baseline {meta['baseline']['commit'][:12]}, current {meta['current']['commit'][:12]}"
        + (" (+ uncommitted changes)" if meta["current"]["dirty"] else "") + f"; {meta['command']}.",
        "",
        "| tree | wall s (median) | runs | peak RSS GB (median) | load avg 1 min |",
        "|---|---|---|---|---|",
        *(f"| {n} | {s['wall_s_median']:.2f} | {', '.join(f'{w:.2f}' for w in s['wall_s'])} | "
          f"{s['maxrss_gb_median']:.2f} | {', '.join(f'{x:.1f}' for x in s['loadavg_1m'])} |" for n, s in summary.items()),
        "",
        f"current / baseline: wall {ratio:.3f}×, peak RSS {rss:.3f}×",
        "",
    ]
    (args.out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
