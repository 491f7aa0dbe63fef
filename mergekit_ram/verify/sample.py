"""`mergekit-ram verify --sample P`: which elements of each output tensor a sample checks, and what passing it says.
Plain data.

The draw (`draw`): every output tensor is cut into equal runs of contiguous elements (the last one shorter), and
some of them are drawn without replacement, by the seed and the tensor's name (`random.Random(f"{seed}/{name}")`:
the same seed draws the same runs everywhere), the runs long enough to hold at least P of the tensor's elements and
at least one row. How many (`allotted`): at most `runs_for(P)` (16 up to P = 2 %, as many per 2 % above), at least
half of that (`least_runs`), and in between as many as the tensor's size asks for the merge's bound below: a tensor
that holds little of the merge's weights needs few runs to keep it, and every run costs one request per file read
from the Hub. A tensor too small to cut (at most `SMALL` elements, or one that P would take half of) is checked
whole. Each RAM+ output entry depends only on the same entry of the inputs and on lambda, so a run is recomputed
from the same run of each input.

What passing says. A tensor (`Slice.pass_bound`): let it differ in a share q of its N elements. Each of its B runs
holds at most `run` elements, so the differing elements touch at least t = ceil(qN / run) runs, wherever they are.
The k runs drawn are a sample without replacement of the B runs, so the tensor passes (no drawn run touches a
difference) with a chance of at most C(B - t, k) / C(B, k) <= (1 - t/B)^k. A merge (`merge_bound`, what the
verdict states): differences holding a share q of all its weights, d_t of them in tensor t, pass with a chance of
at most the product over tensors of exp(-density_t d_t), density_t = k_t / (run_t B_t) (the tensors' draws are
independent: each is seeded by its name); the placement that makes this largest fills the tensors of least density
first, and that bound is stated. A bound whatever the differences' places: spread or in one block, the seed alone
places the runs. A whole tensor replaced by another (another checkpoint's, another `r`'s) differs in nearly every
element and is caught at every seed; one half of whose elements differ, even in one block, passes at most
about 2^-k for its k runs (`Sample.tensor_bound`).
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

#: the shares of differing elements the verdict states the bound for
SHARES = (0.01, 0.1, 0.5)
#: runs drawn per tensor (its ranges per file) up to --sample 0.02, and as many per 2 % above: the bound's strength
#: against the number of reads (docs/verify.md)
RUNS = 16


def runs_for(share: float) -> int:
    """The runs drawn from a tensor at `--sample share`: `RUNS`, more in proportion above 2 % (a larger sample is a
    stronger check, not only longer runs)."""
    return max(RUNS, math.ceil(RUNS * share / 0.02 - 1e-9))


#: a tensor of at most this many elements is checked whole
SMALL = 256
#: the share of a merge's weights changed at which the draw keeps the bound of `runs_for` runs in every tensor
REFERENCE = 0.1
#: what one more request costs, in bytes a link sends meanwhile, on the ordinary link the verdict's comparison
#: assumes (40 ms a round trip, 50 MB/s, `ranged.PARALLEL` requests in flight): when the sample's bytes plus this
#: per request reach a full verify's bytes, the verdict says a full verify would likely cost less
REQUEST_BYTES = 40 * 50_000 // 32


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


@dataclass(frozen=True)
class Slice:
    """The elements of one tensor a sample checks: runs `runs` (indices, sorted) of `run` elements each of its
    `numel` (flat, row-major: the order safetensors stores them in). `whole`: why it is checked whole by running
    its merge task (a tensor mergekit maps by row, ...), or None."""

    name: str
    numel: int
    run: int
    runs: tuple[int, ...]
    whole: str | None = None

    @property
    def count(self) -> int:
        """The runs the tensor is cut into."""
        return -(-self.numel // self.run) if self.numel else 0

    @property
    def elements(self) -> int:
        return sum(stop - start for start, stop in self.spans())

    def spans(self) -> list[tuple[int, int]]:
        """The drawn elements as (start, stop) of the flat tensor, adjacent runs joined."""
        out: list[tuple[int, int]] = []
        for index in self.runs:
            start, stop = index * self.run, min(self.numel, (index + 1) * self.run)
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return out

    @property
    def sliced(self) -> bool:
        """Whether some of its elements are left unchecked (not checked whole, not every run drawn)."""
        return self.whole is None and len(self.runs) < self.count

    def pass_bound(self, share: float) -> float:
        """The most a version of this tensor differing in `share` of its elements passes this draw with."""
        if not self.sliced:
            return 0.0
        touched = math.ceil(share * self.numel / self.run - 1e-12)
        return miss_chance(self.count, touched, len(self.runs))


def miss_chance(units: int, touched: int, drawn: int) -> float:
    """C(units - touched, drawn) / C(units, drawn): the chance that `drawn` of `units`, taken without replacement,
    miss all of `touched` given ones."""
    chance = 1.0
    for i in range(drawn):
        if units - touched - i <= 0:
            return 0.0
        chance *= (units - touched - i) / (units - i)
    return chance


def cut(
    name: str, numel: int, row: int, share: float, seed: int, whole: str | None = None, runs: int | None = None
) -> Slice:
    """The slice of one tensor (`row`: elements per row, its shape's trailing dimensions; `runs`: how many to draw,
    `runs_for(share)` unless given)."""
    wanted = min(numel, max(math.ceil(share * numel - 1e-12), row, 1))
    if whole is not None or numel <= SMALL or 2 * wanted >= numel:
        return Slice(name, numel, max(1, numel), (0,) if numel else (), whole)
    k = runs or runs_for(share)
    run = -(-wanted // k)
    count = -(-numel // run)
    order = random.Random(f"{seed}/{name}").sample(range(count), min(count, k + 1))
    drawn = Slice(name, numel, run, tuple(sorted(order[:k])))
    if drawn.elements < wanted:  # the short last run was drawn: one more
        drawn = Slice(name, numel, run, tuple(sorted(order[: k + 1])))
    return drawn


@dataclass
class Sample:
    """One draw: a slice of every output tensor (`slices`, in name order). `bytes_read`: bytes of weight files read
    (headers, slices, identity samples); `more_than_needed`: why more was read (a server that sent whole files);
    `recounted`: the agents' counts checked against the slices (`counts_bound`, a line of the verdict) or None."""

    seed: int
    share: float
    slices: tuple[Slice, ...]
    bytes_read: int = 0
    more_than_needed: list[str] = field(default_factory=list)
    counts: str | None = None
    #: whether the folder records per-tensor counts a sample checks through their sums (ramplus's ram_stats.json)
    counted: bool = True
    #: HTTP range requests made (0: every file local), and the bytes of every weight file a full verify reads
    requests: int = 0
    full_bytes: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slices)

    @property
    def sizes(self) -> dict[str, int]:
        return {s.name: s.numel for s in self.slices}

    @property
    def elements(self) -> int:
        return sum(s.elements for s in self.slices)

    @property
    def total(self) -> int:
        return sum(s.numel for s in self.slices)

    @property
    def whole(self) -> dict[str, str]:
        """Tensors checked whole by their merge task, and why."""
        return {s.name: s.whole for s in self.slices if s.whole is not None}

    @property
    def least(self) -> int:
        """The fewest runs drawn from a tensor that is not checked whole."""
        return min((len(s.runs) for s in self.slices if s.whole is None and len(s.runs) < s.count), default=0)

    def percent(self) -> str:
        return f"{100 * self.elements / max(1, self.total):.1f} %"

    def pass_bound(self, share: float) -> float:
        """The most a merge whose differences hold `share` of its weights passes with (`merge_bound`)."""
        return merge_bound(self.slices, share)

    def tensor_bound(self, share: float) -> float:
        """The most a tensor differing in `share` of its elements passes with, the tensor least drawn."""
        return max((s.pass_bound(share) for s in self.slices), default=0.0)

    def headline(self) -> str:
        return (
            f"no difference in a slice of every tensor ({len(self.slices):,} tensors, {self.percent()} of the "
            f"weights, seed {self.seed})"
        )

    def odds(self) -> str:
        """The bound in one plain sentence (its derivation: docs/verify.md)."""
        ten, one, half = (
            _percent(self.pass_bound(0.1)),
            _percent(self.pass_bound(0.01)),
            _percent(self.tensor_bound(0.5)),
        )
        return (
            f"a merge with 10 % of its weights changed would pass this check up to {ten} of the time (1 %: up to "
            f"{one}; a tensor replaced by another, half its elements changed or more: up to {half}); use a larger "
            "--sample for a stronger check"
        )

    def said(self) -> list[str]:
        """The verdict's lines on the sample: the bound, then the tensors checked whole by their merge task, by why."""
        why: dict[str, list[str]] = {}
        for name, reason in self.whole.items():
            why.setdefault(reason, []).append(name)
        out = [self.odds(), self.cost()]
        if self.dearer():
            out.append(
                f"a full verify would likely cost less here: {_mb(self.full_bytes)} in a few requests, against "
                f"{self.requests:,} requests (each worth about {_mb(REQUEST_BYTES)} on a 40 ms, 50 MB/s link)"
            )
        for reason, names in sorted(why.items()):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            out.append(f"checked whole, not sliced ({reason}): {shown}")
        return out

    def cost(self) -> str:
        """What the sample read, in one line: bytes, and requests where it read from the Hub."""
        asked = f" in {self.requests:,} HTTP range requests" if self.requests else ""
        return f"read {_mb(self.bytes_read)} of weight files{asked} (a full verify reads {_mb(self.full_bytes)})"

    def dearer(self) -> bool:
        """Whether a full verify would likely have cost less: the sample's bytes plus `REQUEST_BYTES` per request
        at least the bytes a full verify reads (a small merge: the request count does not shrink with the model)."""
        return self.full_bytes > 0 and self.bytes_read + self.requests * REQUEST_BYTES >= self.full_bytes

    def unchecked(self) -> list[str]:
        """What a sample leaves unchecked."""
        left = self.total - self.elements
        out = [f"the bits of {left:,} elements outside the slices ({100 * left / max(1, self.total):.1f} %)"]
        if self.counted:
            out.append(
                "each tensor's counts in ram_stats.json, but through the per-agent totals, rho and lambda they must "
                "sum to and their slice's counts" + (f" ({self.counts})" if self.counts else "")
            )
        return out

    def as_json(self) -> dict:
        return {
            "seed": self.seed,
            "share": self.share,
            "tensors_checked": len(self.slices),
            "tensors_total": len(self.slices),
            "elements_checked": self.elements,
            "elements_total": self.total,
            "bytes_read": self.bytes_read,
            "requests": self.requests,
            "full_verify_bytes": self.full_bytes,
            "full_verify_cheaper": self.dearer(),
            "least_draws": self.least,
            "pass_bound": {str(q): self.pass_bound(q) for q in SHARES},
            "tensor_pass_bound": {str(q): self.tensor_bound(q) for q in SHARES},
            "more_than_needed": list(self.more_than_needed),
            "tensors": sorted(self.names),
            "runs_per_tensor": runs_for(self.share),
            "whole": self.whole,
            "counts": self.counts,
            "slices": {
                s.name: {"share": s.elements / max(1, s.numel), "run": s.run, "runs": list(s.runs)} for s in self.slices
            },
        }


