"""The statistics pass on mergekit's own executors, or its counts from the cache.

Every planned `ramplus` tensor is counted with the very same input task its merge task will
run (dtype, vocabulary alignment, device), the same per-tensor epsilon and the kernel's own
mask (`CountTask`), on the executor mergekit itself would use: by default slice by slice in
the reverse of the merge's order (`run_reversed`), in the merge's order with
`MERGEKIT_RAM_STATS_ORDER=forward`, on every GPU with `--multi-gpu`. The cache key names
each input's identity (its folder's, or its file's for `mergekit-pytorch`: the plan's `identify`,
read once per pass) and every planned task as plain data.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mergekit.graph import Task

from mergekit_ram._mergekit import tasks as planned_tasks
from mergekit_ram.core import cache, kernel, native, statistics
from mergekit_ram.errors import RamError

LOG = logging.getLogger("mergekit_ram")

#: The statistics pass runs in at most this many executors (slices of the merge's order, last slice first).
SLICES = 64
#: seconds between two draws of our progress bars when stderr is no terminal (a log file)
LOG_INTERVAL = 60.0


#: model -> what identifies its weights (`Plan.identity`)
Identify = Callable[[Any], dict]


def statistics_of(
    options: Any, tasks: list[Any], seen: dict[str, dict], *, identify: Identify | None = None
) -> tuple[statistics.Statistics, str]:
    """The counts of `tasks` and where they come from: "cache" or "computed". `seen`: the inputs' identities, read
    once (`identify`; default: the model's folder)."""
    agents = [str(m) for m in planned_tasks.agents(tasks[0])]
    digest = cache_key(tasks, seen, identify)
    entry = cache.load(digest) if digest else None
    if digest and entry is not None and covers(entry, agents, tasks):
        LOG.info("ramplus: statistics from cache %s (no tensor read)", digest[:12])
        return statistics.Statistics.from_json(entry["agents"], entry["tensors"]), "cache"
    stats = statistics.Statistics(agents, count(options, tasks))
    if digest:
        cache.store(digest, agents, stats.to_json())
    return stats, "computed"


def covers(entry: dict, agents: list[str], tasks: list[Any]) -> bool:
    """An entry must name these agents and every planned tensor (buffers aside)."""
    names = {t["name"] for t in entry["tensors"]}
    planned = {t.output_weight.name for t in tasks}
    if entry["agents"] == agents and names <= planned:
        return True
    LOG.warning("ramplus: statistics cache entry does not match the planned merge; recounting")
    return False


def cache_key(tasks: list[Any], seen: dict[str, dict], identify: Identify | None = None) -> str | None:
    """The cache key of counting `tasks` (None: the cache is off, or an input cannot be identified)."""
    if cache.directory() is None:
        return None
    try:
        models = {m for t in tasks for m in t.model_order}
        parts = {
            "kernel": "active=|tau|>eps; tau in float32 (float64 for float64 inputs); diagnostics' sums per "
            f"span of {native.SPAN} entries",  # entries counted with another split of the sums are counted again
            "models": {str(m): identity(m, seen, identify) for m in sorted(models, key=str)},
            "tensors": [
                [
                    t.output_weight.name,
                    planned_tasks.plain(t.gather_tensors),
                    t.parameters["epsilon"],
                    t.dtype,
                    [str(m) for m in t.model_order],
                    str(t.base_model),
                ]
                for t in tasks
            ],
        }
        return cache.key(parts)
    except Exception as error:  # an input we cannot identify is simply not cached
        LOG.warning("ramplus: statistics cache skipped: %s", error)
        return None


def identity(model: Any, seen: dict[str, dict], identify: Identify | None = None) -> dict:
    """The identity of `model` (`identify`; default: its folder's, `cache.folder_identity`), read once per
    statistics pass (`seen`)."""
    if str(model) not in seen:
        seen[str(model)] = (identify or _folder)(model)
    return seen[str(model)]


def _folder(model: Any) -> dict:
    from mergekit.io.tasks import LoaderCache

    return cache.folder_identity(LoaderCache().get(model).index.base_path)


def count(options: Any, tasks: list[Any]) -> list[statistics.TensorCounts]:
    """Count every task on mergekit's executors (buffers are not counted), in planning order."""
    targets = [CountTask(merge_task=t) for t in tasks]
    if not options.multi_gpu and os.environ.get("MERGEKIT_RAM_STATS_ORDER", "reverse") == "reverse":
        results = run_reversed(targets, options)
    else:
        results = run_as_merge(targets, options, desc="RAM+ statistics")
    counted = {value.name: value for _, value in results if value is not None}
    return [counted[t.output_weight.name] for t in tasks if t.output_weight.name in counted]


def run_reversed(targets: list[Any], options: Any) -> Iterator[tuple[Any, Any]]:
    """Count in the reverse of the order the merge will read, so the merge starts on what is still cached.

    mergekit's executor orders tasks by `group_label()` (the tensor name), so the merge pass reads
    tensors in that order. When the inputs exceed the page cache, a statistics pass in the same order
    leaves only its last tensors cached and the merge evicts them before it gets there (a scan defeats
    LRU): everything is read from disk twice. Counting slice by slice, last slice first, the merge pass
    starts on the tensors the statistics pass read last. The counts are the same in any order
    (`MERGEKIT_RAM_STATS_ORDER=forward` counts in the merge's order, in one executor). The progress bar
    is closed however the pass ends, so an error is printed on a line of its own.
    """
    keyed = [(t.group_label() or "", t) for t in targets]
    labels = sorted({label for label, _ in keyed})
    size = -(-len(labels) // SLICES)
    slices = [set(labels[i : i + size]) for i in range(0, len(labels), size)]
    return counted(_reversed(slices, keyed, options), len(targets), "RAM+ statistics", options.quiet)


def _reversed(slices: list[set[str]], keyed: list[tuple[str, Any]], options: Any) -> Iterator[tuple[Any, Any]]:
    for chunk in reversed(slices):
        part = [t for label, t in keyed if label in chunk]
        yield from _executor(part, options).run(quiet=True)


def counted(results: Iterator[tuple[Any, Any]], total: int, desc: str, quiet: bool) -> Iterator[tuple[Any, Any]]:
    """`results` with a progress bar that counts them (one a tensor), closed however they end, so an error starts
    a line of its own; none when `quiet`. When stderr is no terminal the bar is drawn at most once a minute (tqdm's
    `mininterval`): a log file holds its first and last state, not a redraw every tenth of a second."""
    bar = None
    if not quiet:
        import tqdm  # type: ignore[import-untyped]  # mergekit's own progress bars

        every = LOG_INTERVAL if not _terminal() else 0.1  # tqdm's default on a terminal
        bar = tqdm.tqdm(total=total, desc=desc, unit="tensor", mininterval=every)
    try:
        for item in results:
            if bar is not None:
                bar.update(1)
            yield item
    finally:
        if bar is not None:
            bar.close()


def _terminal() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


def run_as_merge(targets: list[Any], options: Any, *, desc: str) -> Iterator[tuple[Any, Any]]:
    """Run `targets` on the executor `run_merge` runs a merge on (mergekit.merge.run_merge, 0.1.5): every GPU with
    `--multi-gpu`, else one device (`_executor`). The statistics pass and verify's recomputation both run here."""
    if options.multi_gpu:
        from mergekit.multigpu_executor import MultiGPUExecutor

        executor = MultiGPUExecutor(targets=targets, storage_device=None if options.low_cpu_memory else "cpu")
        return counted(executor.run(quiet=True), len(targets), desc, options.quiet)
    return counted(_executor(targets, options).run(quiet=True), len(targets), desc, options.quiet)


def _executor(targets: list[Any], options: Any) -> Any:
    """mergekit's single-device executor, on the devices `run_merge` would use."""
    from mergekit.graph import Executor

    storage = options.device if options.low_cpu_memory else "cpu"
    return Executor(targets=targets, math_device=options.device, storage_device=storage)


class CountTask(Task[statistics.TensorCounts | None]):
    """Counts one planned tensor exactly as its ExecuteMergeMethodTask will see it."""

    merge_task: Any

    def arguments(self):
        return {"tensors": self.merge_task.gather_tensors}

    def group_label(self) -> str | None:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return True

    def execute(self, tensors, **_kwargs) -> statistics.TensorCounts | None:
        from mergekit.common import dtype_from_name
        from mergekit.merge_methods import TensorEntry, TensorGroup, TensorMetadata, get
        from mergekit.merge_methods.dtype import align_dtype

        task = self.merge_task
        entries = tuple(
            TensorEntry(id=model, tensor=tensor, is_base=model == task.base_model)
            for model in task.model_order
            if (tensor := tensors.get(model)) is not None
        )
        name = task.output_weight.name
        get(task.method_name).validate_inputs([e.id for e in entries], task.base_model, group_name=name)
        if not all(e.tensor.is_floating_point() for e in entries):
            return None  # buffers are copied, never merged: not counted
        _check_shapes(entries, task.output_weight, task.base_model)
        group = TensorGroup(entries=entries, metadata=TensorMetadata.from_weight_info(task.output_weight))
        group.validate_tensors()
        group = align_dtype(group, dtype_from_name(task.dtype))
        agents = group.non_base
        labels = [str(e.id) for e in agents]
        epsilon = task.parameters["epsilon"]
        found = kernel.diagnose(
            group.base.tensor,
            [e.tensor for e in agents],
            epsilon,
            names=labels,
            tensor_name=name,
            base_name=str(task.base_model),
        )
        counts = dict(zip(labels, map(tuple, found.counts.tolist()), strict=True))
        every = [str(m) for m in planned_tasks.agents(task)]  # an agent without this tensor left it unchanged
        return statistics.TensorCounts(
            name,
            group.base.tensor.numel(),
            {a: counts.get(a, (0, 0, 0)) for a in every},
            epsilon,
            diagnostics(labels, found, every),
        )


def _check_shapes(entries: Sequence[Any], weight: Any, base_model: Any) -> None:
    """A shape mismatch named by model and tensor (mergekit names neither model; a safetensors input's shapes
    were checked from its header already, a PyTorch pickle's are seen here first)."""
    if getattr(weight, "vocabulary_axis", None) is not None or getattr(weight, "is_embed", False):
        return  # aligned by mergekit's vocabulary wrappers, or its own error
    base = next((e for e in entries if e.id == base_model), None)
    if base is None:
        return
    for e in entries:
        if e.tensor.shape != base.tensor.shape:
            raise RamError(
                f"ramplus: tensor {weight.name} has shape {tuple(e.tensor.shape)} in {e.id} but "
                f"{tuple(base.tensor.shape)} in the base model {base_model}: the models do not share one architecture"
            )


def diagnostics(
    labels: Sequence[str], found: kernel.Diagnosis, every: Sequence[str] | None = None
) -> statistics.Diagnostics:
    """The kernel's diagnostics of one tensor (agents in `labels` order) as `statistics.Diagnostics`; with
    `every` (all the merge's agents, in order), zeros for the agents that lack the tensor."""
    ints, sums = found.pair_counts.tolist(), found.pair_sums.tolist()
    single = dict(zip(labels, found.single.tolist(), strict=True))
    magnitude = {a: (u, s) for a, (u, s) in zip(labels, found.magnitude.tolist(), strict=True)}
    pairs = {
        (labels[i], labels[j]): (c, same, d, x, y)
        for (i, j), (c, same), (d, x, y) in zip(kernel.pairs(len(labels)), ints, sums, strict=True)
    }
    if every is None or list(every) == list(labels):
        return statistics.Diagnostics(single, magnitude, pairs)
    none = (0, 0, 0.0, 0.0, 0.0)
    return statistics.Diagnostics(
        {a: single.get(a, 0) for a in every},
        {a: magnitude.get(a, (0.0, 0.0)) for a in every},
        {(a, b): pairs.get((a, b), none) for i, a in enumerate(every) for b in every[i + 1 :]},
    )
