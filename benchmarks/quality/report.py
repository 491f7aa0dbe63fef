"""Tables, chart and results.json of the quality benchmark (every number computed from the eval bits)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the policies benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import paired  # noqa: E402
import run as R  # noqa: E402
from staging import AGENT_STATS, MERGES  # noqa: E402


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 5)


def build(
    cfg: dict, pipe, correct: dict, inspected: Path | None, folders: dict[str, Path], formats: dict | None = None
) -> dict:
    """results.json's content; `formats` ({model: {task: 1/0 per item}}, the shared regime): format compliance."""
    tasks = pipe.names
    specialists = {t: f"{t} agent" for t in tasks}
    bs = paired.Bootstrap(correct, tasks, cfg["eval"]["bootstrap"], seed=cfg["seed"])
    # the same seed and item counts: the same resamples of items as `bs` (paired)
    fbs = paired.Bootstrap(formats, tasks, cfg["eval"]["bootstrap"], seed=cfg["seed"]) if formats else None
    acc = {row: {t: paired.summary(correct[row][t]) for t in tasks} for row in correct}

    gains = {}
    for t in tasks:
        b, s = acc["base"][t]["acc"], acc[specialists[t]][t]["acc"]
        lo, hi = bs.interval(bs.gain(specialists[t], "base", t))
        gains[t] = {
            "base": b,
            "specialist": s,
            "gain": s - b,
            "gain_ci": [lo, hi],
            "significant": lo > 0,
            "meets_bar_15_points": s - b >= 0.15,
        }
    valid = [t for t in tasks if gains[t]["significant"]]

    pair_rows = pipe.pairs
    models = {}
    for row in correct:
        if row in pair_rows:
            continue
        kind = "base" if row == "base" else "specialist" if row in specialists.values() else "merge"
        mean = sum(acc[row][t]["acc"] for t in tasks) / len(tasks)
        entry: dict = {
            "kind": kind,
            "label": MERGES[row].label if kind == "merge" else row,
            "accuracy": {t: {k: _num(v) if k != "n" else v for k, v in acc[row][t].items()} for t in tasks},
            "mean": _num(mean),
            "mean_ci": [_num(x) for x in bs.interval(bs.mean(row))],
            "folder": str(folders[row]),
        }
        if formats and fbs is not None:
            per_task = {t: paired.summary(formats[row][t]) for t in tasks}
            entry["format"] = {
                "compliance": {t: {k: _num(v) if k != "n" else v for k, v in per_task[t].items()} for t in tasks},
                "mean": _num(sum(per_task[t]["acc"] for t in tasks) / len(tasks)),
                "mean_ci": [_num(x) for x in fbs.interval(fbs.mean(row))],
            }
        if kind == "merge":
            spec = MERGES[row]
            entry.update(method=spec.method, shared_parameters=spec.shared, per_model_parameters=spec.per_model)
            retained = {}
            for t in tasks:
                if t not in valid:
                    retained[t] = {"share": None, "ci": [None, None], "note": "specialist gain not significant"}
                    continue
                point = paired.retained_share(acc[row][t]["acc"], acc["base"][t]["acc"], acc[specialists[t]][t]["acc"])
                lo, hi = bs.interval(bs.retained(row, "base", specialists, t))
                retained[t] = {"share": _num(point), "ci": [_num(lo), _num(hi)]}
            entry["retained"] = retained
            if valid and all(retained[t]["share"] is not None for t in valid):
                point = sum(retained[t]["share"] for t in valid) / len(valid)
                reps = np.mean([bs.retained(row, "base", specialists, t) for t in valid], axis=0)
                lo, hi = bs.interval(reps)
                entry["retained_mean"] = {"share": _num(point), "ci": [_num(lo), _num(hi)], "over_tasks": valid}
        models[row] = entry

    merges = [m for m in models if models[m]["kind"] == "merge"]
    comparisons = {}
    if "ramplus" in merges:
        for m in merges:
            if m == "ramplus":
                continue
            d = bs.mean("ramplus") - bs.mean(m)
            lo, hi = bs.interval(d)
            point = models["ramplus"]["mean"] - models[m]["mean"]
            verdict = "ramplus better" if lo > 0 else "ramplus worse" if hi < 0 else "no significant difference"
            comparisons[m] = {"mean_diff": _num(point), "ci": [_num(lo), _num(hi)], "verdict": verdict}

    r_sweep = _sweep(models, R.R_SWEEP, "r")
    eps_sweep = _sweep(models, R.EPS_SWEEP, "epsilon")

    density: dict[str, dict] = {}
    pairs: dict[tuple[str, str], dict] = {}
    if inspected is not None:
        stats = json.loads((inspected / "stats.json").read_text())
        by_path = {str(folders[specialists[t]]): t for t in tasks}

        # ram_stats.json format 4 names agents by label, its inputs table maps each to its path; before, by path
        paths = {label: row["model"] for label, row in stats.get("inputs", {}).items()}

        def task_of(name: str) -> str:
            model = paths.get(name, name)
            return by_path.get(model.split("@")[0], model)

        for a in stats["agents"]:
            density[task_of(a.get("label") or a["model"])] = {k: a.get(k) for k in AGENT_STATS}
        for p in stats.get("pairs", []):
            a, b = (task_of(m) for m in p["agents"])
            pairs[(a, b)] = {
                "agents": [a, b],
                "common": p["common"],
                # entries both changed, as a share of the entries the sparser of the two changed
                "common_share": _num(p["common"] / min(density[a]["active"], density[b]["active"]))
                if min(density[a]["active"], density[b]["active"])
                else None,
                "same_sign_share": _num(p["same_sign_share"]),
                "cosine": _num(p["cosine"]),
            }

    # the same merges on each pair of agents: the outcome on the pair's two tasks beside the pair's diagnostics
    for row, (name, a, b) in pair_rows.items():
        entry = pairs.setdefault((a, b), {"agents": [a, b]})
        own = [a, b]
        reps = np.mean([bs.reps[row][t] for t in own], axis=0)
        result: dict = {
            "row": row,
            "folder": str(folders[row]),
            "accuracy": {t: _num(acc[row][t]["acc"]) for t in tasks},
            "mean": _num(sum(acc[row][t]["acc"] for t in own) / 2),
            "mean_ci": [_num(x) for x in bs.interval(reps)],
        }
        kept = [t for t in own if t in valid]
        if kept:
            shares = [
                paired.retained_share(acc[row][t]["acc"], acc["base"][t]["acc"], acc[specialists[t]][t]["acc"])
                for t in kept
            ]
            point = sum(shares) / len(kept)
            lo, hi = bs.interval(np.mean([bs.retained(row, "base", specialists, t) for t in kept], axis=0))
            result["retained_mean"] = {"share": _num(point), "ci": [_num(lo), _num(hi)], "over_tasks": kept}
        entry.setdefault("merges", {})[name] = result
    for (a, b), entry in pairs.items():
        got = entry.get("merges", {})
        if "ramplus" in got and "ta_sum" in got:
            own = [a, b]
            d = np.mean([bs.reps[got["ramplus"]["row"]][t] - bs.reps[got["ta_sum"]["row"]][t] for t in own], axis=0)
            lo, hi = bs.interval(d)
            point = got["ramplus"]["mean"] - got["ta_sum"]["mean"]
            entry["ramplus_minus_ta_sum"] = {"mean_diff": _num(point), "ci": [_num(lo), _num(hi)]}

    out = {
        "tasks": {t: cfg["tasks"][t] for t in tasks},
        "eval": {
            "n": {t: len(correct["base"][t]) for t in tasks},
            "decoding": "greedy, exact match",
            "max_new_tokens": pipe.max_new,
            "bootstrap_replicates": cfg["eval"]["bootstrap"],
            "intervals": "95 % percentile intervals of a paired bootstrap over eval items",
        },
        "config": cfg,
        "models": models,
        "gains": {
            t: {
                k: (_num(v) if isinstance(v, float) else [_num(x) for x in v] if isinstance(v, list) else v)
                for k, v in g.items()
            }
            for t, g in gains.items()
        },
        "density": density,
        "pairs": list(pairs.values()),
        "r_sweep": r_sweep,
        "epsilon_sweep": eps_sweep,
        "ramplus_vs": comparisons,
    }
    if formats:
        out["format"] = {
            **cfg["format"],
            "scoring": "task accuracy of the answer's content whatever its format; compliance: the greedy answer "
            "is `open` + ... + `close`",
        }
    return out


