"""Measuring: the benchmarked processes, each launched, timed and sampled, and the machine's state around them.

`Bench` holds one workload's configs, scratch folder and caches and runs one timed process of a method
(`METHODS`) through `measure`, which starts it from launcher.py; the rest are the untimed steps around a
run (page cache warmed or dropped, native kernel built, cold cache emptied, waiting for an idle machine)
and what results.json records of the machine and the sources. run.py, stats_ab.py and profile_merge.py
launch their processes with these; report.py turns what they record into tables.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import launcher
import workloads
import yaml

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MERGEKIT_YAML = str(BIN / "mergekit-yaml")
MERGEKIT_PYTORCH = str(BIN / "mergekit-pytorch")
LAUNCHER = HERE / "launcher.py"
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
    # mergekit-pytorch on the same weights, each model one .safetensors file (a workload without shards)
    "pytorch_help": ("mergekit-pytorch --help (start-up)", None, None, None),
    "pytorch_task_arithmetic": ("mergekit-pytorch task_arithmetic", "task_arithmetic", None, {"weight": 1.0}),
    "pytorch_ramplus_cold": ("mergekit-pytorch ramplus cold", "ramplus", RAMPLUS, None),
    "pytorch_ramplus_warm": ("mergekit-pytorch ramplus warm (cache)", "ramplus", RAMPLUS, None),
}
#: the mergekit-pytorch rows: compared with mergekit-pytorch's task_arithmetic, run only when asked for
PYTORCH = [m for m in METHODS if m.startswith("pytorch_")]
DEFAULT_METHODS = [m for m in METHODS if m not in PYTORCH]
#: start-up rows (no merge), and the cold and warm statistics caches of each door
STARTUP = ("help", "pytorch_help")
COLD = ("ramplus_cold", "pytorch_ramplus_cold")
WARM = ("ramplus_warm", "pytorch_ramplus_warm")
SCALING_METHODS = ["help", "task_arithmetic", "ramplus_cold", "ramplus_warm", "ramplus_r0"]
TAIL = 3000
IDLE = 0.15  # CPU busy fraction below which the machine counts as quiet
SAMPLE_S = 0.2  # RssAnon / RssFile sampling interval of the launcher
DROP_CACHES = "/proc/sys/vm/drop_caches"


# --------------------------------------------------------------------------- #
# One process
# --------------------------------------------------------------------------- #
def measure(cmd: list[str], env: dict, timeout: float = 0, sample_s: float = SAMPLE_S) -> dict:
    """Run cmd; wall time around the whole process, the child's own peak RSS (wait4) and sampled peak RssAnon.

    With a timeout (s), a process still running then is killed and recorded as timed out."""
    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp, "result.json"), Path(tmp, "log")
        load = os.getloadavg()[0]
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-S", str(LAUNCHER), str(result), str(timeout), str(sample_s),
                                        *cmd], stdout=out,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                process.wait()
            except BaseException:  # interrupted: do not leave a merge running
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise
        if process.returncode != 0 or not result.exists():
            raise RuntimeError(f"launcher failed ({process.returncode}): {log.read_text(errors='replace')[-TAIL:]}")
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


# --------------------------------------------------------------------------- #
# The methods' processes on one workload
# --------------------------------------------------------------------------- #
def config(wl: workloads.Workload, merge_method: str, shared: dict | None = None,
           per_model: dict | None = None) -> dict:
    """The mergekit config of one method on a workload (bf16, absolute paths, mergekit's defaults otherwise)."""
    models = [{"model": str(p), **({"parameters": dict(per_model)} if per_model else {})}
              for p in wl.agents.values()]
    cfg = {"merge_method": merge_method, "base_model": str(wl.base), "models": models}
    if shared:
        cfg["parameters"] = dict(shared)
    cfg["dtype"] = "bfloat16"
    return cfg


def single_file(folder: Path) -> Path:
    """The one weight file of a model folder (mergekit-pytorch takes one file per model)."""
    found = sorted(Path(folder).glob("*.safetensors"))
    if len(found) != 1:
        raise ValueError(f"{folder} holds {len(found)} .safetensors files; mergekit-pytorch rows need one per model")
    return found[0]


def flat_config(wl: workloads.Workload, merge_method: str, shared: dict | None = None,
                per_model: dict | None = None) -> dict:
    """The mergekit-pytorch config of one method: the same models as `config`, each its single weight file."""
    cfg = config(wl, merge_method, shared, per_model)
    cfg["base_model"] = str(single_file(wl.base))
    for entry, folder in zip(cfg["models"], wl.agents.values(), strict=True):
        entry["model"] = str(single_file(folder))
    return cfg


class Bench:
    """Runs the methods of one workload; holds its configs, scratch and warm cache."""

    def __init__(self, name: str, args):
        self.wl, self.marker = workloads.get(name, args.root)
        self.name, self.args = name, args
        self.scratch = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.scratch))
        self.cold_cache = self.scratch / "cold-cache"
        self.warm_cache = self.scratch / "warm-cache"
        self.configs = {}
        for method, (_, merge_method, shared, per_model) in METHODS.items():
            if merge_method:
                try:
                    text = yaml.safe_dump(self.config(merge_method, shared, per_model, flat=method in PYTORCH))
                except ValueError:
                    continue  # a sharded workload has no mergekit-pytorch rows
                self.configs[method] = self.scratch / f"{method}.yaml"
                self.configs[method].write_text(text)

    def config(self, merge_method, shared, per_model, flat: bool = False) -> dict:
        return (flat_config if flat else config)(self.wl, merge_method, shared, per_model)

    def command(self, method: str, out: Path) -> list[str]:
        if method == "help":
            return [MERGEKIT_YAML, "--help"]
        if method == "pytorch_help":
            return [MERGEKIT_PYTORCH, "--help"]
        if method in PYTORCH:
            if method not in self.configs:
                raise ValueError(f"{method}: workload {self.name} is sharded; mergekit-pytorch rows need one file per model")
            return [MERGEKIT_PYTORCH, str(self.configs[method]), str(out), *(["--cuda"] if self.args.cuda else [])]
        if method == "io_floor":
            return [sys.executable, str(HERE / "io_floor.py"), str(out), str(self.wl.base),
                    *map(str, self.wl.agents.values())]
        if method == "ramplus_stats":  # the pre-pass without the merge: plan, count every tensor, print
            return [str(BIN / "mergekit-ram"), "inspect", str(self.configs[method]), "--quiet",
                    *(["--cuda"] if self.args.cuda else [])]
        return [MERGEKIT_YAML, str(self.configs[method]), str(out), *(["--cuda"] if self.args.cuda else [])]

    def output_folder(self) -> Path:
        """A fresh path in the scratch folder for a merge's output (mergekit creates the folder)."""
        out = Path(tempfile.mkdtemp(prefix="out-", dir=self.scratch))
        shutil.rmtree(out)
        return out

    def run(self, method: str) -> dict:
        """One timed process in a fresh output folder (and a fresh cache for a cold run)."""
        out = self.output_folder()
        cache = self.cold_cache if method in COLD else self.warm_cache
        env = {**os.environ, "MERGEKIT_RAM_CACHE": str(cache) if method in COLD + WARM else "off"}
        before = cache_state(self.warm_cache)
        try:
            limit = self.args.timeout if method not in (*STARTUP, "io_floor") else 0
            result = measure(self.command(method, out), env, limit)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            if method in COLD:
                clear_statistics(cache)
        if method in WARM and result["ok"]:
            result["cache_hit"] = bool(before) and cache_state(self.warm_cache) == before
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
        for cache in (self.cold_cache, self.warm_cache):
            build_native({**os.environ, "MERGEKIT_RAM_CACHE": str(cache)})
        if "pytorch_ramplus_warm" in methods:  # its cache entry too (untimed; a failure shows in its own runs)
            self.run("pytorch_ramplus_warm")
        prime = "ramplus_warm" if "ramplus_warm" in methods else "help"
        return {"method": prime, **self.run(prime)}

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def build_native(env: dict, check: bool = False) -> None:
    """Untimed: compile mergekit_ram's native kernel into the cache `env` names (the package `env` imports)."""
    subprocess.run([sys.executable, "-c", "from mergekit_ram import native; native.library()"], env=env,
                   check=check, capture_output=True)


def clear_statistics(cache: Path) -> None:
    """After a cold run: the statistics gone; the compiled kernel stays, as on a user's machine."""
    for entry in cache.iterdir() if cache.is_dir() else []:
        if entry.name != "native":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def cache_state(folder: Path) -> dict:
    if not folder.is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


# --------------------------------------------------------------------------- #
# The machine around a run
# --------------------------------------------------------------------------- #
def drop_page_cache() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes of the whole machine (root only)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def cpu_ticks() -> tuple[int, int]:
    """(total, idle + iowait) CPU ticks of the whole machine, from /proc/stat."""
    try:
        return launcher.ticks()
    except OSError:
        return 0, 0


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


def machine(cuda: bool = False) -> dict:
    """The machine, package versions and git state results.json records."""
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
    info["git_commit"] = git("rev-parse", "HEAD")
    info["git_dirty"] = bool(git("status", "--porcelain"))
    if cuda:
        info["gpu"] = shell(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
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


def git(*cmd: str, tree: Path = HERE.parent) -> str | None:
    """`git -C tree CMD`'s output (this checkout by default); None where git fails."""
    return shell(["git", "-C", str(tree), *cmd])


def shell(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
