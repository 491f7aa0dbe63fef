"""Time whole `mergekit-yaml` processes (wall time, child peak RSS) on synthetic RL-like workloads.

    python benchmarks/run.py --workload W1 --repeats 3 --out benchmarks/results/W1
    python benchmarks/run.py --scaling agents --repeats 3 --out benchmarks/results/scaling-agents

See benchmarks/README.md for what is measured and how to read the output.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402

BIN = Path(sys.executable).parent
MERGEKIT_YAML = str(BIN / "mergekit-yaml")
RAMPLUS = {"epsilon": 1e-5, "r": 0.1, "alpha": 2.0}

#: id -> (label, merge_method or None, shared parameters, per-model parameters)
METHODS = {
    "help": ("mergekit-yaml --help (start-up)", None, None, None),
    "task_arithmetic": ("task_arithmetic", "task_arithmetic", None, {"weight": 1.0}),
    "ties": ("ties", "ties", None, {"density": 0.5, "weight": 1.0}),
    "dare_linear": ("dare_linear", "dare_linear", None, {"density": 0.5, "weight": 1.0}),
    "ram": ("ram", "ram", None, None),
    "ramplus_tl": ("ramplus_tl", "ramplus_tl", None, None),
    "ramplus_cold": ("ramplus cold", "ramplus", RAMPLUS, None),
    "ramplus_warm": ("ramplus warm (cache)", "ramplus", RAMPLUS, None),
    "ramplus_r0": ("ramplus r=0 (no pre-pass)", "ramplus", {**RAMPLUS, "r": 0.0}, None),
    "ramplus_stats": ("statistics pass alone (mergekit-ram inspect)", "ramplus", RAMPLUS, None),
    "io_floor": ("I/O floor (read all, write one)", None, None, None),
}
SCALING_METHODS = ["help", "task_arithmetic", "ramplus_cold", "ramplus_warm", "ramplus_r0"]
TAIL = 3000
IDLE = 0.15  # CPU busy fraction below which the machine counts as quiet
NOISY = 1.2  # max/min wall over repeats above which a row is flagged


# --------------------------------------------------------------------------- #
# One process
# --------------------------------------------------------------------------- #
# Linux folds the pre-exec image's RSS (for a vfork'd child: the parent's peak) into the child's
# ru_maxrss, so children are started by this ~10 MB launcher, not by the runner (which imports
# torch). It times its child and reports wait4's rusage and the machine's CPU ticks, and samples
# RssAnon / RssFile (/proc/PID/status) over the child's process tree every SAMPLE_S seconds: ru_maxrss
# counts mmapped input pages, which are page cache the kernel can drop, RssAnon is the memory a merge needs.
LAUNCHER = r"""
import json, os, subprocess, sys, threading, time
def ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]
def tree(pid):
    # the child and its descendants, from /proc/PID/task/TID/children
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out
KEYS = ("RssAnon", "RssFile", "VmRSS")
def memory(pids):
    # (RssAnon, RssFile, VmRSS) in KiB summed over the processes
    tot = [0, 0, 0]
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    k = line.split(":", 1)[0]
                    if k in KEYS:
                        tot[KEYS.index(k)] += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return tot
t0 = ticks()
start = time.perf_counter()
limit, every = float(sys.argv[2]), float(sys.argv[3])
proc = subprocess.Popen(sys.argv[4:])
timer = None
if limit > 0:
    timer = threading.Timer(limit, proc.kill)
    timer.start()
peak, samples, done = [0, 0, 0], [0], threading.Event()
def sample():
    while not done.is_set():
        for i, v in enumerate(memory(tree(proc.pid))):
            peak[i] = max(peak[i], v)
        samples[0] += 1
        done.wait(every)
sampler = threading.Thread(target=sample, daemon=True)
if every > 0:
    sampler.start()
_, status, usage = os.wait4(proc.pid, 0)
done.set()
wall = time.perf_counter() - start
if timer is not None:
    timer.cancel()  # else the launcher lingers until the limit, after the child is done
t1 = ticks()
proc.returncode = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    json.dump({"wall_s": wall, "rc": proc.returncode, "maxrss_kib": usage.ru_maxrss, "user_s": usage.ru_utime,
               "sys_s": usage.ru_stime, "busy_ticks": (t1[0] - t0[0]) - (t1[1] - t0[1]),
               "majflt": usage.ru_majflt, "minflt": usage.ru_minflt, "inblock": usage.ru_inblock,
               "oublock": usage.ru_oublock, "peak_rss_anon_kib": peak[0], "peak_rss_file_kib": peak[1],
               "peak_rss_sampled_kib": peak[2], "samples": samples[0]}, f)
