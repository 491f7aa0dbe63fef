"""What verify checks of a `ramplus` merge beyond its weights: `ram_stats.json`'s statistics (rho, lambda and the
counts they come from), the card's RAM+ section, and for `--sample` the counts against the slices.

A full verify counts every planned tensor again and compares the report a merge writes with the recorded one
(`statistics`). A sample counts only its slices: the per-agent totals, rho and lambda are reduced from
`ram_stats.json`'s per-tensor counts (`recorded_statistics`) exactly as a merge reduces them, so a total that does
not follow from them differs; each recorded count is then checked against its tensor's slice (`within_slices`: a
certainty) and each agent's totals against their estimate from every slice (`totals`: a bound that holds with a
stated chance), and the tensors checked whole are counted again (`recount_problems`). All on plain data: the
recompute interface (`recompute.Merge`) counts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from mergekit_ram.checks.output_checks import STATS_FILE
from mergekit_ram.core import cache, formulas, statistics
from mergekit_ram.errors import Unreadable
from mergekit_ram.reporting import card, report, versions
from mergekit_ram.verify import folder_checks, published_checks, recompute, record_checks, sample, verdict

#: at most this many differing leaves of ram_stats.json are named
SHOWN = 5
#: the chance that an honest record fails the totals check, per agent and count (active, unique)
ALPHA = 1e-6


def recorded_statistics(
    recorded: dict, agents: list[str], epsilons: dict[str, float], needs_rho: bool, labels: Mapping[str, str]
) -> tuple[statistics.Statistics | None, str]:
    """`ram_stats.json`'s per-tensor counts as the statistics of the planned ramplus tensors (`epsilons`: each
    one's epsilon, as planned; `agents`: as planned; `labels`: input -> its recorded label), and their source,
    "recorded"; (None, "not computed") where the merge needs no rho and records no counts (r = 0, rho given).
    Each tensor's element count is checked by `numel_mismatches`. Unreadable, naming the tensor, when the record's
    counts are malformed or name a tensor or agent the merge does not plan."""
    by_label = {labels.get(a, a): a for a in agents}
    rows = recorded.get("tensors")
    if not rows and not needs_rho:
        return None, "not computed"
    if not isinstance(rows, list) or not rows:
        raise Unreadable(f"{STATS_FILE} records no per-tensor counts, which a sample needs: verify it without --sample")
    out = []
    for row in rows:
        name = row.get("name") if isinstance(row, dict) else None
        if str(name) not in epsilons:
            raise Unreadable(
                f"{STATS_FILE} counts tensor {name!r}, which the merge does not plan: is the folder damaged?"
            )
        try:
            relabelled = _relabelled(row, by_label)
            cache.validate(agents, [relabelled])
            counts = statistics.Statistics.from_json(agents, [relabelled]).tensors[0]
        except (KeyError, TypeError, ValueError) as error:
            raise Unreadable(f"{STATS_FILE}: the counts of tensor {name} are malformed ({error})") from error
        epsilon = epsilons[str(name)]
        out.append(statistics.TensorCounts(str(name), counts.numel, counts.counts, epsilon, counts.diagnostics))
    return statistics.Statistics(agents, out), "recorded"


def _relabelled(row: dict, agents: dict[str, str]) -> dict:
    """One recorded tensor row with each agent's label replaced by the agent (KeyError for a label no agent has)."""
    out = {**row, "counts": {agents[label]: value for label, value in row["counts"].items()}}
    found = row.get("diagnostics")
    if found is not None:
        out["diagnostics"] = {
            "single": {agents[label]: v for label, v in found["single"].items()},
            "magnitude": {agents[label]: v for label, v in found["magnitude"].items()},
            "pairs": [[agents[a], agents[b], *rest] for a, b, *rest in found["pairs"]],
        }
    return out