def _sweep(models: dict, merges: dict[str, float], name: str) -> list[dict]:
    """One row per merge of a parameter sweep that ran: the parameter's value, mean accuracy, retained share."""
    return [
        {
            "merge": m,
            name: value,
            "mean": models[m]["mean"],
            "mean_ci": models[m]["mean_ci"],
            "retained_mean": models[m].get("retained_mean"),
        }
        for m, value in merges.items()
        if m in models
    ]


# --------------------------------------------------------------------------- #
# Markdown
# --------------------------------------------------------------------------- #
def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def _ci(ci, digits: int = 1) -> str:
    lo, hi = ci
    return "" if lo is None or hi is None else f" [{_pct(lo, digits)}, {_pct(hi, digits)}]"


def _share(rm: dict | None, unit: str = " %") -> str:
    """A retained share with its interval, e.g. `38 % [36, 40]`; — where undefined."""
    return "—" if rm is None or rm["share"] is None else f"{_pct(rm['share'], 0)}{unit}{_ci(rm['ci'], 0)}"


def _sweep_table(title: str, column: str, key: str, rows: list[dict], fmt) -> list[str]:
    out = ["", title, "", f"| {column} | mean accuracy [95% CI] | retained share, mean [95% CI] |", "|---|---|---|"]
    for row in rows:
        out.append(f"| {fmt(row[key])} | {_pct(row['mean'])}{_ci(row['mean_ci'])} | {_share(row['retained_mean'])} |")
    return out


