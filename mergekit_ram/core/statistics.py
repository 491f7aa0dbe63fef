"""RAM+ statistics: per-tensor, per-agent counts and what they imply.

The pre-pass yields, for every merged tensor and agent, (active, unique, pair):
entries the agent changed, those no other agent changed, and those exactly
one other agent changed. Everything else is a reduction of these counts: rho_t
over the whole model (the paper's Eq. 2), per layer or per tensor (`rho_scope`),
densities and overlap shares (the paper's Fig. 2), and lambda for any r, alpha.

The same pass also yields diagnostics (`Diagnostics`): how much of each agent's
update lies in its unique entries, how many of its changes are a single step of
the dtype (rounding-level), and, per pair of agents, whether their common
changes agree in sign and direction (`PairStats`). They tell apart agents whose
overlap is noise, where RAM's mean halves real updates, from agents that share a
common update, where summing counts it twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mergekit_ram.core import formulas
from mergekit_ram.core.params import DEFAULTS, LAMBDA_RULES, SCOPES

_LAYER = re.compile(r"(^|\.)(layers|h|blocks|block|layer)\.(\d+)\.")


@dataclass(frozen=True)
class AgentStats:
    """One agent's counts over a set of tensors.

    Each per-agent number of `ram_stats.json` is an attribute of the same name (`shared_with_1`,
    `shared_with_2plus`, `unique_share`, ..., `single_step`; `rho` is the file's `rho_counted`). The fields
    `pair` (= `shared_with_1`) and `single` (= `single_step`) keep their names: they are how the counts are
    built and stored in the cache, and code that reads them keeps working."""

    name: str
    active: int
    unique: int
    numel: int
    pair: int = 0
    #: diagnostics (None when the counts came without them): active entries one step of the dtype from the
    #: base, and the sum of |tau| over the agent's unique and over its shared entries
    single: int | None = None
    magnitude_unique: float | None = None
    magnitude_shared: float | None = None

    @property
    def shared(self) -> int:
        return self.active - self.unique

    @property
    def single_step_share(self) -> float | None:
        """Of the active entries, the share that is a single step of the dtype (rounding-level changes)."""
        if self.single is None:
            return None
        return self.single / self.active if self.active else 0.0

    @property
    def magnitude_unique_share(self) -> float | None:
        """Of the agent's whole update (sum of |tau| over its active entries), the share in its unique entries."""
        if self.magnitude_unique is None or self.magnitude_shared is None:
            return None
        total = self.magnitude_unique + self.magnitude_shared
        return self.magnitude_unique / total if total else 0.0

    @property
    def shared_with_1(self) -> int:
        """Active entries exactly one other agent changed too (`pair`)."""
        return self.pair

    @property
    def shared_with_2plus(self) -> int:
        return self.shared - self.pair

    @property
    def single_step(self) -> int | None:
        """Active entries one step of the dtype from the base (`single`)."""
        return self.single

    @property
    def unique_share(self) -> float:
        return self.shares[0]

    @property
    def shared_with_1_share(self) -> float:
        return self.shares[1]

    @property
    def shared_with_2plus_share(self) -> float:
        return self.shares[2]

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
        return formulas.rho(self.shared, self.unique)

    def lambda_(self, r: float, alpha: float, rule: str = DEFAULTS["lambda_rule"]) -> float:
        return lambda_for(self.rho, r, alpha, rule)


def lambda_for(rho: float, r: float, alpha: float, rule: str = DEFAULTS["lambda_rule"]) -> float:
    """Eq. 6 (`clip`) or RAM+s (`soft`, App. E)."""
    if rule == "clip":
        return formulas.lambda_clip(rho, r, alpha)
    if rule == "soft":
        return formulas.lambda_soft(rho, r)
    raise ValueError(f"lambda_rule must be one of {LAMBDA_RULES}, got {rule!r}")


def lambda_shown(rho: float | None, r: float, alpha: float, rule: str) -> float | None:
    """lambda as the report, the card and `inspect` show it: 1 for r = 0 (plain RAM, whether or not rho
    was counted), None without a rho, else `lambda_for`."""
    if r == 0:
        return 1.0
    return None if rho is None else lambda_for(rho, r, alpha, rule)


@dataclass(frozen=True)
class PairStats:
    """Two agents over a set of tensors: their common changed entries and how their updates relate there."""

    a: str
    b: str
    common: int
    same_sign: int
    dot: float
    square_a: float
    square_b: float

    @property
    def same_sign_share(self) -> float | None:
        return self.same_sign / self.common if self.common else None

    @property
    def cosine(self) -> float | None:
        """Cosine of the two task vectors over their common changed entries."""
        norm = math.sqrt(self.square_a) * math.sqrt(self.square_b)
        return self.dot / norm if norm else None


@dataclass(frozen=True)
class Diagnostics:
    """The diagnostics of one tensor: agent -> single-step count, agent -> (sum |tau| unique, shared),
    and per pair (a, b) in agent order: (common, same sign, sum tau_a tau_b, sum tau_a^2, sum tau_b^2)."""

    single: Mapping[str, int]
    magnitude: Mapping[str, tuple[float, float]]
    pairs: Mapping[tuple[str, str], tuple[int, int, float, float, float]]

    def to_json(self, labels: Mapping[str, str] | None = None) -> dict:
        """As JSON, each agent named by its label in `labels` (agent -> label; default: its name)."""
        n = labels or {}
        return {
            "single": {n.get(a, a): v for a, v in self.single.items()},
            "magnitude": {n.get(a, a): list(v) for a, v in self.magnitude.items()},
            "pairs": [[n.get(a, a), n.get(b, b), *v] for (a, b), v in self.pairs.items()],
        }

    @classmethod
    def from_json(cls, data: dict) -> Diagnostics:
        return cls(
            {a: int(v) for a, v in data["single"].items()},
            {a: (float(u), float(s)) for a, (u, s) in data["magnitude"].items()},
            {(a, b): (int(c), int(same), float(d), float(x), float(y)) for a, b, c, same, d, x, y in data["pairs"]},
        )


@dataclass(frozen=True)
class TensorCounts:
    """Counts of one merged tensor: agent -> (active, unique, pair), and its diagnostics if counted with them."""

    name: str
    numel: int
    counts: Mapping[str, tuple[int, int, int]]
    epsilon: float | None = None
    diagnostics: Diagnostics | None = None


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


def _diagnosed(tensors: Sequence[TensorCounts]) -> list[Diagnostics] | None:
    """The diagnostics of every tensor; None when there are no tensors or any lacks them (counted before them)."""
    found = [t.diagnostics for t in tensors if t.diagnostics is not None]
    return found if tensors and len(found) == len(tensors) else None


@dataclass
class Statistics:
    """All counts of one pre-pass, in planning order."""

    agents: list[str]
    tensors: list[TensorCounts] = field(default_factory=list)

    def totals(self, tensors: Iterable[TensorCounts] | None = None) -> dict[str, AgentStats]:
        """Sum counts per agent over `tensors` (default: the whole model); diagnostics when every tensor has them."""
        chosen = list(self.tensors if tensors is None else tensors)
        sums = {a: [0, 0, 0, 0] for a in self.agents}
        for t in chosen:
            for agent, (act, uni, pair) in t.counts.items():
                row = sums[agent]
                row[0] += act
                row[1] += uni
                row[2] += pair
                row[3] += t.numel
        extra: dict[str, dict] = {a: {} for a in self.agents}
        found = _diagnosed(chosen)
        if found is not None:
            for a in self.agents:
                extra[a] = {
                    "single": sum(d.single[a] for d in found),
                    "magnitude_unique": math.fsum(d.magnitude[a][0] for d in found),
                    "magnitude_shared": math.fsum(d.magnitude[a][1] for d in found),
                }
        return {a: AgentStats(a, act, uni, numel, pair, **extra[a]) for a, (act, uni, pair, numel) in sums.items()}

    @property
    def has_diagnostics(self) -> bool:
        return _diagnosed(self.tensors) is not None

    def pair_totals(self, tensors: Iterable[TensorCounts] | None = None) -> list[PairStats]:
        """Every pair of agents over `tensors` (default: the whole model); empty without diagnostics."""
        found = _diagnosed(list(self.tensors if tensors is None else tensors))
        if found is None:
            return []
        out = []
        for i, a in enumerate(self.agents):
            for b in self.agents[i + 1 :]:
                rows = [d.pairs[(a, b)] for d in found]
                out.append(
                    PairStats(
                        a,
                        b,
                        sum(r[0] for r in rows),
                        sum(r[1] for r in rows),
                        math.fsum(r[2] for r in rows),
                        math.fsum(r[3] for r in rows),
                        math.fsum(r[4] for r in rows),
                    )
                )
        return out

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

    def to_json(self, labels: Mapping[str, str] | None = None) -> list[dict]:
        """Per tensor, as `ram_stats.json` and the cache hold it; each agent named by its label in `labels`
        (agent -> label; default: its name, as the cache keeps it)."""
        n = labels or {}
        out = []
        for t in self.tensors:
            row = {
                "name": t.name,
                "numel": t.numel,
                "epsilon": t.epsilon,
                "counts": {n.get(a, a): list(c) for a, c in t.counts.items()},
            }
            if t.diagnostics is not None:
                row["diagnostics"] = t.diagnostics.to_json(labels)
            out.append(row)
        return out

    @classmethod
    def from_json(cls, agents: Sequence[str], tensors: Iterable[dict]) -> Statistics:
        return cls(
            list(agents),
            [
                TensorCounts(
                    t["name"],
                    t["numel"],
                    {a: tuple(c) for a, c in t["counts"].items()},
                    t.get("epsilon"),
                    Diagnostics.from_json(t["diagnostics"]) if t.get("diagnostics") is not None else None,
                )
                for t in tensors
            ],
        )
