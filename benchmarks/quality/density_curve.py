"""Density of an agent's bf16 task vector against its gain, along one GRPO run (a tuning aid).

    python benchmarks/quality/density_curve.py BASE_FOLDER TASK --lr 3e-6 --steps 300 --every 50 \
        --task-params '{"digits": 2}'

At every probe it prints the share of weights whose bf16 value differs from the base's (|delta| > 1e-5, what
`mergekit-ram inspect` counts) beside the greedy probe accuracy. With Adam every weight that gets any gradient
moves by about the learning rate per step, so the density grows with lr x sqrt(steps) (noise) while the gain
grows with lr x steps (signal): the trade-off the benchmark's RL settings are chosen on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks as T
import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("task", choices=sorted(T.TASKS))
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--task-params", default="{}", help="JSON, e.g. '{\"digits\": 2}'")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = {k: v.detach().to(torch.bfloat16) for k, v in train.load_model(args.base).state_dict().items()}
    params = {args.task: T.params(args.task, json.loads(args.task_params))}
    sampler = T.Sampler([args.task], params, f"curve/{args.seed}", set())
    probe = T.Sampler([args.task], params, "curve/probe", set()).task(args.task, 200)

    def density(model) -> float:
        changed = total = 0
        for k, v in model.state_dict().items():
            changed += int(((v.detach().to(torch.bfloat16).float() - base[k].float()).abs() > 1e-5).sum())
            total += v.numel()
        return changed / total

    max_new = T.max_new_tokens(args.task, params[args.task])
    base_acc = sum(train.accuracy(train.load_model(args.base), probe, max_new)) / len(probe)
    print(f"base greedy probe {base_acc:.3f}")
    cfg = {
        "seed": args.seed,
        "steps": args.steps,
        "prompts": args.prompts,
        "group": args.group,
        "lr": args.lr,
        "temperature": 1.0,
        "partial": 0.0,
        "kl": 0.0,
        "probe_every": args.every,
    }
    train.grpo(
        args.base,
        args.task,
        cfg,
        sampler,
        max_new,
        probe,
        print,
        on_probe=lambda model, step: print(f"  bf16 density {density(model):.3f}", flush=True),
    )


if __name__ == "__main__":
    main()
