"""`mergekit-ram verify --sample P` on mergekit's plan: the draw over the planned output tensors, the counts taken
from `ram_stats.json` instead of a pass over every tensor, the sampled tensors counted again, and the bytes of
weight files a sample reads.

A full verify counts every planned tensor to get rho, which reads every input byte. A sample instead takes
`ram_stats.json`'s per-tensor counts (`recorded_statistics`: each tensor the merge plans, with its planned element
count and epsilon), from which `pipeline.prepare` sums the per-agent totals and reduces rho exactly as a merge does:
`published.check` then finds any total, rho, lambda or pair in the record that does not follow from them. The
sampled tensors alone are counted again (`recount`) and their counts compared with the record's; counts of the
others are checked only through those sums. The draw itself is `verify.sample`'s, on plain data; each tensor's
element count is its base input's (the header of what the plan reads), else the published header's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Container
from typing import Any

from mergekit_ram import files
from mergekit_ram._mergekit import counting, slicing, tasks
from mergekit_ram.core import cache, statistics
from mergekit_ram.errors import Unreadable
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.verify import folder_checks, loader_files, published_checks, sample

STATS = "ram_stats.json"


def draw(plan: tasks.Plan, folder: str, index: dict[str, str], share: float, seed: int) -> sample.Sample:
    """A slice of every planned output tensor (`index`: the published folder's tensor -> file); a tensor whose
    merge cannot be recomputed slice by slice (`slicing.whole`) is checked whole, and says why."""
    headers: dict[str, dict] = {}
    shapes, whole = {}, {}
    for name, task, _optional, _dtype in plan.saves():
        shape = _planned_shape(plan, task, name, folder, index, headers)
        shapes[name] = (_numel(shape), _numel(list(shape or [1])[1:]))
        why = slicing.whole(plan, task, headers)
        if why is not None:
            whole[name] = why
    return sample.draw(shapes, share, seed, whole)


def _planned_shape(
    plan: tasks.Plan, task: Any, name: str, folder: str, index: dict[str, str], headers: dict[str, dict]
) -> list[int] | None:
    """The shape of tensor `name` as the merge plans it: its inputs' (`_input_shape`), else the published header's
    (`index`: tensor -> file of `folder`), else None."""
    shape = _input_shape(plan, task, headers)
    if shape is None and name in index:
        shape = (tasks.header_entry(os.path.join(folder, index[name]), name, headers) or (None, None))[1]
    return shape


def _input_shape(plan: tasks.Plan, task: Any, headers: dict[str, dict]) -> list[int] | None:
    """The shape of the tensor a merge task reads from its base (else its first input), from the file's header;
    None where mergekit hands the task other rows than the inputs store (`Plan.reshapes`)."""
    if plan.reshapes(task):
        return None
    try:
        found = plan.sources(task)
    except Exception:  # a task that reads no input (a copied buffer's wrapper): the published header says
        return None
    base = str(getattr(task, "base_model", ""))
    for model in sorted(found, key=lambda m: m != base):
        shape = (tasks.header_entry(*found[model], headers) or (None, None))[1]
        if shape is not None:
            return shape
    return None


def _numel(shape: list[int] | None) -> int:
    count = 1
    for size in shape or [1]:
        count *= int(size)
    return count


def absent_shards(folder: str) -> list[str]:
    """One line per weight file an index of `folder` names that the folder does not hold (plain absence: no link,
    nothing opened), and per tensor an index names twice (JSON keeps the last: a sample would read one of two)."""
    out = []
    for choice in sorted(set(loader_files.loader_choices(folder).values())):
        if choice.endswith(".index.json"):
            names = loader_files.weight_files(folder, choice)
            out += [f"{name}: {choice} names it, the folder does not hold it" for name in names
                    if not os.path.lexists(os.path.join(folder, name))]  # fmt: skip
            out += [f"{name}: {choice} names it twice" for name in _twice(folder, choice)]
    return out


def _twice(folder: str, choice: str) -> list[str]:
    """The keys of an index's `weight_map` that it holds more than once."""
    seen: list[list[str]] = []

    def pairs(items: list) -> dict:
        seen.append([str(key) for key, _ in items])
        return dict(items)

    json.loads(folder_checks.read_bytes(folder, choice, folder_checks.JSON_LIMIT), object_pairs_hook=pairs)
    return sorted({key for keys in seen for key in keys if keys.count(key) > 1})


def recorded_statistics(
    recorded: dict, planned: list[Any], labels: dict[str, str]
) -> tuple[statistics.Statistics | None, str]:
    """`ram_stats.json`'s per-tensor counts as the statistics of `planned` (the ramplus tasks a pass would count;
    `labels`: input -> its recorded label), and their source, "recorded"; (None, "not computed") where the merge
    needs no rho and records no counts (r = 0, rho given). Each tensor's epsilon is the plan's (its element count
    is checked by `numel_mismatches`). Unreadable, naming the tensor, when the record's counts are malformed or
    name a tensor or agent the merge does not plan."""
    agents = [str(m) for m in tasks.agents(planned[0])]
    by_label = {labels.get(a, a): a for a in agents}
    by_name = {t.output_weight.name: t for t in planned}
    rows = recorded.get("tensors")
    if not rows and not tasks.needing_rho(planned):
        return None, "not computed"
    if not isinstance(rows, list) or not rows:
        raise Unreadable(f"{STATS} records no per-tensor counts, which a sample needs: verify it without --sample")
    out = []
    for row in rows:
        name = row.get("name") if isinstance(row, dict) else None
        task = by_name.get(str(name))
        if task is None:
            raise Unreadable(f"{STATS} counts tensor {name!r}, which the merge does not plan: is the folder damaged?")
        try:
            relabelled = _relabelled(row, by_label)
            cache.validate(agents, [relabelled])
            counts = statistics.Statistics.from_json(agents, [relabelled]).tensors[0]
        except (KeyError, TypeError, ValueError) as error:
            raise Unreadable(f"{STATS}: the counts of tensor {name} are malformed ({error})") from error
        epsilon = task.parameters["epsilon"]
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


def numel_mismatches(plan: tasks.Plan, stats: statistics.Statistics, folder: str, index: dict[str, str]) -> list[str]:
    """Tensors whose recorded element count is not that of the tensor the plan reads (from the inputs' headers; for
    rows mergekit maps, a union tokenizer's, from the published header, `index`: tensor -> file of `folder`)."""
    found = {t.output_weight.name: t for _, t in tasks.planned(plan, resolves_to_ours)}
    headers: dict[str, dict] = {}
    out = []
    for counts in stats.tensors:
        shape = _planned_shape(plan, found[counts.name], counts.name, folder, index, headers)
        if shape is not None and _numel(shape) != counts.numel:
            out.append(f"{STATS}: tensor {counts.name} records {counts.numel:,} elements; it has {_numel(shape):,}")
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
                        f"{STATS}: tensor {row.name}: {labels.get(agent, agent)}'s {column} count {value:,} cannot "
                        f"be: its slice holds {least:,} of {cut.elements:,} elements, so the tensor holds {least:,} "
                        f"to {least + outside:,}"
                    )
    return out


