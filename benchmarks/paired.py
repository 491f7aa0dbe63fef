"""Paired bootstrap intervals of the quality and policies benchmarks: accuracies, their standard errors, intervals
over fixed evaluation items, and the chart panel of each merge's retained share.

Every model is scored on the same fixed items of every task, so models can be compared item by item: the intervals
come from a paired bootstrap over the items (each task's items resampled with replacement, the same draw for every
model), percentile 95 % intervals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


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


def retained_bars(ax, models: Mapping[str, dict], merges: Sequence[str], xlabel: str) -> None:
    """Each merge's mean retained share (%) with its 95 % interval, `ramplus` in red, on matplotlib axes `ax`. A
    point outside its percentile interval draws no bar on that side (matplotlib refuses a negative one)."""
    shares = [100 * models[m]["retained_mean"]["share"] for m in merges]
    cis = [models[m]["retained_mean"]["ci"] for m in merges]
    err = [
        [0 if c[0] is None else max(0.0, s - 100 * c[0]) for s, c in zip(shares, cis, strict=True)],
        [0 if c[1] is None else max(0.0, 100 * c[1] - s) for s, c in zip(shares, cis, strict=True)],
    ]
    colors = ["tab:red" if models[m]["method"] == "ramplus" else "tab:gray" for m in merges]
    ax.barh(range(len(merges)), shares, xerr=err, color=colors, capsize=3)
    ax.set_yticks(range(len(merges)), [models[m]["label"] for m in merges], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8, ls="--")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel(xlabel)
