"""Reporting: results.json's runs into summaries, results.md (tables, targets, scaling fits) and the chart.

Reads only the results dict run.py writes (and, for the checkpoint tensor counts, the workloads' files), so
`run.py --rerender` and the unit tests render results without measuring anything. measure.py records them.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import workloads
from measure import METHODS, PYTORCH, SAMPLE_S, STARTUP

NOISY = 1.2  # max/min wall over repeats above which a row is flagged


# --------------------------------------------------------------------------- #
# Runs to summaries
# --------------------------------------------------------------------------- #
def valid(run: dict) -> bool:
    """Undisturbed by other processes, and a warm run that really hit the statistics cache."""
    return not run.get("disturbed") and run.get("cache_hit", True) is not False


def summarize(runs: list[dict]) -> dict:
    """A method's summary: medians over its valid runs (over all that succeeded where none is valid), or its failure."""
    runs = [r for r in runs if not r.get("superseded")]
    ok = [r for r in runs if r.get("ok") and "priming" not in r]
    if not ok:
        errors = [r["error"] for r in runs if r.get("error")]
        out = {"ok": False, "error": errors[0] if errors else "no run"}
        if runs and all(r.get("timed_out") for r in runs if "priming" not in r):
            out["timed_out_s"] = min(r["wall_s"] for r in runs if "priming" not in r)
        return out
    clean = [r for r in ok if valid(r)]
    use = clean or ok  # runs still invalid after all retries count only when no valid run exists
    walls = [r["wall_s"] for r in use]
    anon = [r["peak_rss_anon_kib"] * 1024 / 1e9 for r in use if r.get("rss_samples")]  # absent in older results
    return {"ok": True, "n": len(use), "wall_s": statistics.median(walls), "wall_min_s": min(walls),
            "wall_max_s": max(walls), "rss_gb": statistics.median(r["maxrss_kib"] * 1024 / 1e9 for r in use),
            "rss_anon_gb": statistics.median(anon) if anon else None,
            "cpu_s": statistics.median(r["user_s"] + r["sys_s"] for r in use) if all("user_s" in r for r in use) else None,
            "read_gb": statistics.median(r["read_gb"] for r in use) if all("read_gb" in r for r in use) else None,
            "failed_runs": len(runs) - len(ok), "invalid_left_out": len(ok) - len(use),
            "invalid_used": len(use) - len(clean)}


# --------------------------------------------------------------------------- #
# results.md
# --------------------------------------------------------------------------- #
def describe(marker: dict) -> str:
    p = marker["params"]
    experts = f" × {p['num_experts']} experts (width {p['intermediate_size']})" if p.get("num_experts") else ""
    tensors = f", {workloads.tensor_count(marker):,} checkpoint tensors" if experts else ""
    return (f"{p['arch']}, hidden {p['hidden_size']}, {p['num_layers']} layers{experts}{tensors}, vocab {p['vocab_size']}, "
            f"{'tied' if p['tie_word_embeddings'] else 'untied'}, {len(p['densities'])} agents "
            f"(densities {', '.join(f'{d:.0%}' for d in p['densities'])}), {p['dtype']}, "
            f"{marker['num_parameters'] / 1e6:.1f}M params per model")


def _ratio(a: dict, b: dict | None, key: str = "wall_s") -> float | None:
    if not (a.get("ok") and b and b.get("ok")):
        return None
    return a[key] / b[key] if b[key] else None