def accuracy_table(res: dict) -> list[str]:
    tasks = list(res["tasks"])
    fmt = "format" in res
    lines = [
        "| model | "
        + " | ".join(tasks)
        + " | mean [95% CI] | retained share of gain, mean [95% CI] |"
        + (" format compliance [95% CI] |" if fmt else ""),
        "|---" * (len(tasks) + 3 + fmt) + "|",
    ]
    for m in res["models"].values():
        cells = [f"{_pct(m['accuracy'][t]['acc'])} ± {_pct(m['accuracy'][t]['se'])}" for t in tasks]
        lines.append(
            f"| {m['label']} | "
            + " | ".join(cells)
            + f" | {_pct(m['mean'])}{_ci(m['mean_ci'])} | {_share(m.get('retained_mean'))} |"
            + (f" {_pct(m['format']['mean'])}{_ci(m['format']['mean_ci'])} |" if fmt else "")
        )
    return lines


def format_table(res: dict) -> list[str]:
    """Compliance with the common format per model and task (the shared regime)."""
    tasks = list(res["tasks"])
    f = res["format"]
    lines = [
        "",
        f"## The common behaviour: answers in the format `{f['open']}…{f['close']}` (greedy, % of eval items)",
        "",
        "| model | " + " | ".join(tasks) + " | mean [95% CI] |",
        "|---" * (len(tasks) + 2) + "|",
    ]
    for m in res["models"].values():
        c = m["format"]["compliance"]
        lines.append(
            f"| {m['label']} | "
            + " | ".join(_pct(c[t]["acc"]) for t in tasks)
            + f" | {_pct(m['format']['mean'])}{_ci(m['format']['mean_ci'])} |"
        )
    return lines


