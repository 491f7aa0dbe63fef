"""The screens that chose the regime run's settings: a multi-task base's checkpoints, and fine-tunings from it.

    python benchmarks/policies/screen.py base --name b4 --tasks reach-v3 reach-wall-v3 coffee-button-v3 \
        button-press-v3 --steps 100000 --every 10000 --work /tmp/pol/screen
    python benchmarks/policies/screen.py finetune --name ft --base /tmp/pol/screen/b4/ckpt-60000.zip \
        --tasks reach-v3 reach-wall-v3 coffee-button-v3 button-press-v3 --task reach-v3 --lr 1e-4 \
        --steps 10000 --every 2500 --work /tmp/pol/screen

Every checkpoint is evaluated on held-out variations (`rl.TUNING_SEED`: never the evaluation's episodes), its
deterministic actor, `--episodes` per task; a fine-tuning's also by ‖τ‖/‖θ_base‖ of its actor. Each screen writes
one JSON (its arguments, seeds, curve, timings, `uptime`) to benchmarks/policies/results/regime/screen/ (`--record`),
the checkpoints themselves to `--work`. The screens' seeds are fixed (`--seed`), so each reruns as it ran.
The headroom run's screens (issue 51) are in results/headroom/screen/; its base is a base screen's checkpoint,
taken into the stage cache as the configuration's base stage (not trained again):

    python benchmarks/policies/screen.py adopt --name base4-again --config headroom --root /work/pol-headroom/root \
        --record benchmarks/policies/results/headroom/screen
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the quality benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import rl  # noqa: E402
from run import SAC  # noqa: E402
from staging import log  # noqa: E402

RECORD = HERE / "results" / "regime" / "screen"


def _plain(v):
    """An argument as JSON: paths as their text."""
    return [_plain(x) for x in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v


def _uptime() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def update_ratio(base: dict[str, np.ndarray], agent: dict[str, np.ndarray]) -> float:
    """‖τ‖ / ‖θ_base‖ over all of the actor's tensors (τ = agent - base)."""
    tau = np.sqrt(sum(float(np.sum((agent[k] - base[k]) ** 2)) for k in base))
    return tau / np.sqrt(sum(float(np.sum(v**2)) for v in base.values()))


class Checkpoints:
    """Every `every` steps: save the model (`ckpt-STEP.zip`), evaluate its deterministic actor on held-out
    variations of `eval_tasks`, and append a row to `rows` (with ‖τ‖/‖θ_base‖ when `base` is given)."""

    def __init__(self, work: Path, every: int, eval_tasks, tasks, episodes: int, horizon: int, base=None, on_row=None):
        from stable_baselines3.common.callbacks import BaseCallback

        outer = self
        self.rows: list[dict] = []
        self.start = time.perf_counter()

        class _CB(BaseCallback):
            def _on_step(self) -> bool:
                if self.num_timesteps % every == 0:
                    outer.checkpoint(self.model, self.num_timesteps)
                return True

        self.callback = _CB()
        self.work, self.eval_tasks, self.tasks = work, list(eval_tasks), list(tasks)
        self.episodes, self.horizon, self.base = episodes, horizon, base
        self.on_row = on_row or (lambda row: None)

    def checkpoint(self, model, step: int) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        if step:
            model.save(self.work / f"ckpt-{step}.zip")
        rl.export_actor(model, self.work / f"actor-{step}.safetensors")
        actor = rl.load_actor(self.work / f"actor-{step}.safetensors")
        t0 = time.perf_counter()
        success = {
            t: rl.evaluate(actor, t, self.tasks, self.episodes, self.horizon, 0, rl.TUNING_SEED)
            for t in self.eval_tasks
        }
        row = {
            "steps": step,
            "success": {t: sum(x) / len(x) for t, x in success.items()},
            "eval_seconds": round(time.perf_counter() - t0, 1),
            "elapsed": round(time.perf_counter() - self.start, 1),
            "load": _uptime(),
        }
        if self.base is not None:
            row["update_ratio"] = round(update_ratio(self.base, actor), 4)
        log(json.dumps(row))
        self.rows.append(row)
        self.on_row(row)
        return row