def fmt(x, spec=".2f", suffix="") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def workload_markdown(res: dict) -> str:
    s = {m: v["summary"] for m, v in res["methods"].items()}
    startup = s.get("help", {}).get("wall_s") if s.get("help", {}).get("ok") else None
    ta, ram, floor = s.get("task_arithmetic"), s.get("ram"), s.get("io_floor")
    # mergekit-pytorch rows: against mergekit-pytorch's own start-up and task_arithmetic
    flat_startup = s.get("pytorch_help", {}).get("wall_s") if s.get("pytorch_help", {}).get("ok") else None
    flat_ta = s.get("pytorch_task_arithmetic")
    # the I/O-floor and RssAnon columns only where measured (older results.json have neither)
    floor_col = bool(floor and floor["ok"])
    anon_col = any(x.get("rss_anon_gb") is not None for x in s.values())
    cpu_col = any(x.get("cpu_s") is not None for x in s.values())  # and the merge phase's ratio beside it
    lines = [f"## {res['workload']['name']}: {describe(res['workload'])}", ""]
    if res.get("page_cache"):
        lines += [f"Page cache: {res['page_cache']}"
                  + (" (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root)." if res["page_cache"].startswith("dropped")
                     else "."), ""]
    lines += ["| method | wall s (median) | peak RSS GB |" + (" peak RssAnon GB | read GB |" if anon_col else "")
              + " × task_arithmetic | × ram |" + (" × I/O floor |" if floor_col else "")
              + " merge phase s |" + (" merge phase × task_arithmetic | CPU s (median) |" if cpu_col else "")
              + " wall s min–max |",
              "|---|---|---|" + ("---|---|" if anon_col else "") + "---|---|" + ("---|" if floor_col else "")
              + ("---|---|" if cpu_col else "") + "---|---|"]
    for m, v in res["methods"].items():
        x = s[m]
        if not x["ok"]:
            what = f"> {x['timed_out_s']:.0f} (timed out)" if x.get("timed_out_s") else f"**failed**: {x['error']}"
            lines.append(f"| {v['label']} | {what} |" + " — |" * (5 + 2 * anon_col + floor_col + 2 * cpu_col))
            continue
        flat = m in PYTORCH
        begin = flat_startup if flat else startup
        phase = x["wall_s"] - begin if begin is not None and m not in (*STARTUP, "io_floor") else None
        against = flat_ta if flat else ta
        ta_phase = against["wall_s"] - begin if begin is not None and against and against.get("ok") else None
        phase_ratio = phase / ta_phase if phase is not None and ta_phase and ta_phase >= 0.05 else None
        ratios = (None, None) if m in STARTUP else (_ratio(x, against), None if flat else _ratio(x, ram))
        notes = [f"{x['failed_runs']} failed"] if x["failed_runs"] else []
        if x.get("invalid_left_out"):
            notes.append(f"median of {x['n']}; {x['invalid_left_out']} disturbed or cache-miss runs left out")
        if x.get("invalid_used"):
            notes.append(f"{x['invalid_used']} of {x['n']} disturbed or cache misses")
        failed = f" ({'; '.join(notes)})" if notes else ""
        anon = f" {fmt(x.get('rss_anon_gb'))} | {fmt(x.get('read_gb'), '.1f')} |" if anon_col else ""
        cpu = f" {fmt(phase_ratio, '.2f', '×')} | {fmt(x.get('cpu_s'))} |" if cpu_col else ""
        vs_floor = f" {fmt(None if m in STARTUP else _ratio(x, floor), '.2f', '×')} |" if floor_col else ""
        lines.append(f"| {v['label']} | {x['wall_s']:.2f} | {x['rss_gb']:.2f} |{anon} {fmt(ratios[0], '.2f', '×')} | "
                     f"{fmt(ratios[1], '.2f', '×')} |{vs_floor} {fmt(phase)} |{cpu} "
                     f"{x['wall_min_s']:.2f}–{x['wall_max_s']:.2f}{failed} |")
    noisy = [f"{res['methods'][m]['label']} ({x['wall_max_s'] / x['wall_min_s']:.2f}×)" for m, x in s.items()
             if x["ok"] and x["wall_max_s"] > NOISY * x["wall_min_s"]]
    lines += ["", targets(s, startup), ""]
    if any(m in s for m in PYTORCH):
        lines += [flat_targets(s, flat_startup), "",
                  "mergekit-pytorch rows: × task_arithmetic is × mergekit-pytorch's task_arithmetic, the merge phase "
                  "after mergekit-pytorch's start-up; each model is its one .safetensors file.", ""]
    if floor_col and str(res.get("page_cache", "")).startswith("dropped"):
        lines += [floor_targets(s), ""]
    if noisy:
        lines += [f"Noisy (max/min wall over repeats > {NOISY}): {', '.join(noisy)}.", ""]
    timed = [(r.get("others_cpu_s", 0.0), v["label"]) for v in res["methods"].values() for r in v["runs"]
             if r.get("ok") and not r.get("superseded")]
    redone = sum(r.get("superseded", False) for v in res["methods"].values() for r in v["runs"])
    if redone:
        lines += [f"Measured again: {redone} run(s) disturbed by other processes or warm runs that missed the "
                  "cache (kept in results.json, left out of the medians).", ""]
    changed = {r["sources"] for v in res["methods"].values() for r in v["runs"] if r.get("sources")}
    if len(changed) > 1:
        lines += [f"mergekit_ram's sources changed during this benchmark ({len(changed)} versions measured).", ""]
    if timed:
        worst = max(timed)
        lines += [f"Other processes used {sum(t for t, _ in timed):.1f} CPU s during the timed runs "
                  f"(most during one {worst[1]} run: {worst[0]:.1f} s).", ""]
    return "\n".join(lines)


