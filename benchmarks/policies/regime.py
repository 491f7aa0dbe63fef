"""The regime run's measurements: where the agents stand against the methods' assumption (small updates around one
base), and the verdict's statistics at the level of training seeds.

- `statistics`: per agent ‖τ‖/‖θ_base‖, density, unique and shared entries, and the same in the task-ID (one-hot)
  columns of the first layer, plus the inputs no agent changed;
- `hierarchical`: a two-stage bootstrap, training seeds then episodes within each drawn seed (each task's episodes
  resampled alike for every policy: paired), of any per-seed statistic; IQM, probability of improvement and the
  mean difference are computed on it, so their intervals cover the seeds' spread and the evaluation's noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

#: a weight counts as changed when |τ| exceeds this (mergekit-ram inspect's and RAM's default ε)
EPSILON = 1e-5
#: Meta-World's observation before the one-hot task id
N_OBS = 39


def mean_outcomes(draws: Sequence[Sequence[float]]) -> list[float]:
    """Per episode, the mean over several files' outcomes (DARE's mask draws); one file: its outcomes."""
    if len(draws) == 1:
        return list(draws[0])
    return [float(x) for x in np.mean(np.asarray(draws, dtype=float), axis=0)]


def statistics(base: Path, agents: Mapping[str, Path], layout: Sequence[str], eps: float = EPSILON) -> dict:
    """Where each agent stands: {"agents": {task: {...}}, "unchanged_inputs": [...], "base_norm": ...}."""
    import rl

    b = rl.load_actor(base)
    taus = {t: {k: v - b[k] for k, v in rl.load_actor(p).items()} for t, p in agents.items()}
    changed = {t: {k: np.abs(v) > eps for k, v in tau.items()} for t, tau in taus.items()}
    count = {k: sum(changed[t][k].astype(np.int32) for t in taus) for k in b}
    base_norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in b.values()))
    numel = sum(v.size for v in b.values())
    first = "latent_pi.0.weight"
    onehot = {task: N_OBS + j for j, task in enumerate(layout)}
    out = {}
    for t, tau in taus.items():
        mine = changed[t]
        n_changed = sum(int(m.sum()) for m in mine.values())
        by_others = {k: count[k] - mine[k] for k in b}
        unique = sum(int((mine[k] & (by_others[k] == 0)).sum()) for k in b)
        one = sum(int((mine[k] & (by_others[k] == 1)).sum()) for k in b)
        norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in tau.values()))
        own = onehot[t]
        columns = {}
        for task, c in onehot.items():
            col = mine[first][:, c]
            columns[task] = {
                "changed": int(col.sum()),
                "unique": int((col & (by_others[first][:, c] == 0)).sum()),
                "abs_sum": float(np.abs(tau[first][:, c]).sum()),
            }
        out[t] = {
            "update_ratio": norm / base_norm,
            "tau_norm": norm,
            "density": n_changed / numel,
            "unique_share": unique / n_changed if n_changed else None,
            "shared_with_1_share": one / n_changed if n_changed else None,
            "shared_with_2plus_share": (n_changed - unique - one) / n_changed if n_changed else None,
            "own_column": {**columns[t], "index": own, "rows": int(b[first].shape[0])},
            "other_columns_changed": sum(v["changed"] for task, v in columns.items() if task != t),
            "columns": columns,
        }
    unchanged = [int(i) for i in np.flatnonzero(count[first].sum(axis=0) == 0)]
    return {"agents": out, "base_norm": base_norm, "numel": numel, "epsilon": eps, "unchanged_inputs": unchanged}


# --------------------------------------------------------------------------- #
# Seed-level statistics
# --------------------------------------------------------------------------- #
def episode_replicates(outcomes: Mapping[str, Sequence[float]], tasks: Sequence[str], reps: int, rng) -> np.ndarray:
    """(reps,) bootstrap replicates of the mean over tasks of one seed's success rates, each task's episodes
    resampled. `rng` is shared so that two policies of a seed get the same resamples (paired) when the caller
    draws them from generators in the same state."""
    out = np.zeros(reps)
    for t in tasks:
        x = np.asarray(outcomes[t], dtype=float)
        idx = rng.integers(0, len(x), size=(reps, len(x)))
        out += x[idx].mean(axis=1)
    return out / len(tasks)


def per_seed_replicates(runs: Sequence[Mapping], row: str, tasks: Sequence[str], reps: int, seed: int = 0):
    """(seeds, reps): each seed's episode-bootstrap replicates of `row`'s mean success. The generator of seed i
    starts from (seed, i) for every row, so rows are resampled on the same episodes (paired)."""
    return np.stack(
        [
            episode_replicates(run["success"][row], tasks, reps, np.random.default_rng([seed, i]))
            for i, run in enumerate(runs)
        ]
    )


def hierarchical(per_seed: np.ndarray, stat, reps: int, seed: int = 1) -> np.ndarray:
    """Replicates of `stat` (a function of a (seeds,) vector) under a two-stage bootstrap: the seeds drawn with
    replacement, then for each drawn seed one of its episode-bootstrap replicates (`per_seed`: (seeds, B))."""
    rng = np.random.default_rng(seed)
    n, b = per_seed.shape
    s_idx = rng.integers(0, n, size=(reps, n))
    e_idx = rng.integers(0, b, size=(reps, n))
    draws = per_seed[s_idx, e_idx]
    return np.array([stat(d) for d in draws])


def gain_replicates(runs: Sequence[Mapping], rows: Sequence[str], task: str, reps: int, seed: int = 0) -> dict:
    """{row: (seeds, reps)}: each seed's episode-bootstrap replicates of `row`'s success on `task`, every row
    resampled on the same episodes (one generator per seed and task, its indices shared by the rows: paired), so a
    difference of rows (a gain) and a ratio of differences are paired too."""
    out: dict[str, list] = {row: [] for row in rows}
    for i, run in enumerate(runs):
        n = len(run["success"][rows[0]][task])
        idx = np.random.default_rng([seed, i, sum(map(ord, task))]).integers(0, n, size=(reps, n))
        for row in rows:
            out[row].append(np.asarray(run["success"][row][task], dtype=float)[idx].mean(axis=1))
    return {row: np.stack(v) for row, v in out.items()}


def kept_share(runs: Sequence[Mapping], row: str, tasks: Sequence[str], reps: int, seed: int = 1) -> dict:
    """The share of each specialist's gain on its own task that `row` keeps (the paper's measure):
    (row - base) / (specialist - base) on task t, per seed and as the ratio of the gains' means over the seeds, with
    a two-stage bootstrap interval of that ratio (seeds drawn, then each drawn seed's episodes, the same draws for
    base, specialist and `row`); "mean" averages the tasks' ratios on the same draws. A seed whose specialist did
    not gain has no per-seed share (None), and a draw whose gains sum to ≤ 0 no ratio (counted, left out)."""
    rng = np.random.default_rng(seed)
    n = len(runs)
    s_idx = rng.integers(0, n, size=(reps, n))
    e_idx = rng.integers(0, reps, size=(reps, n))
    out: dict = {"tasks": {}}
    draws = []
    for t in tasks:
        rate = {r: [float(np.mean(run["success"][r][t])) for run in runs] for r in ("base", f"{t} agent", row)}
        num = np.subtract(rate[row], rate["base"])
        den = np.subtract(rate[f"{t} agent"], rate["base"])
        per_seed = [float(a / b) if b > 0 else None for a, b in zip(num, den, strict=True)]
        boot = gain_replicates(runs, ["base", f"{t} agent", row], t, reps)
        n_b = (boot[row] - boot["base"])[s_idx, e_idx].sum(axis=1)
        d_b = (boot[f"{t} agent"] - boot["base"])[s_idx, e_idx].sum(axis=1)
        # a gain is a sum of multiples of 1/episodes: below 1e-9 it is 0 and its floating-point rest (a draw of a
        # seed that gained and one that lost as much gave ratios of 1e18)
        gained = d_b > 1e-9
        ratio = np.where(gained, n_b / np.where(gained, d_b, 1.0), np.nan)
        draws.append(ratio)
        valid = [x for x in per_seed if x is not None]
        out["tasks"][t] = {
            "kept": float(num.sum() / den.sum()) if den.sum() > 0 else None,
            # no gain to keep (the specialists' mean gain ≤ 0): no ratio, and no interval
            "ci": list(interval(ratio[np.isfinite(ratio)])) if den.sum() > 0 and np.isfinite(ratio).any() else None,
            "per_seed": per_seed,
            "mean_per_seed": float(np.mean(valid)) if valid else None,
            "undefined_draws": int((~np.isfinite(ratio)).sum()),
        }
    kept = [v["kept"] for v in out["tasks"].values()]
    both = np.mean(np.stack(draws), axis=0)
    out["mean"] = float(np.mean(kept)) if all(k is not None for k in kept) else None
    defined = out["mean"] is not None and np.isfinite(both).any()
    out["mean_ci"] = list(interval(both[np.isfinite(both)])) if defined else None
    return out


def iqm(x: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle half (scipy's trim_mean at 25 %)."""
    from scipy import stats

    return float(stats.trim_mean(np.asarray(x, dtype=float), 0.25))


def improvement(d: np.ndarray) -> float:
    """Probability of improvement over seeds: the share of seeds where the difference is > 0 (= 0 counts half)."""
    d = np.asarray(d, dtype=float)
    return float(np.mean((d > 0) + 0.5 * (d == 0)))


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def detectable(diffs: Sequence[float], power: float = 0.8, level: float = 0.95) -> float | None:
    """The smallest mean difference a paired t-test over these seeds would detect with `power` at the observed
    spread: (t_{1-α/2} + t_{power}) · sd / √n (None under 3 seeds)."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    if len(d) < 3:
        return None
    df = len(d) - 1
    return float((stats.t.ppf(0.5 + level / 2, df) + stats.t.ppf(power, df)) * d.std(ddof=1) / math.sqrt(len(d)))
