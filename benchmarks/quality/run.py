"""Does RAM+ keep RL-trained skills? A reproducible merge-quality benchmark on CPU.

    python benchmarks/quality/run.py                       # the full configuration
    python benchmarks/quality/run.py --config smoke        # a tiny end-to-end run (the test suite's)
    python benchmarks/quality/run.py --set rl.lr=3e-4 --set rl.steps=200   # a tuning attempt
    python benchmarks/quality/run.py --config shared       # the shared regime: every reward also needs `[...]`

Stages, each built once and cached under --root (default /tmp/mergekit-ram-quality) in a folder keyed by a hash
of everything it depends on: a small Qwen2 base pretrained from scratch on a task mix -> one GRPO agent per task
(bf16) -> merges of all agents through plain `mergekit-yaml` -> per-agent density/overlap through
`mergekit-ram inspect` -> greedy exact-match evaluation of every model on every task -> results.json,
results.md, chart.png and density.png in --out. See benchmarks/quality/README.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the policies benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import staging  # noqa: E402
import tasks as T  # noqa: E402
from staging import MERGES, Stage, log, run_tool, seed_of  # noqa: E402

BIN = Path(sys.executable).parent
#: bumped when a stage's code changes what it builds (part of every cache key of that stage)
#: inspect 2: stats.json carries the diagnostics (mergekit-ram format_version 2); a cached version-1 stage lacks them
VERSIONS = {"base": 1, "agent": 1, "merge": 1, "inspect": 2, "eval": 1}

# --------------------------------------------------------------------------- #
# Configurations
# --------------------------------------------------------------------------- #
#: merged once more on every pair of agents: the outcome (RAM+ minus task arithmetic w = 1) beside each pair's
#: diagnostics (same-sign share, cosine), more evidence than one merge of all agents per regime
PAIR_MERGES = ["ramplus", "ta_sum"]
#: task difficulty shared by `full` and `dev`
TASKS = {
    "add": {"digits": 2},
    "sort": {"min_len": 4, "max_len": 8},
    "reverse": {"min_len": 4, "max_len": 8, "letters": 4},
    "count": {"min_len": 6, "max_len": 12},
}
#: the pretraining corpus gives the task's systematic error (tasks.py) as the answer this often
NOISE = {"add": 0.6, "sort": 0.6, "reverse": 0.6, "count": 0.6}
CONFIGS: dict[str, dict] = {
    "full": {
        "seed": 0,
        "threads": 2,
        "tasks": TASKS,
        "model": {"hidden": 128, "intermediate": 384, "layers": 4, "heads": 4, "kv_heads": 2},
        "pretrain": {
            "steps": 3000,
            "batch": 64,
            "lr": 2e-3,
            "warmup": 100,
            "decay": True,
            "weight_decay": 0.01,
            "probe_every": 300,
            "probe_n": 200,
            "stop_mean": 2.0,  # never: a fixed budget, the learning rate decays to 0
            "stop_min": 2.0,
            "weights": {},
            "noise": NOISE,
        },
        "rl": {
            "steps": 150,
            "prompts": 16,
            "group": 8,
            "lr": 3e-6,
            "temperature": 1.0,
            "partial": 0.0,
            "kl": 0.0,
            "probe_every": 50,
            "probe_n": 200,
            # agents trained for different lengths, as real ones are: each about as long as its task needs
            "per_task": {
                "add": {"steps": 800},
                "sort": {"steps": 100},
                "reverse": {"steps": 250},
                "count": {"steps": 120},
            },
        },
        "eval": {"n": 2500, "exclude": 2500, "batch": 512, "bootstrap": 2000},
        "merges": staging.ALL_MERGES,
        "pairs": PAIR_MERGES,
        "inspect": True,
        "jobs": 2,
    },
    # small and fast: for tuning attempts on 2 cores (n = 1000: standard errors up to 1.6 points)
    "dev": {
        "seed": 0,
        "threads": 2,
        "tasks": TASKS,
        "model": {"hidden": 64, "intermediate": 192, "layers": 3, "heads": 4, "kv_heads": 2},
        "pretrain": {
            "steps": 2000,
            "batch": 64,
            "lr": 3e-3,
            "warmup": 100,
            "decay": True,
            "weight_decay": 0.01,
            "probe_every": 250,
            "probe_n": 200,
            "stop_mean": 2.0,
            "stop_min": 2.0,
            "weights": {},
            "noise": NOISE,
        },
        "rl": {
            "steps": 300,
            "prompts": 16,
            "group": 8,
            "lr": 3e-6,
            "temperature": 1.0,
            "partial": 0.0,
            "kl": 0.0,
            "probe_every": 50,
            "probe_n": 200,
        },
        "eval": {"n": 1000, "exclude": 2500, "batch": 500, "bootstrap": 1000},
        "merges": staging.ALL_MERGES,
        "pairs": PAIR_MERGES,
        "inspect": True,
        "jobs": 2,
    },
    "smoke": {
        "seed": 0,
        "threads": 2,
        "tasks": {"add": {"digits": 2}, "reverse": {"min_len": 3, "max_len": 4, "letters": 6}},
        "model": {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 2, "kv_heads": 1},
        "pretrain": {
            "steps": 30,
            "batch": 32,
            "lr": 3e-3,
            "warmup": 5,
            "weight_decay": 0.0,
            "probe_every": 30,
            "probe_n": 32,
            "decay": True,
            "stop_mean": 2.0,
            "stop_min": 2.0,
            "weights": {},
            "noise": {"add": 0.6, "reverse": 0.6},
        },
        "rl": {
            "steps": 3,
            "prompts": 4,
            "group": 4,
            "lr": 1e-4,
            "temperature": 1.0,
            "partial": 0.0,
            "kl": 0.0,
            "probe_every": 3,
            "probe_n": 16,
            "per_task": {"reverse": {"steps": 2, "probe_every": 2}},
        },
        "eval": {"n": 64, "exclude": 64, "batch": 512, "bootstrap": 200},
        "merges": ["ta_mean", "ties", "ramplus"],
        "pairs": PAIR_MERGES,
        "inspect": True,
        "jobs": 3,
    },
}


def _shared(cfg: dict, midtrain: dict, per_task: dict | None = None) -> dict:
    """The shared regime of a configuration: its base trained on where a minority of the answers have the common
    format (`midtrain`, from that configuration's cached base), agents rewarded only for a right answer in it
    (`per_task`: their RL steps, when they differ from the configuration's)."""
    out = copy.deepcopy(cfg)
    out["format"] = dict(FORMAT)
    out["midtrain"] = midtrain
    if per_task is not None:
        out["rl"]["per_task"] = per_task
    return out


#: the shared regime's common output behaviour: the answer in brackets, `[42]`
FORMAT = {"open": "[", "close": "]"}
CONFIGS["shared"] = _shared(
    CONFIGS["full"],
    {
        "steps": 300,
        "batch": 64,
        "lr": 5e-4,
        "warmup": 30,
        "decay": True,
        "weight_decay": 0.01,
        "probe_every": 150,
        "probe_n": 200,
        "stop_mean": 2.0,
        "stop_min": 2.0,
        "weights": {},
        "noise": NOISE,
        "format_share": 0.4,
    },
    # the reward needs the format too, so fewer samples earn it early on: each agent trains longer than in `full`
    {"add": {"steps": 1200}, "sort": {"steps": 150}, "reverse": {"steps": 240}, "count": {"steps": 180}},
)
CONFIGS["smoke-shared"] = _shared(
    CONFIGS["smoke"],
    {**CONFIGS["smoke"]["pretrain"], "steps": 20, "warmup": 2, "probe_every": 20, "format_share": 0.4},
)

#: the r ablation (paper Table 2), in order
R_SWEEP = {"ramplus_r0": 0.0, "ramplus_r0.05": 0.05, "ramplus": 0.1, "ramplus_r0.2": 0.2}
#: the change threshold: 1e-5 counts a one-ulp bf16 step of any weight as a change; larger ones ignore them
EPS_SWEEP = {"ramplus": 1e-5, "ramplus_eps1e-4": 1e-4, "ramplus_eps1e-3": 1e-3}


def rl_settings(cfg: dict, task: str) -> dict:
    """One agent's RL settings: `rl.per_task.TASK` over the shared ones (agents trained for different lengths)."""
    shared = {k: v for k, v in cfg["rl"].items() if k != "per_task"}
    return {**shared, **cfg["rl"].get("per_task", {}).get(task, {})}


def check_config(cfg: dict) -> None:
    for name, p in cfg["tasks"].items():
        if name not in T.TASKS:
            raise SystemExit(f"unknown task {name!r}; known: {sorted(T.TASKS)}")
        cfg["tasks"][name] = T.params(name, p)
    unknown = [m for m in [*cfg["merges"], *cfg.get("pairs", [])] if m not in MERGES]
    if unknown:
        raise SystemExit(f"unknown merge(s) {unknown}; known: {sorted(MERGES)}")
    if cfg["eval"]["exclude"] < cfg["eval"]["n"]:
        raise SystemExit("eval.exclude (prompts withheld from training) must be >= eval.n")
    if "midtrain" in cfg and not cfg.get("format"):
        raise SystemExit("midtrain (the shared regime's base) needs a format")


# --------------------------------------------------------------------------- #
# Caching
# --------------------------------------------------------------------------- #
def files_digest(folder: Path) -> str:
    """sha256 over the model's weight files (names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- #
# Pipeline
# --------------------------------------------------------------------------- #
#: a built agent: (its model folder, its stage key)
T_Agent = tuple[Path, str]


class Pipeline:
    def __init__(self, cfg: dict, root: Path):
        self.cfg, self.root = cfg, root
        self.names = list(cfg["tasks"])
        self.seed = cfg["seed"]
        ev = cfg["eval"]
        #: the common output format of the shared regime (None: the independent regime)
        self.fmt = cfg.get("format")
        extra = len(self.fmt["open"]) + len(self.fmt["close"]) if self.fmt else 0
        self.max_new = {n: T.max_new_tokens(n, p) + extra for n, p in cfg["tasks"].items()}
        self.held_out = {n: T.eval_set(n, p, ev["exclude"], self.seed) for n, p in cfg["tasks"].items()}
        self.eval_items = {n: items[: ev["n"]] for n, items in self.held_out.items()}
        self.exclude = {p for items in self.held_out.values() for p, _ in items}
        self.key_of = staging.StageKeys(VERSIONS)
        self.stages: dict[str, dict] = {}
        #: the merge rows in order (`merge_rows`), and {pair row: (merge name, agent A, agent B)}, set by `merges`
        self.rows: list[str] = []
        self.pairs: dict[str, tuple[str, str, str]] = {}
        self.env = {**os.environ, "MERGEKIT_RAM_CACHE": str(root / "ram-cache")}

    def _record(self, name: str, meta: dict, cached: bool, keep: tuple[str, ...] = ()) -> None:
        entry = {"key": meta["key"], "cached": cached, "build_seconds": meta["seconds"]}
        entry.update({k: meta[k] for k in keep if k in meta})
        self.stages[name] = entry

    # -- base ---------------------------------------------------------------
    def base(self) -> tuple[Path, str]:
        payload = {
            "tasks": self.cfg["tasks"],
            "model": self.cfg["model"],
            "pretrain": self.cfg["pretrain"],
            "seed": self.seed,
            "exclude": self.cfg["eval"]["exclude"],
        }
        key = self.key_of("base", payload)
        stage = Stage(self.root / "base" / key, key, payload)

        def build(tmp: Path) -> dict:
            import train

            pc = {**self.cfg["pretrain"], "model": self.cfg["model"], "seed": self.seed}
            sampler = T.Sampler(
                self.names, self.cfg["tasks"], f"{self.seed}/pretrain", self.exclude, pc.get("weights"), pc.get("noise")
            )
            probe_sampler = T.Sampler(self.names, self.cfg["tasks"], f"{self.seed}/probe", self.exclude)
            probes = {n: probe_sampler.task(n, pc["probe_n"]) for n in self.names}
            log(f"pretraining the base ({key})")
            model, history = train.pretrain(pc, sampler, probes, self.max_new, log)
            train.save_model(model, tmp / "base")
            return {"history": history, "parameters": train.num_parameters(model), "steps": history[-1]["step"]}

        meta, cached = stage.build(build)
        self._record("base", meta, cached, ("parameters", "steps", "history"))
        if "midtrain" not in self.cfg:
            return stage.folder / "base", key
        return self.base_format(stage.folder / "base", key)

    def base_format(self, parent: Path, parent_key: str) -> tuple[Path, str]:
        """The shared regime's base: `parent` trained on in a corpus where a minority of the answers (`midtrain.
        format_share`) have the common format, so the base can sample it but does not reliably produce it."""
        payload = {
            "parent": parent_key,
            "tasks": self.cfg["tasks"],
            "midtrain": self.cfg["midtrain"],
            "format": self.fmt,
            "seed": self.seed,
            "exclude": self.cfg["eval"]["exclude"],
        }
        key = self.key_of("base", payload)
        stage = Stage(self.root / "base" / key, key, payload)

        def build(tmp: Path) -> dict:
            import train

            mc = self.cfg["midtrain"]
            pc = {**mc, "model": self.cfg["model"], "seed": self.seed, "init": str(parent), "format": self.fmt}
            sampler = T.Sampler(
                self.names,
                self.cfg["tasks"],
                f"{self.seed}/midtrain",
                self.exclude,
                mc.get("weights"),
                mc.get("noise"),
                self.fmt,
                mc["format_share"],
            )
            probe_sampler = T.Sampler(self.names, self.cfg["tasks"], f"{self.seed}/probe", self.exclude)
            probes = {n: probe_sampler.task(n, pc["probe_n"]) for n in self.names}
            log(f"training the shared regime's base on a corpus with {mc['format_share']:.0%} formatted ({key})")
            model, history = train.pretrain(pc, sampler, probes, self.max_new, log)
            train.save_model(model, tmp / "base")
            return {"history": history, "parameters": train.num_parameters(model), "steps": history[-1]["step"]}

        meta, cached = stage.build(build)
        self._record("base format", meta, cached, ("parameters", "steps", "history"))
        return stage.folder / "base", key

    # -- agents -------------------------------------------------------------
    def agents(self, base: Path, base_key: str) -> dict[str, tuple[Path, str]]:
        out = {}
        for name in self.names:
            rl = {**rl_settings(self.cfg, name), "seed": seed_of(self.seed, "rl", name)}
            if self.fmt:
                rl["format"] = self.fmt
            payload = {"base": base_key, "task": name, "task_params": self.cfg["tasks"][name], "rl": rl}
            key = self.key_of("agent", payload)
            stage = Stage(self.root / "agents" / key, key, payload)

            def build(tmp: Path, name=name, rl=rl, key=key) -> dict:
                import train

                sampler = T.Sampler([name], self.cfg["tasks"], f"{self.seed}/rl/{name}", self.exclude)
                probe = T.Sampler([name], self.cfg["tasks"], f"{self.seed}/probe", self.exclude).task(
                    name, rl["probe_n"]
                )
                log(f"GRPO agent {name} ({key})")
                model, history = train.grpo(base, name, rl, sampler, self.max_new[name], probe, log)
                train.save_model(model, tmp / name)
                return {"history": history}

            meta, cached = stage.build(build)
            self._record(f"agent {name}", meta, cached, ("history",))
            out[name] = (stage.folder / name, key)
        return out

    # -- merges -------------------------------------------------------------
    def merge_rows(self, agents: dict[str, T_Agent]) -> dict[str, tuple[str, dict[str, T_Agent]]]:
        """{row: (merge name, the agents it merges)}: each of `merges` on all agents, then each of `pairs` on
        every pair of agents (row `NAME A+B`; with two agents the same merge as NAME, so the same cached folder)."""
        rows = {name: (name, agents) for name in self.cfg["merges"]}
        for a, b in itertools.combinations(agents, 2):
            for name in self.cfg.get("pairs", []):
                rows[f"{name} {a}+{b}"] = (name, {a: agents[a], b: agents[b]})
        return rows

    def merges(self, base: Path, base_key: str, agents: dict[str, T_Agent]) -> dict[str, Path]:
        """Every merge of `merge_rows`, built by `mergekit-yaml` (`jobs` at a time): {row: model folder}."""
        todo = []
        out = {}
        rows = self.merge_rows(agents)
        self.pairs = {row: (name, *merged) for row, (name, merged) in rows.items() if row not in self.cfg["merges"]}
        for row, (name, merged) in rows.items():
            spec = MERGES[name]
            payload = {
                "spec": spec.__dict__,
                "base": base_key,
                "agents": [k for _, k in merged.values()],
                "seed": self.seed,
                "mergekit": version("mergekit"),
            }
            key = self.key_of("merge", payload)
            stage = Stage(self.root / "merges" / f"{name}-{key}", key, payload)
            out[row] = stage.folder / "model"
            todo.append((row, spec, stage, merged))

        def run_one(item) -> None:
            name, spec, stage, merged = item

            def build(tmp: Path) -> dict:
                tmp.mkdir(parents=True)
                config = staging.merge_config(spec, base, [p for p, _ in merged.values()], "bfloat16")
                cfg_path = tmp / "merge.yaml"
                cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
                cmd = [
                    str(BIN / "mergekit-yaml"),
                    str(cfg_path),
                    str(tmp / "model"),
                    "--random-seed",
                    str(self.seed),
                    "--quiet",
                ]
                env = {**self.env, "OMP_NUM_THREADS": "1"} if self.cfg["jobs"] > 1 else self.env
                run_tool(cmd, tmp / "mergekit.log", env)
                if not (tmp / "model" / "tokenizer.json").exists():  # mergekit copies the base's; be sure
                    import train

                    train.save_tokenizer(tmp / "model")
                return {
                    "config": config,
                    "command": " ".join(
                        ["mergekit-yaml", "merge.yaml", "model", "--random-seed", str(self.seed), "--quiet"]
                    ),
                }

            log(f"merge {name}" + (" (cached)" if stage.done else ""))
            meta, cached = stage.build(build)
            self._record(f"merge {name}", meta, cached, ("config", "command"))

        # two rows can be one stage (a pair merge of two agents is the merge of all): built once, recorded for both
        first: dict[Path, tuple] = {}
        for item in todo:
            first.setdefault(item[2].folder, item)
        with ThreadPoolExecutor(max_workers=max(1, self.cfg["jobs"])) as pool:
            list(pool.map(run_one, first.values()))
        for item in todo:
            row = first[item[2].folder][0]
            if row != item[0]:
                self.stages[f"merge {item[0]}"] = {**self.stages[f"merge {row}"], "same_stage_as": f"merge {row}"}
        self.rows = list(out)
        return out

    def _order(self, stage: str) -> tuple[int, int]:
        kind, _, name = stage.partition(" ")
        kinds = ["base", "agent", "merge", "inspect", "eval"]
        index = self.rows.index(name) if kind == "merge" and name in self.rows else 0
        return kinds.index(kind) if kind in kinds else 9, index

    # -- density / overlap --------------------------------------------------
    def inspect(self, base: Path, base_key: str, agents: dict[str, tuple[Path, str]]) -> Path | None:
        if not self.cfg["inspect"]:
            return None
        payload = {"base": base_key, "agents": [k for _, k in agents.values()], "mergekit": version("mergekit")}
        key = self.key_of("inspect", payload)
        stage = Stage(self.root / "inspect" / key, key, payload)

        def build(tmp: Path) -> dict:
            tmp.mkdir(parents=True)
            config = staging.merge_config(MERGES["ramplus"], base, [p for p, _ in agents.values()], "bfloat16")
            (tmp / "ramplus.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            cmd = [
                str(BIN / "mergekit-ram"),
                "inspect",
                str(tmp / "ramplus.yaml"),
                "--json",
                str(tmp / "stats.json"),
                "--plot",
                str(tmp / "density.png"),
                "--quiet",
            ]
            done = run_tool(cmd, tmp / "inspect.log", self.env)
            return {
                "command": "mergekit-ram inspect ramplus.yaml --json stats.json --plot density.png --quiet",
                "table": done.stdout,
            }

        log("mergekit-ram inspect" + (" (cached)" if stage.done else ""))
        meta, cached = stage.build(build)
        self._record("inspect", meta, cached, ("command", "table"))
        return stage.folder

    # -- evaluation ---------------------------------------------------------
    def evaluate(self, models: dict[str, Path]) -> tuple[dict[str, dict[str, list[int]]], dict | None]:
        """({model: {task: 1/0 per item}}, with a format {model: {task: 1/0 per item: formatted}} else None)."""
        import evaluate as E

        ev = self.cfg["eval"]
        results = {}
        formats: dict[str, dict[str, list[int]]] = {}
        start, built, cached_n, seconds_all = time.perf_counter(), 0, 0, 0.0
        for row, folder in models.items():
            payload = {
                "model": files_digest(folder),
                "tasks": self.cfg["tasks"],
                "n": ev["n"],
                "exclude": ev["exclude"],
                "seed": self.seed,
            }
            if self.fmt:
                payload["format"] = self.fmt
            key = self.key_of("eval", payload)
            path = self.root / "evals" / f"{key}.json"
            if path.exists():
                stored = json.loads(path.read_text())
                results[row] = stored["correct"]
                if self.fmt:
                    formats[row] = stored["formatted"]
                seconds_all += stored["seconds"]
                cached_n += 1
                continue
            t0 = time.perf_counter()
            bits, fmt_bits = E.score(folder, self.eval_items, self.max_new, ev["batch"], self.fmt)
            seconds = time.perf_counter() - t0
            log(
                f"eval {row}: "
                + ", ".join(f"{t} {sum(b) / len(b):.3f}" for t, b in bits.items())
                + (
                    ", format " + ", ".join(f"{t} {sum(b) / len(b):.3f}" for t, b in fmt_bits.items())
                    if fmt_bits is not None
                    else ""
                )
                + f" ({seconds:.1f} s)"
            )
            stored = {
                "key": key,
                "payload": payload,
                "seconds": round(seconds, 2),
                "model_folder": str(folder),
                "correct": bits,
            }
            if fmt_bits is not None:
                stored["formatted"] = fmt_bits
                formats[row] = fmt_bits
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stored))
            tmp.rename(path)
            results[row] = bits
            built += 1
            seconds_all += seconds
        self.stages["eval"] = {
            "models_evaluated": built,
            "models_cached": cached_n,
            "this_run_seconds": round(time.perf_counter() - start, 2),
            "build_seconds": round(seconds_all, 2),
        }
        return results, (formats if self.fmt else None)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def git_commit() -> str | None:
    """HEAD, with `+changes` when the package or this benchmark differ from it (the run used uncommitted code)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "../../mergekit_ram", "."],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="full", help=f"one of {sorted(CONFIGS)}, or a JSON file")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. rl.lr=3e-4 (repeatable)",
    )
    ap.add_argument(
        "--root", type=Path, default=Path(os.environ.get("MERGEKIT_RAM_QUALITY_DIR", "/tmp/mergekit-ram-quality"))
    )
    ap.add_argument("--out", type=Path, help="results folder (default ROOT/results/CONFIG)")
    ap.add_argument("--stop-after", choices=["base", "agents", "merges"], help="build up to this stage only")
    args = ap.parse_args(argv)

    if args.config in CONFIGS:
        cfg, name = CONFIGS[args.config], args.config
    else:
        cfg, name = json.loads(Path(args.config).read_text()), Path(args.config).stem
    cfg = staging.apply_overrides(cfg, args.set)
    check_config(cfg)
    root = args.root.resolve()
    out = (args.out or root / "results" / name).resolve()

    import torch

    torch.set_num_threads(cfg["threads"])
    start = time.perf_counter()
    pipe = Pipeline(cfg, root)
    base, base_key = pipe.base()
    if args.stop_after == "base":
        return 0
    agents = pipe.agents(base, base_key)
    if args.stop_after == "agents":
        return 0
    if args.stop_after == "merges":
        pipe.merges(base, base_key, agents)
        return 0
    # `mergekit-ram inspect` is one more process like the merges: run it beside them
    with ThreadPoolExecutor(max_workers=1) as side:
        inspecting = side.submit(pipe.inspect, base, base_key, agents)
        merged = pipe.merges(base, base_key, agents)
        inspected = inspecting.result()
    pipe.stages = dict(sorted(pipe.stages.items(), key=lambda kv: pipe._order(kv[0])))
    models = {"base": base, **{f"{t} agent": p for t, (p, _) in agents.items()}, **merged}
    correct, formats = pipe.evaluate(models)

    import report

    out.mkdir(parents=True, exist_ok=True)
    results = report.build(cfg, pipe, correct, inspected, models, formats)
    results.update(
        {
            "config_name": name,
            "command": " ".join(["python", "benchmarks/quality/run.py", *(argv if argv is not None else sys.argv[1:])]),
            "root": str(root),
            "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": staging.machine(),
            "stages": pipe.stages,
            "runtime_s": round(time.perf_counter() - start, 1),
            # what building every stage from scratch took (cached stages: their recorded build time)
            "build_seconds_total": round(
                sum(s.get("build_seconds", 0) for s in pipe.stages.values() if "same_stage_as" not in s), 1
            ),
        }
    )
    if inspected is not None:
        shutil.copyfile(inspected / "density.png", out / "density.png")
        shutil.copyfile(inspected / "stats.json", out / "ram_stats.json")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report.markdown(results))
    report.chart(results, out / "chart.png")
    log(
        f"wrote {out}/results.json, results.md, chart.png"
        + (", density.png" if inspected else "")
        + f" in {results['runtime_s']:.0f} s"
    )
    print(report.markdown(results, short=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