def targets(s: dict, startup: float | None) -> str:
    """One line: which performance targets are met."""
    ta = s.get("task_arithmetic")
    if not (ta and ta["ok"]):
        return "Targets: not evaluated (no task_arithmetic run)."
    warm_id = "ramplus_warm" if s.get("ramplus_warm", {}).get("ok") else "ramplus_r0"
    out = []

    def check(label, ok, detail):
        out.append(f"{label}: {'**met**' if ok else '**MISSED**'} ({detail})")

    def phase_ratio(x, y=ta):
        if startup is None or y["wall_s"] - startup < 0.05:
            return None  # no measurable merge phase
        return (x["wall_s"] - startup) / (y["wall_s"] - startup)

    for mid, limit, label in (("ramplus_cold", 1.2, "cold ≤ 1.2× task_arithmetic"),
                              (warm_id, 1.0, f"warm{' (r=0 proxy)' if warm_id == 'ramplus_r0' else ''} ≤ 1.0× task_arithmetic")):
        x = s.get(mid)
        if x and x["ok"]:
            r = x["wall_s"] / ta["wall_s"]
            check(label, r <= limit, f"{r:.2f}× wall, {fmt(phase_ratio(x), '.2f', '×')} merge phase")
    ours = [s[m] for m in ("ramplus_cold", "ramplus_warm", "ramplus_r0") if s.get(m, {}).get("ok")]
    if ours:
        peak = max(x["rss_gb"] for x in ours)
        check("ramplus peak RSS ≤ task_arithmetic's", peak <= ta["rss_gb"], f"{peak:.2f} vs {ta['rss_gb']:.2f} GB")
    ties, cold = s.get("ties"), s.get("ramplus_cold")
    if ties and ties["ok"] and cold and cold["ok"]:
        r = ties["wall_s"] / cold["wall_s"]
        check("ramplus cold ≥ 3× faster than ties", r >= 3, f"{r:.2f}× wall, {fmt(phase_ratio(ties, cold), '.2f', '×')} merge phase")
    return "Targets: " + "; ".join(out) + "." if out else "Targets: not evaluated."


def flat_targets(s: dict, startup: float | None) -> str:
    """One line: mergekit-pytorch's ramplus against its task_arithmetic (wall ≤ 1.1×, peak RssAnon no higher)."""
    ta = s.get("pytorch_task_arithmetic")
    if not (ta and ta["ok"]):
        return "mergekit-pytorch targets: not evaluated (no mergekit-pytorch task_arithmetic run)."
    out = []
    for mid in ("pytorch_ramplus_cold", "pytorch_ramplus_warm"):
        x = s.get(mid)
        if not (x and x["ok"]):
            continue
        r = x["wall_s"] / ta["wall_s"]
        phase = None if startup is None or ta["wall_s"] - startup < 0.05 else (x["wall_s"] - startup) / (ta["wall_s"] - startup)
        out.append(f"{METHODS[mid][0]} ≤ 1.1× its task_arithmetic: {'**met**' if r <= 1.1 else '**MISSED**'} "
                   f"({r:.2f}× wall, {fmt(phase, '.2f', '×')} merge phase)")
        if x.get("rss_anon_gb") is not None and ta.get("rss_anon_gb") is not None:
            ok = x["rss_anon_gb"] <= ta["rss_anon_gb"]
            out.append(f"its peak RssAnon ≤ task_arithmetic's: {'**met**' if ok else '**MISSED**'} "
                       f"({x['rss_anon_gb']:.2f} vs {ta['rss_anon_gb']:.2f} GB)")
    return "mergekit-pytorch targets: " + ("; ".join(out) if out else "not evaluated") + "."


def floor_targets(s: dict) -> str:
    """Disk-bound targets (page cache dropped): ramplus against the I/O floor of the same inputs, RssAnon vs TA."""
    floor, ta = s["io_floor"], s.get("task_arithmetic")
    out = []
    for mid, limit in (("ramplus_warm", 1.3), ("ramplus_r0", 1.3), ("ramplus_cold", 1.45)):
        x = s.get(mid)
        if x and x["ok"]:
            r = x["wall_s"] / floor["wall_s"]
            out.append(f"{METHODS[mid][0]} ≤ {limit}× I/O floor: {'**met**' if r <= limit else '**MISSED**'} ({r:.2f}×)")
    ours = [s[m]["rss_anon_gb"] for m in ("ramplus_cold", "ramplus_warm", "ramplus_r0")
            if s.get(m, {}).get("ok") and s[m].get("rss_anon_gb") is not None]
    if ours and ta and ta["ok"] and ta.get("rss_anon_gb") is not None:
        peak = max(ours)
        out.append(f"ramplus peak RssAnon ≤ task_arithmetic's: {'**met**' if peak <= ta['rss_anon_gb'] else '**MISSED**'} "
                   f"({peak:.2f} vs {ta['rss_anon_gb']:.2f} GB)")
    return "I/O-floor targets (page cache dropped): " + ("; ".join(out) if out else "not evaluated") + "."


