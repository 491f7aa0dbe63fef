"""Whole-model RAM+ statistics: per-agent counts reduced to rho_t and lambda_t.

The pre-pass produces one (active, unique) pair per agent and tensor; this
module sums them over the model (Eq. 2 is over all parameters, not per tensor)
and formats what RAM+ will do, so a user can see why before trusting a merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Mapping, Tuple

from mergekit_ram import kernel


@dataclass(frozen=True)
class AgentStats:
    """Counts of one agent over every merged tensor."""

    name: str
    active: int
    unique: int
    numel: int

    @property
    def shared(self) -> int:
        return self.active - self.unique

    @property
    def density(self) -> float:
        return self.active / self.numel if self.numel else 0.0

    @property
    def rho(self) -> float:
        return kernel.rho(self.shared, self.unique)

    def lambda_(self, r: float, alpha: float) -> float:
        return kernel.lambda_clip(self.rho, r, alpha)


# per tensor: {agent: (active, unique)}, plus the tensor's element count
TensorCounts = Tuple[int, Mapping[Hashable, Tuple[int, int]]]


def reduce_counts(
    per_tensor: Iterable[TensorCounts], order: Iterable[Hashable]
) -> Dict[Hashable, AgentStats]:
    """Sum per-tensor counts into one AgentStats per agent, in `order`."""
    order = list(order)
    totals = {agent: [0, 0, 0] for agent in order}
    for numel, counts in per_tensor:
        for agent, (act, uni) in counts.items():
            row = totals.setdefault(agent, [0, 0, 0])
            row[0] += int(act)
            row[1] += int(uni)
            row[2] += int(numel)
    return {
        agent: AgentStats(str(agent), act, uni, numel)
        for agent, (act, uni, numel) in totals.items()
    }


def format_table(stats: Iterable[AgentStats], r: float, alpha: float) -> str:
    """A plain-text per-agent table: density, unique share, rho, lambda."""
    rows: List[Tuple[str, ...]] = [
        ("agent", "active", "density", "unique", "shared", "rho", f"lambda (r={r:g}, alpha={alpha:g})")
    ]
    for s in stats:
        share = s.unique / s.active if s.active else 0.0
        rows.append(
            (
                s.name,
                f"{s.active:,}",
                f"{100 * s.density:.2f}%",
                f"{100 * share:.1f}%",
                f"{100 * (1 - share) if s.active else 0.0:.1f}%",
                _fmt(s.rho),
                f"{s.lambda_(r, alpha):.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.4g}"
