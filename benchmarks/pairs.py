"""Paired whole-process figures of a `run.py` result: each repeat's `ramplus_cold` against the `task_arithmetic` run
beside it (round-robin: run one after the other), wall and user + system CPU time, the load, and the spread.

    python benchmarks/pairs.py RESULTS_DIR [RESULTS_DIR ...] [--markdown]

Wall time on a shared machine stretches with the other processes; CPU time much less, so an outlier whose CPU time
is ordinary was waiting for a core (contention), one whose CPU time grew too did more work (allocator, page faults:
see `minflt`). Written for issue 53 (the torch path's spread over 20 runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pairs(folder: Path) -> dict:
    found = json.loads((folder / "results.json").read_text())
    work = found["workloads"][0]
    runs = {m: {r["repeat"]: r for r in v["runs"] if r.get("ok")} for m, v in work["methods"].items()}
    ta, ram = runs["task_arithmetic"], runs["ramplus_cold"]
    rows = []
    for k in sorted(set(ta) & set(ram)):
        a, b = ta[k], ram[k]
        cpu_a, cpu_b = a["user_s"] + a["sys_s"], b["user_s"] + b["sys_s"]
        rows.append({"repeat": k, "ta_wall": a["wall_s"], "ram_wall": b["wall_s"], "ta_cpu": cpu_a, "ram_cpu": cpu_b,
                     "wall_ratio": b["wall_s"] / a["wall_s"], "cpu_ratio": cpu_b / cpu_a,
                     "load": (a["loadavg_1m"] + b["loadavg_1m"]) / 2, "ram_minflt": b["minflt"]})
    return {"name": folder.name, "workload": work["workload"], "rows": rows}


def summary(found: dict) -> str:
    rows = found["rows"]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "repeat"}
    worst = max(rows, key=lambda r: r["ram_wall"])
    loads = [r["load"] for r in rows]
    return (f"| {found['name']} | {len(rows)} | {med['ta_wall']:.2f} / {med['ram_wall']:.2f} | "
            f"**{med['wall_ratio']:.2f}x** ({min(r['wall_ratio'] for r in rows):.2f}-"
            f"{max(r['wall_ratio'] for r in rows):.2f}) | {med['ta_cpu']:.2f} / {med['ram_cpu']:.2f} | "
            f"**{med['cpu_ratio']:.2f}x** ({min(r['cpu_ratio'] for r in rows):.2f}-{max(r['cpu_ratio'] for r in rows):.2f}) "
            f"| {worst['ram_wall'] / med['ram_wall']:.2f}x (CPU {worst['ram_cpu'] / med['ram_cpu']:.2f}x) "
            f"| {min(loads):.1f}-{max(loads):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--runs", action="store_true", help="every pair, not only the summary")
    args = p.parse_args()
    print("| run | pairs | median wall s, TA / ramplus | wall ratio, median (min-max) | median CPU s, TA / ramplus "
          "| CPU ratio, median (min-max) | slowest ramplus / median wall | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    found = [pairs(f) for f in args.folders]
    for f in found:
        print(summary(f))
    if args.runs:
        for f in found:
            print(f"\n{f['name']}: repeat, TA wall, ramplus wall, ratio, TA CPU, ramplus CPU, ratio, load, minflt")
            for r in f["rows"]:
                print(f"{r['repeat']:>3} {r['ta_wall']:6.2f} {r['ram_wall']:6.2f} {r['wall_ratio']:5.2f} "
                      f"{r['ta_cpu']:6.2f} {r['ram_cpu']:6.2f} {r['cpu_ratio']:5.2f} {r['load']:5.1f} {r['ram_minflt']}")


if __name__ == "__main__":
    main()