def numel_mismatches(stats: statistics.Statistics, planned: Mapping[str, int]) -> list[str]:
    """Tensors whose recorded element count is not that of the tensor the plan reads (`planned`: tensor -> its
    element count, from the inputs' headers; for rows mergekit maps, a union tokenizer's, from the published
    header)."""
    out = []
    for counts in stats.tensors:
        numel = planned.get(counts.name)
        if numel is not None and numel != counts.numel:
            out.append(f"{STATS_FILE}: tensor {counts.name} records {counts.numel:,} elements; it has {numel:,}")
    return out


def recount_problems(recorded: dict, counted: Mapping[str, dict | None]) -> list[str]:
    """The ramplus tensors checked whole, counted again (`counted`: tensor -> its ram_stats.json row, None for one
    the merge does not count, a buffer), against `ram_stats.json`'s counts of them: one line per value that differs
    (the diagnostics' sums to `published_checks.SUM_TOLERANCE` of their size, as a full verify)."""
    rows = {row.get("name"): (i, row) for i, row in enumerate(recorded.get("tensors") or []) if isinstance(row, dict)}
    out = []
    for name, now in counted.items():
        at, was = rows.get(name, (None, None))
        if was is None or now is None:
            if (was is None) != (now is None):
                said = "records no counts of it" if was is None else "counts it, the merge does not (a buffer)"
                out.append(f"{STATS_FILE}: tensor {name}: {STATS_FILE} {said}")
            continue
        for line in published_checks.report_differences(was, now, f"tensors[{at}]"):
            out.append(f"{STATS_FILE} ({name}, counted again): {line}")
    return out


def within_slices(
    stats: statistics.Statistics, counted: dict[str, statistics.TensorCounts], drawn: sample.Sample, labels: dict
) -> list[str]:
    """One line per recorded count (active, unique, pair) that its tensor's slice contradicts: a tensor whose slice
    holds c such entries of its n, in N elements, holds between c and c + N - n (a certainty, not a chance)."""
    cuts = {s.name: s for s in drawn.slices}
    out = []
    for row in stats.tensors:
        found, cut = counted.get(row.name), cuts.get(row.name)
        if found is None or cut is None:
            continue
        outside = cut.numel - cut.elements
        for agent, values in row.counts.items():
            for column, value, least in zip(("active", "unique", "pair"), values, found.counts[agent], strict=True):
                if not least <= value <= least + outside:
                    out.append(
                        f"{STATS_FILE}: tensor {row.name}: {labels.get(agent, agent)}'s {column} count {value:,} "
                        f"cannot be: its slice holds {least:,} of {cut.elements:,} elements, so the tensor holds "
                        f"{least:,} to {least + outside:,}"
                    )
    return out


def totals(
    stats: statistics.Statistics,
    counted: dict[str, statistics.TensorCounts],
    drawn: sample.Sample,
    parameters: Mapping[str, Any],
    labels: dict[str, str],
) -> tuple[list[str], str]:
    """Each agent's active and unique totals in `ram_stats.json` against their estimate from the slices (a tensor
    checked whole counts as recorded: `recount_problems` counts it again), and what the check says (a sentence).

    Sliced tensor t, its B runs of at most `run` elements, k drawn: `count * B / k` estimates its count without
    bias, a sum of k draws without replacement, each in [0, B * run / k]. By Hoeffding (whose bound holds for draws
    without replacement, and for the sum over independently sliced tensors), the estimate of a total is further
    than s from the truth with a chance of at most 2 exp(-2 s^2 / V), V = sum over sliced tensors of
    (B * run)^2 / k: s is set so that chance is `ALPHA`. A record within s of the estimate is off by at most 2 s
    with a chance of at least 1 - ALPHA, which bounds how far lambda (`rho_scope: model`) can be moved unseen."""
    cuts = {s.name: s for s in drawn.slices}
    spread, recorded, estimated = 0.0, {a: [0, 0] for a in stats.agents}, {a: [0.0, 0.0] for a in stats.agents}
    for row in stats.tensors:
        cut, found = cuts.get(row.name), counted.get(row.name)
        scale = 1.0
        if cut is not None and found is not None and len(cut.runs) < cut.count:
            spread += (cut.count * cut.run) ** 2 / len(cut.runs)
            scale = cut.count / len(cut.runs)
        for agent, values in row.counts.items():
            seen = found.counts[agent] if found is not None else values
            for column in (0, 1):
                recorded[agent][column] += values[column]
                estimated[agent][column] += seen[column] * scale
    room = math.sqrt(math.log(2 / ALPHA) / 2 * spread)
    out, moved = [], 0.0
    for agent in stats.agents:
        (active, unique), label = recorded[agent], labels.get(agent, agent)
        for column, name in enumerate(("active", "unique")):
            if abs(estimated[agent][column] - recorded[agent][column]) > room:
                out.append(
                    f"{STATS_FILE}: {label}'s {name} entries total {recorded[agent][column]:,}; its slices estimate "
                    f"{estimated[agent][column]:,.0f}, more than {room:,.0f} apart (an honest record is, with a chance "
                    f"below {ALPHA:g})"
                )
        moved = max(moved, _lambda_moved(active, unique, 2 * room, parameters))
    said = f"each agent's active and unique totals within {room:,.0f} of the slices' estimate"
    if parameters["rho_scope"] == "model" and parameters["r"] != 0:
        said += f"; a record moving an agent's lambda by more than {moved:.2g} is caught with a chance of at least "
        said += f"{100 * (1 - ALPHA):.4f} %"
    return out, said