"""
SAMPLE_S = 0.2  # RssAnon / RssFile sampling interval of the launcher


def measure(cmd: list[str], env: dict, timeout: float = 0, sample_s: float = SAMPLE_S) -> dict:
    """Run cmd; wall time around the whole process, the child's own peak RSS (wait4) and sampled peak RssAnon.

    With a timeout (s), a process still running then is killed and recorded as timed out."""
    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp, "result.json"), Path(tmp, "log")
        load = os.getloadavg()[0]
        with open(log, "wb") as out:
            launcher = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, str(result), str(timeout), str(sample_s),
                                         *cmd], stdout=out,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                launcher.wait()
            except BaseException:  # interrupted: do not leave a merge running
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
                raise
        if launcher.returncode != 0 or not result.exists():
            raise RuntimeError(f"launcher failed ({launcher.returncode}): {log.read_text(errors='replace')[-TAIL:]}")
        m = json.loads(result.read_text())
        rc, child = m["rc"], m["user_s"] + m["sys_s"]
        # CPU time the rest of the machine used meanwhile: a busy neighbour shows up here
        others = m["busy_ticks"] / os.sysconf("SC_CLK_TCK") - child
        run = {"wall_s": round(m["wall_s"], 4), "maxrss_kib": m["maxrss_kib"], "user_s": round(m["user_s"], 3),
               "sys_s": round(m["sys_s"], 3), "others_cpu_s": round(max(others, 0.0), 2),
               "returncode": rc, "ok": rc == 0, "loadavg_1m": load,
               # KiB; sampled every sample_s over the process tree (a process shorter than that may show 0)
               "peak_rss_anon_kib": m["peak_rss_anon_kib"], "peak_rss_file_kib": m["peak_rss_file_kib"],
               "peak_rss_sampled_kib": m["peak_rss_sampled_kib"], "rss_samples": m["samples"],
               # bytes read from / written to storage (rusage blocks of 512 bytes) and major page faults
               "read_gb": round(m["inblock"] * 512 / 1e9, 3), "written_gb": round(m["oublock"] * 512 / 1e9, 3),
               "majflt": m["majflt"], "minflt": m["minflt"]}
        if rc == -9 and timeout and m["wall_s"] >= timeout:
            run["timed_out"] = True
        if rc != 0:
            run["log_tail"] = log.read_text(errors="replace")[-TAIL:]
            run["error"] = (f"timed out: killed after {timeout:g} s" if run.get("timed_out") else
                            f"killed by {signal.Signals(-rc).name}" + (" (out of memory?)" if rc == -9 else "")
                            if rc < 0 else f"exit status {rc}")
    return run


class Bench:
    """Runs the methods of one workload; holds its configs, scratch and warm cache."""

    def __init__(self, name: str, args):
        self.wl, self.marker = workloads.get(name, args.root)
        self.name, self.args = name, args
        self.scratch = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.scratch))
        self.warm_cache = self.scratch / "warm-cache"
        self.configs = {}
        for method, (_, merge_method, shared, per_model) in METHODS.items():
            if merge_method:
                self.configs[method] = self.scratch / f"{method}.yaml"
                self.configs[method].write_text(yaml.safe_dump(self.config(merge_method, shared, per_model)))

    def config(self, merge_method, shared, per_model) -> dict:
        models = [{"model": str(p), **({"parameters": dict(per_model)} if per_model else {})}
                  for p in self.wl.agents.values()]
        cfg = {"merge_method": merge_method, "base_model": str(self.wl.base), "models": models}
        if shared:
            cfg["parameters"] = dict(shared)
        cfg["dtype"] = "bfloat16"
        return cfg

    def command(self, method: str, out: Path) -> list[str]:
        if method == "help":
            return [MERGEKIT_YAML, "--help"]
        if method == "io_floor":
            return [sys.executable, str(HERE / "io_floor.py"), str(out), str(self.wl.base),
                    *map(str, self.wl.agents.values())]
        if method == "ramplus_stats":  # the pre-pass without the merge: plan, count every tensor, print
            return [str(BIN / "mergekit-ram"), "inspect", str(self.configs[method]), "--quiet",
                    *(["--cuda"] if self.args.cuda else [])]
        return [MERGEKIT_YAML, str(self.configs[method]), str(out), *(["--cuda"] if self.args.cuda else [])]

    def run(self, method: str) -> dict:
        """One timed process in a fresh output folder (and a fresh cache for a cold run)."""
        out = Path(tempfile.mkdtemp(prefix="out-", dir=self.scratch))
        shutil.rmtree(out)  # mergekit creates it
        cache = self.scratch / "cold-cache" if method == "ramplus_cold" else self.warm_cache
        env = {**os.environ, "MERGEKIT_RAM_CACHE": str(cache) if method in ("ramplus_cold", "ramplus_warm") else "off"}
        before = _cache_state(self.warm_cache)
        try:
            limit = self.args.timeout if method not in ("help", "io_floor") else 0
            result = measure(self.command(method, out), env, limit)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            if method == "ramplus_cold":  # statistics gone; the compiled kernel stays, as on a user's machine
                for entry in cache.iterdir() if cache.is_dir() else []:
                    if entry.name != "native":
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        if method == "ramplus_warm" and result["ok"]:
            result["cache_hit"] = bool(before) and _cache_state(self.warm_cache) == before
        return result

    def prepare(self) -> None:
        """Untimed, before every timed process: drop the page cache (--drop-cache) or read every input once."""
        if self.args.drop_cache:
            drop_page_cache()
        else:
            self.read_inputs()

    def read_inputs(self) -> None:
        """Untimed: read every input file once, so runs start from a warm page cache."""
        buf = bytearray(1 << 24)
        folders = [self.wl.base, *self.wl.agents.values()]
        for f in sorted(p for d in folders for p in d.iterdir() if p.is_file()):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    def warm_up(self, methods: list[str]) -> dict:
        """Untimed: warm page cache, build the native kernel, then one priming process (warm cache or --help).

        The kernel is compiled once per machine (a few seconds); a cold run measures new models, not a new machine.
        """
        if not self.args.drop_cache:
            self.read_inputs()
        for cache in (self.scratch / "cold-cache", self.warm_cache):
            env = {**os.environ, "MERGEKIT_RAM_CACHE": str(cache)}
            subprocess.run([sys.executable, "-c", "from mergekit_ram import native; native.library()"], env=env,
                           check=False, capture_output=True)
        prime = "ramplus_warm" if "ramplus_warm" in methods else "help"
        return {"method": prime, **self.run(prime)}

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes of the whole machine (root only)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def cpu_ticks() -> tuple[int, int]:
    """(total, idle + iowait) CPU ticks of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(v), v[3] + v[4]


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over `seconds`; the runner itself is idle then."""
    (t0, i0), _, (t1, i1) = cpu_ticks(), time.sleep(seconds), cpu_ticks()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_idle(limit: float) -> float:
    """Wait up to `limit` s for other work on the machine to stop; the last busy fraction."""
    deadline = time.monotonic() + limit
    busy = cpu_busy(0.5)
    while busy > IDLE and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return round(busy, 3)


def _cache_state(folder: Path) -> dict:
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def bench(name: str, methods: list[str], args) -> dict:
    """All repeats of one workload, methods round-robin within each repeat."""
    b = Bench(name, args)
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
                    busy = wait_idle(args.wait_idle) if args.wait_idle else cpu_busy(0.2)
                    if args.drop_cache:
                        b.prepare()  # after the wait: nothing reads the inputs back in between
                    r = {"repeat": rep, "busy_before": busy, "sources": sources_digest(), **b.run(m)}
                    r["disturbed"] = r["others_cpu_s"] > 1.0 + 0.05 * r["wall_s"]
                    runs[m].append(r)
                    status = "ok" if r["ok"] else f"FAILED: {r['error']}"
                    print(f"[{name} {rep + 1}/{args.repeats}] {m:<16} {r['wall_s']:8.2f} s "
                          f"{r['maxrss_kib'] / 1e6 * 1.024:6.2f} GB (anon {r['peak_rss_anon_kib'] / 1e6 * 1.024:5.2f}, "
                          f"read {r['read_gb']:5.1f} GB)  busy before {busy:4.0%}, others "
                          f"{r['others_cpu_s']:5.1f} CPU s  {status}{' (disturbed)' if r['disturbed'] else ''}"
                          f"{' (cache miss)' if r.get('cache_hit') is False else ''}", flush=True)
                    if not (r["ok"] and not valid(r)) or attempt == args.retry_disturbed:
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
                        "config": b.config(*METHODS[m][1:]) if METHODS[m][1] else None,
                        "runs": runs[m], "summary": summarize(runs[m])} for m in methods},
        "priming": prime,
        "page_cache": "dropped before every run" if args.drop_cache else "warm (inputs read before every run)",
        "total_wall_s": round(time.perf_counter() - start, 2),
    }


def _report_failure(workload: str, method: str, run: dict) -> None:
    bar = "!" * 78
    print(f"{bar}\n{workload}: {method} FAILED ({run['error']}); log tail:\n{run.get('log_tail', '')}\n{bar}",
          file=sys.stderr, flush=True)


def valid(run: dict) -> bool:
    """Undisturbed by other processes, and a warm run that really hit the statistics cache."""
    return not run.get("disturbed") and run.get("cache_hit", True) is not False


def summarize(runs: list[dict]) -> dict:
    runs = [r for r in runs if not r.get("superseded")]
    ok = [r for r in runs if r.get("ok") and "priming" not in r]
    if not ok:
        errors = [r["error"] for r in runs if r.get("error")]
        out = {"ok": False, "error": errors[0] if errors else "no run"}
        if runs and all(r.get("timed_out") for r in runs if "priming" not in r):
            out["timed_out_s"] = min(r["wall_s"] for r in runs if "priming" not in r)
        return out
    clean = [r for r in ok if valid(r)]
    use = clean or ok  # runs still invalid after all retries count only when no valid run exists
    walls = [r["wall_s"] for r in use]
    anon = [r["peak_rss_anon_kib"] * 1024 / 1e9 for r in use if r.get("rss_samples")]  # absent in older results
    return {"ok": True, "n": len(use), "wall_s": statistics.median(walls), "wall_min_s": min(walls),
            "wall_max_s": max(walls), "rss_gb": statistics.median(r["maxrss_kib"] * 1024 / 1e9 for r in use),
            "rss_anon_gb": statistics.median(anon) if anon else None,
            "read_gb": statistics.median(r["read_gb"] for r in use) if all("read_gb" in r for r in use) else None,
            "failed_runs": len(runs) - len(ok), "invalid_left_out": len(ok) - len(use),
            "invalid_used": len(use) - len(clean)}


# --------------------------------------------------------------------------- #
# Reports
# --------------------------------------------------------------------------- #
def machine(args) -> dict:
    info = {"cpu": "unknown", "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        info["ram_gb"] = round(kib * 1024 / 1e9, 1)
    except (OSError, StopIteration):
        pass
    for pkg in ("torch", "mergekit", "mergekit-ram", "safetensors", "transformers"):
        try:
            info[pkg] = version(pkg)
        except Exception:
            info[pkg] = None
    info["mergekit_ram_sources_sha256"] = sources_digest()
    info["git_commit"] = _git("rev-parse", "HEAD")
    info["git_dirty"] = bool(_git("status", "--porcelain"))
    if args.cuda:
        info["gpu"] = _shell(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return info


def sources_digest() -> str:
    """Fingerprint of mergekit_ram's source files (Python and C): the working tree may change during a benchmark."""
    import mergekit_ram

    digest = hashlib.sha256()
    folder = Path(mergekit_ram.__file__).parent
    for f in sorted([*folder.rglob("*.py"), *folder.rglob("*.c")]):
        if "__pycache__" in f.parts:
            continue
        digest.update(f.relative_to(folder).as_posix().encode() + f.read_bytes())
    return digest.hexdigest()[:16]