def draw(
    tensors: Mapping[str, tuple[int, int]], share: float, seed: int, whole: Mapping[str, str] | None = None
) -> Sample:
    """A slice of every tensor of `tensors` (name -> (elements, elements per row)), each with its `allotted` runs;
    `whole`: the tensors checked whole, and why."""
    whole = whole or {}
    runs = allotted({name: numel for name, (numel, _) in tensors.items()}, share)
    slices = tuple(cut(name, *tensors[name], share, seed, whole.get(name), runs[name]) for name in sorted(tensors))
    return Sample(seed, share, slices)


def allotted(numels: Mapping[str, int], share: float) -> dict[str, int]:
    """The runs drawn from each tensor: at least `least_runs(share)`, and as many as keep the merge's bound at
    `REFERENCE` what `runs_for(share)` runs in every tensor would give, (1 - REFERENCE)^runs_for(share), at most
    `runs_for(share)`. A tensor's runs weigh in the bound by their density, runs per element (`merge_bound`): a
    small tensor holds little of a merge's weights, so a few runs of it do what many runs of a large one do, and
    every run of every file is one request."""
    most, total = runs_for(share), sum(numels.values())
    density = -most * math.log1p(-REFERENCE) / (REFERENCE * max(1, total))
    least = least_runs(share)
    # 10 % above the density: a run's length rounds up (runs x length >= elements), which dilutes it
    return {name: min(most, max(least, math.ceil(1.1 * density * numel))) for name, numel in numels.items()}


