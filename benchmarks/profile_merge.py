"""Wall-clock profile of one whole merge process, with its I/O and memory over time.

    python benchmarks/profile_merge.py --workload R3 --root /work/bench --method ramplus_cold --drop-cache \
        --out benchmarks/results/R3 --name profile-before

Writes, into --out:
  NAME.speedscope.json  py-spy samples (`--idle`: waiting threads are sampled too, so the samples add up to
                        wall time), chronological per thread; open it at https://www.speedscope.app
  NAME.io.csv           every --every s: bytes read / written by the process tree (/proc/PID/io read_bytes,
                        write_bytes: storage, not page cache hits), RssAnon, RssFile, CPU seconds, major faults
  NAME.vmstat.txt       `vmstat 1` over the run (bi/bo: the whole machine's block I/O, wa: I/O wait)
  NAME.summary.md       where the samples of the main thread went, by phase and category, and a timeline

py-spy comes from PyPI (`pip install py-spy`); it needs ptrace (root, or a relaxed kernel.yama.ptrace_scope).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402
from launcher import tree  # noqa: E402

# (category, substrings of a frame "function (file:line)"); the first rule any frame of a stack matches wins,
# rules are tried from the top, frames from the leaf up: the most specific frame decides.
RULES = [
    ("write: safetensors save_file", ("save_file", "_save_st", "_write_shard_task")),
    ("read: safetensors get_tensor / mmap", ("get_tensor (safetensors", "safe_open", "get_slice")),
    ("import (start-up)", ("_find_and_load", "_call_with_frames_removed")),
    ("mergekit_ram kernel (arithmetic, and the page faults of its first touch of mmapped inputs)", ("mergekit_ram/core/kernel.py", "mergekit_ram/core/native.py")),
    ("arithmetic: torch (method / executor)", ("torch/",)),
]


def frame_name(frame: dict) -> str:
    return f"{frame.get('name')} ({frame.get('file')}:{frame.get('line')})"


def classify(stack: list[str]) -> str:
    """Category of one sample (a stack from the root to the leaf)."""
    if not stack:
        return "idle (no Python frame)"
    for category, keys in RULES:
        for frame in reversed(stack):
            if any(k in frame for k in keys):
                return category
    return "other Python: " + stack[-1].split(" (")[0]


# The statistics pass's files: the planned tasks as plain data and rho written back (_mergekit/tasks.py), the
# counting on mergekit's executors (counting.py), their orchestration (`pipeline.prepare`'s frame only: `hooks._merge`
# wraps the whole of run_merge). Older profiles still classify:
# all three were _mergekit/planning.py before, and mergekit_ram/prepass.py before that (the profiles in results/R3).
STATISTICS_FILES = (
    *(f"mergekit_ram/_mergekit/{name}.py" for name in ("counting", "tasks", "planning")),
    "mergekit_ram/prepass.py",
    "mergekit_ram/core/statistics.py",
    "prepare (/",
)


def phase(stack: list[str]) -> str:
    joined = ";".join(stack)
    if "_find_and_load" in joined and "run_merge" not in joined:
        return "1 start-up (imports)"
    if any(f in joined for f in STATISTICS_FILES):
        return "3 statistics pass"
    if "graph.py" in joined or "Executor" in joined:
        return "4 merge (executor)"
    if "finalize" in joined or "tensor_writer" in joined:
        return "5 writer"
    if "run_merge" in joined or "main" in joined:
        return "2 set-up / plan (inside run_merge)"
    return "0 other"


class Sampler(threading.Thread):
    """Samples /proc of a process tree every `every` s into rows."""

    def __init__(self, root_pid: int, every: float):
        super().__init__(daemon=True)
        self.root, self.every, self.rows, self.stop = root_pid, every, [], threading.Event()

    def run(self) -> None:
        start = time.perf_counter()
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop.is_set():
            tot = Counter()
            for pid in tree(self.root):
                tot.update(proc_numbers(pid, tick))
            self.rows.append({"t_s": round(time.perf_counter() - start, 2), **tot})
            self.stop.wait(self.every)


def proc_numbers(pid: int, tick: int) -> dict:
    out: dict = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, v = line.split(":")
                if k in ("read_bytes", "write_bytes", "rchar", "wchar"):
                    out[k] = int(v)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(":", 1)[0]
                if k in ("RssAnon", "RssFile"):
                    out[k + "_kib"] = int(line.split()[1])
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["majflt"] = int(fields[9])
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError):
        pass
    return out


def summarize(speedscope: Path, rate: float, io_rows: list[dict], wall: float) -> str:
    io_rows = [r for r in io_rows if "read_bytes" in r]  # the last sample may find the process gone
    data = json.loads(speedscope.read_text())
    frames = [frame_name(f) for f in data["shared"]["frames"]]
    lines = [f"Wall time {wall:.1f} s; py-spy at {rate:g} Hz with `--idle` (every sample counts, running or waiting).", ""]
    main = None
    for prof in data["profiles"]:
        n = len(prof["samples"])
        if main is None or n > len(main["samples"]):
            main = prof
    per_thread = ", ".join(f"{p['name']}: {len(p['samples'])} samples" for p in data["profiles"])
    lines += [f"Threads: {per_thread}. The tables below are the thread with the most samples ({main['name']}).", ""]
    stacks = [[frames[i] for i in s] for s in main["samples"]]
    weights = main.get("weights") or [1] * len(stacks)
    unit = sum(weights) / len(weights) if weights else 1
    total = sum(weights)
    by_phase: dict[str, Counter] = defaultdict(Counter)
    for st, w in zip(stacks, weights, strict=True):
        by_phase[phase(st)][classify(st)] += w
    lines += ["| phase | category | samples | share of samples | ≈ s |", "|---|---|---|---|---|"]
    for ph in sorted(by_phase):
        for cat, w in by_phase[ph].most_common(6):
            lines.append(f"| {ph} | {cat} | {w / unit:.0f} | {w / total:.1%} | {w / total * wall:.1f} |")
    lines += ["", "Phase totals:", ""]
    for ph in sorted(by_phase):
        w = sum(by_phase[ph].values())
        lines.append(f"- {ph}: {w / total:.1%} of samples ≈ {w / total * wall:.1f} s")
    # timeline: dominant phase/category per 5 % of the samples, with the I/O of that window
    lines += ["", "Timeline (samples in order, spread over the wall time; I/O from NAME.io.csv):", "",
              "| from s | to s | phase: top category | read GB/s | write GB/s | RssAnon GB |", "|---|---|---|---|---|---|"]
    bins = 20
    for b in range(bins):
        lo, hi = b * len(stacks) // bins, (b + 1) * len(stacks) // bins
        c = Counter(f"{phase(st)}: {classify(st)}" for st in stacks[lo:hi])
        t0, t1 = wall * b / bins, wall * (b + 1) / bins
        win = [r for r in io_rows if t0 <= r["t_s"] <= t1]
        rd = wr = anon = None
        if len(win) >= 2:
            dt = win[-1]["t_s"] - win[0]["t_s"] or 1
            rd = (win[-1].get("read_bytes", 0) - win[0].get("read_bytes", 0)) / dt / 1e9
            wr = (win[-1].get("write_bytes", 0) - win[0].get("write_bytes", 0)) / dt / 1e9
            anon = max(r.get("RssAnon_kib", 0) for r in win) * 1024 / 1e9
        top = c.most_common(1)[0] if c else ("—", 0)
        lines.append(f"| {t0:.0f} | {t1:.0f} | {top[0]} ({top[1] / max(hi - lo, 1):.0%}) | {report.fmt(rd)} | "
                     f"{report.fmt(wr)} | {report.fmt(anon)} |")
    if io_rows:
        last = io_rows[-1]
        lines += ["", f"Process tree totals (last sample, {last['t_s']} s): read {last.get('read_bytes', 0) / 1e9:.1f} GB "
                  f"from storage, rchar {last.get('rchar', 0) / 1e9:.1f} GB, wrote {last.get('write_bytes', 0) / 1e9:.1f} GB, "
                  f"{last.get('majflt', 0)} major faults, {last.get('cpu_s', 0):.0f} CPU s; peak RssAnon "
                  f"{max(r.get('RssAnon_kib', 0) for r in io_rows) * 1024 / 1e9:.2f} GB, peak RssFile "
                  f"{max(r.get('RssFile_kib', 0) for r in io_rows) * 1024 / 1e9:.2f} GB."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="R3")
    p.add_argument("--root")
    p.add_argument("--method", default="ramplus_cold", choices=[m for m, v in measure.METHODS.items() if v[1]])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="profile")
    p.add_argument("--rate", type=float, default=50)
    p.add_argument("--every", type=float, default=0.5, help="/proc sampling interval, s")
    p.add_argument("--drop-cache", action="store_true", help="sync; echo 3 > /proc/sys/vm/drop_caches first (root)")
    p.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too; slower)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the merge")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    bench_args = argparse.Namespace(root=args.root, scratch=None, cuda=False, drop_cache=args.drop_cache, timeout=0)
    bench_args.scratch = str(workloads.root_dir(args.root))
    b = measure.Bench(args.workload, bench_args)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        out_model = b.output_folder()
        cache = b.cold_cache if args.method in measure.COLD else b.warm_cache
        env = {**os.environ, "MERGEKIT_RAM_CACHE": str(cache) if args.method in measure.COLD + measure.WARM else "off",
               **dict(kv.split("=", 1) for kv in args.env)}
        measure.build_native({**env, "MERGEKIT_RAM_CACHE": str(cache)})  # compiled outside the profile, as run.py does
        if args.method in measure.WARM:  # a cache hit: the entry written first, untimed, as run.py primes it
            b.run(args.method)
        merge = b.command(args.method, out_model)
        speedscope = args.out / f"{args.name}.speedscope.json"
        cmd = [spy, "record", "--idle", "--threads", "--nonblocking", "--rate", f"{args.rate:g}", "--format",
               "speedscope", "-o", str(speedscope), *(["--native"] if args.native else []), "--", *merge]
        b.prepare()  # the page cache dropped (--drop-cache) or the inputs read into it
        vmstat = subprocess.Popen(["vmstat", "-n", "-t", "1"], stdout=open(args.out / f"{args.name}.vmstat.txt", "w"))  # noqa: SIM115
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, args.every)
        sampler.start()
        log, _ = proc.communicate()
        wall = time.perf_counter() - start
        sampler.stop.set()
        sampler.join()
        vmstat.terminate()
        vmstat.wait()
        (args.out / f"{args.name}.log").write_bytes(log[-20000:])
        if proc.returncode != 0:
            print(log.decode(errors="replace")[-3000:], file=sys.stderr)
            return proc.returncode
        keys = sorted({k for r in sampler.rows for k in r}, key=lambda k: (k != "t_s", k))
        with open(args.out / f"{args.name}.io.csv", "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(sampler.rows)
        head = (f"# {args.name}: `{args.method}` on {args.workload}, "
                f"{'page cache dropped first' if args.drop_cache else 'inputs read into the page cache first'}\n\n"
                f"Command: `{' '.join(cmd)}`\n\nEnvironment: MERGEKIT_RAM_CACHE={env['MERGEKIT_RAM_CACHE']}"
                f"{''.join(' ' + kv for kv in args.env)}\n\n")
        text = head + summarize(speedscope, args.rate, sampler.rows, wall)
        (args.out / f"{args.name}.summary.md").write_text(text)
        print(text)
    finally:
        if args.method in measure.COLD:
            measure.clear_statistics(b.cold_cache)
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