def recount(plan: tasks.Plan, drawn: sample.Sample, recorded: dict, labels: dict[str, str]) -> list[str]:
    """The ramplus tensors checked whole counted again, against `ram_stats.json`'s counts of them: one line per value
    that differs (the diagnostics' sums to `published_checks.SUM_TOLERANCE` of their size, as a full verify)."""
    rows = {row.get("name"): (i, row) for i, row in enumerate(recorded.get("tensors") or []) if isinstance(row, dict)}
    planned = [t for _, t in tasks.planned(plan, resolves_to_ours)]
    tied = tasks.tied_copies(plan.out_model_config, planned)
    chosen = set(drawn.whole)
    wanted = [t for t in planned if t.output_weight.name in chosen and t.output_weight.name not in tied]
    if not wanted:
        return []
    agents = [str(m) for m in tasks.agents(wanted[0])]
    found = statistics.Statistics(agents, counting.count(plan.options, wanted)).to_json(labels)
    counted = {row["name"]: row for row in found}
    out = []
    for task in wanted:
        name = task.output_weight.name
        at, was = rows.get(name, (None, None))
        now = counted.get(name)
        if was is None or now is None:
            if (was is None) != (now is None):
                said = "records no counts of it" if was is None else "counts it, the merge does not (a buffer)"
                out.append(f"{STATS}: tensor {name}: {STATS} {said}")
            continue
        for line in published_checks.report_differences(was, now, f"tensors[{at}]"):
            out.append(f"{STATS} ({name}, counted again): {line}")
    return out


