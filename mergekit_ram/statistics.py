"""RAM+ statistics: per-tensor, per-agent counts and what they imply.

The pre-pass yields, for every merged tensor and agent, (active, unique, pair):
entries the agent changed, those no other agent changed, and those exactly
one other agent changed. Everything else is a reduction of these counts: rho_t
over the whole model (the paper's Eq. 2), per layer or per tensor (`rho_scope`),
densities and overlap shares (the paper's Fig. 2), and lambda for any r, alpha.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mergekit_ram import kernel

SCOPES = ("model", "layer", "tensor")
#: Largest accepted `r` and `alpha`. The paper's lambda is about 1.2; beyond this,
#: lambda * tau is no longer a weight update, and lambda itself (or 0 * lambda for an
#: agent without unique entries) can leave float32's range and turn merged values into
#: Inf or NaN.
PARAMETER_MAX = 1000.0
LAMBDA_RULES = ("clip", "soft")
_LAYER = re.compile(r"(^|\.)(layers|h|blocks|block|layer)\.(\d+)\.")


@dataclass(frozen=True)
class AgentStats:
    """One agent's counts over a set of tensors."""

    name: str
    active: int
    unique: int
    numel: int
    pair: int = 0

    @property
    def shared(self) -> int:
        return self.active - self.unique

    @property
    def density(self) -> float:
        return self.active / self.numel if self.numel else 0.0

    @property
    def shares(self) -> tuple[float, float, float]:
        """Of the active entries: unique, shared with 1 other, with >= 2 others."""
        if not self.active:
            return (0.0, 0.0, 0.0)
        many = self.active - self.unique - self.pair
        return (self.unique / self.active, self.pair / self.active, many / self.active)

    @property
    def rho(self) -> float:
        return kernel.rho(self.shared, self.unique)

    def lambda_(self, r: float, alpha: float, rule: str = "clip") -> float:
        return lambda_for(self.rho, r, alpha, rule)


def check_parameter(name: str, value: float, *, upper: bool = True) -> None:
    """ValueError unless 0 <= value (<= PARAMETER_MAX for `r` and `alpha`), naming the parameter."""
    if not value >= 0 or value == math.inf or (upper and value > PARAMETER_MAX):
        bound = f" and <= {PARAMETER_MAX:g}" if upper else ""
        raise ValueError(f"ramplus parameter '{name}' must be a finite number >= 0{bound}, got {value}")


def lambda_for(rho: float, r: float, alpha: float, rule: str = "clip") -> float:
    """Eq. 6 (`clip`) or RAM+s (`soft`, App. E)."""
    if rule == "clip":
        return kernel.lambda_clip(rho, r, alpha)
    if rule == "soft":
        return kernel.lambda_soft(rho, r)
    raise ValueError(f"lambda_rule must be one of {LAMBDA_RULES}, got {rule!r}")


@dataclass(frozen=True)
class TensorCounts:
    """Counts of one merged tensor: agent -> (active, unique, pair)."""

    name: str
    numel: int
    counts: Mapping[str, tuple[int, int, int]]
    epsilon: float | None = None


def scope_group(tensor: str, scope: str) -> str:
    """The tensors that share one rho: all (`model`), one transformer block
    (`layer`; tensors outside blocks each stand alone), or one tensor."""
    if scope == "model":
        return ""
    if scope == "layer":
        found = _LAYER.search(tensor)
        return tensor[: found.end()].rstrip(".") if found else tensor
    if scope == "tensor":
        return tensor
    raise ValueError(f"rho_scope must be one of {SCOPES}, got {scope!r}")


@dataclass
class Statistics:
    """All counts of one pre-pass, in planning order."""

    agents: list[str]
    tensors: list[TensorCounts] = field(default_factory=list)

    def totals(self, tensors: Iterable[TensorCounts] | None = None) -> dict[str, AgentStats]:
        """Sum counts per agent over `tensors` (default: the whole model)."""
        sums = {a: [0, 0, 0, 0] for a in self.agents}
        for t in self.tensors if tensors is None else tensors:
            for agent, (act, uni, pair) in t.counts.items():
                row = sums[agent]
                row[0] += act
                row[1] += uni
                row[2] += pair
                row[3] += t.numel
        return {a: AgentStats(a, act, uni, numel, pair) for a, (act, uni, pair, numel) in sums.items()}

    def groups(self, scope: str) -> dict[str, list[TensorCounts]]:
        out: dict[str, list[TensorCounts]] = {}
        for t in self.tensors:
            out.setdefault(scope_group(t.name, scope), []).append(t)
        return out

    def rho(self, scope: str = "model") -> dict[str, dict[str, float]]:
        """group -> agent -> rho, for the given scope."""
        return {
            group: {a: s.rho for a, s in self.totals(members).items()} for group, members in self.groups(scope).items()
        }

    def to_json(self) -> list[dict]:
        return [
            {
                "name": t.name,
                "numel": t.numel,
                "epsilon": t.epsilon,
                "counts": {a: list(c) for a, c in t.counts.items()},
            }
            for t in self.tensors
        ]

    @classmethod
    def from_json(cls, agents: Sequence[str], tensors: Iterable[dict]) -> Statistics:
        return cls(
            list(agents),
            [
                TensorCounts(t["name"], t["numel"], {a: tuple(c) for a, c in t["counts"].items()}, t.get("epsilon"))
                for t in tensors
            ],
        )


def format_table(
    stats: Iterable[AgentStats], r: float, alpha: float, rule: str = "clip", labels: Mapping[str, str] | None = None
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
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.4g}"


def _lambda_label(r: float, alpha: float, rule: str) -> str:
    return f"r={r:g}, alpha={alpha:g}" if rule == "clip" else f"soft, r={r:g}"
