"""Both regimes side by side: do the diagnostics of `mergekit-ram inspect` tell which merge keeps more?

    python benchmarks/quality/regimes.py benchmarks/quality/results/full benchmarks/quality/results/shared \
        --out benchmarks/quality/results/regimes.md

Reads each run's results.json (made by run.py: the merge of all agents and the same merges of every pair of
agents, each beside the pairs' diagnostics) and writes one table per level (regime, pair), a scatter of each pair
diagnostic against the outcome (`regimes.png` beside the markdown) and, for each diagnostic, whether one threshold
on it separates the pairs where `ramplus` kept more than task arithmetic w = 1 from those where it kept less.
Every figure is computed from the results; nothing here is typed in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# this benchmark's modules by name, then those it shares with the policies benchmark (benchmarks/staging.py)
sys.path[:0] = [str(HERE), str(HERE.parent)]
import report as P  # noqa: E402

#: pair diagnostics tried as a rule: (key, label)
PAIR_DIAGNOSTICS = [
    ("same_sign_share", "same-sign share"),
    ("cosine", "cosine over common entries"),
    ("common_share", "entries both changed"),
]


def _range(values: list[float | None], pct: bool = True) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "—"
    lo, hi = min(got), max(got)
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.3f}")
    return f"{f(lo)} to {f(hi)}" + (" %" if pct else "")


def verdict(c: dict | None) -> str | None:
    """'better' / 'worse' / 'tie' for ramplus against task arithmetic w = 1, from the interval."""
    if c is None or c["ci"][0] is None:
        return None
    lo, hi = c["ci"]
    return "better" if lo > 0 else "worse" if hi < 0 else "tie"


def separation(points: list[tuple[float, str]]) -> str:
    """Does one threshold on the diagnostic put every pair of one verdict on one side? `points`: (value, verdict)."""
    verdicts = {v for _, v in points}
    if len(verdicts) < 2:
        only = next(iter(verdicts), "none")
        return f"nothing to separate: every pair's verdict is '{only}'"
    ordered = sorted(points)
    for i in range(1, len(ordered)):
        low, high = {v for _, v in ordered[:i]}, {v for _, v in ordered[i:]}
        if len(low) == 1 and len(high) == 1 and low != high and ordered[i - 1][0] < ordered[i][0]:
            theta = (ordered[i - 1][0] + ordered[i][0]) / 2
            return f"yes: below {theta:.3f} '{low.pop()}', above '{high.pop()}'"
    return "no single threshold separates the verdicts"


def spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3:
        return None
    rx, ry = (np.argsort(np.argsort(v)).astype(float) for v in (x, y))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def load(folder: Path) -> dict:
    res = json.loads((folder / "results.json").read_text())
    res["_folder"] = str(folder)
    return res


def markdown(runs: list[dict]) -> tuple[str, list[dict]]:
    out = [
        "# The two regimes side by side",
        "",
        "Made by `python benchmarks/quality/regimes.py "
        + " ".join(r["_folder"] for r in runs)
        + "` from each run's `results.json` (every figure computed there: see each run's `results.md`).",
        "",
        "## Merge of all agents",
        "",
        "| regime | changed weights | Σ\\|τ\\| in unique entries | one-step changes | pairs: same sign | "
        "pairs: cosine | ramplus - TA w=1 (points) [95% CI] | retained: ramplus | retained: TA w=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    pair_rows = []
    for r in runs:
        d, pairs, o = r["density"], r.get("pairs") or [], P.outcome(r)
        out.append(
            f"| {r['config_name']} | "
            + " | ".join(
                [
                    _range([a["density"] for a in d.values()]),
                    _range([a.get("magnitude_unique_share") for a in d.values()]),
                    _range([a.get("single_step_share") for a in d.values()]),
                    _range([p.get("same_sign_share") for p in pairs]),
                    _range([p.get("cosine") for p in pairs], pct=False),
                    P._diff(o["ramplus_minus_ta_sum"]),
                    P._share(o["retained"].get("ramplus")),
                    P._share(o["retained"].get("ta_sum")),
                ]
            )
            + " |"
        )
        for p in pairs:
            pair_rows.append({"regime": r["config_name"], **p, "verdict": verdict(p.get("ramplus_minus_ta_sum"))})
    out += [
        "",
        "Ranges are over the agents (first three columns) and over the pairs of agents (next two).",
        "",
        "## Each pair merged alone",
        "",
        "| regime | agents | entries both changed | same sign | cosine | ramplus - TA w=1 (points) [95% CI] | "
        "verdict | retained: ramplus | retained: TA w=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pair_rows:
        got = p.get("merges", {})
        out.append(
            "| "
            + " | ".join(
                [
                    p["regime"],
                    " + ".join(p["agents"]),
                    f"{P._pct(p.get('common_share'))} %",
                    f"{P._pct(p.get('same_sign_share'))} %",
                    "—" if p.get("cosine") is None else f"{p['cosine']:.3f}",
                    P._diff(p.get("ramplus_minus_ta_sum")),
                    p["verdict"] or "—",
                    P._share(got.get("ramplus", {}).get("retained_mean")),
                    P._share(got.get("ta_sum", {}).get("retained_mean")),
                ]
            )
            + " |"
        )
    judged = [p for p in pair_rows if p["verdict"] is not None]
    out += [
        "",
        f"## Does one diagnostic separate the outcomes? ({len(judged)} pairs)",
        "",
        "Verdict per pair: 'better' where the 95 % interval of ramplus - task arithmetic w = 1 lies above 0, "
        "'worse' below, 'tie' across. A rule is a single threshold on one diagnostic with one verdict on each side.",
        "",
        "| diagnostic | one threshold separates the verdicts? | Spearman ρ with ramplus - TA w=1 |",
        "|---|---|---|",
    ]
    for key, label in PAIR_DIAGNOSTICS:
        pts = [(p[key], p["verdict"]) for p in judged if p.get(key) is not None]
        rho = spearman(
            [p[key] for p in judged if p.get(key) is not None],
            [p["ramplus_minus_ta_sum"]["mean_diff"] for p in judged if p.get(key) is not None],
        )
        out.append(f"| {label} | {separation(pts)} | {'—' if rho is None else f'{rho:+.2f}'} |")
    return "\n".join(out) + "\n", pair_rows


def chart(pair_rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no regimes.png")
        return None
    rows = [p for p in pair_rows if p.get("ramplus_minus_ta_sum")]
    if not rows:
        return None
    regimes = sorted({p["regime"] for p in rows})
    fig, axes = plt.subplots(
        1, len(PAIR_DIAGNOSTICS), figsize=(4.2 * len(PAIR_DIAGNOSTICS), 3.8), constrained_layout=True, sharey=True
    )
    for ax, (key, label) in zip(axes, PAIR_DIAGNOSTICS, strict=True):
        for i, regime in enumerate(regimes):
            got = [p for p in rows if p["regime"] == regime and p.get(key) is not None]
            x = [p[key] for p in got]
            y = [100 * p["ramplus_minus_ta_sum"]["mean_diff"] for p in got]
            err = [
                [v - 100 * p["ramplus_minus_ta_sum"]["ci"][0] for v, p in zip(y, got, strict=True)],
                [100 * p["ramplus_minus_ta_sum"]["ci"][1] - v for v, p in zip(y, got, strict=True)],
            ]
            ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, label=regime, color=f"C{i}")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel(label)
    axes[0].set_ylabel("ramplus - task arithmetic w=1\n(points, pair's two tasks, 95 % CI)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Each pair of agents merged alone: outcome against the pair's diagnostics", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results folders of run.py (each with results.json)")
    ap.add_argument("--out", type=Path, help="write the markdown here (and regimes.png beside it)")
    args = ap.parse_args(argv)
    text, pair_rows = markdown([load(f) for f in args.results])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        chart(pair_rows, args.out.with_suffix(".png"))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
