"""Evaluation of the quality benchmark: greedy exact match per item, standard errors, and bootstrap intervals.

Every model is scored on the same fixed eval items of every task (`tasks.eval_set`), so models can be compared
item by item: the intervals below come from a paired bootstrap over eval items (items of each task resampled
with replacement, the same draw for every model), percentile 95 % intervals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def score(
    folder,
    items: Mapping[str, Sequence[tuple[str, str]]],
    max_new: Mapping[str, int],
    batch_size: int = 512,
    fmt: dict | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
    """({task: [1/0 per eval item]}, with `fmt` {task: [1/0: the answer follows the format]} else None) of the
    model stored in `folder` (greedy decoding; with `fmt` the answer's content is scored, whatever its format)."""
    import train

    model = train.load_model(folder)
    scored = {name: train.score(model, its, max_new[name], batch_size, fmt) for name, its in items.items()}
    right = {name: r for name, (r, _) in scored.items()}
    return right, ({name: f for name, (_, f) in scored.items()} if fmt else None)  # type: ignore[misc]


def summary(bits: Sequence[int]) -> dict:
    """Accuracy, its binomial standard error sqrt(p(1-p)/n), and n."""
    n = len(bits)
    p = sum(bits) / n
    return {"acc": p, "se": math.sqrt(p * (1 - p) / n), "n": n}


class Bootstrap:
    """Paired bootstrap replicates of every model's accuracy per task.

    `correct`: {model: {task: 0/1 array}} with the same items (in the same order) for every model.
    `reps[model][task]` is a (B,) array of resampled accuracies, one per replicate, the same resample of
    items for every model.
    """

    def __init__(
        self,
        correct: Mapping[str, Mapping[str, Sequence[int]]],
        tasks: Sequence[str],
        replicates: int = 2000,
        seed: int = 0,
    ):
        rng = np.random.default_rng(seed)
        self.tasks = list(tasks)
        self.reps: dict[str, dict[str, np.ndarray]] = {m: {} for m in correct}
        for t in self.tasks:
            n = len(next(iter(correct.values()))[t])
            idx = rng.integers(0, n, size=(replicates, n))
            for m, per_task in correct.items():
                arr = np.asarray(per_task[t], dtype=np.float32)
                if len(arr) != n:
                    raise ValueError(f"{m} has {len(arr)} items for {t}, others {n}")
                self.reps[m][t] = arr[idx].mean(axis=1)

    @staticmethod
    def interval(samples: np.ndarray) -> tuple[float, float]:
        finite = samples[np.isfinite(samples)]
        if len(finite) < 0.9 * len(samples):
            return math.nan, math.nan
        lo, hi = np.percentile(finite, [2.5, 97.5])
        return float(lo), float(hi)

    def mean(self, model: str) -> np.ndarray:
        return np.mean([self.reps[model][t] for t in self.tasks], axis=0)

    def gain(self, model: str, base: str, task: str) -> np.ndarray:
        return self.reps[model][task] - self.reps[base][task]

    def retained(self, model: str, base: str, specialists: Mapping[str, str], task: str) -> np.ndarray:
        """(model - base) / (specialist - base) on `task`, per replicate (inf/nan where the gain is 0)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.gain(model, base, task) / self.gain(specialists[task], base, task)


def retained_share(merged: float, base: float, specialist: float) -> float:
    """(merged - base) / (specialist - base) on one task, NaN where the specialist gained nothing."""
    gain = specialist - base
    return (merged - base) / gain if gain > 0 else math.nan
