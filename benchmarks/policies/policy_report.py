"""The policies benchmark's report: results.json, results.md (the paper's Table 1 form), chart.png, density pictures.

Every policy is evaluated on the same episodes (task variation and reset seed per episode index) of every task, for
each training seed; the intervals are 95 % percentile intervals of a paired bootstrap over those episodes, the
seeds' episodes pooled (`benchmarks/quality/evaluate.py`'s `Bootstrap`). They cover the evaluation's noise, not
the training seeds' spread, which the per-seed table shows.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import MERGES, _quality  # noqa: E402

E = _quality("evaluate")
STATS_KEYS = (
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


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 6)


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
    bs = E.Bootstrap(correct, tasks, cfg["eval"]["bootstrap"], seed=0)
    rate = {row: {t: E.summary(correct[row][t]) for t in tasks} for row in rows}

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
                point = E.retained_share(rate[row][t]["acc"], rate["base"][t]["acc"], rate[specialists[t]][t]["acc"])
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
            # ram_stats.json format 4 names agents by label, its inputs table maps each to its path; before, by path
            paths = {label: row["model"] for label, row in stats.get("inputs", {}).items()}
            for a in stats["agents"]:
                path = paths.get(a.get("label"), a.get("model", "")).split("@")[0]
                task = by_path.get(path) or next((t for t in tasks if Path(path).stem == t), path)
                agents[task] = {k: _num(a.get(k)) if isinstance(a.get(k), float) else a.get(k) for k in STATS_KEYS}
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
        E.retained_share(_seed_rate(run, row, t), _seed_rate(run, "base", t), _seed_rate(run, specialists[t], t))
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
    shares = [100 * res["models"][m]["retained_mean"]["share"] for m in merges]
    cis = [res["models"][m]["retained_mean"]["ci"] for m in merges]
    err = [
        [0 if c[0] is None else max(0.0, s - 100 * c[0]) for s, c in zip(shares, cis, strict=True)],
        [0 if c[1] is None else max(0.0, 100 * c[1] - s) for s, c in zip(shares, cis, strict=True)],
    ]
    colors = ["tab:red" if res["models"][m]["method"] == "ramplus" else "tab:gray" for m in merges]
    ax.barh(range(len(merges)), shares, xerr=err, color=colors, capsize=3)
    ax.set_yticks(range(len(merges)), [res["models"][m]["label"] for m in merges], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8, ls="--")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("share of the specialists' gains kept (%)\nmean over tasks, 95 % CI")
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
