"""What `mergekit-ram verify` costs beside the merge it checks: wall time and peak RssAnon, whole processes.

    python benchmarks/verify_cost.py --workload W1 --repeats 3 [--root DIR] [--scratch DIR]

On one workload (workloads.py), a ramplus merge by `mergekit-yaml` into a scratch folder, then, round-robin
for `--repeats` rounds: the merge again and `mergekit-ram verify` of its folder, each with the statistics
cache off (both count) and with a warm cache (neither counts), each a whole process timed and sampled by
measure.py's launcher. Prints the medians and verify / merge. The page cache is warm (the inputs are read
by the first merge). Not part of the benchmark suite (run.py): a check of one command's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import measure
import workloads
import yaml

MERGEKIT_RAM = str(measure.BIN / "mergekit-ram")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", help="workload folder (workloads.py)")
    parser.add_argument("--scratch", help="where the merged folders go (default: a temporary folder)")
    args = parser.parse_args(argv)
    wl, marker = workloads.get(args.workload, args.root)
    scratch = Path(tempfile.mkdtemp(prefix="verify-cost-", dir=args.scratch))
    config = scratch / "ramplus.yaml"
    config.write_text(yaml.safe_dump(measure.config(wl, "ramplus", measure.RAMPLUS)))
    out = scratch / "merged"
    env = measure.os.environ.copy()
    caches = {"cold": "off", "warm": str(scratch / "cache")}
    merge = [measure.MERGEKIT_YAML, str(config), str(out), "--no-copy-tokenizer", "--quiet"]
    first = measure.measure(merge, {**env, "MERGEKIT_RAM_CACHE": caches["warm"]})  # fills the cache, warms pages
    assert first["ok"], first.get("log_tail")
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for cache, value in caches.items():
            for what, cmd in (("merge", merge), ("verify", [MERGEKIT_RAM, "verify", str(out), "-q"])):
                run = measure.measure(cmd, {**env, "MERGEKIT_RAM_CACHE": value})
                assert run["ok"], run.get("log_tail")
                runs.setdefault(f"{what} {cache}", []).append(run)
    rows = {}
    for key, found in runs.items():
        rows[key] = {
            "wall_s": statistics.median(r["wall_s"] for r in found),
            "peak_rss_anon_gb": statistics.median(r["peak_rss_anon_kib"] for r in found) / 2**20,
            "wall_s_all": [r["wall_s"] for r in found],
        }
    print(f"{args.workload}: {marker['num_parameters'] / 1e6:.1f}M params per model, {len(wl.agents)} agents; "
          f"{args.repeats} repeats, medians, warm page cache")
    print("| run | wall s | peak RssAnon GB | all walls |")
    print("|---|---|---|---|")
    for key, row in rows.items():
        print(f"| {key} | {row['wall_s']:.2f} | {row['peak_rss_anon_gb']:.2f} | {row['wall_s_all']} |")
    for cache in caches:
        v, m = rows[f"verify {cache}"], rows[f"merge {cache}"]
        print(f"verify / merge, cache {cache}: {v['wall_s'] / m['wall_s']:.2f}x wall, "
              f"{v['peak_rss_anon_gb'] / m['peak_rss_anon_gb']:.2f}x peak RssAnon")
    (scratch / "verify_cost.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {scratch / 'verify_cost.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
