"""What the quality and policies benchmarks' pipelines share: stages built once and cached in folders keyed by what
they depend on, the merges both run and mergekit's config of one, and the machine a run was on.

`benchmarks/quality/run.py` and `benchmarks/policies/run.py` put benchmarks/ on `sys.path` after their own folder
and import this module by name. Each pipeline keys its stages with its own `StageKeys` (its table of versions); a
key hashes the same values as it always has, so the published results' stage keys still name their stages.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path


# --------------------------------------------------------------------------- #
# Stages
# --------------------------------------------------------------------------- #
class StageKeys:
    """A pipeline's stage keys: `keys(kind, payload)`. Each kind's version, bumped when that stage's code changes
    what it builds, is part of every key of that kind."""

    def __init__(self, versions: Mapping[str, int]):
        self.versions = dict(versions)

    def __call__(self, kind: str, payload: dict) -> str:
        blob = json.dumps({"kind": kind, "version": self.versions[kind], **payload}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def seed_of(*parts: object) -> int:
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:8], 16)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


class Stage:
    """A folder that is complete once its stage.json exists; built in a temporary sibling and renamed."""

    def __init__(self, folder: Path, key: str, payload: dict):
        self.folder, self.key, self.payload = folder, key, payload
        self.meta_path = folder / "stage.json"

    @property
    def done(self) -> bool:
        return self.meta_path.exists()

    @property
    def tmp(self) -> Path:
        """The temporary sibling the stage is built in."""
        return self.folder.with_name(self.folder.name + ".tmp")

    def meta(self) -> dict:
        return json.loads(self.meta_path.read_text())

    def build(self, fn: Callable[[Path], dict]) -> tuple[dict, bool]:
        """(stage.json contents, cached?) — runs fn(tmp_folder) -> dict of extra metadata when not cached."""
        if self.done:
            return self.meta(), True
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        extra = fn(self.tmp)
        return self.finish(time.perf_counter() - start, extra), False

    def finish(self, seconds: float, extra: dict) -> dict:
        """Complete the stage whose files are in `tmp` (written here or by another process): its stage.json."""
        meta = {
            "key": self.key,
            "payload": self.payload,
            "seconds": round(seconds, 2),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **extra,
        }
        self.place(meta)
        return meta

    def place(self, meta: dict) -> None:
        """Write `meta` as `tmp`'s stage.json and rename `tmp` into the stage's folder."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.tmp / "stage.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(self.folder, ignore_errors=True)
        self.tmp.rename(self.folder)


def run_tool(cmd: list[str], log_path: Path, env: dict) -> subprocess.CompletedProcess:
    """Run a mergekit / mergekit-ram command, keep its output in `log_path`, raise with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


# --------------------------------------------------------------------------- #
# Merges
# --------------------------------------------------------------------------- #
RAMPLUS = {"epsilon": 1e-5, "r": 0.1, "alpha": 2.0}


@dataclass(frozen=True)
class Merge:
    label: str
    method: str
    shared: dict | None
    per_model: dict | str | None  # "1/N": weight 1/N for each agent
    base: bool = True


MERGES = {
    "linear": Merge("linear (mean)", "linear", None, {"weight": 1.0}, base=False),
    "ta_mean": Merge("task_arithmetic w=1/N", "task_arithmetic", {"normalize": False}, "1/N"),
    "ta_sum": Merge("task_arithmetic w=1", "task_arithmetic", {"normalize": False}, {"weight": 1.0}),
    "ties": Merge("ties (density 0.5, w=1)", "ties", None, {"density": 0.5, "weight": 1.0}),
    "dare_ties": Merge("dare_ties (density 0.5, w=1)", "dare_ties", None, {"density": 0.5, "weight": 1.0}),
    "ram": Merge("mergekit ram", "ram", {"epsilon": 1e-5}, None),
    "ramplus": Merge("ramplus (r=0.1, α=2)", "ramplus", RAMPLUS, None),
    "ramplus_s": Merge("ramplus RAM+s (soft, r=0.1)", "ramplus", {**RAMPLUS, "lambda_rule": "soft"}, None),
    "ramplus_r0": Merge("ramplus r=0 (RAM)", "ramplus", {**RAMPLUS, "r": 0.0}, None),
    "ramplus_r0.05": Merge("ramplus r=0.05", "ramplus", {**RAMPLUS, "r": 0.05}, None),
    "ramplus_r0.2": Merge("ramplus r=0.2", "ramplus", {**RAMPLUS, "r": 0.2}, None),
    "ramplus_eps1e-4": Merge("ramplus ε=1e-4", "ramplus", {**RAMPLUS, "epsilon": 1e-4}, None),
    "ramplus_eps1e-3": Merge("ramplus ε=1e-3", "ramplus", {**RAMPLUS, "epsilon": 1e-3}, None),
}
#: RAM, and RAM+ with its variant RAM+s and its r and ε ablations
RAM_MERGES = [
    "ram",
    "ramplus",
    "ramplus_s",
    "ramplus_r0",
    "ramplus_r0.05",
    "ramplus_r0.2",
    "ramplus_eps1e-4",
    "ramplus_eps1e-3",
]
#: mergekit's methods, then RAM's
ALL_MERGES = ["linear", "ta_mean", "ta_sum", "ties", "dare_ties", *RAM_MERGES]


def merge_config(spec: Merge, base: Path, models: Sequence[Path], dtype: str) -> dict:
    """mergekit's config of merge `spec` of `models` in `dtype` (onto `base` where the method takes one)."""
    entries = []
    for path in models:
        entry: dict = {"model": str(path)}
        if spec.per_model == "1/N":
            entry["parameters"] = {"weight": 1.0 / len(models)}
        elif spec.per_model:
            entry["parameters"] = dict(spec.per_model)
        entries.append(entry)
    cfg: dict = {"merge_method": spec.method}
    if spec.base:
        cfg["base_model"] = str(base)
    cfg["models"] = entries
    if spec.shared:
        cfg["parameters"] = dict(spec.shared)
    cfg["dtype"] = dtype
    return cfg


#: each agent's figures that the reports take from `mergekit-ram inspect`'s stats.json (the last two are its
#: diagnostics, stats format_version 2)
AGENT_STATS = (
    "density",
    "unique_share",
    "shared_with_1_share",
    "shared_with_2plus_share",
    "rho_counted",
    "lambda",
    "active",
    "numel",
    "magnitude_unique_share",
    "single_step_share",
)


# --------------------------------------------------------------------------- #
# Configurations and the machine
# --------------------------------------------------------------------------- #
def apply_overrides(cfg: dict, sets: list[str]) -> dict:
    """`--set a.b=value` (value parsed as JSON when it parses, else a string)."""
    cfg = copy.deepcopy(cfg)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set needs KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def machine(packages: Sequence[str] = ()) -> dict:
    """The CPU, Python, platform and the versions of the packages a result depends on (`packages` after the
    shared ones; None for one not installed)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:  # the vector ISA torch's CPU kernels use: float results (so the trained weights) depend on it
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        info["torch_cpu_capability"] = None
    for pkg in ("torch", "transformers", "mergekit", "mergekit-ram", "numpy", *packages):
        try:
            info[pkg] = version(pkg)
        except Exception:
            info[pkg] = None
    return info