def _lambda_moved(active: int, unique: int, room: float, parameters: Mapping[str, Any]) -> float:
    """The most lambda moves when an agent's active and unique totals each move by up to `room`."""
    r, alpha, rule = parameters["r"], parameters["alpha"], parameters["lambda_rule"]

    def lam(a: float, u: float) -> float:
        u = max(u, 0.0)
        return statistics.lambda_for(formulas.rho(max(a, u) - u, u), r, alpha, rule)

    now = lam(active, unique)
    return max(abs(lam(active + room, unique - room) - now), abs(lam(active - room, unique + room) - now))


def against_slices(
    merge: recompute.Merge,
    stats: statistics.Statistics,
    counted: dict[str, statistics.TensorCounts],
    recorded: dict,
    outcome: verdict.Outcome,
) -> None:
    """A sample's checks of the recorded counts: each tensor's element count against the plan's, each count
    against its slice's, the tensors checked whole counted again, and each agent's totals against the slices'
    estimate."""
    names, drawn = merge.names, outcome.sample
    assert drawn is not None
    outcome.files += numel_mismatches(stats, merge.planned_numels())
    outcome.files += within_slices(stats, counted, drawn, names)
    outcome.files += recount_problems(recorded, merge.count_again(set(drawn.whole), names))
    if counted and stats.agents:
        parameters = merge.parameters(next(iter(counted)))  # the first sliced tensor's, as planned
        lines, drawn.counts = totals(stats, counted, drawn, parameters, names)
        outcome.files += lines


def check_statistics(recorded: dict, recomputed: dict, outcome: verdict.Outcome) -> None:
    """ram_stats.json against the report of the merge run again (one of an older format read in the current
    format's shape, `labels.upgraded`: its keys the format lacks are notes)."""
    format_version = recorded.get("format_version")
    older = isinstance(format_version, int) and format_version < report.FORMAT_VERSION
    recomputed = {**recomputed, "format_version": format_version} if older else recomputed
    found = published_checks.report_differences(recorded, json.loads(report.dumps(recomputed)))
    was = (recorded.get("versions") or {}).get("mergekit-ram") if isinstance(recorded.get("versions"), dict) else None
    now = versions.installed("mergekit-ram")
    if (was and was != now) or older:  # another mergekit-ram writes other keys: only a differing value differs
        keys = [line for line in found if line.endswith((" lacks it", " the merge does not"))]
        written = (
            f"format_version {format_version}, read as {report.FORMAT_VERSION}"
            if older
            else f"written by mergekit-ram {was}; {now} is installed"
        )
        outcome.notes += [f"{STATS_FILE}: {line} ({written})" for line in keys]
        found = [line for line in found if line not in keys]
    shown = [f"{STATS_FILE}: {line}" for line in found[:SHOWN]]
    if len(found) > SHOWN:
        shown.append(f"{STATS_FILE}: {len(found) - SHOWN} more value(s) differ from the recomputed ones")
    outcome.files += shown
    if not found and outcome.sample is not None:  # `verify --sample`: the totals from the recorded per-tensor counts
        outcome.checked.append(
            f"{STATS_FILE}'s statistics against its per-tensor counts (the per-agent totals, densities, rho, lambda "
            "and pairs they sum to); each tensor's counts against its slice's"
        )
    elif not found:
        outcome.checked.append(
            f"{STATS_FILE}'s statistics (recomputed: counts, densities, rho, lambda, diagnostics; their float sums "
            f"to {published_checks.SUM_TOLERANCE:g} of their size, as kernels add in other orders)"
        )


