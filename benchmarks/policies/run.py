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
import itertools
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the quality benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import rl  # noqa: E402
import staging  # noqa: E402
from staging import MERGES, Merge, Stage, log, run_tool, seed_of  # noqa: E402

BIN = Path(sys.executable).parent
#: bumped when a stage's code changes what it builds (part of every cache key of that stage)
VERSIONS = {"pbase": 1, "pagent": 1, "pmerge": 1, "pinspect": 1, "peval": 1}

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
#: the packages a policies result depends on besides those of every benchmark (`staging.machine`)
PACKAGES = ("metaworld", "mujoco", "gymnasium", "stable-baselines3")
#: the quality benchmark's merges: mergekit's methods and the `ramplus` r and ε sweeps
MERGE_NAMES = list(staging.ALL_MERGES)
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


#: the tuned merges of the regime run: each family's grid of scale (and density where it has one), tuned per
#: training seed on held-out variations (`rl.TUNING_SEED`). Per-model parameters `weight`, `density`; shared
#: `lambda` (mergekit's factor on the merged task vector: with `ties`' normalisation the weights cancel, so its
#: scale is `lambda`). The first point of each grid is mergekit's usual setting (the earlier runs' row); a tie on
#: the held-out episodes goes to the earlier point.
TUNED: dict[str, dict] = {
    "task_arithmetic": {"method": "task_arithmetic", "weight": [1.0, 0.25, 0.5, 0.75, 1.25]},
    "ties": {"method": "ties", "density": [0.5, 0.2, 0.8], "lambda": [1.0, 1.5]},
    "dare_linear": {"method": "dare_linear", "density": [0.5, 0.9], "weight": [1.0, 0.25, 0.5]},
    "dare_ties": {"method": "dare_ties", "density": [0.5, 0.9], "weight": [1.0, 0.5]},
}
#: the regime run's fixed merges: averaging, RAM and RAM+ with its r, RAM+s and ε ablation
REGIME_MERGES = ["linear", *staging.RAM_MERGES]
CONFIGS["regime"] = {
    # issue 42: agents that fine-tune one strong base (trained once, published), a verdict over ten seeds
    "regime": True,
    "seeds": list(range(10)),
    # the specialists' tasks; the base's layout has button-press too, which the screen's fine-tuning did not learn
    # (0 of 10 held-out episodes at 2k, 4k and 6k steps from this base: results/regime/screen/)
    "tasks": ["reach-v3", "reach-wall-v3", "coffee-button-v3"],
    "base_tasks": ["reach-v3", "reach-wall-v3", "coffee-button-v3", "button-press-v3"],
    "horizon": 500,
    # trained once, with its own seed (not the training seed's)
    # the screen's 100k-step run (screen.py base --name base4) stopped at 60k steps, where its held-out success
    # was highest (results/regime/screen/base4.json): its checkpoint is the published base
    "base": {**SAC, "train_freq": 1, "steps": 100000, "stop_at": 60000, "seed": 0, "log_every": 10000},
    # the fine-tuning screen (results/regime/screen/ft-*.json): at 1e-4 reach and reach-wall stayed at the base's
    # level for 8k steps; at 3e-4 coffee-button rose from 0 to 50-70 % in 4-6k steps with ‖τ‖/‖θ_base‖ 0.13-0.18
    "agent": {**SAC, "train_freq": 1, "steps": 6000, "warmup": 1000, "fresh_optimizer": True},
    # multi-task SAC from the same base with the agents' settings and their total budget (K x their steps)
    "multitask": True,
    # episode i of seed s: variation (episodes * s + i) mod 50 (the seeds together cover all 50)
    "eval": {"episodes": 20, "seed": 100_000, "bootstrap": 2000},
    "tune": {"episodes": 8, "grid": TUNED},
    "dare_seeds": 3,
    "merges": REGIME_MERGES,
    "interpolate": [0.25, 0.5, 0.75],
    "bf16": [],
    "inspect": ["float32"],
    "jobs": 2,
}
CONFIGS["regime-smoke"] = {
    **{k: v for k, v in CONFIGS["regime"].items() if k != "base_tasks"},
    "seeds": [0, 1, 2],
    "tasks": ["reach-v3", "drawer-close-v3"],
    "horizon": 30,
    "base": {**CONFIGS["smoke"]["base"], "seed": 0},
    "agent": {**CONFIGS["smoke"]["agent"], "train_freq": 1, "fresh_optimizer": True},
    "eval": {"episodes": 3, "seed": 100_000, "bootstrap": 200},
    "tune": {
        "episodes": 2,
        "grid": {"task_arithmetic": TUNED["task_arithmetic"], "dare_linear": {**TUNED["dare_linear"], "weight": [1.0]}},
    },
    "dare_seeds": 2,
    "merges": ["linear", "ramplus"],
    "interpolate": [0.5],
    "jobs": 1,
}