def _commit(commit: str | None) -> str:
    """Short hash, keeping a `+changes` mark (the run used uncommitted code)."""
    if not commit:
        return "?"
    head, plus, rest = commit.partition("+")
    return head[:10] + plus + rest


def _diff(c: dict | None) -> str:
    return "—" if c is None or c["mean_diff"] is None else f"{100 * c['mean_diff']:+.1f}{_ci(c['ci'])}"


def outcome(res: dict) -> dict:
    """The outcome the diagnostics are set beside: RAM+ minus task arithmetic w = 1 (mean accuracy, points, with
    its interval) and both retained shares, for the merge of all agents."""
    m = res["models"]
    return {
        "ramplus_minus_ta_sum": res["ramplus_vs"].get("ta_sum"),
        "retained": {k: m[k].get("retained_mean") for k in ("ramplus", "ta_sum") if k in m},
    }


def diagnostics_section(res: dict) -> list[str]:
    """Per pair of agents: the diagnostics of `mergekit-ram inspect` beside the pair's own merges (when built)."""
    pairs = res.get("pairs") or []
    if not pairs:
        return []
    o = outcome(res)
    merged = any("ramplus_minus_ta_sum" in p for p in pairs)
    out = [
        "",
        "## Diagnostics beside the outcome",
        "",
        "Per pair of agents (`mergekit-ram inspect`): the entries both changed (share of the sparser agent's "
        "changed entries), the share of those where the two updates have the same sign, and the cosine of the two "
        "task vectors over them."
        + (
            " Beside them, the same pair merged alone by `ramplus` and by task arithmetic w = 1: the difference "
            "in mean accuracy on the pair's two tasks and each merge's retained share of the two specialists' gains."
            if merged
            else ""
        ),
        "",
        "| agents | entries both changed | same sign | cosine"
        + (" | ramplus - TA w=1 (points) [95% CI] | retained: ramplus | retained: TA w=1 |" if merged else " |"),
        "|---|---|---|---" + ("|---|---|---|" if merged else "|"),
    ]
    for p in pairs:
        cells = [
            " + ".join(p["agents"]),
            f"{p['common']:,} ({_pct(p.get('common_share'))} %)" if "common" in p else "—",
            f"{_pct(p.get('same_sign_share'))} %",
            "—" if p.get("cosine") is None else f"{p['cosine']:.3f}",
        ]
        if merged:
            got = p.get("merges", {})
            cells += [
                _diff(p.get("ramplus_minus_ta_sum")),
                _share(got.get("ramplus", {}).get("retained_mean")),
                _share(got.get("ta_sum", {}).get("retained_mean")),
            ]
        out.append("| " + " | ".join(cells) + " |")
    if o["ramplus_minus_ta_sum"] is not None:
        r = o["retained"]
        out += [
            "",
            f"All agents merged: ramplus - task arithmetic w = 1 = {_diff(o['ramplus_minus_ta_sum'])} points of mean "
            f"accuracy; retained share ramplus {_share(r.get('ramplus'))}, task arithmetic w = 1 "
            f"{_share(r.get('ta_sum'))}.",
        ]
    return out