def check_card(folder: str, recorded: dict, outcome: verdict.Outcome) -> None:
    """The card holds exactly one RAM+ section, outside comments, code and HTML, the one a merge of this report
    writes (`published_checks.card_problem`), and the front matter a merge writes."""
    if not os.path.lexists(os.path.join(folder, "README.md")):
        outcome.not_checked.append("the model card (no README.md)")
        return
    text = folder_checks.read_bytes(folder, "README.md").decode("utf-8", errors="replace")
    if recorded.get("format_version") != report.FORMAT_VERSION:  # another mergekit-ram's section, not rebuilt
        outcome.not_checked.append(
            f"the card's RAM+ section ({STATS_FILE} is format_version {recorded.get('format_version')}, whose "
            "section this mergekit-ram does not write)"
        )
        return
    try:
        section = card.card_section(recorded)
    except (KeyError, TypeError, ValueError, AttributeError):
        outcome.files.append(f"README.md: {STATS_FILE} cannot make its RAM+ section (its versions are damaged)")
        return
    problem = published_checks.card_problem(text, section)
    if problem is None:
        outcome.checked.append("the card's RAM+ section")
    else:
        outcome.files.append(f"README.md: {problem}")
    lineage = published_checks.front_matter_problems(text, card.front_matter(recorded))
    outcome.files += [f"README.md: {line}" for line in lineage]
    if not lineage:
        outcome.checked.append("the card's front matter (base_model, base_model_relation, tags)")


class RamPlusChecks:
    """`recompute.MethodChecks` of a `ramplus` merge: this module's checks, as the driver calls them."""

    checked_record: str | None = "the planned parameters and rho against ram_stats.json"

    def prepare(
        self, merge: recompute.Merge, recorded: dict, seen: dict[str, dict], sampled: bool, outcome: verdict.Outcome
    ) -> tuple[dict, Any] | None:
        outcome.parameters = record_checks.plan_mismatches(recorded, merge.planned(), source=merge.planned_from)
        if outcome.parameters:
            return None
        given = self.given(recorded, merge.names) if sampled else None
        made, stats, source = merge.prepare(seen, given, count=bool(recorded.get("tensors")))
        made = record_checks.as_recorded({**made, "merge": recorded.get("merge")}, merge.labels)
        outcome.statistics = source
        outcome.parameters = record_checks.rho_mismatches(recorded, made)
        return made, stats

    def given(self, recorded: dict, labels: Mapping[str, str]) -> recompute.Given:
        def reduced(agents: list[str], epsilons: dict[str, float], needs_rho: bool) -> Any:
            return recorded_statistics(recorded, agents, epsilons, needs_rho, labels)

        return reduced

    def against_slices(
        self, merge: recompute.Merge, stats: Any, counted: dict, recorded: dict, outcome: verdict.Outcome
    ) -> None:
        against_slices(merge, stats, counted, recorded, outcome)

    def check_statistics(self, recorded: dict, recomputed: dict, outcome: verdict.Outcome) -> None:
        check_statistics(recorded, recomputed, outcome)

    def check_card(self, folder: str, recorded: dict, outcome: verdict.Outcome) -> None:
        check_card(folder, recorded, outcome)


#: the checks of the one method verify runs again (`record_checks.read_report` refuses another method's record)
CHECKS = RamPlusChecks()