#: issue 51: specialists that all learn. The regime base's run (the same four-task layout, settings and seed), trained
#: again on this machine and stopped at 40,000 steps, where the screen (results/headroom/screen/, 20 held-out
#: variations) found reach 40 %, reach-wall 55 %, coffee-button 10 % (button-press 0 %: in the layout, not merged)
CONFIGS["headroom"] = {
    **CONFIGS["regime"],
    "base": {**CONFIGS["regime"]["base"], "stop_at": 40000},
    # the pilots (results/headroom/screen/pilot-*.json): at 3e-4 every task swung or fell (coffee-button 50, 0, 0, 0 %
    # at 2k-8k steps, reach-wall 35-40 % from 55 %); at 1e-4 coffee-button 5, 70, 15, 5, 25 % and reach-wall 70, 40,
    # 60, 75, 75 % (2k-10k steps; ‖τ‖/‖θ_base‖ ≤ 0.22): a specialist is its best checkpoint on held-out variations
    # (every 2,000 steps, 10 variations of the tuning set; rl.Select), as the base is
    "agent": {**CONFIGS["regime"]["agent"], "lr": 1e-4, "steps": 8000, "select": {"every": 2000, "episodes": 10}},
    # the report adds the share of each specialist's gain on its task that each merge keeps (the paper's measure)
    "gain_kept": True,
    # where this configuration is published: its base and actors are adopted from there by stage key
    "published": "results/headroom",
}
CONFIGS["headroom-smoke"] = {
    **CONFIGS["regime-smoke"],
    "agent": {**CONFIGS["regime-smoke"]["agent"], "select": {"every": 100, "episodes": 2}},
    "gain_kept": True,
    "published": "results/headroom",
}

