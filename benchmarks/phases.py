"""RAM+'s own cost inside one merge process, timed phase by phase: what a cache hit, a cold statistics pass and
`r: 0` each add to mergekit's merge, without the start-up's noise.

    python benchmarks/phases.py --workload W1 --repeats 5 --out benchmarks/results/W1-phases

Whole-process benchmarks (`run.py`) carry the start-up (importing mergekit costs seconds) and the machine's
noise in every row, so a difference of a few tenths of a second between two rows is below what they resolve.
Here one Python process imports mergekit once, then runs `run_merge` of the same config again and again,
rotating through the variants (a cache hit, r = 0, a cold pass in a fresh cache), with the inputs in the page
cache. Each run is timed whole (`merge s`) and in its RAM+ pre-pass (`prepare s`: planned tasks to rho, the
cache key and entry, the report; `pipeline.prepare`, wrapped here by the benchmark, not by the package) with
the process's CPU time beside the wall time. `read s` is one read of every input tensor from the page cache in
the same process (io_floor.py's touch of every page): the cost of the pass's one read of the inputs.

Writes NAME.json (every run) and NAME.md (medians, and the differences the targets name) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import io_floor  # noqa: E402
import measure  # noqa: E402
import workloads  # noqa: E402
from report import fmt  # noqa: E402

VARIANTS = {
    "warm": "ramplus, statistics from the cache (a hit)",
    "r0": "ramplus r = 0 (no statistics needed; cache off)",
    "cold": "ramplus, statistics counted (a fresh cache)",
    "task_arithmetic": "mergekit's task_arithmetic",
}


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def read_inputs(wl: workloads.Workload) -> tuple[float, float]:
    """(wall s, CPU s) of touching every page of every input tensor once, in this process."""
    from safetensors import safe_open

    w0, c0 = clocks()
    for folder in (wl.base, *wl.agents.values()):
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():
                    io_floor.touch(handle.get_tensor(name))
    w1, c1 = clocks()
    return w1 - w0, c1 - c0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1")
    p.add_argument("--root")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="phases")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args(argv)

    import mergekit_ram  # noqa: F401  # registers ramplus
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from mergekit_ram._mergekit import pipeline

    wl, marker = workloads.get(args.workload, args.root)
    scratch = Path(tempfile.mkdtemp(prefix="phases-", dir=workloads.root_dir(args.root)))
    configs = {
        "warm": measure.config(wl, "ramplus", measure.RAMPLUS),
        "r0": measure.config(wl, "ramplus", {**measure.RAMPLUS, "r": 0.0}),
        "cold": measure.config(wl, "ramplus", measure.RAMPLUS),
        "task_arithmetic": measure.config(wl, "task_arithmetic", None, {"weight": 1.0}),
    }
    options = MergeOptions(quiet=True, cuda=args.cuda)
    spent: list[float] = []
    real_prepare = pipeline.prepare

    def timed_prepare(*a, **k):
        t = time.perf_counter()
        try:
            return real_prepare(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)

    pipeline.prepare = timed_prepare
    runs: list[dict] = []
    try:
        def merge(variant: str) -> dict:
            cache = {"warm": scratch / "warm-cache", "cold": scratch / f"cold-{len(runs)}", "r0": None}.get(variant)
            os.environ["MERGEKIT_RAM_CACHE"] = str(cache) if cache else "off"
            out = scratch / "out"
            spent.clear()
            w0, c0 = clocks()
            run_merge(MergeConfiguration.model_validate(configs[variant]), str(out), options)
            w1, c1 = clocks()
            shutil.rmtree(out)
            if variant == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            return {"variant": variant, "merge_s": w1 - w0, "merge_cpu_s": c1 - c0, "prepare_s": sum(spent) or None}

        read_inputs(wl)  # untimed: inputs into the page cache
        for variant in VARIANTS:  # untimed: imports, the compiled kernel, the warm cache's entry
            merge(variant)
        for i in range(args.repeats):
            order = list(VARIANTS)[i % len(VARIANTS):] + list(VARIANTS)[: i % len(VARIANTS)]
            for variant in order:
                runs.append({"repeat": i, **merge(variant)})
            wall, cpu = read_inputs(wl)
            runs.append({"repeat": i, "variant": "read", "merge_s": wall, "merge_cpu_s": cpu, "prepare_s": None})
    finally:
        pipeline.prepare = real_prepare
        shutil.rmtree(scratch, ignore_errors=True)

    def med(variant: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["variant"] == variant and r[key] is not None]
        return statistics.median(values) if values else None

    result = {"workload": marker, "repeats": args.repeats, "cuda": args.cuda, "machine": measure.machine(args.cuda),
              "load_average": os.getloadavg(), "runs": runs,
              "command": "python benchmarks/phases.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")

    rows = ["| variant | merge s | merge CPU s | RAM+ pre-pass s | runs |", "|---|---|---|---|---|"]
    for variant, label in [*VARIANTS.items(), ("read", "one read of every input tensor (page cache)")]:
        n = sum(r["variant"] == variant for r in runs)
        cells = [fmt(med(variant, key), ".3f") for key in ("merge_s", "merge_cpu_s", "prepare_s")]
        rows.append(f"| {label} | {' | '.join(cells)} | {n} |")
    hit = diff(runs, "warm", "r0")
    cold = diff(runs, "cold", "r0")
    read = med("read", "merge_s")
    text = "\n".join([
        f"# RAM+ phases in one process: {args.workload} ({marker['num_parameters'] / 1e6:.1f}M params per model)",
        "",
        f"Command: `{result['command']}`; {args.repeats} repeats, variants rotated, medians; inputs in the page "
        f"cache; {'--cuda' if args.cuda else 'CPU'}; load average at the end {os.getloadavg()[0]:.2f}.",
        "",
        *rows,
        "",
        f"- A cache hit over r = 0 (paired by repeat, median of the differences): **{fmt(hit[0], '+.3f')} s** wall, "
        f"{fmt(hit[1], '+.3f')} s CPU (target: ≤ +0.3 s).",
        f"- A cold pass over r = 0: **{fmt(cold[0], '+.3f')} s** wall, {fmt(cold[1], '+.3f')} s CPU; one read of "
        f"the inputs: {fmt(read, '.3f')} s (target: cold ≤ r = 0 + one read).",
        "",
    ])
    (args.out / f"{args.name}.md").write_text(text)
    print(text)


def diff(runs: list[dict], a: str, b: str) -> tuple[float | None, float | None]:
    """Median over repeats of (a - b), wall and CPU."""
    by = {(r["repeat"], r["variant"]): r for r in runs}
    pairs = [(by[i, a], by[i, b]) for i in sorted({r["repeat"] for r in runs}) if (i, a) in by and (i, b) in by]
    if not pairs:
        return None, None
    return (statistics.median(x["merge_s"] - y["merge_s"] for x, y in pairs),
            statistics.median(x["merge_cpu_s"] - y["merge_cpu_s"] for x, y in pairs))


if __name__ == "__main__":
    main()
