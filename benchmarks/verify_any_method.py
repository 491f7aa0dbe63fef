"""What `mergekit-ram verify` costs on a merge by one of mergekit's own methods: wall time and peak RssAnon beside
the merge's own, whole processes (issue 70's time target: at most 1.2x the merge).

    python benchmarks/verify_any_method.py --workload W1 --repeats 3 [--methods task_arithmetic,slerp]
        [--root DIR] [--scratch DIR] [--out FILE.json]

On one workload (workloads.py), per method a merge by mergekit with this plugin disabled
(`MERGEKIT_RAM_DISABLE=1 mergekit-yaml`, mergekit's defaults: the folder a user would publish, its
`mergekit_config.yml` and card, no ram_stats.json): `task_arithmetic` of the base and every agent (weight 1.0, as
run.py's row), `slerp` of the base and the first agent (`t: 0.3`). Then, round-robin for `--repeats` rounds, per
method: the merge again (into a fresh folder, deleted after) and a full `mergekit-ram verify` of the first merge's
folder (no --sample), each a whole process timed and sampled by measure.py's launcher (wall time, peak RSS from
wait4, peak RssAnon sampled over the process tree). The page cache is warm: every input and merged file is read
once, untimed, before each timed process. Prints the medians and verify / merge per method, with the load before
each run; on a shared machine the times are upper bounds. Not part of the benchmark suite (run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import measure
import workloads
import yaml

MERGEKIT_RAM = str(measure.BIN / "mergekit-ram")
METHODS = ("task_arithmetic", "slerp")


def config(wl: workloads.Workload, method: str) -> dict:
    """The mergekit config of `method` on the workload (bf16, absolute paths)."""
    if method == "slerp":  # two models, one of them the base; t weighs the other
        first = next(iter(wl.agents.values()))
        return {"merge_method": "slerp", "base_model": str(wl.base),
                "models": [{"model": str(wl.base)}, {"model": str(first)}], "parameters": {"t": 0.3},
                "dtype": "bfloat16"}
    return measure.config(wl, method, None, {"weight": 1.0})


def touch(folders: list[Path]) -> None:
    """Untimed: read every file of `folders` once, so each timed process starts from a warm page cache."""
    buf = bytearray(1 << 24)
    for f in sorted(p for d in folders for p in d.iterdir() if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: task_arithmetic, slerp")
    parser.add_argument("--root", help="workload folder (workloads.py)")
    parser.add_argument("--scratch", help="where the merged folders go (default: a temporary folder)")
    parser.add_argument("--out", help="write every run and the medians here as JSON")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    wl, marker = workloads.get(args.workload, args.root)
    scratch = Path(tempfile.mkdtemp(prefix="verify-any-", dir=args.scratch))
    inputs = [wl.base, *wl.agents.values()]
    # the statistics cache is not used by either (no ramplus): off, so nothing outside the scratch is written
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off"}
    env.pop("MERGEKIT_RAM_DISABLE", None)
    plain = {**env, "MERGEKIT_RAM_DISABLE": "1"}  # mergekit alone: the merge a user of mergekit makes
    merges, published = {}, {}
    for method in methods:
        path = scratch / f"{method}.yaml"
        path.write_text(yaml.safe_dump(config(wl, method)))
        merges[method] = [measure.MERGEKIT_YAML, str(path)]
        published[method] = scratch / f"published-{method}"
        first = measure.measure([*merges[method], str(published[method])], plain)
        assert first["ok"], first.get("log_tail")
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for method in methods:
                touch([*inputs, published[method]])
                out = scratch / "out"  # mergekit creates it; removed after each merge
                run = measure.measure([*merges[method], str(out)], plain)
                shutil.rmtree(out, ignore_errors=True)
                assert run["ok"], run.get("log_tail")
                runs.setdefault(f"merge {method}", []).append(run)
                touch([*inputs, published[method]])
                run = measure.measure([MERGEKIT_RAM, "verify", str(published[method]), "-q"], env)
                assert run["ok"], run.get("log_tail")  # exit 0: every tensor bit-identical
                runs.setdefault(f"verify {method}", []).append(run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {key: summary(found) for key, found in runs.items()}
    ratios = {method: ratio(rows, runs, method) for method in methods}
    print(f"{args.workload}: {marker['num_parameters'] / 1e6:.1f}M params per model, {len(wl.agents)} agents; "
          f"{args.repeats} repeats, medians, warm page cache (every file read before each run)")
    print("| run | wall s | CPU s | peak RssAnon GB | peak RSS GB | all walls | load (1 min) |")
    print("|---|---|---|---|---|---|---|")
    for key, row in rows.items():
        print(f"| {key} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {row['peak_rss_anon_gb']:.2f} | "
              f"{row['peak_rss_gb']:.2f} | {row['wall_s_all']} | {row['load_all']} |")
    for method, found in ratios.items():
        print(f"verify / merge, {method}: {found['wall']:.2f}x wall, {found['cpu']:.2f}x CPU, "
              f"{found['peak_rss_anon']:.2f}x peak RssAnon; per round (wall): {found['wall_per_round']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "repeats": args.repeats,
                                              "machine": measure.machine(), "medians": rows, "ratios": ratios,
                                              "runs": runs}, indent=1) + "\n")


def ratio(rows: dict, runs: dict, method: str) -> dict:
    """verify / merge of one method: of the medians (wall, CPU, peak RssAnon), and of each round's pair (a busy
    neighbour stretches the two runs of one round more alike than runs minutes apart; CPU time moves least)."""
    verify, merge = rows[f"verify {method}"], rows[f"merge {method}"]
    pairs = zip(runs[f"verify {method}"], runs[f"merge {method}"], strict=True)
    return {"wall": verify["wall_s"] / merge["wall_s"], "cpu": verify["cpu_s"] / merge["cpu_s"],
            "peak_rss_anon": verify["peak_rss_anon_gb"] / merge["peak_rss_anon_gb"],
            "wall_per_round": [round(v["wall_s"] / m["wall_s"], 2) for v, m in pairs]}


def summary(found: list[dict]) -> dict:
    """Medians of one kind of process (GB = 2**30 bytes, as verify_cost.py prints them), and every wall and load."""
    return {"wall_s": statistics.median(r["wall_s"] for r in found),
            "cpu_s": statistics.median(r["user_s"] + r["sys_s"] for r in found),
            "peak_rss_anon_gb": statistics.median(r["peak_rss_anon_kib"] for r in found) / 2**20,
            "peak_rss_gb": statistics.median(r["maxrss_kib"] for r in found) / 2**20,
            "wall_s_all": [r["wall_s"] for r in found], "load_all": [r["loadavg_1m"] for r in found]}


if __name__ == "__main__":
    main()