def needed(
    plan: tasks.Plan, folder: str, index: dict[str, str], drawn: sample.Sample, seen: dict
) -> dict[str, set[tuple[int, int]]]:
    """The spans of weight files a sample reads (file -> (start, stop)): every safetensors header of the folder and
    the inputs, the inputs' identity samples (`cache`), and the drawn tensors' bytes in the folder and in the inputs
    they are computed from; a weight file that is not safetensors (a pickle), whole."""
    ranges: dict[str, set[tuple[int, int]]] = {}
    headers: dict[str, tuple[int, dict]] = {}

    def add(path: str, name: str | None = None, within: list[tuple[int, int]] | None = None) -> None:
        path = os.path.realpath(path)
        if not path.endswith(".safetensors"):
            ranges.setdefault(path, set()).add((0, os.path.getsize(path)))
            return
        if path not in headers:
            raw, header = files.read_header(path)
            headers[path] = (8 + len(raw), header)
            ranges.setdefault(path, set()).add((0, 8 + len(raw)))
        start, header = headers[path]
        entry = header.get(name) if name is not None else None
        if isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2:
            first, last = start + int(entry["data_offsets"][0]), start + int(entry["data_offsets"][1])
            if within is None:  # the whole tensor
                ranges[path].add((first, last))
                return
            size = (last - first) // max(1, _numel(entry.get("shape")))
            ranges[path].update((min(last, first + a * size), min(last, first + b * size)) for a, b in within)

    for file in sorted(set(index.values())):  # ranges fetched, and a damaged file named, in one order
        add(os.path.join(folder, file))
    for identity in seen.values():
        for path, size in _identity_files(identity):
            add(path)
            for start in cache.sample_offsets(size):
                ranges.setdefault(os.path.realpath(path), set()).add((start, min(size, start + cache.SAMPLE)))
    cuts = {s.name: s for s in drawn.slices}
    for name, task, _optional, _dtype in plan.saves():
        cut = cuts.get(name)
        if cut is None:
            continue
        within = None if cut.whole is not None else cut.spans()
        if name in index:
            add(os.path.join(folder, index[name]), name, within)
        try:
            found = plan.sources(task)
        except Exception:
            continue
        for path, tensor in found.values():
            add(path, tensor, within)
    return ranges


def bytes_read(spans: dict[str, set[tuple[int, int]]], elsewhere: Container[str] = ()) -> int:
    """The bytes `spans` (`needed`) cover, each once, but in the files `elsewhere` counts (fetched by ranges)."""
    return sum(_covered(found) for path, found in spans.items() if path not in elsewhere)


def _identity_files(identity: dict) -> list[tuple[str, int]]:
    """(path, size) of each file whose windows an input's identity samples (`cache`: a folder's safetensors files,
    or the single file of a `mergekit-pytorch` input)."""
    path, named = identity.get("path") or "", identity.get("files") or {}
    if os.path.isfile(path):
        return [(path, int(entry["size"])) for entry in named.values()]
    return [(os.path.join(path, n), int(e["size"])) for n, e in named.items() if n.endswith(".safetensors")]


def _covered(spans: set[tuple[int, int]]) -> int:
    """The bytes the union of `spans` covers."""
    total, end = 0, 0
    for start, stop in sorted(spans):
        start = max(start, end)
        if stop > start:
            total += stop - start
            end = stop
    return total
