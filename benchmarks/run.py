"""Time whole `mergekit-yaml` processes (wall time, child peak RSS) on synthetic RL-like workloads.

    python benchmarks/run.py --workload W1 --repeats 3 --out benchmarks/results/W1
    python benchmarks/run.py --scaling agents --repeats 3 --out benchmarks/results/scaling-agents

The command line and the order of the runs; measure.py launches and measures each process, report.py
writes results.md and the chart. See benchmarks/README.md for what is measured and how to read the output.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402
from measure import DEFAULT_METHODS, METHODS, SCALING_METHODS  # noqa: E402


# --------------------------------------------------------------------------- #
# The runs of one workload
# --------------------------------------------------------------------------- #
def bench(name: str, methods: list[str], args) -> dict:
    """All repeats of one workload, methods round-robin within each repeat."""
    b = measure.Bench(name, args)
    start = time.perf_counter()
    runs: dict[str, list] = {m: [] for m in methods}
    failed: set[str] = set()
    try:
        prime = b.warm_up(methods)
        if not prime["ok"]:
            _report_failure(name, f"{prime['method']} (priming)", prime)
            failed.add(prime["method"])
            runs.setdefault(prime["method"], []).append({**prime, "priming": True})
        for rep in range(args.repeats):
            for m in methods:
                if m in failed:
                    runs[m].append({"ok": False, "skipped": "failed or timed out earlier", "repeat": rep})
                    continue
                for attempt in range(1 + args.retry_disturbed):
                    if not args.drop_cache:
                        b.prepare()  # a big merge before may have evicted the inputs
                    busy = measure.wait_idle(args.wait_idle) if args.wait_idle else measure.cpu_busy(0.2)
                    if args.drop_cache:
                        b.prepare()  # after the wait: nothing reads the inputs back in between
                    r = {"repeat": rep, "busy_before": busy, "sources": measure.sources_digest(), **b.run(m)}
                    r["disturbed"] = r["others_cpu_s"] > 1.0 + 0.05 * r["wall_s"]
                    runs[m].append(r)
                    status = "ok" if r["ok"] else f"FAILED: {r['error']}"
                    print(f"[{name} {rep + 1}/{args.repeats}] {m:<16} {r['wall_s']:8.2f} s "
                          f"{r['maxrss_kib'] / 1e6 * 1.024:6.2f} GB (anon {r['peak_rss_anon_kib'] / 1e6 * 1.024:5.2f}, "
                          f"read {r['read_gb']:5.1f} GB)  busy before {busy:4.0%}, others "
                          f"{r['others_cpu_s']:5.1f} CPU s  {status}{' (disturbed)' if r['disturbed'] else ''}"
                          f"{' (cache miss)' if r.get('cache_hit') is False else ''}", flush=True)
                    if not (r["ok"] and not report.valid(r)) or attempt == args.retry_disturbed:
                        break
                    r["superseded"] = True  # measured again; kept in the JSON, left out of the medians
                if r.get("timed_out"):
                    failed.add(m)  # later repeats would time out too
                elif not r["ok"]:
                    _report_failure(name, m, r)
                    failed.add(m)
    finally:
        b.close()
    return {
        "workload": b.marker,
        "methods": {m: {"label": METHODS[m][0], "command": b.command(m, Path("OUT")),
                        "config": b.config(*METHODS[m][1:], flat=m in measure.PYTORCH) if METHODS[m][1] else None,
                        "runs": runs[m], "summary": report.summarize(runs[m])} for m in methods},
        "priming": prime,
        "page_cache": "dropped before every run" if args.drop_cache else "warm (inputs read before every run)",
        "total_wall_s": round(time.perf_counter() - start, 2),
    }


def _report_failure(workload: str, method: str, run: dict) -> None:
    bar = "!" * 78
    print(f"{bar}\n{workload}: {method} FAILED ({run['error']}); log tail:\n{run.get('log_tail', '')}\n{bar}",
          file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W1", help=f"one of {', '.join(workloads.WORKLOADS)}")
    p.add_argument("--scaling", choices=sorted(workloads.SCALING), help="run a scaling series instead")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                   help=f"subset of: {', '.join(METHODS)} (default: all but the pytorch_ rows, which need a workload "
                        f"of single-file models; scaling: {' '.join(SCALING_METHODS)})")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and the chart")
    p.add_argument("--root", help="workload folder (default $MERGEKIT_RAM_BENCH_DIR or /tmp/mergekit-ram-bench)")
    p.add_argument("--scratch", help="folder for merge outputs and caches (default: the workload folder)")
    p.add_argument("--cuda", action="store_true", help="pass --cuda to mergekit-yaml")
    p.add_argument("--wait-idle", type=float, default=0, metavar="S",
                   help=f"before each run, wait up to S seconds until other CPU use drops below {measure.IDLE:.0%}%")
    p.add_argument("--retry-disturbed", type=int, default=0, metavar="K",
                   help="measure a run again (up to K times) when other processes used > 1 s + 5%% of its wall "
                        "time in CPU meanwhile, or when a warm run missed the statistics cache")
    p.add_argument("--timeout", type=float, default=0, metavar="S",
                   help="kill a merge still running after S seconds and report it as '> S' (0: no limit)")
    p.add_argument("--drop-cache", action="store_true",
                   help="before every timed process, `sync; echo 3 > /proc/sys/vm/drop_caches` (root only) instead of "
                        "reading the inputs into the page cache: disk-bound merges, as when the inputs exceed RAM")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--rerender", action="store_true", help="only rewrite results.md/chart from OUT/results.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.drop_cache and not args.rerender and not os.access(measure.DROP_CACHES, os.W_OK):
        p.error(f"--drop-cache needs root (write access to {measure.DROP_CACHES})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.rerender:
        report.rerender(args.out)
        print((args.out / "results.md").read_text())
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up scratch and the child
    if not os.access(measure.MERGEKIT_YAML, os.X_OK):
        sys.exit(f"mergekit-yaml not found next to {sys.executable}")
    names = workloads.SCALING[args.scaling] if args.scaling else [args.workload]
    methods = args.methods or (SCALING_METHODS if args.scaling else DEFAULT_METHODS)
    methods = [m for m in METHODS if m in methods]  # canonical order
    args.scratch = args.scratch or str(workloads.root_dir(args.root))
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "argv": sys.argv,
               "repeats": args.repeats, "methods": methods, "scaling": args.scaling, "no_chart": args.no_chart,
               "drop_cache": args.drop_cache, "sample_s": measure.SAMPLE_S,
               "machine": measure.machine(args.cuda), "workloads": []}
    for name in names:
        workloads.get(name, args.root)  # build outside the timed region
    for name in names:
        results["workloads"].append(bench(name, methods, args))
        results["total_wall_s"] = round(time.perf_counter() - start, 2)
        report.write(results, args.out)  # after every workload, so a crash keeps what was measured
    print((args.out / "results.md").read_text())
    failures = [f"{r['workload']['name']}:{m}" for r in results["workloads"]
                for m, v in r["methods"].items()
                if not (v["summary"]["ok"] or v["summary"].get("timed_out_s")) or v["summary"].get("failed_runs")]
    if failures:
        print(f"FAILED runs: {', '.join(failures)} (recorded in {args.out / 'results.json'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
