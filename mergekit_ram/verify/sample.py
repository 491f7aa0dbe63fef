"""`mergekit-ram verify --sample P`: which output tensors a sample checks, and what passing it says. Plain data.

The draw (`draw`): output tensors are drawn one at a time without replacement, each with a chance proportional to
its element count among those not drawn yet (`random.Random(seed)`, integers only: the same seed draws the same
tensors everywhere), until the drawn tensors hold at least `P` of the output's elements. A large tensor is likely
drawn; a change to a large share of the weights cannot hide in small tensors.

What passing says (`pass_bound`): let the tensors that differ hold a share `q` of the output's elements. While none
of them is drawn, they are all still in the pool, and the pool holds at most every element, so each draw takes
one of them with a chance of at least `q`, whatever came before: each draw misses them with a chance of at most
`1 - q`. The draw cannot stop before `least_draws` tensors (the fewest, largest first, that hold `P`), so a merge
whose differing tensors hold `q` of the weights passes with a chance of at most `(1 - q) ** least_draws`. A bound,
not an estimate: the true chance is smaller where the draw takes more tensors than the fewest it could.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

#: the shares of differing weights the verdict states the bound for
SHARES = (0.01, 0.1)


def options(share: str | None, seed: str | None) -> tuple[float, int] | None:
    """`--sample P [--sample-seed N]` as (P, seed); None without `--sample`, or with P = 1 (every tensor, as without).
    ValueError in one line for a P outside (0, 1], a seed that is no integer, or a seed without `--sample`."""
    if share is None:
        if seed is not None:
            raise ValueError(f"--sample-seed {seed}: it seeds --sample's draw; give --sample P too")
        return None
    found = fraction(share), seed_of(seed)
    return None if found[0] == 1 else found


def fraction(text: str) -> float:
    """`--sample`'s value: a fraction in (0, 1]; ValueError in one line otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 1):
        raise ValueError(f"--sample {text}: expected a fraction of the weights in (0, 1], e.g. 0.02")
    return value


def seed_of(text: str | None) -> int:
    """`--sample-seed`'s value (an integer), or one drawn from the operating system."""
    if text is None:
        return secrets.randbits(63)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--sample-seed {text}: expected an integer") from None


@dataclass
class Sample:
    """One draw: `names` in the order drawn, of `sizes` (every output tensor -> its elements); `least`: the fewest
    draws that can hold `share`. `bytes_read`: bytes of weight files read (headers, tensors, identity samples);
    `more_than_needed`: why more was read (a server that sent whole files)."""

    seed: int
    share: float
    names: tuple[str, ...]
    sizes: Mapping[str, int]
    least: int
    bytes_read: int = 0
    more_than_needed: list[str] = field(default_factory=list)

    @property
    def elements(self) -> int:
        return sum(self.sizes[name] for name in self.names)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def percent(self) -> str:
        return f"{100 * self.elements / max(1, self.total):.1f} %"

    def headline(self) -> str:
        return (
            f"no difference in a sample of {len(self.names):,} of {len(self.sizes):,} tensors ({self.percent()} of "
            f"the weights, seed {self.seed})"
        )

    def odds(self) -> str:
        """The chance that a merge differing in a given share of its weights passes a sample like this one."""
        said = [f"{_percent(q)} of them: at most {_percent(pass_bound(self.least, q))}" for q in SHARES[:-1]]
        last = SHARES[-1]
        return (
            f"a merge whose differing tensors hold {_percent(last)} of the weights passes a sample like this with "
            f"a chance of at most {_percent(pass_bound(self.least, last))} ({'; '.join(said)}): the draw takes at "
            f"least {self.least} tensor(s), each missing them with a chance of at most 1 - share (docs/verify.md)"
        )

    def as_json(self) -> dict:
        return {
            "seed": self.seed,
            "share": self.share,
            "tensors_checked": len(self.names),
            "tensors_total": len(self.sizes),
            "elements_checked": self.elements,
            "elements_total": self.total,
            "bytes_read": self.bytes_read,
            "least_draws": self.least,
            "pass_bound": {str(q): pass_bound(self.least, q) for q in SHARES},
            "more_than_needed": list(self.more_than_needed),
            "tensors": sorted(self.names),
        }


def draw(sizes: Mapping[str, int], share: float, seed: int) -> Sample:
    """Draw tensors of `sizes` (name -> elements) until they hold at least `share` of the elements (see above)."""
    pool = sorted(sizes)
    total = sum(sizes.values())
    wanted = Fraction(share) * total
    rng = random.Random(seed)
    left, drawn, held = total, [], 0
    while held < wanted and left > 0:
        pick, at = rng.randrange(left), 0
        while pick >= sizes[pool[at]]:
            pick -= sizes[pool[at]]
            at += 1
        name = pool.pop(at)
        drawn.append(name)
        held += sizes[name]
        left -= sizes[name]
    return Sample(seed, share, tuple(drawn), dict(sizes), least_draws(sizes, share))


def least_draws(sizes: Mapping[str, int], share: float) -> int:
    """The fewest tensors of `sizes` that hold at least `share` of the elements (largest first)."""
    wanted = Fraction(share) * sum(sizes.values())
    held = 0
    for count, size in enumerate(sorted(sizes.values(), reverse=True), 1):
        held += size
        if held >= wanted:
            return count
    return len(sizes)


def pass_bound(least: int, share: float) -> float:
    """The most a merge whose differing tensors hold `share` of the weights can pass a draw of at least `least`
    tensors with: (1 - share) ** least."""
    return (1 - share) ** least


def _percent(value: float) -> str:
    return f"{100 * value:.3g} %"
