"""Does RAM+ keep RL-trained skills of robot policies? A Meta-World merging benchmark through `mergekit-pytorch`.

    python benchmarks/policies/run.py                      # the full configuration, training seeds 0 to 3
    python benchmarks/policies/run.py --seeds 0            # one training seed
    python benchmarks/policies/run.py --seeds 1 --until agents   # train seed 1 only (e.g. beside seed 0)
    python benchmarks/policies/run.py --config smoke       # a tiny end-to-end run (minutes)

Stages, each built once and cached under --root (default /tmp/mergekit-ram-policies) in a folder keyed by a hash of
everything it depends on: a multi-task SAC base (stable-baselines3, the task's one-hot appended to Meta-World's
observation) -> one specialist per task, fine-tuned from the base with SAC on its task alone -> each actor exported
as `.safetensors` -> merges of the specialists' actors by the real `mergekit-pytorch` with mergekit's own configs ->
`mergekit-ram inspect` (float32, and a bf16 round trip of the same actors) -> success rate of every policy on every
task over fixed evaluation episodes -> results.json, results.md, chart.png, density.png in --out.
See benchmarks/policies/README.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rl  # noqa: E402


def _quality(name: str):
    """A module of benchmarks/quality (its stage cache, merges and bootstrap), loaded under its own name."""
    key = f"quality_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE.parent / "quality" / f"{name}.py")
        assert spec and spec.loader
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


Q = _quality("run")
Stage, key_of, seed_of, log, run_tool, MERGES = Q.Stage, Q.key_of, Q.seed_of, Q.log, Q.run_tool, Q.MERGES
BIN = Path(sys.executable).parent
#: bumped when a stage's code changes what it builds (part of every cache key of that stage)
VERSIONS = {"pbase": 1, "pagent": 1, "pmerge": 1, "pinspect": 1, "peval": 1}
Q.VERSIONS.update(VERSIONS)

SAC = {
    "lr": 3e-4,
    "batch": 256,
    "gamma": 0.99,
    "train_freq": 4,
    "gradient_steps": 1,
    "net_arch": [128, 128],
    "learning_starts": 2000,
    "log_every": 5000,
}
#: the quality benchmark's merges: mergekit's methods and the `ramplus` r and ε sweeps
MERGE_NAMES = list(Q.ALL_MERGES)
CONFIGS: dict[str, dict] = {
    "full": {
        "seeds": [0, 1, 2, 3],
        # screened: benchmarks/policies/README.md, "Tasks, and how they were chosen"
        "tasks": ["reach-v3", "reach-wall-v3", "coffee-button-v3", "button-press-v3"],
        "horizon": 200,
        "base": {**SAC, "steps": 50000},
        # one gradient step per environment step: the screens learned faster per second than with SAC's train_freq 4
        "agent": {
            **SAC,
            "train_freq": 1,
            "steps": 30000,
            "warmup": 1000,
        },
        "eval": {"episodes": 50, "seed": 100_000, "bootstrap": 2000},
        "merges": MERGE_NAMES,
        "bf16": ["ramplus", "ta_sum"],
        "inspect": ["float32", "bfloat16"],
        "jobs": 2,
    },
}
CONFIGS["smoke"] = {
    **CONFIGS["full"],
    "seeds": [0],
    "tasks": ["reach-v3", "drawer-close-v3"],
    "horizon": 30,
    "base": {**SAC, "net_arch": [16, 16], "batch": 32, "learning_starts": 100, "log_every": 100, "steps": 300},
    "agent": {**SAC, "net_arch": [16, 16], "batch": 32, "log_every": 100, "steps": 200, "warmup": 50},
    "eval": {"episodes": 3, "seed": 100_000, "bootstrap": 200},
    "merges": ["ramplus", "ta_sum", "linear"],
    "bf16": ["ramplus"],
    "jobs": 1,
}


def agent_settings(cfg: dict, task: str) -> dict:
    shared = {k: v for k, v in cfg["agent"].items() if k != "per_task"}
    return {**shared, **cfg["agent"].get("per_task", {}).get(task, {})}


# --------------------------------------------------------------------------- #
# Stages
# --------------------------------------------------------------------------- #
def _threads() -> None:
    import torch

    torch.set_num_threads(1)


class Pipeline:
    def __init__(self, cfg: dict, root: Path, seed: int):
        self.cfg, self.root, self.seed = cfg, root, seed
        self.tasks = list(cfg["tasks"])
        self.stages: dict[str, dict] = {}
        self.env = {**os.environ, "MERGEKIT_RAM_CACHE": str(root / "ram-cache"), "OMP_NUM_THREADS": "1"}

    def _record(self, name: str, meta: dict, cached: bool, keep=()) -> None:
        self.stages[name] = {"seconds": meta["seconds"], "cached": cached, **{k: meta[k] for k in keep if k in meta}}

    def base(self) -> tuple[Path, str]:
        payload = {"tasks": self.tasks, "horizon": self.cfg["horizon"], "sac": self.cfg["base"], "seed": self.seed}
        key = key_of("pbase", payload)
        stage = Stage(self.root / f"base-{key}", key, payload)

        def build(tmp: Path) -> dict:
            _threads()
            log(f"seed {self.seed}: base on {self.tasks}, {self.cfg['base']['steps']} steps")
            return rl.train_base(
                tmp, self.tasks, self.cfg["base"], self.cfg["horizon"], seed_of("base", self.seed), log
            )

        meta, cached = stage.build(build)
        self._record("base", meta, cached, ("curve",))
        return stage.folder, key

    def agents(self, base: Path, base_key: str) -> dict[str, tuple[Path, str]]:
        out = {}
        for task in self.tasks:
            sac = agent_settings(self.cfg, task)
            payload = {"base": base_key, "task": task, "sac": sac, "seed": self.seed}
            key = key_of("pagent", payload)
            stage = Stage(self.root / f"agent-{task}-{key}", key, payload)

            def build(tmp: Path, task=task, sac=sac) -> dict:
                _threads()
                log(f"seed {self.seed}: agent {task}, {sac['steps']} steps from the base")
                seed = seed_of("agent", task, self.seed)
                return rl.finetune(tmp, base / "sac.zip", task, self.tasks, sac, self.cfg["horizon"], seed, log)

            meta, cached = stage.build(build)
            self._record(f"agent {task}", meta, cached, ("curve",))
            out[task] = (stage.folder / "actor.safetensors", key)
        return out

    # -- merges -------------------------------------------------------------
    def merge_config(self, name: str, base: Path, agents: dict[str, Path], dtype: str) -> dict:
        """The quality benchmark's mergekit config of merge `name`, its models being files, in `dtype`."""
        config = Q.Pipeline.merge_config(self, MERGES[name], base, {t: (p, "") for t, p in agents.items()})
        return {**config, "dtype": dtype}

    def bf16_inputs(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> tuple[Path, dict]:
        """The same actors rounded to bfloat16 (the dtype of the paper's agents), for inspect and merges."""
        payload = {"base": base_key, "agents": [k for _, k in agents.values()]}
        key = key_of("pmerge", {"bf16_inputs": payload})
        stage = Stage(self.root / f"bf16-{key}", key, payload)

        def build(tmp: Path) -> dict:
            from safetensors.torch import load_file, save_file

            tmp.mkdir(parents=True)
            for name, src in [("base", base / "actor.safetensors"), *((t, p) for t, (p, _) in agents.items())]:
                sd = {k: v.to(__import__("torch").bfloat16) for k, v in load_file(str(src)).items()}
                save_file(sd, str(tmp / f"{name}.safetensors"))
            return {}

        stage.build(build)
        return stage.folder / "base.safetensors", {t: stage.folder / f"{t}.safetensors" for t in agents}

    def merges(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> dict[str, Path]:
        """Every configured merge of all specialists' actors (float32), and `bf16` ones of the bf16 round trip,
        each built by a `mergekit-pytorch` process: {row: merged actor file}."""
        bf_base, bf_agents = self.bf16_inputs(base, base_key, agents)
        jobs = [
            (n, "float32", base / "actor.safetensors", {t: p for t, (p, _) in agents.items()})
            for n in self.cfg["merges"]
        ]
        jobs += [(n, "bfloat16", bf_base, bf_agents) for n in self.cfg["bf16"]]
        out, todo = {}, []
        for name, dtype, b, ag in jobs:
            payload = {
                "spec": MERGES[name].__dict__,
                "dtype": dtype,
                "base": base_key,
                "agents": [k for _, k in agents.values()],
                "seed": self.seed,
                "mergekit": version("mergekit"),
            }
            key = key_of("pmerge", payload)
            row = name if dtype == "float32" else f"{name} (bf16)"
            stage = Stage(self.root / "merges" / f"{name}-{dtype}-{key}", key, payload)
            out[row] = stage.folder / "model" / "model.safetensors"
            todo.append((row, name, dtype, b, ag, stage))

        def run_one(item) -> None:
            row, name, dtype, b, ag, stage = item

            def build(tmp: Path) -> dict:
                tmp.mkdir(parents=True)
                config = self.merge_config(name, b, ag, dtype)
                (tmp / "merge.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                cmd = [str(BIN / "mergekit-pytorch"), str(tmp / "merge.yaml"), str(tmp / "model")]
                cmd += ["--random-seed", str(self.seed)]
                run_tool(cmd, tmp / "mergekit.log", self.env)
                return {
                    "config": config,
                    "command": "mergekit-pytorch merge.yaml model --random-seed " + str(self.seed),
                }

            log(f"seed {self.seed}: merge {row}" + (" (cached)" if stage.done else ""))
            meta, cached = stage.build(build)
            self._record(f"merge {row}", meta, cached, ("config", "command"))

        with ThreadPoolExecutor(max_workers=max(1, self.cfg["jobs"])) as pool:
            list(pool.map(run_one, todo))
        return out

    def inspect(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> dict[str, dict]:
        """`mergekit-ram inspect` of the specialists, float32 and the bf16 round trip: {dtype: stats.json}."""
        bf_base, bf_agents = self.bf16_inputs(base, base_key, agents)
        out = {}
        inputs = {
            "float32": (base / "actor.safetensors", {t: p for t, (p, _) in agents.items()}),
            "bfloat16": (bf_base, bf_agents),
        }
        for dtype, (b, ag) in inputs.items():
            if dtype not in self.cfg["inspect"]:
                continue
            payload = {"base": base_key, "agents": [k for _, k in agents.values()], "dtype": dtype}
            key = key_of("pinspect", payload)
            stage = Stage(self.root / f"inspect-{dtype}-{key}", key, payload)

            def build(tmp: Path, b=b, ag=ag, dtype=dtype) -> dict:
                tmp.mkdir(parents=True)
                config = self.merge_config("ramplus", b, ag, dtype)
                (tmp / "inspect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                cmd = [
                    str(BIN / "mergekit-ram"),
                    "inspect",
                    str(tmp / "inspect.yaml"),
                    "--json",
                    str(tmp / "stats.json"),
                ]
                cmd += ["-q"]
                try:
                    import matplotlib  # noqa: F401

                    cmd += ["--plot", str(tmp / "density.png")]
                except ImportError:
                    pass
                done = run_tool(cmd, tmp / "inspect.log", self.env)
                (tmp / "inspect.txt").write_text(done.stdout)
                return {}

            meta, cached = stage.build(build)
            self._record(f"inspect {dtype}", meta, cached)
            out[dtype] = json.loads((stage.folder / "stats.json").read_text())
            out[dtype]["_folder"] = str(stage.folder)
        return out

    def evaluate(self, policies: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
        """Success (1/0 per episode) of every policy on every task; each (policy file, task) cached by the file's
        bytes, so the same actor is never evaluated twice."""
        ev = self.cfg["eval"]
        todo, out = [], {row: {} for row in policies}
        for row, path in policies.items():
            digest = _digest(path)
            for task in self.tasks:
                payload = {"actor": digest, "task": task, "tasks": self.tasks, "horizon": self.cfg["horizon"], **ev}
                payload.pop("bootstrap")
                key = key_of("peval", payload)
                stage = Stage(self.root / "eval" / f"{task}-{key}", key, payload)
                todo.append((row, task, path, stage))
        # one build per stage folder: two rows with the same bytes (ta_sum and a ramplus that changes each entry
        # once are often bit-identical) share one folder, and two processes building it at once raced on its
        # temporary folder (FileNotFoundError on stage.json, seen under load with jobs=2)
        missing = list({s.folder: (row, task, path, s) for row, task, path, s in todo if not s.done}.values())
        if missing:
            log(f"seed {self.seed}: evaluating {len(missing)} (policy, task) pairs, {ev['episodes']} episodes each")
            args = [
                (
                    str(p),
                    t,
                    self.tasks,
                    ev["episodes"],
                    self.cfg["horizon"],
                    ev["seed"],
                    str(s.folder),
                    s.key,
                    s.payload,
                )
                for _, t, p, s in missing
            ]
            with ProcessPoolExecutor(max_workers=max(1, self.cfg["jobs"])) as pool:
                list(pool.map(_eval_one, *zip(*args, strict=True)))
        seconds = 0.0
        for row, task, _, stage in todo:
            meta = stage.meta()
            out[row][task] = meta["success"]
            seconds += meta["seconds"]
        # summed over the evaluations, which ran `jobs` at a time
        self.stages["eval"] = {"seconds": round(seconds, 2), "cached": not missing}
        return out


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _eval_one(path, task, tasks, episodes, horizon, seed, folder, key, payload) -> None:
    stage = Stage(Path(folder), key, payload)
    stage.build(lambda tmp: {"success": rl.evaluate(Path(path), task, tasks, episodes, horizon, seed)})


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def run_seed(cfg: dict, root: Path, seed: int, until: str) -> dict:
    pipe = Pipeline(cfg, root, seed)
    base, base_key = pipe.base()
    agents = pipe.agents(base, base_key)
    if until == "agents":
        return {"stages": pipe.stages}
    merged = pipe.merges(base, base_key, agents)
    stats = pipe.inspect(base, base_key, agents)
    policies = {"base": base / "actor.safetensors", **{f"{t} agent": p for t, (p, _) in agents.items()}, **merged}
    success = pipe.evaluate(policies)
    return {
        "seed": seed,
        "stages": pipe.stages,
        "success": success,
        "stats": stats,
        "files": {k: str(v) for k, v in policies.items()},
    }


def machine() -> dict:
    info = Q.machine()
    for pkg in ("metaworld", "mujoco", "gymnasium", "stable-baselines3"):
        info[pkg] = version(pkg)
    return info


def git_commit() -> str | None:
    """HEAD, with `+changes` when the package or this benchmark differ from it (the run used uncommitted code)."""
    import subprocess

    try:
        git = ["git", "-C", str(HERE)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # the code; not the published results, which a run rewrites
        paths = [str(HERE.parent.parent / "mergekit_ram"), str(HERE), f":(exclude){HERE / 'results'}"]
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="full", help=f"one of {sorted(CONFIGS)}, or a JSON file")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE override, e.g. agent.steps=20000")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default: the configuration's)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/mergekit-ram-policies"), help="the stage cache")
    ap.add_argument("--out", type=Path, help="where results.json/.md and the charts go (default ROOT/results)")
    ap.add_argument("--until", choices=["agents", "all"], default="all", help="stop after training the agents")
    args = ap.parse_args(argv)
    known = args.config in CONFIGS
    cfg = copy.deepcopy(CONFIGS[args.config]) if known else json.loads(Path(args.config).read_text())
    cfg = Q.apply_overrides(cfg, args.set)
    seeds = args.seeds if args.seeds is not None else cfg["seeds"]
    unknown = [m for m in [*cfg["merges"], *cfg["bf16"]] if m not in MERGES]
    if unknown:
        raise SystemExit(f"unknown merge(s) {unknown}; known: {sorted(MERGES)}")
    root = args.root.resolve()
    start = time.perf_counter()
    runs = [run_seed(cfg, root, s, args.until) for s in seeds]
    if args.until == "agents":
        log(f"trained seeds {seeds} in {time.perf_counter() - start:.0f} s")
        return 0
    import policy_report

    out = (args.out or root / "results").resolve()
    res = policy_report.build(cfg, runs, machine(), git_commit(), args.config, time.perf_counter() - start)
    policy_report.write(res, out)
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
