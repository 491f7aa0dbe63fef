"""RAM+ statistics: per-tensor, per-agent counts and what they imply.

The pre-pass yields, for every merged tensor and agent, (active, unique, pair):
entries the agent changed, those no other agent changed, and those exactly
one other agent changed. Everything else is a reduction of these counts: rho_t
over the whole model (the paper's Eq. 2), per layer or per tensor (`rho_scope`),
densities and overlap shares (the paper's Fig. 2), and lambda for any r, alpha.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mergekit_ram import kernel
from mergekit_ram.params import LAMBDA_RULES, SCOPES

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