def markdown(res: dict, short: bool = False) -> str:
    tasks = list(res["tasks"])
    n = res["eval"]["n"]
    out = [f"# Merge quality: `{res['config_name']}` configuration", ""]
    cfg = res["config"]
    base_stage = res["stages"].get("base", {})
    out += [
        f"Command: `{res['command']}`  ",
        f"Date {res['date']}, commit `{_commit(res['git_commit'])}`, {res['machine']['cpu']}, "
        f"{res['machine']['cores']} cores"
        + (f" ({c} kernels)" if (c := res["machine"].get("torch_cpu_capability")) else "")
        + f", torch {res['machine']['torch']}, mergekit {res['machine']['mergekit']}. "
        f"This run: {res['runtime_s']:.0f} s; building every stage from scratch: "
        f"{res['build_seconds_total']:.0f} s.",
        "",
        f"Accuracy in % (greedy decoding, exact match, n = {', '.join(f'{t} {n[t]}' for t in tasks)} "
        "fixed held-out items; ± is the binomial standard error). Retained share of gain = "
        "(merged - base) / (specialist - base) on each task whose specialist gain is significant, averaged "
        "over those tasks; intervals: 95 % paired bootstrap over eval items.",
        "",
    ]
    if "format" in res:
        f = res["format"]
        out += [
            f"Shared regime: every agent's reward also required the answer in the format `{f['open']}…{f['close']}`; "
            "task accuracy is scored on the answer's content whatever its format, compliance with the format "
            "on its own.",
            "",
        ]
    out += accuracy_table(res)
    if short:
        return "\n".join(out) + "\n"
    if "format" in res:
        out += format_table(res)

    out += [
        "",
        "## Specialists' gains on their own task",
        "",
        "| task | base | specialist | gain (points) [95% CI] | ≥ +15 points? |",
        "|---|---|---|---|---|",
    ]
    for t, g in res["gains"].items():
        out.append(
            f"| {t} | {_pct(g['base'])} | {_pct(g['specialist'])} | {100 * g['gain']:+.1f}"
            f"{_ci(g['gain_ci'])} | {'yes' if g['meets_bar_15_points'] else 'no'} |"
        )

    merges = {k: m for k, m in res["models"].items() if m["kind"] == "merge"}
    if merges:
        out += [
            "",
            "## Retained share of each specialist's gain (%)",
            "",
            "| merge | " + " | ".join(tasks) + " | mean |",
            "|---" * (len(tasks) + 2) + "|",
        ]
        for m in merges.values():
            cells = [_share(m["retained"][t], unit="") for t in tasks]
            out.append(f"| {m['label']} | " + " | ".join([*cells, _share(m.get("retained_mean"), unit="")]) + " |")

    if res["density"]:
        out += [
            "",
            "## bf16 task vectors: density and overlap (`mergekit-ram inspect`, ε = 1e-5)",
            "",
            "| agent | changed weights | of those: unique | shared with 1 | shared with ≥ 2 | ρ | λ (r 0.1, α 2) "
            "| share of Σ\\|τ\\| in unique entries | changes of one bf16 step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t, d in res["density"].items():
            rho = d["rho_counted"]
            out.append(
                f"| {t} | {_pct(d['density'])} % | {_pct(d['unique_share'])} % | "
                f"{_pct(d['shared_with_1_share'])} % | {_pct(d['shared_with_2plus_share'])} % | "
                f"{rho if isinstance(rho, str) else f'{rho:.3f}'} | "
                + ("—" if d["lambda"] is None else f"{d['lambda']:.4f}")
                + f" | {_pct(d.get('magnitude_unique_share'))} % | {_pct(d.get('single_step_share'))} % |"
            )
    out += diagnostics_section(res)

    if res["r_sweep"]:
        out += _sweep_table("## r sweep (ramplus, α = 2)", "r", "r", res["r_sweep"], str)
    if len(res.get("epsilon_sweep", [])) > 1:
        out += _sweep_table(
            "## ε sweep (ramplus, r = 0.1, α = 2)", "ε", "epsilon", res["epsilon_sweep"], lambda e: f"{e:g}"
        )

    if res["ramplus_vs"]:
        out += [
            "",
            "## ramplus against each other merge (mean accuracy, paired bootstrap)",
            "",
            "| other merge | ramplus - other (points) [95% CI] | verdict |",
            "|---|---|---|",
        ]
        for m, c in res["ramplus_vs"].items():
            out.append(f"| {res['models'][m]['label']} | {100 * c['mean_diff']:+.1f}{_ci(c['ci'])} | {c['verdict']} |")

    out += ["", "## Stages", "", "| stage | key | cached in this run | build seconds |", "|---|---|---|---|"]
    for name, s in res["stages"].items():
        evals = f"{s.get('models_cached', 0)} of {s.get('models_cached', 0) + s.get('models_evaluated', 0)} models"
        cached = s.get("cached", evals)
        out.append(f"| {name} | {s.get('key', '—')} | {cached} | {s.get('build_seconds', 0):.1f} |")
    base_hist = base_stage.get("history") or []
    if base_hist:
        pc = cfg["pretrain"]
        stop = (
            f"stopped by its probe (mean ≥ {pc['stop_mean']}, each task ≥ {pc['stop_min']}) or at {pc['steps']} steps"
            if pc["stop_mean"] <= 1
            else "a fixed budget" + (", learning rate decayed linearly to 0" if pc.get("decay") else "")
        )
        noise = pc.get("noise") or {}
        out += [
            "",
            f"Base: {base_stage.get('parameters', 0):,} parameters, pretrained {base_stage.get('steps')} steps "
            f"({stop}); "
            + (
                "share of pretraining answers that are the task's systematic error: "
                + ", ".join(f"{t} {v}" for t, v in noise.items())
                if noise
                else "a clean corpus"
            )
            + ".",
        ]
        variant = res["stages"].get("base format")
        if variant and "midtrain" in cfg:
            mc = cfg["midtrain"]
            fmt_probe = (variant.get("history") or [{}])[-1].get("probe_format", {})
            out.append(
                f"Shared regime's base: that base trained on {variant.get('steps')} more steps (lr {mc['lr']}, "
                f"decayed to 0) on the same corpus with {mc['format_share']:.0%} of the answers in the format; "
                "its greedy format compliance on the probe: "
                + ", ".join(f"{t} {100 * v:.1f} %" for t, v in fmt_probe.items())
                + "."
            )
        rl = cfg["rl"]
        steps = {t: R.rl_settings(cfg, t)["steps"] for t in tasks}
        out.append(
            f"Agents: GRPO, lr {rl['lr']}, {rl['prompts']} prompts x {rl['group']} samples per step, steps "
            + ", ".join(f"{t} {n}" for t, n in steps.items())
            + "."
        )
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- #
# Chart
# --------------------------------------------------------------------------- #
def chart(res: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart.png")
        return None
    tasks = list(res["tasks"])
    rows = list(res["models"])
    labels = [res["models"][r]["label"] for r in rows]
    data = [
        [100 * res["models"][r]["accuracy"][t]["acc"] for t in tasks] + [100 * res["models"][r]["mean"]] for r in rows
    ]
    columns = [*tasks, "mean"]
    if "format" in res:  # the shared regime: compliance with the common format beside the accuracies
        for r, row in zip(rows, data, strict=True):
            row.append(100 * res["models"][r]["format"]["mean"])
        columns.append("format")
    merges = [r for r in rows if res["models"][r].get("retained_mean")]
    fig, axes = plt.subplots(
        1, 2, figsize=(13, 1.6 + 0.38 * len(rows)), constrained_layout=True, gridspec_kw={"width_ratios": [1.3, 1]}
    )
    ax = axes[0]
    image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.set_title(
        "accuracy (%), greedy exact match" + (" (content); format: compliance (%)" if "format" in res else ""),
        fontsize=10,
    )
    fig.colorbar(image, ax=ax, shrink=0.7)
    ax = axes[1]
    if merges:
        xlabel = "retained share of the specialists' gains (%)\nmean over tasks, 95 % CI"
        paired.retained_bars(ax, res["models"], merges, xlabel)
    else:
        ax.text(0.5, 0.5, "no specialist gain is significant:\nretained share undefined", ha="center", va="center")
        ax.set_axis_off()
    fig.suptitle(
        f"Merge quality ({res['config_name']}): {len(tasks)} tasks, n = {min(res['eval']['n'].values())} per task"
        + (", agents rewarded for a common format too" if "format" in res else ""),
        fontsize=11,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