def adopt(args) -> int:
    """A base screen's checkpoint at step `base.stop_at` as the configuration's base stage under `--root` (what
    the pipeline would train: the same run, stopped there; tests/test_policies.py checks the bytes), so the
    pipeline does not train it again. The screen's JSON (`--record/--name.json`) must be of that run."""
    import copy
    import shutil

    import run

    record = json.loads((args.record / f"{args.name}.json").read_text())
    cfg = copy.deepcopy(run.CONFIGS[args.config])
    base = cfg["base"]
    ran = record["args"]
    want = {
        "kind": "base",
        "tasks": cfg.get("base_tasks", cfg["tasks"]),
        "steps": base["steps"],
        "seed": base["seed"],
        "horizon": cfg["horizon"],
        "lr": base["lr"],
        "train_freq": base["train_freq"],
    }
    got = {"kind": record["kind"], **{k: ran[k] for k in want if k != "kind"}}
    if got != want:
        raise SystemExit(f"screen {args.name} is not {args.config}'s base run: {got} != {want}")
    step = base["stop_at"]
    row = next((r for r in record["rows"] if r.get("steps") == step), None)
    folder = Path(ran["work"]) / args.name
    if row is None or not (folder / f"ckpt-{step}.zip").exists():
        raise SystemExit(f"screen {args.name} has no checkpoint at step {step} in {folder}")
    stage = run.Pipeline(cfg, args.root.resolve(), 0).base_stage()
    if stage.done:
        log(f"{stage.folder} exists")
        return 0
    shutil.rmtree(stage.tmp, ignore_errors=True)
    stage.tmp.mkdir(parents=True)
    shutil.copyfile(folder / f"ckpt-{step}.zip", stage.tmp / "sac.zip")
    shutil.copyfile(folder / f"actor-{step}.safetensors", stage.tmp / "actor.safetensors")
    stage.finish(row["elapsed"], {"steps": base["steps"], "stop_at": step, "screen": args.name, "screen_row": row})
    log(f"{args.name}'s checkpoint at {step} steps is {args.config}'s base: {stage.folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["base", "finetune", "evaluate", "adopt"])
    ap.add_argument("--actors", nargs="+", type=Path, help="evaluate: actor files (e.g. a base screen's checkpoints)")
    ap.add_argument("--name", required=True, help="the screen's name (its JSON: NAME.json)")
    ap.add_argument("--tasks", nargs="+", help="the one-hot layout (the base's tasks)")
    ap.add_argument("--task", nargs="+", help="finetune: the task(s) trained on")
    ap.add_argument("--base", type=Path, help="finetune: the base's SAC zip")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--every", type=int)
    ap.add_argument("--lr", type=float, default=SAC["lr"])
    ap.add_argument("--train-freq", type=int, default=1)
    ap.add_argument("--gradient-steps", type=int, default=1, help="gradient steps per training round (SAC's UTD)")
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--horizon", type=int, default=500)
    ap.add_argument("--episodes", type=int, default=10, help="held-out variations per task and checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, help="checkpoints go to WORK/NAME")
    ap.add_argument("--record", type=Path, default=RECORD)
    ap.add_argument("--config", help="adopt: the configuration whose base the checkpoint is (e.g. headroom)")
    ap.add_argument("--root", type=Path, help="adopt: the configuration's stage cache (run.py --root)")
    args = ap.parse_args(argv)
    if args.kind == "adopt":
        if not (args.config and args.root):
            raise SystemExit("adopt needs --config and --root")
        return adopt(args)
    if args.kind == "evaluate" and not (args.tasks and args.actors):
        raise SystemExit("evaluate needs --tasks and --actors")
    if args.kind != "evaluate" and (not args.tasks or args.steps is None or args.every is None or args.work is None):
        raise SystemExit(f"{args.kind} needs --tasks, --steps, --every and --work")

    import torch

    torch.set_num_threads(1)
    work = args.work / args.name if args.work else None
    settings = {**SAC, "lr": args.lr, "train_freq": args.train_freq, "gradient_steps": args.gradient_steps}
    settings.update(steps=args.steps, log_every=args.every)
    start = time.perf_counter()
    record = {
        "kind": args.kind,
        "args": {k: _plain(v) for k, v in vars(args).items() if k != "record"},
        "settings": settings,
        "rows": [],
        "pid": os.getpid(),
    }
    args.record.mkdir(parents=True, exist_ok=True)

    def save(row: dict) -> None:  # after every checkpoint: a screen stopped by hand keeps what it measured
        record.update(seconds=round(time.perf_counter() - start, 1), load_at_end=_uptime())
        (args.record / f"{args.name}.json").write_text(json.dumps(record, indent=1))

    if args.kind == "evaluate":  # existing actors, more held-out episodes than their screen gave them
        for path in args.actors or []:
            t0 = time.perf_counter()
            actor = rl.load_actor(path)
            success = {t: rl.evaluate(actor, t, args.tasks, args.episodes, args.horizon, 0, rl.TUNING_SEED)
                       for t in args.tasks}  # fmt: skip
            row = {"actor": path.name, "success": {t: sum(x) / len(x) for t, x in success.items()}}
            row.update(eval_seconds=round(time.perf_counter() - t0, 1), load=_uptime())
            log(json.dumps(row))
            record["rows"].append(row)
            save(row)
        return 0
    if args.kind == "base":
        ck = Checkpoints(work, args.every, args.tasks, args.tasks, args.episodes, args.horizon, on_row=save)
        record["rows"] = ck.rows
        rl.train_base(work, args.tasks, settings, args.horizon, args.seed, log, [ck.callback])
    else:
        if not args.base or not args.task:
            raise SystemExit("finetune needs --base and --task")
        from stable_baselines3 import SAC as SB3SAC

        base_model = SB3SAC.load(args.base, device="cpu")
        base = {k: v.detach().numpy().copy() for k, v in base_model.policy.actor.state_dict().items()}
        del base_model
        ck = Checkpoints(work, args.every, args.task, args.tasks, args.episodes, args.horizon, base, on_row=save)
        record["rows"] = ck.rows
        record["settings"] = settings = {**settings, "warmup": args.warmup, "fresh_optimizer": True}
        task = args.task[0] if len(args.task) == 1 else args.task
        rl.finetune(work, args.base, task, args.tasks, settings, args.horizon, args.seed, log, [ck.callback])
    save({})
    return 0


if __name__ == "__main__":
    sys.exit(main())
