"""`verify --sample`'s slices recomputed: the drawn runs of every output tensor (`verify.sample`), read from the
files by their byte ranges and merged by the tensor's own merge task, compared bit for bit with the same runs of
the published tensor, and counted.

A RAM+ output entry depends only on the same entry of the inputs and on lambda (the kernel is elementwise), so
mergekit's `ExecuteMergeMethodTask.execute`, given each input's drawn elements as one flat tensor, computes exactly
the drawn elements of the merged tensor: the same dtype alignment, method, rounding and cast to the saved dtype as
a merge, at the cost of the slice alone. A task is sliced only where that holds (`whole`): its inputs are read as
stored (`GatherTensors`, or `mergekit-pytorch`'s plain loads), from safetensors files, under the output's name or
an alias, every input holding it in one shape. Anything else (a vocabulary mapped by row through a union
tokenizer, a pickled input, a tensor copied or converted under another name) is checked whole by the executor,
and the verdict names it with why.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mergekit_ram import errors, files
from mergekit_ram._mergekit import counting, tasks
from mergekit_ram.core import statistics
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.verify import bitwise, sample

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def whole(plan: tasks.Plan, task: Any, headers: dict[str, dict]) -> str | None:
    """Why the tensor `task` makes cannot be recomputed slice by slice (None: it can)."""
    from mergekit.io.tasks import GatherTensors
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper

    if not isinstance(task, ExecuteMergeMethodTask) or not resolves_to_ours(task.method_name):
        return f"made by {type(task).__name__}, not by a ramplus merge task"
    gather = task.gather_tensors
    if not isinstance(gather, (GatherTensors, TensorDictWrapper)):
        return f"mergekit maps its rows ({type(gather).__name__}: a vocabulary aligned through the tokenizer)"
    try:
        found = plan.sources(task)
    except Exception as error:
        return f"its inputs cannot be located ({type(error).__name__})"
    if len(found) != len(task.model_order):
        return "an input does not store it under its name (mergekit loads it tied, converted or not at all)"
    if any(not path.lower().endswith(".safetensors") for path, _ in found.values()):
        return "an input is a pickle, which has no byte ranges"
    stored = {
        tuple((tasks.header_entry(path, name, headers) or (None, None))[1] or ()) for path, name in found.values()
    }
    if len(stored) != 1 or not next(iter(stored)):
        return "its inputs store it in different shapes (the merge names the mismatch)"
    return None


def _cast(task: Any, model: Any) -> str | None:
    """The dtype mergekit's load of `model`'s tensor casts to (None: as stored)."""
    gather = task.gather_tensors
    loads = getattr(gather, "tensors", None)
    if loads is not None:  # mergekit-pytorch: each input's own load
        return getattr(loads[model], "dtype", None)
    return getattr(gather, "dtype", None)


def read(path: str, name: str, spans: list[tuple[int, int]], headers: dict[str, tuple[int, dict]]) -> torch.Tensor:
    """The elements `spans` of tensor `name` in the safetensors file `path`, flat, read by their byte ranges;
    Unreadable naming the file when its header does not place them inside it."""
    entry = _entry(path, name, headers)
    dtype = _DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise errors.Unreadable(f"{path}: tensor {name} is not stored as a float (safetensors header)")
    start = headers[path][0]
    size, itemsize = os.path.getsize(path), torch.empty((), dtype=dtype).element_size()
    first, last = (start + int(offset) for offset in entry["data_offsets"])
    numel = 1
    for length in entry["shape"]:
        numel *= int(length)
    if last - first != numel * itemsize or first < start or last > size:
        raise errors.Unreadable(
            f"{path}: tensor {name}'s bytes {first}-{last} do not hold its {numel:,} elements inside the file "
            f"({size:,} bytes)"
        )
    out = bytearray()
    with open(path, "rb") as f:
        for a, b in spans:
            f.seek(first + a * itemsize)
            out += f.read((b - a) * itemsize)
    if len(out) != sum(b - a for a, b in spans) * itemsize:
        raise errors.Unreadable(f"{path}: tensor {name}: the file ends inside it")
    return torch.frombuffer(out, dtype=dtype) if out else torch.empty(0, dtype=dtype)


def check(
    plan: tasks.Plan, saves: list, drawn: sample.Sample, folder: str, index: dict[str, str], outcome: Any
) -> dict[str, statistics.TensorCounts]:
    """Compare the slice of every sliced tensor (`saves`: after rho is injected); each compared tensor goes into
    `outcome`. Returns the slices' counts (`counting.CountTask` on the slices), tensor -> counts."""
    from mergekit.common import dtype_from_name

    slices = {s.name: s for s in drawn.slices if s.whole is None}
    headers: dict[str, tuple[int, dict]] = {}
    counted: dict[str, statistics.TensorCounts] = {}
    for name, task, _optional, dtype in saves:
        cut = slices.get(name)
        if cut is None:
            continue
        if name not in index:
            outcome.add(bitwise.Difference(name, "missing"))
            continue
        spans, found, inputs = cut.spans(), plan.sources(task), {}
        for model in task.model_order:
            tensor = read(*found[str(model)], spans, headers)
            wanted = dtype_from_name(_cast(task, model))
            inputs[model] = tensor if wanted is None else tensor.to(dtype=wanted)
        published = os.path.join(folder, index[name])
        planned = [int(n) for n in _entry(*found[str(task.base_model)], headers)["shape"]]
        mismatch = _published_mismatch(published, name, planned, dtype, headers)
        if mismatch is not None:
            outcome.add(mismatch)
            continue
        try:
            merged = task.execute(tensors=inputs)
        except errors.NonFiniteResultError as error:
            detail = f"{error} (in its slice; verify stopped here, as the merge does)"
            outcome.add(bitwise.Difference(name, "not finite", detail=detail))
            return counted
        if merged is not None and dtype:
            merged = merged.to(dtype=dtype_from_name(dtype))
        outcome.add(bitwise.compare(name, merged, read(published, name, spans, headers)))
        counts = counting.CountTask(merge_task=task).execute(tensors=inputs)
        if counts is not None:
            counted[name] = counts
    return counted