def header_markdown(report: dict) -> str:
    m = report["machine"]
    return "\n".join([
        f"# mergekit-ram benchmark ({m['date']})", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('ram_gb', '?')} GB RAM{', GPU ' + str(m['gpu']) if m.get('gpu') else ''}; "
        f"torch {m['torch']}, mergekit {m['mergekit']}, mergekit-ram {m['mergekit-ram']}; "
        f"commit {str(m['git_commit'])[:12]}{' (dirty tree)' if m['git_dirty'] else ''}, "
        f"mergekit_ram sources {m.get('mergekit_ram_sources_sha256')}.",
        f"Command: `{report['command']}`; {report['repeats']} repeats, methods round-robin, medians; "
        f"whole processes, {'page cache dropped before every run' if report.get('drop_cache') else 'warm page cache'}; "
        f"peak RssAnon sampled every {report.get('sample_s', SAMPLE_S)} s over the process tree. Total benchmark wall time {report['total_wall_s']:.0f} s.", "", ""])


# --------------------------------------------------------------------------- #
# Scaling series
# --------------------------------------------------------------------------- #
def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b·x; returns (a, b, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def scaling_series(report: dict) -> tuple[str, list[float], dict[str, list[float | None]]]:
    by = report["scaling"]
    label = {"size": "params (M)", "agents": "agents N", "tensors": "checkpoint tensors"}[by]
    xs = [r["workload"]["num_parameters"] / 1e6 if by == "size" else
          workloads.tensor_count(r["workload"]) if by == "tensors" else len(r["workload"]["params"]["densities"])
          for r in report["workloads"]]
    ys = {m: [r["methods"][m]["summary"].get("wall_s") for r in report["workloads"]]
          for m in report["methods"] if m != "help"}
    return label, xs, ys


def scaling_markdown(report: dict) -> str:
    label, xs, ys = scaling_series(report)
    methods = list(ys)
    lines = [f"## Scaling over {report['scaling']}", "",
             "| workload | " + label + " | " + " | ".join(f"{METHODS[m][0]} s" for m in methods) + " |",
             "|---" * (2 + len(methods)) + "|"]
    for i, r in enumerate(report["workloads"]):
        lines.append(f"| {r['workload']['name']} | {xs[i]:g} | " + " | ".join(_cell(r, m, ys[m][i]) for m in methods) + " |")
    if report["scaling"] == "tensors":
        lines += _per_tensor(report, xs, methods)
    lines += ["", "Least-squares fit, wall s = a + b·x:", ""]
    for m in methods:
        pts = [(x, y) for x, y in zip(xs, ys[m]) if y is not None]
        if len(pts) >= 2:
            a, b, r2 = fit(*zip(*pts))
            unit = {"size": "M params", "agents": "agent", "tensors": "tensor"}[report["scaling"]]
            lines.append(f"- {METHODS[m][0]}: a = {a:.3f} s, b = {b:.4f} s per {unit}, R² = {r2:.4f}")
    return "\n".join(lines) + "\n\n"


def _cell(res: dict, method: str, wall: float | None) -> str:
    x = res["methods"][method]["summary"]
    return f"> {x['timed_out_s']:.0f}" if x.get("timed_out_s") else fmt(wall)


def _per_tensor(report: dict, xs: list[float], methods: list[str]) -> list[str]:
    """Merge-phase milliseconds per checkpoint tensor: (wall - start-up) / tensors."""
    lines = ["", "Milliseconds per checkpoint tensor, (wall − `--help` start-up) / tensors:", "",
             "| workload | tensors | " + " | ".join(f"{METHODS[m][0]}" for m in methods) + " |",
             "|---" * (2 + len(methods)) + "|"]
    for i, r in enumerate(report["workloads"]):
        s = {m: v["summary"] for m, v in r["methods"].items()}
        start = s.get("help", {}).get("wall_s") if s.get("help", {}).get("ok") else None
        cells = []
        for m in methods:
            x = s[m]
            if start is None:
                cells.append("—")
            elif x.get("timed_out_s"):
                cells.append(f"> {(x['timed_out_s'] - start) / xs[i] * 1e3:.2f}")
            else:
                cells.append(fmt((x["wall_s"] - start) / xs[i] * 1e3) if x["ok"] else "—")
        lines.append(f"| {r['workload']['name']} | {xs[i]:g} | " + " | ".join(cells) + " |")
    if "ramplus_cold" in methods and "ramplus_r0" in methods:
        lines += _prepass_per_tensor(report, xs)
    return lines


def _prepass_per_tensor(report: dict, xs: list[float]) -> list[str]:
    """The statistics pre-pass alone: ramplus cold minus r = 0 (same merge, no pre-pass), per tensor."""
    lines = ["", "The statistics pre-pass alone, ramplus cold − ramplus r=0 (the same merge without it):", "",
             "| workload | tensors | pre-pass s | ms per tensor |", "|---|---|---|---|"]
    pts = []
    for i, r in enumerate(report["workloads"]):
        cold, r0 = (r["methods"].get(m, {}).get("summary", {}) for m in ("ramplus_cold", "ramplus_r0"))
        if cold.get("ok") and r0.get("ok"):
            d = cold["wall_s"] - r0["wall_s"]
            pts.append((xs[i], d))
            lines.append(f"| {r['workload']['name']} | {xs[i]:g} | {fmt(d)} | {fmt(d / xs[i] * 1e3)} |")
        else:
            lines.append(f"| {r['workload']['name']} | {xs[i]:g} | — | — |")
    if len(pts) >= 2:
        a, b, r2 = fit(*zip(*pts))
        lines += ["", f"Fit: pre-pass s = {a:.3f} + {b * 1e3:.3f} ms × tensors (R² = {r2:.4f}); a cost growing with "
                  "the square of the count would bend this line upwards."]
    return lines


# --------------------------------------------------------------------------- #
# Chart and files
# --------------------------------------------------------------------------- #
def chart(report: dict, path: Path) -> None:
    """Wall-time and peak-RSS bars (or the scaling fit); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no chart (pip install matplotlib)", file=sys.stderr)
        return
    if report.get("scaling"):
        label, xs, ys = scaling_series(report)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, y in ys.items():
            pts = [(x, v) for x, v in zip(xs, y) if v is not None]
            if not pts:
                continue
            px, py = zip(*pts)
            if len(pts) < 2:
                ax.plot(px, py, "o", label=METHODS[m][0])
                continue
            a, b, r2 = fit(px, py)
            line = ax.plot(px, py, "o", label=f"{METHODS[m][0]} (R²={r2:.3f})")[0]
            ax.plot([min(px), max(px)], [a + b * min(px), a + b * max(px)], "--", color=line.get_color())
        if report["scaling"] == "tensors":  # 267 to 24,651 tensors: a quadratic cost shows as slope 2
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("wall s (median, whole process)")
        ax.set_title(f"Scaling over {report['scaling']}")
        ax.legend()
    else:
        res = report["workloads"][0]
        ids = list(res["methods"])
        names = [res["methods"][m]["label"] for m in ids]
        summ = [res["methods"][m]["summary"] for m in ids]
        colors = ["tab:gray" if m in ("help", "io_floor") else "tab:orange" if m.startswith("ramplus_") and m != "ramplus_tl"
                  else "tab:blue" for m in ids]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(ids) + 1.8))
        for ax, key, title in ((ax1, "wall_s", "wall s (median)"), (ax2, "rss_gb", "peak RSS GB")):
            vals = [x[key] if x["ok"] else 0 for x in summ]
            ax.barh(names, vals, color=colors)
            for i, (v, x) in enumerate(zip(vals, summ)):
                ax.text(v, i, f" {v:.2f}" if x["ok"] else " failed", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_title(title)
        ax2.set_yticklabels([])
        fig.suptitle(f"{res['workload']['name']}: {describe(res['workload'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rerender(out: Path) -> None:
    """Recompute the summaries of an existing results.json and write results.md and the chart again."""
    report = json.loads((out / "results.json").read_text())
    for res in report["workloads"]:
        for v in res["methods"].values():
            v["summary"] = summarize(v["runs"])
    write(report, out)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    body = scaling_markdown(report) if report.get("scaling") else ""
    body += "\n".join(workload_markdown(r) for r in report["workloads"])
    (out / "results.md").write_text(header_markdown(report) + body)
    if not report["no_chart"]:
        chart(report, out / ("scaling.png" if report.get("scaling") else "chart.png"))

