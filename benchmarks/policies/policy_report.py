"""The policies benchmark's report: results.json, results.md (the paper's Table 1 form), chart.png, density pictures.

Every policy is evaluated on the same episodes (task variation and reset seed per episode index) of every task, for
each training seed; the intervals are 95 % percentile intervals of a paired bootstrap over those episodes, the
seeds' episodes pooled (`benchmarks/paired.py`'s `Bootstrap`, as the quality benchmark's). They cover the
evaluation's noise, not the training seeds' spread, which the per-seed table shows.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the quality benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import paired  # noqa: E402
from staging import AGENT_STATS, MERGES  # noqa: E402


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 6)


def _input_paths(stats: dict) -> dict:
    """label -> input path: ram_stats.json format 4 names agents by label, its inputs table maps each to its
    path (before format 4, agents were named by path: no table, so the lookups fall back to the path)."""
    return {label: row["model"] for label, row in stats.get("inputs", {}).items()}


def _label(row: str) -> str:
    if row.endswith(" (bf16)"):
        return MERGES[row[: -len(" (bf16)")]].label + ", bf16 inputs"
    return MERGES[row].label if row in MERGES else row


def build(cfg: dict, runs: list[dict], machine: dict, commit: str | None, config_name: str, seconds: float) -> dict:
    tasks = list(cfg["tasks"])
    specialists = {t: f"{t} agent" for t in tasks}
    rows = list(runs[0]["success"])
    # the seeds' episodes pooled: item i of a task is (seed, episode), the same for every policy
    correct = {row: {t: [x for run in runs for x in run["success"][row][t]] for t in tasks} for row in rows}
    bs = paired.Bootstrap(correct, tasks, cfg["eval"]["bootstrap"], seed=0)
    rate = {row: {t: paired.summary(correct[row][t]) for t in tasks} for row in rows}

    gains = {}
    for t in tasks:
        b, s = rate["base"][t]["acc"], rate[specialists[t]][t]["acc"]
        lo, hi = bs.interval(bs.gain(specialists[t], "base", t))
        per_seed = [_seed_rate(run, specialists[t], t) - _seed_rate(run, "base", t) for run in runs]
        gains[t] = {
            "base": _num(b),
            "specialist": _num(s),
            "gain": _num(s - b),
            "gain_ci": [_num(lo), _num(hi)],
            "per_seed": [_num(g) for g in per_seed],
            "significant": bool(lo > 0),
            "meets_bar_20_points": bool(s - b >= 0.20),
        }
    valid = [t for t in tasks if gains[t]["significant"]]

    models = {}
    for row in rows:
        kind = "base" if row == "base" else "specialist" if row in specialists.values() else "merge"
        entry: dict = {
            "kind": kind,
            "label": _label(row),
            "success": {t: {k: _num(v) if k != "n" else v for k, v in rate[row][t].items()} for t in tasks},
            "mean": _num(np.mean([rate[row][t]["acc"] for t in tasks])),
            "mean_ci": [_num(x) for x in bs.interval(bs.mean(row))],
            "per_seed_mean": [_num(np.mean([_seed_rate(run, row, t) for t in tasks])) for run in runs],
            "per_seed_success": [{t: _num(_seed_rate(run, row, t)) for t in tasks} for run in runs],
        }
        if kind == "merge":
            spec = MERGES[row.removesuffix(" (bf16)")]
            entry.update(method=spec.method, shared_parameters=spec.shared, per_model_parameters=spec.per_model)
            retained = {}
            for t in valid:
                point = paired.retained_share(
                    rate[row][t]["acc"], rate["base"][t]["acc"], rate[specialists[t]][t]["acc"]
                )
                lo, hi = bs.interval(bs.retained(row, "base", specialists, t))
                retained[t] = {"share": _num(point), "ci": [_num(lo), _num(hi)]}
            entry["retained"] = retained
            # each seed's own share (its base and specialists), averaged over the tasks its specialist improved
            entry["per_seed_retained"] = [_num(_seed_retained(run, row, specialists, valid)) for run in runs]
            if valid:
                point = float(np.mean([retained[t]["share"] for t in valid]))
                lo, hi = bs.interval(np.mean([bs.retained(row, "base", specialists, t) for t in valid], axis=0))
                entry["retained_mean"] = {"share": _num(point), "ci": [_num(lo), _num(hi)], "over_tasks": valid}
                own = [x for x in entry["per_seed_retained"] if x is not None]
                seed_ci = seed_interval(own) if len(own) == len(runs) else None
                entry["retained_mean"]["seed_ci"] = None if seed_ci is None else [_num(x) for x in seed_ci]
        models[row] = entry

    comparisons = {}
    if "ramplus" in models:
        for m in (r for r in rows if models[r]["kind"] == "merge" and r != "ramplus"):
            lo, hi = bs.interval(bs.mean("ramplus") - bs.mean(m))
            d = models["ramplus"]["mean"] - models[m]["mean"]
            verdict = "ramplus better" if lo > 0 else "ramplus worse" if hi < 0 else "no significant difference"
            ours, theirs = models["ramplus"]["per_seed_mean"], models[m]["per_seed_mean"]
            per_seed = [a - b for a, b in zip(ours, theirs, strict=True)]
            seed_ci = seed_interval(per_seed)
            comparisons[m] = {
                "mean_diff": _num(d),
                "ci": [_num(lo), _num(hi)],
                "verdict": verdict,
                "per_seed": [_num(x) for x in per_seed],
                "seed_ci": None if seed_ci is None else [_num(x) for x in seed_ci],
            }

    density = {}
    for run in runs:
        per_dtype = {}
        for dtype, stats in run["stats"].items():
            by_path = {str(Path(run["files"][specialists[t]])): t for t in tasks}
            by_path.update({str(Path(stats["_folder"]).parent / "x"): None})  # placeholder, never matched
            agents = {}
            paths = _input_paths(stats)
            for a in stats["agents"]:
                path = paths.get(a.get("label"), a.get("model", "")).split("@")[0]
                task = by_path.get(path) or next((t for t in tasks if Path(path).stem == t), path)
                agents[task] = {k: _num(a.get(k)) if isinstance(a.get(k), float) else a.get(k) for k in AGENT_STATS}
            pairs = []
            for p in stats.get("pairs", []):
                names = [by_path.get(m) or Path(m).stem for m in (paths.get(a, a).split("@")[0] for a in p["agents"])]
                pairs.append({"agents": names, **{k: _num(p.get(k)) for k in ("same_sign_share", "cosine")}})
            per_dtype[dtype] = {"agents": agents, "pairs": pairs}
        density[str(run["seed"])] = per_dtype

    return {
        "config_name": config_name,
        "config": cfg,
        "tasks": tasks,
        "seeds": [run["seed"] for run in runs],
        "eval": {
            "episodes_per_seed": {t: len(runs[0]["success"]["base"][t]) for t in tasks},
            "success": "Meta-World info['success'] at any step (the episode stops there), deterministic actor",
            "episode": f"at most {cfg['horizon']} steps; episode i: variation i mod 50, reset seed eval.seed + i",
            "bootstrap_replicates": cfg["eval"]["bootstrap"],
            "intervals": "95 % percentile intervals of a paired bootstrap over episodes, training seeds pooled",
        },
        "models": models,
        "gains": gains,
        "ramplus_vs": comparisons,
        "density": density,
        "stages": {str(run["seed"]): run["stages"] for run in runs},
        "seconds": round(seconds, 1),
        "machine": machine,
        "git_commit": commit,
        "_runs": runs,
    }


def seed_interval(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student-t interval of the mean over training seeds (each seed one observation; None under 3 seeds).

    The bootstrap's intervals resample episodes, so they cover the evaluation's noise only; this one treats the
    seeds as the sample, so it covers the training seeds' spread (with few seeds, a wide interval)."""
    if len(xs) < 3:
        return None
    from scipy import stats

    a = np.asarray(xs, dtype=float)
    half = stats.t.ppf(0.5 + level / 2, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return float(a.mean() - half), float(a.mean() + half)


def _seed_retained(run: dict, row: str, specialists: dict[str, str], tasks: list[str]) -> float | None:
    shares = [
        paired.retained_share(_seed_rate(run, row, t), _seed_rate(run, "base", t), _seed_rate(run, specialists[t], t))
        for t in tasks
    ]
    shares = [x for x in shares if math.isfinite(x)]
    return float(np.mean(shares)) if shares else None


def _seed_rate(run: dict, row: str, task: str) -> float:
    xs = run["success"][row][task]
    return sum(xs) / len(xs)


def _pct(x, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def _ci(ci, digits: int = 0) -> str:
    return "" if ci is None or None in ci else f"[{100 * ci[0]:.{digits}f}, {100 * ci[1]:.{digits}f}]"


def table(res: dict) -> list[str]:
    tasks = res["tasks"]
    head = ["model", *tasks, "mean [95% CI]", "per seed", "share of specialists' gains kept [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in res["models"].values():
        cells = [m["label"], *(_pct(m["success"][t]["acc"]) for t in tasks)]
        cells.append(f"{_pct(m['mean'])} {_ci(m['mean_ci'], 1)}")
        cells.append(" / ".join(_pct(x) for x in m["per_seed_mean"]))
        rm = m.get("retained_mean")
        cells.append(f"{_pct(rm['share'], 0)} % {_ci(rm['ci'])}" if rm else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def seed_table(res: dict) -> list[str]:
    """Each training seed alone: success per task, mean, and the share of that seed's specialists' gains kept."""
    seeds, tasks = res["seeds"], res["tasks"]
    lines = [f"Per training seed (success %, {' / '.join(tasks)}; mean; share of that seed's gains kept):", ""]
    head = ["model", *(f"seed {s}" for s in seeds), "share kept: seeds' mean [t, 95 %]"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in res["models"].values():
        cells = []
        for i, rates in enumerate(m["per_seed_success"]):
            cell = " / ".join(f"{100 * rates[t]:.0f}" for t in tasks) + f"; {_pct(m['per_seed_mean'][i])}"
            share = m.get("per_seed_retained", [None] * len(seeds))[i]
            cells.append(cell + ("" if share is None else f"; {100 * share:.0f} %"))
        own = [x for x in m.get("per_seed_retained", []) if x is not None]
        ci = (m.get("retained_mean") or {}).get("seed_ci")
        cells.append(f"{100 * np.mean(own):.0f} % {_ci(ci)}".rstrip() if own else "—")
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    return lines


def density_table(res: dict) -> list[str]:
    head = ["seed", "agent", "dtype", "changed weights", "unique", "shared with 1", "shared with ≥ 2", "ρ", "λ"]
    head += ["Σ|τ| in unique entries", "one-step changes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed, per_dtype in res["density"].items():
        for task in res["tasks"]:
            for dtype, d in per_dtype.items():
                a = d["agents"].get(task)
                if not a:
                    continue
                rho = a["rho_counted"]
                cells = [seed, task, dtype, f"{_pct(a['density'])} %", f"{_pct(a['unique_share'])} %"]
                cells += [f"{_pct(a['shared_with_1_share'])} %", f"{_pct(a['shared_with_2plus_share'])} %"]
                cells += ["∞" if rho is None else f"{rho:.3f}", f"{a['lambda']:.4f}" if a["lambda"] else "—"]
                cells += [f"{_pct(a.get('magnitude_unique_share'))} %", f"{_pct(a.get('single_step_share'))} %"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(res: dict) -> str:
    tasks = res["tasks"]
    ev = res["eval"]
    out = [
        f"# Meta-World policies merged through mergekit-pytorch ({res['config_name']})",
        "",
        f"Tasks {', '.join(tasks)}; training seeds {res['seeds']}; {min(ev['episodes_per_seed'].values())} evaluation "
        f"episodes per task and seed ({ev['episode']}). Success rate in %; {ev['intervals']}.",
        "",
        *table(res),
        "",
        "Specialists' gains on their own task (points, 95 % interval; per seed):",
        "",
    ]
    for t, g in res["gains"].items():
        per_seed = ", ".join(f"{100 * x:+.1f}" for x in g["per_seed"])
        out.append(
            f"- {t}: base {_pct(g['base'])}, specialist {_pct(g['specialist'])}, gain {100 * g['gain']:+.1f} "
            f"{_ci(g['gain_ci'], 1)} (seeds: {per_seed}){'' if g['meets_bar_20_points'] else ' — below 20 points'}"
        )
    out += ["", *seed_table(res)]
    if res["ramplus_vs"]:
        n = len(res["seeds"])
        out += ["", "ramplus (defaults) minus each other merge, mean success (points): the paired bootstrap's 95 % "]
        out[-1] += f"interval (evaluation noise), each seed's difference, and a t-interval over the {n} seeds "
        out[-1] += "(the seeds' spread; from 3 seeds):"
        out += ["", "| merge | ramplus - merge | verdict | per seed | over seeds (t, 95 %) |", "|---|---|---|---|---|"]
        for m, c in res["ramplus_vs"].items():
            seeds = " / ".join(f"{100 * x:+.1f}" for x in c["per_seed"])
            cells = [_label(m), f"{100 * c['mean_diff']:+.1f} {_ci(c['ci'], 1)}", c["verdict"], seeds]
            cells.append(_ci(c["seed_ci"], 1) or "—")
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "Per-agent statistics of the specialists' actors (`mergekit-ram inspect`, ε 1e-5, r 0.1, α 2):", ""]
    out += density_table(res)
    pairs = [(seed, dtype, p) for seed, pd in res["density"].items() for dtype, d in pd.items() for p in d["pairs"]]
    if pairs:
        same = [p["same_sign_share"] for _, dt, p in pairs if dt == "float32" and p["same_sign_share"] is not None]
        cos = [p["cosine"] for _, dt, p in pairs if dt == "float32" and p["cosine"] is not None]
        if same and cos:
            out += [
                "",
                f"Pairs of agents (float32, all seeds): same sign on {100 * min(same):.1f} to {100 * max(same):.1f} "
                f"% of their common entries, cosine {min(cos):.3f} to {max(cos):.3f}.",
            ]
    out += ["", "Stage times (s):", ""]
    for seed, stages in res["stages"].items():
        parts = [f"{name} {s['seconds']:.0f}{' (cached)' if s.get('cached') else ''}" for name, s in stages.items()]
        out.append(f"- seed {seed}: " + ", ".join(parts))
    m = res["machine"]
    out += [
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores; torch {m.get('torch')}, mergekit {m.get('mergekit')}, "
        f"mergekit-ram {m.get('mergekit-ram')}; commit {res['git_commit']}; this run {res['seconds']:.0f} s.",
    ]
    return "\n".join(out) + "\n"


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, rows = res["tasks"], list(res["models"])
    data = [
        [100 * res["models"][r]["success"][t]["acc"] for t in tasks] + [100 * res["models"][r]["mean"]] for r in rows
    ]
    fig, axes = plt.subplots(
        1, 2, figsize=(14, 1.6 + 0.36 * len(rows)), constrained_layout=True, gridspec_kw={"width_ratios": [1.3, 1]}
    )
    ax = axes[0]
    image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(len(tasks) + 1), [*tasks, "mean"], fontsize=8, rotation=25, ha="right")
    ax.set_yticks(range(len(rows)), [res["models"][r]["label"] for r in rows], fontsize=8)
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.set_title("success rate (%)", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.7)
    ax = axes[1]
    merges = [r for r in rows if res["models"][r].get("retained_mean")]
    paired.retained_bars(
        ax, res["models"], merges, "share of the specialists' gains kept (%)\nmean over tasks, 95 % CI"
    )
    fig.suptitle(f"Meta-World policies, seeds {res['seeds']}: merges of {len(tasks)} SAC specialists", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def density_chart(res: dict, path: Path) -> None:
    """Per agent and seed: the share of weights changed, float32 and bf16, split into unique / shared with 1 /
    shared with >= 2 other agents (`mergekit-ram inspect`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars, labels = [], []
    for seed, per_dtype in res["density"].items():
        for task in res["tasks"]:
            for dtype, d in per_dtype.items():
                a = d["agents"].get(task)
                if a:
                    dens = 100 * a["density"]
                    parts = [a["unique_share"], a["shared_with_1_share"], a["shared_with_2plus_share"]]
                    bars.append([dens * p for p in parts])
                    labels.append(f"seed {seed} {task} {'bf16' if dtype == 'bfloat16' else 'fp32'}")
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.26 * len(bars)), constrained_layout=True)
    left = np.zeros(len(bars))
    names = ["unique (λ applies)", "shared with 1 other", "shared with ≥ 2 others"]
    for k, (name, color) in enumerate(zip(names, ["tab:red", "tab:orange", "tab:gray"], strict=True)):
        vals = np.array([b[k] for b in bars])
        ax.barh(range(len(bars)), vals, left=left, color=color, label=name)
        left += vals
    ax.set_yticks(range(len(bars)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the actor's weights changed (|τ| > 1e-5), by how many agents changed them")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Specialists' actors: density and overlap (mergekit-ram inspect)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = res.pop("_runs")
    (out / "results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    (out / "results.md").write_text(markdown(res))
    try:
        chart(res, out / "chart.png")
        density_chart(res, out / "density.png")
    except ImportError:
        print("matplotlib is not installed: no chart.png")
    # rebuilt whole: files of an earlier run's tasks or seeds would otherwise stay beside this run's
    for name in ("ram_stats", "policies"):
        shutil.rmtree(out / name, ignore_errors=True)
    for run in runs:
        seed = run["seed"]
        for row, path in run["files"].items():
            folder = Path(path).parent
            stats = folder / "ram_stats.json"
            if row not in ("base",) and stats.exists():
                dest = out / "ram_stats" / f"seed{seed}" / f"{row.replace(' (bf16)', '_bf16')}.json"
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stats, dest)
        if res["config_name"] == "full":  # the inputs of every merge: base and specialists' actors (about 90 KB each)
            for row, path in run["files"].items():
                if row == "base" or row.endswith(" agent"):
                    dest = out / "policies" / f"seed{seed}" / f"{row.replace(' ', '_')}.safetensors"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, dest)


# --------------------------------------------------------------------------- #
# The regime run (issue 42): a verdict at the level of training seeds
# --------------------------------------------------------------------------- #
#: ramplus against these first (the issue's list), then every other merge
HEADLINE = ["linear", "ties (tuned)", "dare_linear (tuned)", "task_arithmetic (tuned)"]
REGIME_LABELS = {
    "multitask SAC": "multi-task SAC (same budget)",
    "task_arithmetic (tuned)": "task_arithmetic, tuned w",
    "ties (tuned)": "ties, tuned d and λ",
    "dare_linear (tuned)": "dare_linear, tuned d and w (mean of mask draws)",
    "dare_ties (tuned)": "dare_ties, tuned d and w (mean of mask draws)",
}


def regime_label(row: str) -> str:
    return REGIME_LABELS.get(row) or (MERGES[row].label if row in MERGES else row)


def _kind(row: str, tasks: list[str]) -> str:
    if row == "base":
        return "base"
    if row in (f"{t} agent" for t in tasks):
        return "specialist"
    return "reference" if row == "multitask SAC" else "merge"


def portable(obj, mapping: dict[str, str]):
    """`obj` (JSON-like) with every absolute path of `mapping` replaced by its published, relative name."""
    text = json.dumps(obj, ensure_ascii=False)
    for src, dst in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(json.dumps(src)[1:-1], dst)
    return json.loads(text)


def published_names(runs: list[dict]) -> dict[str, str]:
    """{absolute file or stage folder: its name in the publication}: the base, each seed's actors, the cache."""
    out = {}
    for run in runs:
        for row, path in run["files"].items():
            name = "base/actor.safetensors" if row == "base" else f"policies/seed{run['seed']}/{_file(row)}"
            out[str(path)] = name
            if row == "base":
                out[str(Path(path).parent / "sac.zip")] = "base/sac.zip"
    return out


def _file(row: str) -> str:
    return row.replace(" ", "_") + ".safetensors"


def _at_bar(gain: float) -> bool:
    """A specialist's gain reaches the issue's bar, 20 points (a rate difference; the slack absorbs float rests)."""
    return gain >= 0.20 - 1e-9


def build_regime(cfg, runs, machine, commit, config_name, seconds, reps: int | None = None) -> dict:
    import regime as R

    tasks, seeds = list(cfg["tasks"]), [run["seed"] for run in runs]
    reps = reps or cfg["eval"]["bootstrap"]
    rows = list(runs[0]["success"])
    rate = lambda run, row, t: float(np.mean(run["success"][row][t]))  # noqa: E731
    per_seed = {row: [float(np.mean([rate(run, row, t) for t in tasks])) for run in runs] for row in rows}
    boot = {row: R.per_seed_replicates(runs, row, tasks, reps) for row in rows}
    models = {}
    for row in rows:
        x = np.asarray(per_seed[row])
        mean_ci = R.interval(R.hierarchical(boot[row], np.mean, reps))
        iqm_ci = R.interval(R.hierarchical(boot[row], R.iqm, reps))
        models[row] = {
            "kind": _kind(row, tasks),
            "label": regime_label(row),
            "success": {t: _num(np.mean([rate(run, row, t) for run in runs])) for t in tasks},
            "mean": _num(x.mean()),
            "mean_ci": [_num(v) for v in mean_ci],
            "iqm": _num(R.iqm(x)),
            "iqm_ci": [_num(v) for v in iqm_ci],
            "per_seed_mean": [_num(v) for v in x],
            "per_seed_success": [{t: _num(rate(run, row, t)) for t in tasks} for run in runs],
        }
    gains = {}
    for t in tasks:
        g = [rate(run, f"{t} agent", t) - rate(run, "base", t) for run in runs]
        gains[t] = {
            "base": _num(np.mean([rate(run, "base", t) for run in runs])),
            "specialist": _num(np.mean([rate(run, f"{t} agent", t) for run in runs])),
            "per_seed": [_num(v) for v in g],
            "min": _num(min(g)),
            "meets_bar_20_points_every_seed": all(_at_bar(v) for v in g),
        }
    comparisons = {}
    if "ramplus" in rows:
        others = (
            [r for r in HEADLINE if r in rows]
            + [r for r in rows if r not in HEADLINE and r != "ramplus" and _kind(r, tasks) in ("merge", "reference")]
            + ["base"]
        )
        for m in others:
            d = np.asarray(per_seed["ramplus"]) - np.asarray(per_seed[m])
            diff = boot["ramplus"] - boot[m]
            ci = R.interval(R.hierarchical(diff, np.mean, reps))
            p_ci = R.interval(R.hierarchical(diff, R.improvement, reps))
            t_ci = seed_interval(list(d))
            verdict = "ramplus better" if ci[0] > 0 else "ramplus worse" if ci[1] < 0 else "not resolved"
            if len(runs) < 3:  # the seeds' spread is not measured: the interval is the episodes' noise alone
                verdict = "— (under 3 seeds)"
            comparisons[m] = {
                "per_seed": [_num(v) for v in d],
                "mean_diff": _num(d.mean()),
                "ci": [_num(v) for v in ci],
                "seed_ci": None if t_ci is None else [_num(v) for v in t_ci],
                "p_improvement": _num(R.improvement(d)),
                "p_improvement_ci": [_num(v) for v in p_ci],
                "detectable_80": _num(R.detectable(list(d))),
                "verdict": verdict,
            }
    kept = {}
    if cfg.get("gain_kept"):  # the paper's measure: the share of each specialist's gain a policy keeps on its task
        for row in rows:
            if _kind(row, tasks) in ("merge", "reference"):
                kept[row] = R.kept_share(runs, row, tasks, reps)
                for k in kept[row]["tasks"].values():
                    t_ci = seed_interval([x for x in k["per_seed"] if x is not None])
                    k["seed_ci"] = None if t_ci is None else [_num(v) for v in t_ci]
    names = published_names(runs)
    agents_regime = {str(run["seed"]): run["regime"] for run in runs}
    interpolation = {
        t: {a: [_num(np.mean(run["interpolation"][t][a])) for run in runs] for a in runs[0]["interpolation"][t]}
        for t in tasks
    }
    tuning = {
        f: {
            "best": [run["tuning"][f]["best"] for run in runs],
            "scores": [{p: _num(v) for p, v in run["tuning"][f]["scores"].items()} for run in runs],
            "variations": [run["tuning"][f]["variations"] for run in runs],
        }
        for f in runs[0]["tuning"]
    }
    density = {}
    for run in runs:
        stats = run["stats"].get("float32")
        if stats:
            keep = ("rho_counted", "lambda", "density", "unique_share")
            paths = _input_paths(stats)
            density[str(run["seed"])] = {
                Path(paths.get(a.get("label"), a.get("model", "")).split("@")[0]).parent.name: {
                    k: _num(a.get(k)) for k in keep
                }
                for a in stats["agents"]
            }
    episodes = {
        str(run["seed"]): {
            "first_variation": run["first_episode"],
            "success": run["success"],
            "dare_draws": run["per_draw"],
            "tuning": {f: run["tuning"][f]["success"] for f in run["tuning"]},
            "interpolation": run["interpolation"],
        }
        for run in runs
    }
    res = {
        "format": "regime",
        "config_name": config_name,
        "config": cfg,
        "tasks": tasks,
        "layout": list(cfg.get("base_tasks", tasks)),
        "seeds": seeds,
        "eval": {
            "episodes_per_seed": cfg["eval"]["episodes"],
            "success": "Meta-World info['success'] at any step (the episode stops there), deterministic actor",
            "episode": f"at most {cfg['horizon']} steps; seed s, episode i: variation (episodes * s + i) mod 50",
            "tuning": f"each family's grid on {cfg['tune']['episodes']} held-out variations per task and seed "
            f"(metaworld.MT1(task, seed=1): never the evaluation's)",
            "bootstrap_replicates": reps,
            "intervals": "95 % percentile intervals of a two-stage bootstrap: training seeds with replacement, then "
            "each drawn seed's episodes (paired across policies)",
        },
        "models": models,
        "gains": gains,
        **({"kept": kept} if cfg.get("gain_kept") else {}),
        "ramplus_vs": comparisons,
        "regime": agents_regime,
        "interpolation": interpolation,
        "tuning": tuning,
        "density": density,
        "episodes": episodes,
        "stages": portable({str(run["seed"]): run["stages"] for run in runs}, names),
        "keys": {str(run["seed"]): run["keys"] for run in runs},
        "seconds": round(seconds, 1),
        "machine": machine,
        "git_commit": commit,
        "_runs": runs,
        "_names": names,
    }
    return res


def _pp(x, digits: int = 1) -> str:
    """Points with a sign."""
    return "—" if x is None else f"{100 * x:+.{digits}f}"


def markdown_regime(res: dict) -> str:
    tasks, seeds = res["tasks"], res["seeds"]
    ev = res["eval"]
    out = [
        f"# Meta-World policies in the fine-tuning regime ({res['config_name']})",
        "",
        f"Tasks {', '.join(tasks)} (the base's one-hot layout: {', '.join(res['layout'])}); training seeds "
        f"{seeds}; {ev['episodes_per_seed']} evaluation episodes per task and seed ({ev['episode']}). Success in %. "
        f"Intervals: {ev['intervals']}; {ev['bootstrap_replicates']} replicates. Merges tuned: {ev['tuning']}.",
        "",
        "| model | " + " | ".join(tasks) + " | mean [95 % CI] | IQM over seeds [95 % CI] | per seed |",
        "|" + "---|" * (len(tasks) + 4),
    ]
    for m in res["models"].values():
        cells = [m["label"], *(_pct(m["success"][t]) for t in tasks)]
        cells += [f"{_pct(m['mean'])} {_ci(m['mean_ci'], 1)}", f"{_pct(m['iqm'])} {_ci(m['iqm_ci'], 1)}"]
        cells.append(" / ".join(f"{100 * x:.0f}" for x in m["per_seed_mean"]))
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Specialists' gains on their own task (points, per seed):", ""]
    for t, g in res["gains"].items():
        seeds_txt = ", ".join(f"{100 * x:+.0f}" for x in g["per_seed"])
        met = sum(_at_bar(x) for x in g["per_seed"])
        bar = f"≥ 20 in {met} of {len(g['per_seed'])} seeds"
        out.append(f"- {t}: base {_pct(g['base'])}, specialist {_pct(g['specialist'])}; {seeds_txt} ({bar})")
    chosen = {seed: {n: st for n, st in stages.items() if st.get("selected") is not None}
              for seed, stages in res["stages"].items()}  # fmt: skip
    if any(chosen.values()):
        out += ["", "Checkpoints chosen on held-out variations (the step; held-out success at each checkpoint, %):", ""]
        for seed, per in chosen.items():
            parts = []
            for n, st in per.items():
                curve = ", ".join(f"{100 * np.mean(list(r['success'].values())):.0f}" for r in st["selection"])
                parts.append(f"{n.removeprefix('agent ')} {st['selected']} ({curve})")
            out.append(f"- seed {seed}: " + "; ".join(parts))
    if res.get("kept"):
        out += [
            "",
            "Share of each specialist's gain on its own task that each policy keeps, (policy - base) / (specialist - "
            "base), in %: the ratio of the gains' means over the seeds with its two-stage bootstrap interval (seeds, "
            "then each seed's episodes, paired), the mean of the per-seed shares with a Student-t interval over the "
            "seeds (of the seeds whose specialist gained), and the mean over the tasks of the ratios (100 % keeps the "
            "whole gain; 0 % the base's level):",
            "",
            "| policy | " + " | ".join(f"{t}: kept [95 % CI] | per-seed mean [t]" for t in tasks) + " | mean over "
            "tasks [95 % CI] |",
            "|" + "---|" * (2 * len(tasks) + 2),
        ]
        for row, k in res["kept"].items():
            cells = [regime_label(row)]
            for t in tasks:
                x = k["tasks"][t]
                cells.append(f"{_pct(x['kept'], 0)} {_ci(x['ci'])}".strip())
                n = sum(v is not None for v in x["per_seed"])  # the seeds whose specialist gained
                parts = [_pct(x["mean_per_seed"], 0), _ci(x["seed_ci"]), f"({n} of {len(x['per_seed'])})"]
                cells.append(" ".join(p for p in parts if p))
            cells.append(f"{_pct(k['mean'], 0)} {_ci(k['mean_ci'])}".strip())
            out.append("| " + " | ".join(cells) + " |")
    if res["ramplus_vs"]:
        out += [
            "",
            "`ramplus` (defaults) minus each other policy, mean success over the tasks (points): per seed, the mean "
            "over seeds with its two-stage bootstrap interval, a Student-t interval over the seeds, the probability "
            "of improvement (share of seeds where RAM+ is ahead; ties half) with its bootstrap interval, the "
            "smallest difference these seeds would detect (paired t, 80 % power), and the verdict of the two-stage "
            "interval:",
            "",
            "| policy | per seed | mean [95 % CI] | t over seeds | P(RAM+ ahead) | detectable | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, c in res["ramplus_vs"].items():
            per = " / ".join(f"{100 * x:+.0f}" for x in c["per_seed"])
            p = f"{c['p_improvement']:.2f} [{c['p_improvement_ci'][0]:.2f}, {c['p_improvement_ci'][1]:.2f}]"
            cells = [regime_label(m), per, f"{_pp(c['mean_diff'])} {_ci(c['ci'], 1)}", _ci(c["seed_ci"], 1) or "—"]
            cells += [p, "—" if c["detectable_80"] is None else f"{100 * c['detectable_80']:.1f}", c["verdict"]]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "Tuned settings per seed (held-out variations):", ""]
    for f, t in res["tuning"].items():
        chosen = [f"seed {s}: {b.split('[')[-1].rstrip(']')}" for s, b in zip(seeds, t["best"], strict=True)]
        out.append(f"- {f}: " + "; ".join(chosen))
    out += [
        "",
        "The regime: each specialist's update against the base (ε 1e-5; the first layer's task-ID columns):",
        "",
    ]
    head = ["seed", "agent", "‖τ‖/‖θ_base‖", "changed", "unique", "shared with 1", "shared with ≥ 2"]
    head += ["own task-ID column: changed / unique (of rows)", "other task-ID columns changed", "ρ", "λ"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed, reg in res["regime"].items():
        dens = res["density"].get(seed, {})
        for t in tasks:
            a = reg["agents"][t]
            own = a["own_column"]
            d = next((v for k, v in dens.items() if k.startswith(f"agent-{t}-")), {})
            cells = [seed, t, f"{a['update_ratio']:.3f}", f"{_pct(a['density'])} %", f"{_pct(a['unique_share'])} %"]
            cells += [f"{_pct(a['shared_with_1_share'])} %", f"{_pct(a['shared_with_2plus_share'])} %"]
            cells += [f"{own['changed']} / {own['unique']} (of {own['rows']})", str(a["other_columns_changed"])]
            rho = d.get("rho_counted")
            cells += ["∞" if rho is None else f"{rho:.2f}", "—" if d.get("lambda") is None else f"{d['lambda']:.3f}"]
            out.append("| " + " | ".join(cells) + " |")
    first = next(iter(res["regime"].values()))
    out += [
        "",
        f"‖θ_base‖ = {first['base_norm']:.2f} over {first['numel']} weights. Inputs no specialist changed (first "
        f"layer columns, every seed): "
        + "; ".join(f"seed {s}: {r['unchanged_inputs']}" for s, r in res["regime"].items()),
        "",
        "Success on the own task along base → specialist, θ_base + α τ (mean over seeds, %):",
        "",
    ]
    alphas = list(next(iter(res["interpolation"].values())))
    out += ["| task | " + " | ".join(f"α = {a}" for a in alphas) + " |", "|" + "---|" * (len(alphas) + 1)]
    for t, per in res["interpolation"].items():
        out.append(f"| {t} | " + " | ".join(f"{100 * np.mean(per[a]):.0f}" for a in alphas) + " |")
    out += ["", "Stage times (s):", ""]
    for seed, stages in res["stages"].items():
        parts = [f"{n} {s['seconds']:.0f}{' (cached)' if s.get('cached') else ''}" for n, s in stages.items()
                 if not n.startswith("merge ")]  # fmt: skip
        merges = [s for n, s in stages.items() if n.startswith("merge ")]
        parts.append(f"{len(merges)} merges {sum(s['seconds'] for s in merges):.0f}")
        out.append(f"- seed {seed}: " + ", ".join(parts))
    m = res["machine"]
    out += [
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores; torch {m.get('torch')}, mergekit {m.get('mergekit')}, "
        f"mergekit-ram {m.get('mergekit-ram')}; commit {res['git_commit']}; this report {res['seconds']:.0f} s.",
    ]
    return "\n".join(out) + "\n"


def chart_regime(res: dict, out: Path) -> None:
    """chart.png: mean success per policy over seeds (each seed a dot) and RAM+'s differences with their
    two-stage intervals; regime.png: each agent's ‖τ‖/‖θ_base‖ and overlap, and success along base → specialist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = res["models"]
    rows = list(models)
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.5 + 0.34 * len(rows)), constrained_layout=True)
    ax = axes[0]
    for i, r in enumerate(rows):
        m = models[r]
        lo, hi = m["mean_ci"]
        color = "tab:red" if r.startswith("ramplus") else "tab:blue" if m["kind"] == "merge" else "tab:gray"
        ax.errorbar(100 * m["mean"], i, xerr=[[100 * (m["mean"] - lo)], [100 * (hi - m["mean"])]], fmt="o",
                    color=color, capsize=3)  # fmt: skip
        ax.scatter([100 * x for x in m["per_seed_mean"]], [i] * len(m["per_seed_mean"]), s=8, color=color, alpha=0.35)
    ax.set_yticks(range(len(rows)), [models[r]["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mean success over the tasks (%):\nseeds as dots, mean with its 95 % two-stage interval")
    ax = axes[1]
    comps = res["ramplus_vs"]
    names = list(comps)
    for i, m in enumerate(names):
        c = comps[m]
        ax.errorbar(100 * c["mean_diff"], i, xerr=[[100 * (c["mean_diff"] - c["ci"][0])], [100 * (c["ci"][1] -
                    c["mean_diff"])]], fmt="o", color="tab:red", capsize=3)  # fmt: skip
        ax.scatter([100 * x for x in c["per_seed"]], [i] * len(c["per_seed"]), s=8, color="tab:red", alpha=0.35)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), [regime_label(m) for m in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("RAM+ minus policy (points):\nseeds as dots, mean with its 95 % two-stage interval")
    fig.suptitle(f"Meta-World, {len(res['seeds'])} training seeds: merges of specialists fine-tuned from one base")
    fig.savefig(out / "chart.png", dpi=110)
    plt.close(fig)

    tasks = res["tasks"]
    n_bars = len(res["regime"]) * len(tasks)
    fig, axes = plt.subplots(1, 3, figsize=(16, max(4.5, 1.5 + 0.16 * n_bars)), constrained_layout=True)
    ax = axes[0]
    for t in tasks:
        ratios = [reg["agents"][t]["update_ratio"] for reg in res["regime"].values()]
        dens = [100 * reg["agents"][t]["density"] for reg in res["regime"].values()]
        ax.scatter(ratios, dens, label=t, s=18)
    ax.axvline(0.5, color="black", lw=0.8, ls="--")
    ax.set_xlabel("‖τ‖ / ‖θ_base‖ (each agent of each seed)")
    ax.set_ylabel("weights changed (%)")
    ax.legend(fontsize=7)
    ax = axes[1]
    labels, parts = [], []
    for seed, reg in res["regime"].items():
        for t in tasks:
            a = reg["agents"][t]
            own = a["own_column"]
            labels.append(f"s{seed} {t.removesuffix('-v3')}")
            own_share = own["unique"] / own["changed"] if own["changed"] else 0.0
            parts.append([a["unique_share"] or 0, a["shared_with_1_share"] or 0, a["shared_with_2plus_share"] or 0,
                          own_share])  # fmt: skip
    y = np.arange(len(parts))
    left = np.zeros(len(parts))
    for k, (name, color) in enumerate(
        zip(["unique", "shared with 1", "shared with ≥ 2"], ["tab:red", "tab:orange", "tab:gray"], strict=True)
    ):
        vals = np.array([100 * p[k] for p in parts])
        ax.barh(y, vals, left=left, color=color, label=name, height=0.8)
        left += vals
    ax.scatter([100 * p[3] for p in parts], y, color="black", s=10, label="own task-ID column: changed rows unique")
    ax.set_yticks(y, labels, fontsize=5)
    ax.invert_yaxis()
    ax.set_xlabel("% of the agent's changed weights (ε 1e-5)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax = axes[2]
    for t, per in res["interpolation"].items():
        alphas = [float(a) for a in per]
        ax.plot(alphas, [100 * np.mean(v) for v in per.values()], marker="o", label=t)
    ax.set_xlabel("α in θ_base + α τ")
    ax.set_ylabel("own-task success (%, mean over seeds)")
    ax.legend(fontsize=7)
    fig.suptitle("Where the agents stand: update size, overlap, and success along base → specialist")
    fig.savefig(out / "regime.png", dpi=110)
    plt.close(fig)

    if res.get("kept"):  # kept.png: the share of each specialist's gain each policy keeps, per task
        kept = res["kept"]
        names = list(kept)
        fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4 * (len(tasks) + 1), 1.5 + 0.34 * len(names)),
                                 sharey=True, constrained_layout=True)  # fmt: skip
        for ax, t in zip(axes, [*tasks, None], strict=True):
            for i, r in enumerate(names):
                k = kept[r] if t is None else kept[r]["tasks"][t]
                x, ci = (k["mean"], k["mean_ci"]) if t is None else (k["kept"], k["ci"])
                color = "tab:red" if r.startswith("ramplus") else "tab:blue"
                if x is not None and ci is not None:
                    ax.errorbar(100 * x, i, xerr=[[100 * (x - ci[0])], [100 * (ci[1] - x)]], fmt="o", color=color,
                                capsize=3)  # fmt: skip
                if t is not None:
                    per = [100 * v for v in k["per_seed"] if v is not None]
                    ax.scatter(per, [i] * len(per), s=8, color=color, alpha=0.35)
            ax.axvline(0, color="black", lw=0.8)
            ax.axvline(100, color="black", lw=0.8, ls="--")
            ax.set_title("mean over the tasks" if t is None else t, fontsize=9)
            ax.set_xlabel("share of the specialist's gain kept (%)")
        axes[0].set_yticks(range(len(names)), [regime_label(r) for r in names], fontsize=8)
        axes[0].invert_yaxis()
        fig.suptitle("(policy - base) / (specialist - base) on each task: seeds as dots, the ratio of the mean gains "
                     "with its 95 % two-stage interval")  # fmt: skip
        fig.savefig(out / "kept.png", dpi=110)
        plt.close(fig)


def _compact(text: str) -> str:
    """JSON with every list of numbers on one line (the per-episode outcomes: a line each otherwise)."""
    import re

    numbers = r"\[\s*([-0-9.eE]+(?:,\s*[-0-9.eE]+)*)\s*\]"
    return re.sub(numbers, lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text)


def write_regime(res: dict, out: Path) -> None:
    """results.json, results.md, the charts, the default ramplus merge's ram_stats.json, the base (actor and SAC state,
    what fine-tuning starts from), each seed's actors, and stages.json (the stage keys of the published files, so
    a run resumes or replays from them)."""
    runs, names = res.pop("_runs"), res.pop("_names")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("policies", "ram_stats"):  # rebuilt whole (run.py writes here only when asked: --overwrite)
        shutil.rmtree(out / name, ignore_errors=True)
    res = portable(res, names)
    (out / "results.json").write_text(_compact(json.dumps(res, indent=1, ensure_ascii=False)))
    (out / "results.md").write_text(markdown_regime(res))
    try:
        chart_regime(res, out)
    except ImportError:
        print("matplotlib is not installed: no charts")
    index = {}
    for run in runs:
        seed = run["seed"]
        for row, path in run["files"].items():
            folder = Path(path).parent
            dest = out / names[str(path)]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            files = {"actor.safetensors": names[str(path)]}
            if row == "base" and (folder / "sac.zip").exists():
                shutil.copyfile(folder / "sac.zip", out / "base" / "sac.zip")
                files["sac.zip"] = "base/sac.zip"
            meta = json.loads((folder / "stage.json").read_text())
            index[meta["key"]] = {"files": files, "meta": meta}
        for row, paths in run["merge_files"].items():
            stats = Path(paths[0]).parent / "ram_stats.json"
            if row == "ramplus" and stats.exists():  # the others: a replay makes them again
                dest = out / "ram_stats" / f"seed{seed}" / f"{row}.json"
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(json.dumps(portable(json.loads(stats.read_text()), names), indent=1))
    (out / "stages.json").write_text(json.dumps(index, indent=1))