#: issue 51, second screen (results/headroom/screen/base6-easy*.json, pilot6-*.json): a base over six tasks that SAC
#: learns sooner (the regime settings and seed, 100,000 steps planned), stopped at 80,000 steps, where 20 held-out
#: variations give reach 45 %, window-close 0 %, drawer-close 75 %, button-press-topdown 5 %, handle-press 20 %,
#: plate-slide 10 %. Merged: the three whose pilots gained 20 points or more (two seeds each; README, "The second
#: screen"); reach never did, window-close and drawer-close have no headroom there. All six stay in the layout.
CONFIGS["headroom6"] = {
    **CONFIGS["headroom"],
    "tasks": ["handle-press-v3", "plate-slide-v3", "button-press-topdown-v3"],
    "base_tasks": [
        "reach-v3",
        "window-close-v3",
        "drawer-close-v3",
        "button-press-topdown-v3",
        "handle-press-v3",
        "plate-slide-v3",
    ],
    "base": {**CONFIGS["regime"]["base"], "stop_at": 80000},
    # the pilots: with 4 gradient steps per environment step plate-slide gained +50 and +55 within 16,000 steps
    # (one step: +35 and -5), button-press-topdown +40 and 0; handle-press +55 in both seeds with one step, kept
    # there. 16,000 steps keep ‖τ‖/‖θ_base‖ at 0.19-0.38; the best of four checkpoints on 20 held-out variations
    "agent": {
        **CONFIGS["headroom"]["agent"],
        "steps": 16000,
        "gradient_steps": 4,
        "select": {"every": 4000, "episodes": 20},
        "per_task": {"handle-press-v3": {"gradient_steps": 1}},
    },
    "published": "results/headroom6",
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
    """One training seed's stages. `published`: a results folder whose base and actors (with their stage keys) are
    copied into the cache when a stage's key matches (so a run resumes from the repository's files); `replay`:
    every training stage must come from there (nothing is trained)."""

    def __init__(self, cfg: dict, root: Path, seed: int, published: Path | None = None, replay: bool = False):
        self.cfg, self.root, self.seed = cfg, root, seed
        self.tasks = list(cfg["tasks"])
        #: the one-hot layout: the base's tasks (the agents' tasks when the base has no others)
        self.layout = list(cfg.get("base_tasks", self.tasks))
        self.published, self.replay = published, replay
        self.key_of = staging.StageKeys(VERSIONS)
        self.stages: dict[str, dict] = {}
        self.env = {
            **os.environ,
            "MERGEKIT_RAM_CACHE": str(root / "ram-cache"),
            "OMP_NUM_THREADS": "1",
            # DARE's masks follow the tensors' order, which follows string hashing: fixed, so each merge repeats
            "PYTHONHASHSEED": "0",
        }

    def _record(self, name: str, meta: dict, cached: bool, keep=()) -> None:
        self.stages[name] = {"seconds": meta["seconds"], "cached": cached, **{k: meta[k] for k in keep if k in meta}}

    def _adopt(self, stage: Stage, name: str) -> None:
        """Fill `stage` from the published results when their `stages.json` lists a stage of this key (the base,
        each seed's actors): a run resumes from the repository's files, and a replay uses nothing else."""
        if stage.done or self.published is None:
            return
        index = self.published / "stages.json"
        entry = json.loads(index.read_text()).get(stage.key) if index.exists() else None
        if entry is None:
            if self.replay:
                raise SystemExit(f"replay: seed {self.seed}'s {name} (stage {stage.key}) is not in {index}")
            return
        shutil.rmtree(stage.tmp, ignore_errors=True)
        stage.tmp.mkdir(parents=True)
        for dest, src in entry["files"].items():
            shutil.copyfile(self.published / src, stage.tmp / dest)
        stage.place(entry["meta"])
        log(f"seed {self.seed}: {name} from {self.published}")

    def base_stage(self) -> Stage:
        """The base's stage (its key: the layout, the horizon, SAC's settings, and the training seed unless the
        base has its own `seed`)."""
        payload = {"tasks": self.layout, "horizon": self.cfg["horizon"], "sac": self.cfg["base"]}
        if self.cfg["base"].get("seed") is None:
            payload["seed"] = self.seed
        key = self.key_of("pbase", payload)
        return Stage(self.root / f"base-{key}", key, payload)

    def base(self) -> tuple[Path, str]:
        """The multi-task base. With `base.seed` it is trained once, the same for every training seed."""
        once = self.cfg["base"].get("seed") is not None
        stage = self.base_stage()
        key = stage.key
        self._adopt(stage, "base")
        seed = self.cfg["base"]["seed"] if once else seed_of("base", self.seed)

        def build(tmp: Path) -> dict:
            _threads()
            log(f"seed {self.seed}: base on {self.layout}, {self.cfg['base']['steps']} steps")
            return rl.train_base(tmp, self.layout, self.cfg["base"], self.cfg["horizon"], seed, log)

        meta, cached = stage.build(build)
        self._record("base", meta, cached, ("curve",))
        return stage.folder, key

    def agents(self, base: Path, base_key: str) -> dict[str, tuple[Path, str]]:
        """One specialist per task, and with `multitask` the multi-task reference (row `multitask SAC`): the base
        trained on all tasks with the agents' settings and their total budget. `jobs` train at a time."""
        out, missing = {}, []
        todo = self.agent_stages(base_key)
        for row, task, sac, seed, stage in todo:
            self._adopt(stage, row)
            out[row] = (stage.folder / "actor.safetensors", stage.key)
            if not stage.done:
                missing.append((row, task, sac, seed, stage))
        args = [(str(base / "sac.zip"), t, self.layout, sac, self.cfg["horizon"], seed, self.seed, str(st.folder),
                 st.key, st.payload) for _, t, sac, seed, st in missing]  # fmt: skip
        if args:
            if self.cfg["jobs"] > 1 and len(args) > 1:
                with ProcessPoolExecutor(max_workers=self.cfg["jobs"]) as pool:
                    list(pool.map(_train_one, *zip(*args, strict=True)))
            else:
                for a in args:
                    _train_one(*a)
        built = {st.folder for *_, st in missing}
        for row, task, _, _, stage in todo:
            name = row if row == "multitask SAC" else f"agent {task}"
            self._record(name, stage.meta(), stage.folder not in built, ("curve", "selection", "selected"))
        #: the multi-task reference's (actor file, stage key), or None
        self.multitask = out.get("multitask SAC")
        return {t: out[f"{t} agent"] for t in self.tasks}

    def agent_stages(self, base_key: str) -> list[tuple]:
        """[(row, task(s), SAC settings, SAC seed, Stage)]: each specialist's stage, then the multi-task
        reference's."""
        todo = []
        for task in self.tasks:
            sac = agent_settings(self.cfg, task)
            payload = {"base": base_key, "task": task, "sac": sac, "seed": self.seed}
            if self.layout != self.tasks:
                payload["layout"] = self.layout
            todo.append((f"{task} agent", task, sac, payload, seed_of("agent", task, self.seed)))
        if self.cfg.get("multitask"):
            sac = {**self.cfg["agent"], "steps": self.cfg["agent"]["steps"] * len(self.tasks)}
            sac.pop("per_task", None)
            payload = {"base": base_key, "task": self.tasks, "layout": self.layout, "sac": sac, "seed": self.seed}
            todo.append(("multitask SAC", self.tasks, sac, payload, seed_of("multitask", self.seed)))
        out = []
        for row, task, sac, payload, seed in todo:
            key = self.key_of("pagent", payload)
            label = "multitask" if row == "multitask SAC" else task
            out.append((row, task, sac, seed, Stage(self.root / f"agent-{label}-{key}", key, payload)))
        return out

    # -- merges -------------------------------------------------------------
    def merge_config(self, spec, base: Path, agents: dict[str, Path], dtype: str) -> dict:
        """The quality benchmark's mergekit config of merge `spec`, its models being files, in `dtype`."""
        spec = MERGES[spec] if isinstance(spec, str) else spec
        return staging.merge_config(spec, base, list(agents.values()), dtype)

    def bf16_inputs(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> tuple[Path, dict]:
        """The same actors rounded to bfloat16 (the dtype of the paper's agents), for inspect and merges."""
        payload = {"base": base_key, "agents": [k for _, k in agents.values()]}
        key = self.key_of("pmerge", {"bf16_inputs": payload})
        stage = Stage(self.root / f"bf16-{key}", key, payload)

        def build(tmp: Path) -> dict:
            import torch
            from safetensors.torch import load_file, save_file

            tmp.mkdir(parents=True)
            for name, src in [("base", base / "actor.safetensors"), *((t, p) for t, (p, _) in agents.items())]:
                sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(src)).items()}
                save_file(sd, str(tmp / f"{name}.safetensors"))
            return {}

        stage.build(build)
        return stage.folder / "base.safetensors", {t: stage.folder / f"{t}.safetensors" for t in agents}

    def merge_all(self, jobs: list[tuple], base_key: str, agents: dict[str, tuple[Path, str]]) -> dict[str, Path]:
        """Merges of the specialists' actors, `jobs` = [(row, Merge, dtype, base file, {task: file}, random seed)],
        each a stage; the missing ones run in one `merge_batch.py` process (mergekit-pytorch in-process, with
        PYTHONHASHSEED 0): {row: merged actor file}."""
        out, todo = {}, []
        for row, spec, dtype, b, ag, random_seed in jobs:
            payload = {
                "spec": spec.__dict__,
                "dtype": dtype,
                "base": base_key,
                "agents": [k for _, k in agents.values()],
                "seed": random_seed,
                "pythonhashseed": self.env["PYTHONHASHSEED"],
                "mergekit": version("mergekit"),
            }
            key = self.key_of("pmerge", payload)
            stage = Stage(self.root / "merges" / f"{spec.method}-{dtype}-{key}", key, payload)
            out[row] = stage.folder / "model" / "model.safetensors"
            if not stage.done and all(stage.folder != s.folder for *_, s in todo):
                todo.append((row, spec, dtype, b, ag, random_seed, stage))
            elif stage.done:
                self._record(f"merge {row}", stage.meta(), True, ("config", "command"))
        if todo:
            log(f"seed {self.seed}: {len(todo)} merges (mergekit-pytorch, in one process)")
            batch = []
            for _, spec, dtype, b, ag, random_seed, stage in todo:
                shutil.rmtree(stage.tmp, ignore_errors=True)
                stage.tmp.mkdir(parents=True)
                config_path = stage.tmp / "merge.yaml"
                config_path.write_text(yaml.safe_dump(self.merge_config(spec, b, ag, dtype), sort_keys=False))
                batch.append([str(config_path), str(stage.tmp / "model"), "--random-seed", str(random_seed)])
            jobs_file = self.root / "merges" / f"batch-{os.getpid()}.json"
            jobs_file.parent.mkdir(parents=True, exist_ok=True)
            jobs_file.write_text(json.dumps(batch))
            start = time.perf_counter()
            run_tool([sys.executable, str(HERE / "merge_batch.py"), str(jobs_file)], jobs_file.with_suffix(".log"),
                     self.env)  # fmt: skip
            each = (time.perf_counter() - start) / len(todo)
            for row, *_, random_seed, stage in todo:
                config = yaml.safe_load((stage.tmp / "merge.yaml").read_text())
                command = f"PYTHONHASHSEED=0 mergekit-pytorch merge.yaml model --random-seed {random_seed}"
                meta = stage.finish(each, {"config": config, "command": command})
                self._record(f"merge {row}", meta, False, ("config", "command"))
        return out

    def merges(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]], more=()) -> dict[str, Path]:
        """Every configured merge of all specialists' actors (float32), `bf16` ones of the bf16 round trip, and
        the `more` jobs (the tuning grid), all in one batch."""
        files = {t: p for t, (p, _) in agents.items()}
        jobs = [(n, MERGES[n], "float32", base / "actor.safetensors", files, self.seed) for n in self.cfg["merges"]]
        if self.cfg["bf16"]:
            bf_base, bf_agents = self.bf16_inputs(base, base_key, agents)
            jobs += [(f"{n} (bf16)", MERGES[n], "bfloat16", bf_base, bf_agents, self.seed) for n in self.cfg["bf16"]]
        return self.merge_all([*jobs, *more], base_key, agents)

    def dare_seed(self, m: int) -> int:
        """The `--random-seed` of DARE's mask draw `m` (0, 1, ...) in this training seed."""
        return seed_of("dare", self.seed, m) % 2**31

    def grid(self, base: Path, agents: dict[str, tuple[Path, str]]) -> tuple[list[tuple], dict[str, list[dict]]]:
        """Every point of every tuned family's grid (DARE with its first mask draw): the merge jobs, and
        {family: [{"point": name, "parameters": {...}}]} (`merge_all` gives their files)."""
        files = {t: p for t, (p, _) in agents.items()}
        points, jobs = {}, []
        for family, spec in self.cfg["tune"]["grid"].items():
            points[family] = []
            for name, merge, params in grid_points(family, spec):
                seed = self.dare_seed(0) if family.startswith("dare") else self.seed
                jobs.append((name, merge, "float32", base / "actor.safetensors", files, seed))
                points[family].append({"point": name, "parameters": params})
        return jobs, points

    def tune(self, grid: dict[str, list[dict]]) -> dict[str, dict]:
        """Each family's best grid point on the held-out variations (mean success over the tasks; a tie goes to the
        earlier point): {family: {"best": point, "parameters", "scores": {point: mean}, "success": ...}}."""
        tu = self.cfg["tune"]
        cells = [(p["point"], t, p["file"]) for points in grid.values() for p in points for t in self.tasks]
        first = (tu["episodes"] * self.seed) % 50
        success = self.evaluate_cells(cells, tu["episodes"], rl.TUNING_SEED, first, "tune")
        out = {}
        for family, points in grid.items():
            scores = {p["point"]: float(np.mean([np.mean(success[p["point"]][t]) for t in self.tasks])) for p in points}
            best = max(points, key=lambda p: (scores[p["point"]], -points.index(p)))
            out[family] = {
                "best": best["point"],
                "parameters": best["parameters"],
                "scores": scores,
                "success": {p["point"]: success[p["point"]] for p in points},
                "variations": f"tuning set (MT1 seed {rl.TUNING_SEED}) {first} to {first + tu['episodes'] - 1}",
            }
        return out

    def tuned(self, base: Path, base_key: str, agents, tuning: dict[str, dict]) -> dict[str, list[Path]]:
        """Each family at its tuned point; DARE at `dare_seeds` mask draws: {row: [files]}."""
        files = {t: p for t, (p, _) in agents.items()}
        jobs, rows = [], {}
        for family, spec in self.cfg["tune"]["grid"].items():
            name, merge, _ = next(x for x in grid_points(family, spec) if x[0] == tuning[family]["best"])
            draws = range(self.cfg["dare_seeds"]) if family.startswith("dare") else [None]
            rows[f"{family} (tuned)"] = []
            for m in draws:
                row = name if m is None else f"{name} mask {m}"
                seed = self.seed if m is None else self.dare_seed(m)
                jobs.append((row, merge, "float32", base / "actor.safetensors", files, seed))
                rows[f"{family} (tuned)"].append(row)
        made = self.merge_all(jobs, base_key, agents)
        return {row: [made[r] for r in parts] for row, parts in rows.items()}

    def interpolations(self, base: Path, base_key: str, agents) -> dict[str, dict[float, Path]]:
        """θ_base + α τ for each specialist and each α of `interpolate`: {task: {α: file}}."""
        alphas = list(self.cfg.get("interpolate", []))
        payload = {"base": base_key, "agents": [agents[t][1] for t in self.tasks], "alphas": alphas}
        key = self.key_of("pmerge", {"interpolate": payload})
        stage = Stage(self.root / f"interp-{key}", key, payload)

        def build(tmp: Path) -> dict:
            from safetensors.numpy import save_file

            tmp.mkdir(parents=True)
            b = rl.load_actor(base / "actor.safetensors")
            for t in self.tasks:
                a = rl.load_actor(agents[t][0])
                for alpha in alphas:
                    sd = {k: (b[k] + np.float32(alpha) * (a[k] - b[k])).astype(np.float32) for k in b}
                    save_file(sd, str(tmp / f"{t}-{alpha}.safetensors"))
            return {}

        stage.build(build)
        return {t: {alpha: stage.folder / f"{t}-{alpha}.safetensors" for alpha in alphas} for t in self.tasks}

    def inspect(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> dict[str, dict]:
        """`mergekit-ram inspect` of the specialists, float32 and the bf16 round trip: {dtype: stats.json}."""
        inputs = {"float32": (base / "actor.safetensors", {t: p for t, (p, _) in agents.items()})}
        if "bfloat16" in self.cfg["inspect"]:
            inputs["bfloat16"] = self.bf16_inputs(base, base_key, agents)
        out = {}
        for dtype, (b, ag) in inputs.items():
            if dtype not in self.cfg["inspect"]:
                continue
            payload = {"base": base_key, "agents": [k for _, k in agents.values()], "dtype": dtype}
            key = self.key_of("pinspect", payload)
            stage = Stage(self.root / f"inspect-{dtype}-{key}", key, payload)

            def build(tmp: Path, b=b, ag=ag, dtype=dtype) -> dict:
                tmp.mkdir(parents=True)
                config = self.merge_config("ramplus", b, ag, dtype)
                (tmp / "inspect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                cmd = [str(BIN / "mergekit-ram"), "inspect", str(tmp / "inspect.yaml")]
                cmd += ["--json", str(tmp / "stats.json"), "-q"]
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

    # -- evaluation ---------------------------------------------------------
    def evaluate(self, policies: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
        """Success (1/0 per episode) of every policy on every task on the evaluation's episodes."""
        ev = self.cfg["eval"]
        first = (ev["episodes"] * self.seed) % 50 if self.cfg.get("regime") else 0
        cells = [(row, t, path) for row, path in policies.items() for t in self.tasks]
        return self.evaluate_cells(cells, ev["episodes"], rl.VARIATION_SEED, first, "eval")

    def evaluate_cells(self, cells, episodes: int, variation_seed: int, first: int, name: str) -> dict:
        """{row: {task: 1/0 per episode}} of (row, task, actor file) cells; each (file, task, episodes) cached by the
        file's bytes, so the same actor is never evaluated twice. The evaluations run `jobs` processes at a time,
        each taking one task's environment through several actors."""
        ev = self.cfg["eval"]
        todo, out = [], {}
        for row, task, path in cells:
            payload = {"actor": _digest(path), "task": task, "tasks": self.layout, "horizon": self.cfg["horizon"]}
            payload.update(episodes=episodes, seed=ev["seed"])
            if variation_seed != rl.VARIATION_SEED or first:
                payload.update(variation_seed=variation_seed, first=first)
            key = self.key_of("peval", payload)
            todo.append((row, task, path, Stage(self.root / "eval" / f"{task}-{key}", key, payload)))
        # one build per stage folder: two rows with the same bytes share one folder (two processes building it at
        # once raced on its temporary folder)
        missing = list({s.folder: (t, p, s) for _, t, p, s in todo if not s.done}.values())
        if missing:
            log(f"seed {self.seed}: evaluating {len(missing)} (policy, task) pairs ({name}), {episodes} episodes each")
            groups = []
            for task in self.tasks:
                mine = [(str(p), str(s.folder), s.key, s.payload) for t, p, s in missing if t == task]
                size = max(1, -(-len(mine) // max(1, self.cfg["jobs"] * 2)))
                groups += [(task, mine[i : i + size]) for i in range(0, len(mine), size)]
            args = [(t, g, self.layout, episodes, self.cfg["horizon"], ev["seed"], variation_seed, first)
                    for t, g in groups]  # fmt: skip
            if self.cfg["jobs"] > 1:
                with ProcessPoolExecutor(max_workers=self.cfg["jobs"]) as pool:
                    list(pool.map(_eval_group, *zip(*args, strict=True)))
            else:
                for a in args:
                    _eval_group(*a)
        seconds = 0.0
        for row, task, _, stage in todo:
            meta = stage.meta()
            out.setdefault(row, {})[task] = meta["success"]
            seconds += meta["seconds"]
        # summed over the evaluations, which ran `jobs` at a time
        self.stages[name] = {"seconds": round(seconds, 2), "cached": not missing}
        return out


def grid_points(family: str, spec: dict) -> list[tuple[str, Merge, dict]]:
    """The points of a tuned family's grid: [(row name, Merge, {parameter: value})], mergekit's usual one first."""
    axes = {k: v for k, v in spec.items() if k != "method"}
    out = []
    for values in itertools.product(*axes.values()):
        params = dict(zip(axes, values, strict=True))
        per_model = {k: v for k, v in params.items() if k in ("weight", "density")}
        per_model.setdefault("weight", 1.0)
        shared = {"lambda": params["lambda"]} if "lambda" in params else None
        text = ", ".join(f"{SHORT.get(k, k)}={v}" for k, v in params.items())
        out.append((f"{family} [{text}]", Merge(f"{family} ({text})", spec["method"], shared, per_model), params))
    return out


SHORT = {"weight": "w", "density": "d", "lambda": "λ"}


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _train_one(base_zip, task, layout, sac, horizon, seed, training_seed, folder, key, payload) -> None:
    stage = Stage(Path(folder), key, payload)

    def build(tmp: Path) -> dict:
        _threads()
        what = task if isinstance(task, str) else f"multitask {'+'.join(task)}"
        log(f"seed {training_seed}: agent {what}, {sac['steps']} steps from the base")
        return rl.finetune(tmp, Path(base_zip), task, layout, sac, horizon, seed, log)

    stage.build(build)


def _eval_group(task, group, layout, episodes, horizon, seed, variation_seed, first) -> None:
    """One task's environment through several actors: [(actor file, stage folder, key, payload)]."""
    for path, folder, key, payload in group:
        stage = Stage(Path(folder), key, payload)
        stage.build(
            lambda tmp, path=path: {
                "success": rl.evaluate(Path(path), task, layout, episodes, horizon, seed, variation_seed, first)
            }
        )


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def run_seed(cfg: dict, root: Path, seed: int, until: str, published: Path | None = None, replay=False) -> dict:
    pipe = Pipeline(cfg, root, seed, published, replay)
    base, base_key = pipe.base()
    agents = pipe.agents(base, base_key)
    if until == "agents":
        return {"stages": pipe.stages}
    if cfg.get("regime"):
        return run_regime(pipe, base, base_key, agents)
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


def run_regime(pipe: Pipeline, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> dict:
    """The regime run's seed: fixed merges, each tuned family's grid tuned on held-out variations and merged at its
    best point (DARE at several mask draws), base -> specialist interpolations, the regime's statistics, and every
    policy evaluated on the evaluation's episodes. A row's episode outcome is the mean over its files (DARE's
    draws)."""
    import regime

    grid_jobs, grid = pipe.grid(base, agents)
    made = pipe.merges(base, base_key, agents, grid_jobs)
    merged = {row: made[row] for row in pipe.cfg["merges"]}
    for points in grid.values():
        for p in points:
            p["file"] = made[p["point"]]
    tuning = pipe.tune(grid)
    tuned = pipe.tuned(base, base_key, agents, tuning)
    interp = pipe.interpolations(base, base_key, agents)
    stats = pipe.inspect(base, base_key, agents)
    rows: dict[str, list[Path]] = {"base": [base / "actor.safetensors"]}
    rows.update({f"{t} agent": [p] for t, (p, _) in agents.items()})
    if pipe.multitask:
        rows["multitask SAC"] = [pipe.multitask[0]]
    rows.update({r: [p] for r, p in merged.items()})
    rows.update(tuned)
    files = {f"{r} #{i}": p for r, ps in rows.items() for i, p in enumerate(ps)}
    by_file = pipe.evaluate(files)
    success = {r: {t: regime.mean_outcomes([by_file[f"{r} #{i}"][t] for i in range(len(ps))]) for t in pipe.tasks}
               for r, ps in rows.items()}  # fmt: skip
    ev = pipe.cfg["eval"]
    first = (ev["episodes"] * pipe.seed) % 50
    cells = [(f"{t} α={a}", t, f) for t, per in interp.items() for a, f in per.items()]
    along = pipe.evaluate_cells(cells, ev["episodes"], rl.VARIATION_SEED, first, "interpolation")
    interpolation = {t: {"0": success["base"][t], **{str(a): along[f"{t} α={a}"][t] for a in per}, "1":
                         success[f"{t} agent"][t]} for t, per in interp.items()}  # fmt: skip
    files_of = {"base": base / "actor.safetensors", **{f"{t} agent": p for t, (p, _) in agents.items()}}
    if pipe.multitask:
        files_of["multitask SAC"] = pipe.multitask[0]
    return {
        "seed": pipe.seed,
        "stages": pipe.stages,
        "success": success,
        "per_draw": {r: [by_file[f"{r} #{i}"] for i in range(len(ps))] for r, ps in tuned.items() if len(ps) > 1},
        "tuning": tuning,
        "interpolation": interpolation,
        "regime": regime.statistics(base / "actor.safetensors", {t: p for t, (p, _) in agents.items()}, pipe.layout),
        "stats": stats,
        "files": {k: str(v) for k, v in files_of.items()},
        "merge_files": {r: [str(p) for p in ps] for r, ps in rows.items() if r not in files_of},
        "keys": {
            "base": base_key,
            **{f"{t} agent": k for t, (_, k) in agents.items()},
            **({"multitask SAC": pipe.multitask[1]} if pipe.multitask else {}),
        },
        "first_episode": first,
    }


def publish_stages(cfg: dict, root: Path, out: Path, seeds: list[int]) -> dict[str, str]:
    """The base and every finished agent stage of `seeds` in the cache, copied into `out` (`base/`,
    `policies/seedS/`) and added to its `stages.json`, so that a later run, in a fresh checkout too, adopts them
    instead of training them: the seeds that a session did not finish keep what they trained. Nothing is trained.
    Run it after the report's `--overwrite` (which rewrites `stages.json` from the finished seeds alone).
    {stage key: published file}."""
    index_path = out / "stages.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    done = {}
    for seed in seeds:
        pipe = Pipeline(cfg, root, seed)
        base = pipe.base_stage()
        if not base.done:
            continue
        entries = [(base, {"actor.safetensors": "base/actor.safetensors", "sac.zip": "base/sac.zip"})]
        for row, *_, stage in pipe.agent_stages(base.key):
            if stage.done:  # the report's names (policy_report.published_names)
                name = f"policies/seed{seed}/{row.replace(' ', '_')}.safetensors"
                entries.append((stage, {"actor.safetensors": name}))
        for stage, files in entries:
            for src, dest in files.items():
                (out / dest).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stage.folder / src, out / dest)
            index[stage.key] = {"files": files, "meta": stage.meta()}
            done[stage.key] = files["actor.safetensors"]
    out.mkdir(parents=True, exist_ok=True)
    index_path.write_text(json.dumps(index, indent=1))
    return done


def git_commit() -> str | None:
    """HEAD, with `+changes` when the package or this benchmark differ from it (the run used uncommitted code)."""
    import subprocess

    try:
        git = ["git", "-C", str(HERE)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # the code; not the published results, which a run rewrites, nor the README written from them
        paths = [str(HERE.parent.parent / "mergekit_ram"), str(HERE), f":(exclude){HERE / 'results'}"]
        paths.append(f":(exclude){HERE / 'README.md'}")
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed.stdout.strip() else "")


#: where the regime run is published: its base and actors are read from here when a stage's key matches
REGIME_RESULTS = HERE / "results" / "regime"


def published_folder(cfg: dict) -> Path | None:
    """Where a configuration's base and actors are published (its `published`, relative to this folder; the regime
    run's for the other regime configurations), read when a stage's key matches."""
    if cfg.get("published"):
        return HERE / cfg["published"]
    return REGIME_RESULTS if cfg.get("regime") else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="full", help=f"one of {sorted(CONFIGS)}, or a JSON file")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE override, e.g. agent.steps=20000")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default: the configuration's)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/mergekit-ram-policies"), help="the stage cache")
    ap.add_argument("--out", type=Path, help="where results.json/.md and the charts go (default ROOT/results)")
    ap.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    ap.add_argument("--until", choices=["agents", "all"], default="all", help="stop after training the agents")
    ap.add_argument(
        "--published",
        type=Path,
        help="a results folder whose base and actors are used where their stage keys match (default: the "
        "configuration's `published`; for the other regime configurations "
        f"{REGIME_RESULTS.relative_to(HERE.parent.parent)})",
    )
    ap.add_argument(
        "--replay",
        type=Path,
        metavar="RESULTS",
        help="re-merge and re-evaluate a publication from its published actors, with its configuration; nothing is "
        "trained (e.g. benchmarks/policies/results/regime)",
    )
    ap.add_argument(
        "--publish-stages",
        action="store_true",
        help="copy the base and every finished agent stage of --seeds from --root into --out and its stages.json "
        "(nothing is trained): what an unfinished session leaves for the next",
    )
    args = ap.parse_args(argv)
    if args.publish_stages:
        cfg = staging.apply_overrides(copy.deepcopy(CONFIGS[args.config]), args.set)
        if not args.out:
            raise SystemExit("--publish-stages needs --out")
        done = publish_stages(cfg, args.root.resolve(), args.out.resolve(), args.seeds or cfg["seeds"])
        log(f"published {len(done)} stages in {args.out}: " + ", ".join(sorted(set(done.values()))))
        return 0
    if args.replay:
        published = json.loads((args.replay / "results.json").read_text())
        cfg, name = published["config"], published["config_name"]
        seeds = args.seeds if args.seeds is not None else published["seeds"]
    else:
        known = args.config in CONFIGS
        cfg = copy.deepcopy(CONFIGS[args.config]) if known else json.loads(Path(args.config).read_text())
        cfg = staging.apply_overrides(cfg, args.set)
        seeds = args.seeds if args.seeds is not None else cfg["seeds"]
        name = args.config
    unknown = [m for m in [*cfg["merges"], *cfg["bf16"]] if m not in MERGES]
    if unknown:
        raise SystemExit(f"unknown merge(s) {unknown}; known: {sorted(MERGES)}")
    root = args.root.resolve()
    out = (args.out or root / "results").resolve()
    if args.until == "all" and (out / "results.json").exists() and not args.overwrite:
        raise SystemExit(f"{out} already holds results: pass --overwrite to replace them, or another --out")
    published = args.replay or args.published or published_folder(cfg)
    start = time.perf_counter()
    runs = [run_seed(cfg, root, s, args.until, published, bool(args.replay)) for s in seeds]
    if args.until == "agents":
        log(f"trained seeds {seeds} in {time.perf_counter() - start:.0f} s")
        return 0
    import policy_report

    info, commit, seconds = staging.machine(PACKAGES), git_commit(), time.perf_counter() - start
    if cfg.get("regime"):
        res = policy_report.build_regime(cfg, runs, info, commit, name, seconds)
        policy_report.write_regime(res, out)
    else:
        res = policy_report.build(cfg, runs, info, commit, name, seconds)
        policy_report.write(res, out)
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