def least_runs(share: float) -> int:
    """The fewest runs drawn from a sliced tensor: half of `runs_for(share)` (8 up to 2 %), so a tensor half of
    whose elements differ, even in one block, passes at most about 2^-8 (0.4 %) of the time at 2 %."""
    return runs_for(share) // 2


def merge_bound(slices: Iterable[Slice], share: float) -> float:
    """The most a merge whose differences hold `share` of all its elements passes with: tensor t, drawing k of its
    B runs of `run` elements, passes d differing elements (touching at least d / run runs) with a chance of at
    most (1 - d / (run B))^k <= exp(-density d), density = k / (run B); the tensors' draws are independent (each
    seeded by the seed and its name), so the merge passes with at most exp(-sum of density d) over the tensors.
    The differences that minimise that sum fill the tensors of least density first (a tensor checked whole, or
    every run of it drawn, catches any: they go there last, and a merge whose differences must reach one passes
    never)."""
    slices = list(slices)
    left = share * sum(s.numel for s in slices)
    exponent = 0.0
    for density, numel in sorted((len(s.runs) / (s.run * s.count), s.numel) for s in slices if s.sliced):
        placed = min(left, numel)
        exponent += density * placed
        left -= placed
        if left <= 0:
            return math.exp(-exponent)
    return 0.0


def _mb(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def _percent(value: float) -> str:
    if value == 0:
        return "0 %"
    return f"{100 * value:.2g} %" if value < 0.1 else f"{100 * value:.0f} %"


def bytes_read(spans: Mapping[str, set[tuple[int, int]]], elsewhere: Container[str] = ()) -> int:
    """The bytes `spans` (file -> byte spans a sample reads) cover, each once, but in the files `elsewhere` counts
    (fetched by ranges)."""
    return sum(_covered(found) for path, found in spans.items() if path not in elsewhere)


def _covered(spans: set[tuple[int, int]]) -> int:
    """The bytes the union of `spans` covers."""
    total, end = 0, 0
    for start, stop in sorted(spans):
        start = max(start, end)
        if stop > start:
            total += stop - start
            end = stop
    return total