def _git(*cmd) -> str | None:
    return _shell(["git", "-C", str(HERE.parent), *cmd])


def _shell(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def describe(marker: dict) -> str:
    p = marker["params"]
    experts = f" × {p['num_experts']} experts (width {p['intermediate_size']})" if p.get("num_experts") else ""
    tensors = f", {workloads.tensor_count(marker):,} checkpoint tensors" if experts else ""
    return (f"{p['arch']}, hidden {p['hidden_size']}, {p['num_layers']} layers{experts}{tensors}, vocab {p['vocab_size']}, "
            f"{'tied' if p['tie_word_embeddings'] else 'untied'}, {len(p['densities'])} agents "
            f"(densities {', '.join(f'{d:.0%}' for d in p['densities'])}), {p['dtype']}, "
            f"{marker['num_parameters'] / 1e6:.1f}M params per model")


def _ratio(a: dict, b: dict | None, key: str = "wall_s") -> float | None:
    if not (a.get("ok") and b and b.get("ok")):
        return None
    return a[key] / b[key] if b[key] else None


def _fmt(x, spec=".2f", suffix="") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def workload_markdown(res: dict) -> str:
    s = {m: v["summary"] for m, v in res["methods"].items()}
    startup = s.get("help", {}).get("wall_s") if s.get("help", {}).get("ok") else None
    ta, ram, floor = s.get("task_arithmetic"), s.get("ram"), s.get("io_floor")
    # the I/O-floor and RssAnon columns only where measured (older results.json have neither)
    floor_col = bool(floor and floor["ok"])
    anon_col = any(x.get("rss_anon_gb") is not None for x in s.values())
    lines = [f"## {res['workload']['name']}: {describe(res['workload'])}", ""]
    if res.get("page_cache"):
        lines += [f"Page cache: {res['page_cache']}"
                  + (" (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root)." if res["page_cache"].startswith("dropped")
                     else "."), ""]
    lines += ["| method | wall s (median) | peak RSS GB |" + (" peak RssAnon GB | read GB |" if anon_col else "")
              + " × task_arithmetic | × ram |" + (" × I/O floor |" if floor_col else "")
              + " merge phase s | wall s min–max |",
              "|---|---|---|" + ("---|---|" if anon_col else "") + "---|---|" + ("---|" if floor_col else "") + "---|---|"]
    for m, v in res["methods"].items():
        x = s[m]
        if not x["ok"]:
            what = f"> {x['timed_out_s']:.0f} (timed out)" if x.get("timed_out_s") else f"**failed**: {x['error']}"
            lines.append(f"| {v['label']} | {what} |" + " — |" * (5 + 2 * anon_col + floor_col))
            continue
        phase = x["wall_s"] - startup if startup is not None and m not in ("help", "io_floor") else None
        ratios = (None, None) if m == "help" else (_ratio(x, ta), _ratio(x, ram))
        notes = [f"{x['failed_runs']} failed"] if x["failed_runs"] else []
        if x.get("invalid_left_out"):
            notes.append(f"median of {x['n']}; {x['invalid_left_out']} disturbed or cache-miss runs left out")
        if x.get("invalid_used"):
            notes.append(f"{x['invalid_used']} of {x['n']} disturbed or cache misses")
        failed = f" ({'; '.join(notes)})" if notes else ""
        anon = f" {_fmt(x.get('rss_anon_gb'))} | {_fmt(x.get('read_gb'), '.1f')} |" if anon_col else ""
        vs_floor = f" {_fmt(None if m == 'help' else _ratio(x, floor), '.2f', '×')} |" if floor_col else ""
        lines.append(f"| {v['label']} | {x['wall_s']:.2f} | {x['rss_gb']:.2f} |{anon} {_fmt(ratios[0], '.2f', '×')} | "
                     f"{_fmt(ratios[1], '.2f', '×')} |{vs_floor} {_fmt(phase)} | "
                     f"{x['wall_min_s']:.2f}–{x['wall_max_s']:.2f}{failed} |")
    noisy = [f"{res['methods'][m]['label']} ({x['wall_max_s'] / x['wall_min_s']:.2f}×)" for m, x in s.items()
             if x["ok"] and x["wall_max_s"] > NOISY * x["wall_min_s"]]
    lines += ["", targets(s, startup), ""]
    if floor_col and str(res.get("page_cache", "")).startswith("dropped"):
        lines += [floor_targets(s), ""]
    if noisy:
        lines += [f"Noisy (max/min wall over repeats > {NOISY}): {', '.join(noisy)}.", ""]
    timed = [(r.get("others_cpu_s", 0.0), v["label"]) for v in res["methods"].values() for r in v["runs"]
             if r.get("ok") and not r.get("superseded")]
    redone = sum(r.get("superseded", False) for v in res["methods"].values() for r in v["runs"])
    if redone:
        lines += [f"Measured again: {redone} run(s) disturbed by other processes or warm runs that missed the "
                  "cache (kept in results.json, left out of the medians).", ""]
    changed = {r["sources"] for v in res["methods"].values() for r in v["runs"] if r.get("sources")}
    if len(changed) > 1:
        lines += [f"mergekit_ram's sources changed during this benchmark ({len(changed)} versions measured).", ""]
    if timed:
        worst = max(timed)
        lines += [f"Other processes used {sum(t for t, _ in timed):.1f} CPU s during the timed runs "
                  f"(most during one {worst[1]} run: {worst[0]:.1f} s).", ""]
    return "\n".join(lines)


def targets(s: dict, startup: float | None) -> str:
    """One line: which performance targets are met."""
    ta = s.get("task_arithmetic")
    if not (ta and ta["ok"]):
        return "Targets: not evaluated (no task_arithmetic run)."
    warm_id = "ramplus_warm" if s.get("ramplus_warm", {}).get("ok") else "ramplus_r0"
    out = []

    def check(label, ok, detail):
        out.append(f"{label}: {'**met**' if ok else '**MISSED**'} ({detail})")

    def phase_ratio(x, y=ta):
        if startup is None or y["wall_s"] - startup < 0.05:
            return None  # no measurable merge phase
        return (x["wall_s"] - startup) / (y["wall_s"] - startup)

    for mid, limit, label in (("ramplus_cold", 1.2, "cold ≤ 1.2× task_arithmetic"),
                              (warm_id, 1.0, f"warm{' (r=0 proxy)' if warm_id == 'ramplus_r0' else ''} ≤ 1.0× task_arithmetic")):
        x = s.get(mid)
        if x and x["ok"]:
            r = x["wall_s"] / ta["wall_s"]
            check(label, r <= limit, f"{r:.2f}× wall, {_fmt(phase_ratio(x), '.2f', '×')} merge phase")
    ours = [s[m] for m in ("ramplus_cold", "ramplus_warm", "ramplus_r0") if s.get(m, {}).get("ok")]
    if ours:
        peak = max(x["rss_gb"] for x in ours)
        check("ramplus peak RSS ≤ task_arithmetic's", peak <= ta["rss_gb"], f"{peak:.2f} vs {ta['rss_gb']:.2f} GB")
    ties, cold = s.get("ties"), s.get("ramplus_cold")
    if ties and ties["ok"] and cold and cold["ok"]:
        r = ties["wall_s"] / cold["wall_s"]
        check("ramplus cold ≥ 3× faster than ties", r >= 3, f"{r:.2f}× wall, {_fmt(phase_ratio(ties, cold), '.2f', '×')} merge phase")
    return "Targets: " + "; ".join(out) + "." if out else "Targets: not evaluated."


def floor_targets(s: dict) -> str:
    """Disk-bound targets (page cache dropped): ramplus against the I/O floor of the same inputs, RssAnon vs TA."""
    floor, ta = s["io_floor"], s.get("task_arithmetic")
    out = []
    for mid, limit in (("ramplus_warm", 1.3), ("ramplus_r0", 1.3), ("ramplus_cold", 1.45)):
        x = s.get(mid)
        if x and x["ok"]:
            r = x["wall_s"] / floor["wall_s"]
            out.append(f"{METHODS[mid][0]} ≤ {limit}× I/O floor: {'**met**' if r <= limit else '**MISSED**'} ({r:.2f}×)")
    ours = [s[m]["rss_anon_gb"] for m in ("ramplus_cold", "ramplus_warm", "ramplus_r0")
            if s.get(m, {}).get("ok") and s[m].get("rss_anon_gb") is not None]
    if ours and ta and ta["ok"] and ta.get("rss_anon_gb") is not None:
        peak = max(ours)
        out.append(f"ramplus peak RssAnon ≤ task_arithmetic's: {'**met**' if peak <= ta['rss_anon_gb'] else '**MISSED**'} "
                   f"({peak:.2f} vs {ta['rss_anon_gb']:.2f} GB)")
    return "I/O-floor targets (page cache dropped): " + ("; ".join(out) if out else "not evaluated") + "."


def header_markdown(report: dict) -> str:
    m = report["machine"]
    return "\n".join([
        f"# mergekit-ram benchmark ({m['date']})", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('ram_gb', '?')} GB RAM{', GPU ' + str(m['gpu']) if m.get('gpu') else ''}; "
        f"torch {m['torch']}, mergekit {m['mergekit']}, mergekit-ram {m['mergekit-ram']}; "
        f"commit {str(m['git_commit'])[:12]}{' (dirty tree)' if m['git_dirty'] else ''}, "
        f"mergekit_ram sources {m.get('mergekit_ram_sources_sha256')}.",
        f"Command: `{report['command']}`; {report['repeats']} repeats, methods round-robin, medians; "
        f"whole processes, {'page cache dropped before every run' if report.get('drop_cache') else 'warm page cache'}; "
        f"peak RssAnon sampled every {report.get('sample_s', SAMPLE_S)} s over the process tree. Total benchmark wall time {report['total_wall_s']:.0f} s.", "", ""])


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b·x; returns (a, b, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def scaling_series(report: dict) -> tuple[str, list[float], dict[str, list[float | None]]]:
    by = report["scaling"]
    label = {"size": "params (M)", "agents": "agents N", "tensors": "checkpoint tensors"}[by]
    xs = [r["workload"]["num_parameters"] / 1e6 if by == "size" else
          workloads.tensor_count(r["workload"]) if by == "tensors" else len(r["workload"]["params"]["densities"])
          for r in report["workloads"]]
    ys = {m: [r["methods"][m]["summary"].get("wall_s") for r in report["workloads"]]
          for m in report["methods"] if m != "help"}
    return label, xs, ys


def scaling_markdown(report: dict) -> str:
    label, xs, ys = scaling_series(report)
    methods = list(ys)
    lines = [f"## Scaling over {report['scaling']}", "",
             "| workload | " + label + " | " + " | ".join(f"{METHODS[m][0]} s" for m in methods) + " |",
             "|---" * (2 + len(methods)) + "|"]
    for i, r in enumerate(report["workloads"]):
        lines.append(f"| {r['workload']['name']} | {xs[i]:g} | " + " | ".join(_cell(r, m, ys[m][i]) for m in methods) + " |")
    if report["scaling"] == "tensors":
        lines += _per_tensor(report, xs, methods)
    lines += ["", "Least-squares fit, wall s = a + b·x:", ""]
    for m in methods:
        pts = [(x, y) for x, y in zip(xs, ys[m]) if y is not None]
        if len(pts) >= 2:
            a, b, r2 = fit(*zip(*pts))
            unit = {"size": "M params", "agents": "agent", "tensors": "tensor"}[report["scaling"]]
            lines.append(f"- {METHODS[m][0]}: a = {a:.3f} s, b = {b:.4f} s per {unit}, R² = {r2:.4f}")
    return "\n".join(lines) + "\n\n"


def _cell(res: dict, method: str, wall: float | None) -> str:
    x = res["methods"][method]["summary"]
    return f"> {x['timed_out_s']:.0f}" if x.get("timed_out_s") else _fmt(wall)


def _per_tensor(report: dict, xs: list[float], methods: list[str]) -> list[str]:
    """Merge-phase milliseconds per checkpoint tensor: (wall - start-up) / tensors."""
    lines = ["", "Milliseconds per checkpoint tensor, (wall − `--help` start-up) / tensors:", "",
             "| workload | tensors | " + " | ".join(f"{METHODS[m][0]}" for m in methods) + " |",
             "|---" * (2 + len(methods)) + "|"]
    for i, r in enumerate(report["workloads"]):
        s = {m: v["summary"] for m, v in r["methods"].items()}
        start = s.get("help", {}).get("wall_s") if s.get("help", {}).get("ok") else None
        cells = []
        for m in methods:
            x = s[m]
            if start is None:
                cells.append("—")
            elif x.get("timed_out_s"):
                cells.append(f"> {(x['timed_out_s'] - start) / xs[i] * 1e3:.2f}")
            else:
                cells.append(_fmt((x["wall_s"] - start) / xs[i] * 1e3) if x["ok"] else "—")
        lines.append(f"| {r['workload']['name']} | {xs[i]:g} | " + " | ".join(cells) + " |")
    if "ramplus_cold" in methods and "ramplus_r0" in methods:
        lines += _prepass_per_tensor(report, xs)
    return lines


def _prepass_per_tensor(report: dict, xs: list[float]) -> list[str]:
    """The statistics pre-pass alone: ramplus cold minus r = 0 (same merge, no pre-pass), per tensor."""
    lines = ["", "The statistics pre-pass alone, ramplus cold − ramplus r=0 (the same merge without it):", "",
             "| workload | tensors | pre-pass s | ms per tensor |", "|---|---|---|---|"]
    pts = []
    for i, r in enumerate(report["workloads"]):
        cold, r0 = (r["methods"].get(m, {}).get("summary", {}) for m in ("ramplus_cold", "ramplus_r0"))
        if cold.get("ok") and r0.get("ok"):
            d = cold["wall_s"] - r0["wall_s"]
            pts.append((xs[i], d))
            lines.append(f"| {r['workload']['name']} | {xs[i]:g} | {_fmt(d)} | {_fmt(d / xs[i] * 1e3)} |")
        else:
            lines.append(f"| {r['workload']['name']} | {xs[i]:g} | — | — |")
    if len(pts) >= 2:
        a, b, r2 = fit(*zip(*pts))
        lines += ["", f"Fit: pre-pass s = {a:.3f} + {b * 1e3:.3f} ms × tensors (R² = {r2:.4f}); a cost growing with "
                  "the square of the count would bend this line upwards."]
    return lines


def chart(report: dict, path: Path) -> None:
    """Wall-time and peak-RSS bars (or the scaling fit); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no chart (pip install matplotlib)", file=sys.stderr)
        return
    if report.get("scaling"):
        label, xs, ys = scaling_series(report)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, y in ys.items():
            pts = [(x, v) for x, v in zip(xs, y) if v is not None]
            if not pts:
                continue
            px, py = zip(*pts)
            if len(pts) < 2:
                ax.plot(px, py, "o", label=METHODS[m][0])
                continue
            a, b, r2 = fit(px, py)
            line = ax.plot(px, py, "o", label=f"{METHODS[m][0]} (R²={r2:.3f})")[0]
            ax.plot([min(px), max(px)], [a + b * min(px), a + b * max(px)], "--", color=line.get_color())
        if report["scaling"] == "tensors":  # 267 to 24,651 tensors: a quadratic cost shows as slope 2
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("wall s (median, whole process)")
        ax.set_title(f"Scaling over {report['scaling']}")
        ax.legend()
    else:
        res = report["workloads"][0]
        ids = list(res["methods"])
        names = [res["methods"][m]["label"] for m in ids]
        summ = [res["methods"][m]["summary"] for m in ids]
        colors = ["tab:gray" if m in ("help", "io_floor") else "tab:orange" if m.startswith("ramplus_") and m != "ramplus_tl"
                  else "tab:blue" for m in ids]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(ids) + 1.8))
        for ax, key, title in ((ax1, "wall_s", "wall s (median)"), (ax2, "rss_gb", "peak RSS GB")):
            vals = [x[key] if x["ok"] else 0 for x in summ]
            ax.barh(names, vals, color=colors)
            for i, (v, x) in enumerate(zip(vals, summ)):
                ax.text(v, i, f" {v:.2f}" if x["ok"] else " failed", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_title(title)
        ax2.set_yticklabels([])
        fig.suptitle(f"{res['workload']['name']}: {describe(res['workload'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rerender(out: Path) -> None:
    """Recompute the summaries of an existing results.json and write results.md and the chart again."""
    report = json.loads((out / "results.json").read_text())
    for res in report["workloads"]:
        for v in res["methods"].values():
            v["summary"] = summarize(v["runs"])
    write(report, out)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    body = scaling_markdown(report) if report.get("scaling") else ""
    body += "\n".join(workload_markdown(r) for r in report["workloads"])
    (out / "results.md").write_text(header_markdown(report) + body)
    if not report["no_chart"]:
        chart(report, out / ("scaling.png" if report.get("scaling") else "chart.png"))


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W1", help=f"one of {', '.join(workloads.WORKLOADS)}")
    p.add_argument("--scaling", choices=sorted(workloads.SCALING), help="run a scaling series instead")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                   help=f"subset of: {', '.join(METHODS)} (default: all; scaling: {' '.join(SCALING_METHODS)})")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and the chart")
    p.add_argument("--root", help="workload folder (default $MERGEKIT_RAM_BENCH_DIR or /tmp/mergekit-ram-bench)")
    p.add_argument("--scratch", help="folder for merge outputs and caches (default: the workload folder)")
    p.add_argument("--cuda", action="store_true", help="pass --cuda to mergekit-yaml")
    p.add_argument("--wait-idle", type=float, default=0, metavar="S",
                   help=f"before each run, wait up to S seconds until other CPU use drops below {IDLE:.0%}")
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
    if args.drop_cache and not args.rerender and not os.access(DROP_CACHES, os.W_OK):
        p.error(f"--drop-cache needs root (write access to {DROP_CACHES})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.rerender:
        rerender(args.out)
        print((args.out / "results.md").read_text())
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up scratch and the child
    if not os.access(MERGEKIT_YAML, os.X_OK):
        sys.exit(f"mergekit-yaml not found next to {sys.executable}")
    names = workloads.SCALING[args.scaling] if args.scaling else [args.workload]
    methods = args.methods or (SCALING_METHODS if args.scaling else list(METHODS))
    methods = [m for m in METHODS if m in methods]  # canonical order
    args.scratch = args.scratch or str(workloads.root_dir(args.root))
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "argv": sys.argv,
              "repeats": args.repeats, "methods": methods, "scaling": args.scaling, "no_chart": args.no_chart,
              "drop_cache": args.drop_cache, "sample_s": SAMPLE_S,
              "machine": machine(args), "workloads": []}
    for name in names:
        workloads.get(name, args.root)  # build outside the timed region
    for name in names:
        report["workloads"].append(bench(name, methods, args))
        report["total_wall_s"] = round(time.perf_counter() - start, 2)
        write(report, args.out)  # after every workload, so a crash keeps what was measured
    print((args.out / "results.md").read_text())
    failures = [f"{r['workload']['name']}:{m}" for r in report["workloads"]
                for m, v in r["methods"].items()
                if not (v["summary"]["ok"] or v["summary"].get("timed_out_s")) or v["summary"].get("failed_runs")]
    if failures:
        print(f"FAILED runs: {', '.join(failures)} (recorded in {args.out / 'results.json'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