def _entry(path: str, name: str, headers: dict[str, tuple[int, dict]]) -> dict:
    """Tensor `name`'s entry in the header of `path` ({} when absent); each header read once (`headers`)."""
    if path not in headers:
        try:
            raw, header = files.read_header(path)
        except (OSError, ValueError) as error:
            raise errors.Unreadable(f"{path}: its safetensors header cannot be read ({error})") from error
        headers[path] = (8 + len(raw), header)
    entry = headers[path][1].get(name)
    return entry if isinstance(entry, dict) else {}


def _published_mismatch(
    path: str, name: str, planned: list[int], dtype: str | None, headers: dict[str, tuple[int, dict]]
) -> bitwise.Difference | None:
    """A published tensor whose dtype or shape is not what the plan writes (the base's shape, the saved dtype)."""
    entry = _entry(path, name, headers)
    if not entry:
        return bitwise.Difference(name, "missing")
    said = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}.get(str(entry.get("dtype")))
    said = said or str(entry.get("dtype"))
    shape = [int(n) for n in entry.get("shape") or []]
    wanted = str(dtype) if dtype else said
    if said != wanted or shape != planned:
        status = "dtype" if said != wanted else "shape"
        return bitwise.Difference(name, status, published=f"{said} {shape}", recomputed=f"{wanted} {planned}")
    return None


#: the chance that an honest record fails the totals check, per agent and count (active, unique)
ALPHA = 1e-6


def totals(
    stats: statistics.Statistics,
    counted: dict[str, statistics.TensorCounts],
    drawn: sample.Sample,
    task: Any,
    labels: dict[str, str],
) -> tuple[list[str], str]:
    """Each agent's active and unique totals in `ram_stats.json` against their estimate from the slices (a tensor
    checked whole counts as recorded: `sampling.recount` counts it again), and what the check says (a sentence).

    Sliced tensor t, its B runs of at most `run` elements, k drawn: `count * B / k` estimates its count without
    bias, a sum of k draws without replacement, each in [0, B * run / k]. By Hoeffding (whose bound holds for draws
    without replacement, and for the sum over independently sliced tensors), the estimate of a total is further
    than s from the truth with a chance of at most 2 exp(-2 s^2 / V), V = sum over sliced tensors of
    (B * run)^2 / k: s is set so that chance is `ALPHA`. A record within s of the estimate is off by at most 2 s
    with a chance of at least 1 - ALPHA, which bounds how far lambda (`rho_scope: model`) can be moved unseen."""
    import math

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
                    f"ram_stats.json: {label}'s {name} entries total {recorded[agent][column]:,}; its slices estimate "
                    f"{estimated[agent][column]:,.0f}, more than {room:,.0f} apart (an honest record is, with a chance "
                    f"below {ALPHA:g})"
                )
        moved = max(moved, _lambda_moved(active, unique, 2 * room, task.parameters))
    said = f"each agent's active and unique totals within {room:,.0f} of the slices' estimate"
    if task.parameters["rho_scope"] == "model" and task.parameters["r"] != 0:
        said += f"; a record moving an agent's lambda by more than {moved:.2g} is caught with a chance of at least "
        said += f"{100 * (1 - ALPHA):.4f} %"
    return out, said


def _lambda_moved(active: int, unique: int, room: float, parameters: Any) -> float:
    """The most lambda moves when an agent's active and unique totals each move by up to `room`."""
    r, alpha, rule = parameters["r"], parameters["alpha"], parameters["lambda_rule"]

    def lam(a: float, u: float) -> float:
        u = max(u, 0.0)
        return statistics.lambda_for((max(a, u) - u) / u if u else float("inf"), r, alpha, rule)

    now = lam(active, unique)
    return max(abs(lam(active + room, unique - room) - now), abs(lam(active - room, unique + room) - now))
