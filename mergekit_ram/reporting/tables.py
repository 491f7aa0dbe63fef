"""Presentation: the per-agent tables printed by a merge and `inspect`, and the card's cells."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from mergekit_ram.core.params import DEFAULTS
from mergekit_ram.core.statistics import AgentStats, PairStats, Statistics


def format_table(
    stats: Iterable[AgentStats],
    r: float,
    alpha: float,
    rule: str = DEFAULTS["lambda_rule"],
    labels: Mapping[str, str] | None = None,
) -> str:
    """A plain-text per-agent table in the spirit of the paper's Fig. 2."""
    head = (
        "agent",
        "active",
        "density",
        "unique",
        "shared w/ 1",
        "w/ >=2",
        "rho",
        f"lambda ({_lambda_label(r, alpha, rule)})",
    )
    rows = [head]
    for s in stats:
        uni, one, many = s.shares
        rows.append(
            (
                (labels or {}).get(s.name, s.name),
                f"{s.active:,}",
                f"{100 * s.density:.2f}%",
                f"{100 * uni:.1f}%",
                f"{100 * one:.1f}%",
                f"{100 * many:.1f}%",
                format_number(s.rho),
                f"{s.lambda_(r, alpha, rule):.4f}",
            )
        )
    return _columns(rows)


def format_number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.4g}"


def _lambda_label(r: float, alpha: float, rule: str) -> str:
    return f"r={r:g}, alpha={alpha:g}" if rule == "clip" else f"soft, r={r:g}"


def agent_rows(report: dict) -> list[list[str]]:
    """Per-agent cells of the card's table: label, density, unique, w/ 1, w/ >=2, rho, lambda."""
    rows = []
    for a in report["agents"]:
        counted = "density" in a
        rows.append(
            [
                a["label"],
                _pct(a.get("density")) if counted else "—",
                _pct(a.get("unique_share")) if counted else "—",
                _pct(a.get("shared_with_1_share")) if counted else "—",
                _pct(a.get("shared_with_2plus_share")) if counted else "—",
                _fmt(a["rho"]) + (" (given)" if a.get("rho_source") == "given" else ""),
                "—" if a["lambda"] is None else f"{a['lambda']:.4f}",
            ]
        )
    return rows


def diagnostic_rows(report: dict) -> list[list[str]]:
    """Per-agent diagnostic cells: label, share of |tau| in unique entries, single-step share (empty: none)."""
    return [
        [a["label"], _pct(a["magnitude_unique_share"]), _pct(a["single_step_share"])]
        for a in report["agents"]
        if "single_step_share" in a
    ]


def pair_rows(report: dict) -> list[list[str]]:
    """Per-pair cells: "a / b", common entries, same-sign share, cosine."""
    return [
        [
            " / ".join(p["agents"]),
            f"{p['common']:,}",
            _pct(p["same_sign_share"]),
            "—" if p["cosine"] is None else f"{p['cosine']:.4f}",
        ]
        for p in report.get("pairs", [])
    ]


def format_diagnostics(stats: Iterable[AgentStats], pairs: Iterable[PairStats], labels: Mapping[str, str]) -> str:
    """Plain-text diagnostics for `inspect`: per agent, then per pair of agents."""
    agent_rows = [("agent", "|tau| in unique", "one-step changes")]
    for s in stats:
        agent_rows.append((labels.get(s.name, s.name), _pct(s.magnitude_unique_share), _pct(s.single_step_share)))
    pair_table = [("agents", "both changed", "same sign", "cosine")]
    for p in pairs:
        pair_table.append(
            (
                f"{labels.get(p.a, p.a)} / {labels.get(p.b, p.b)}",
                f"{p.common:,}",
                _pct(p.same_sign_share),
                "—" if p.cosine is None else f"{p.cosine:.4f}",
            )
        )
    return _columns(agent_rows) + ("\n\n" + _columns(pair_table) if len(pair_table) > 1 else "")


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cell(text: str) -> str:
    """`text` as a Markdown table cell (a `|` escaped)."""
    return str(text).replace("|", "\\|")


def _fmt(value) -> str:
    if value is None:
        return "—"
    return "inf" if value == "inf" else f"{value:.4g}"


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


#: An agent denser than this is reported as SFT-like (`inspect`).
DENSE = 0.9


def inspect_summary(found: Mapping, stats: Statistics, labels: Mapping[str, str], source: str) -> tuple[str, list[str]]:
    """What `inspect` prints of a report (`found`, with λ for the flags' parameters) and its statistics: the table,
    the base and agents, the diagnostics when counted; and its warnings (an agent so dense it looks like SFT or an
    fp32 export)."""
    chosen, totals, inputs = found["parameters"], stats.totals(), found["inputs"]
    base = f"{found['base_model']} ({inputs[found['base_model']]['model']})"
    lines = [
        f"RAM+ statistics of {source} ({found['statistics']}; rho per {chosen['rho_scope']}):",
        format_table(totals.values(), chosen["r"], chosen["alpha"], chosen["lambda_rule"], labels),
        f"base: {base}; {sum(t.numel for t in stats.tensors):,} parameters in {len(stats.tensors)} tensors",
        "agents: " + ", ".join(f"{label} ({row['model']})" for label, row in inputs.items() if row["role"] == "agent"),
    ]
    if stats.has_diagnostics:
        lines += [
            "",
            "Diagnostics (share of each agent's update sum |tau| in its unique entries, changes of one dtype step;",
            "per pair: entries both changed, the share with the same sign, cosine of the updates there):",
            format_diagnostics(totals.values(), stats.pair_totals(), labels),
        ]
    warnings = [
        f"warning: {labels[agent]} changes {100 * s.density:.1f}% of the weights: it looks like SFT "
        "or an fp32 export, not a sparse RL update; RAM then degenerates towards plain averaging"
        for agent, s in totals.items()
        if s.density > DENSE
    ]
    return "\n".join(lines), warnings
