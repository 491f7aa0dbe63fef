"""The `ramplus` pipeline on mergekit's planned tasks: checks, count or cache, inject rho, report, write.

RAM+'s rho_t is a whole-model quantity, but mergekit merges one tensor at a
time. Once mergekit has planned the tensors (`hooks` calls `prepare` right
after `MergePlanner._plan`), we turn the planned `ramplus` tasks into plain
data (`session.Planned`), check what the models store, count every planned
tensor with the very same input task (dtype, vocabulary alignment, device),
the same per-tensor epsilon and the kernel's own mask, on the executor mergekit
itself would use (`CountTask`), or take the counts from the cache; then hand
each merge task its agents' rho and keep the report in the `MergeSession`.
`ram_stats.json` is written after the model. `inspect` runs the same pipeline
without merging. Both `mergekit-yaml` and `inspect` go through `prepare`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from mergekit.graph import Task

from mergekit_ram import cache, config_checks, files, input_checks, kernel, output_checks, report, statistics, tables
from mergekit_ram._mergekit import surface
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.params import DEFAULTS
from mergekit_ram.session import MergeSession, Planned, active

LOG = logging.getLogger("mergekit_ram")


# --------------------------------------------------------------------------- #
# Checks before anything is read
# --------------------------------------------------------------------------- #
def check_config(current: MergeSession) -> None:
    """The config's base and parameters (an `inspect` of another method's config: its base only)."""
    if not current.config_checked:
        config_checks.check_config(current.config, parameters=current.check_parameters)
        current.config_checked = True


def check_inputs(config: Any, *, card: bool) -> None:
    """Input files before mergekit opens them; a config mergekit can write into the card (`card`)."""
    if card:
        output_checks.check_config_serialisable(config)
    input_checks.check_input_files(config)


def _ours(config: Any) -> bool:
    return resolves_to_ours(config.merge_method)


# --------------------------------------------------------------------------- #
# The statistics pass
# --------------------------------------------------------------------------- #
def prepare(planner: Any, current: MergeSession) -> None:
    """Count (or load), reduce to rho per scope, inject into the planned tasks, keep the report in `current`."""
    found = _planned_tasks(planner)
    if not found:  # nothing to count (inspect says so when it finds no report)
        return
    found = _round_once_to_out_dtype(planner, found)
    tasks = [task for _, task in found]
    headers: dict[str, dict] = {}  # each file's header, read once
    rows = [_stored_row(task, headers) for task in tasks]
    input_checks.check_stored_tensors(rows)
    _warn_stored_dtypes(planner.config, rows[0])
    tied = _tied_copies(planner, tasks)
    tasks = [t for t in tasks if t.output_weight.name not in tied]  # a tied pair is counted once
    current.planned = [_summary(task) for task in tasks]
    needs = {
        model
        for task in tasks
        if task.parameters["r"] != 0
        for model in _agents(task)
        if task.input_parameters[model].get("rho") is None
    }
    counting = bool(needs) or current.mode == "inspect"
    seen: dict[str, dict] = {}  # each input folder's identity, read once (cache key and report)
    current.stats, current.source = _statistics(planner, tasks, seen, compute=counting)
    if not needs and current.mode == "merge":
        LOG.info("ramplus: r = 0 or rho given for every agent; no statistics pre-pass")
    if current.stats is not None and current.mode == "merge":
        _inject(planner, found, current.stats, needs, tied)
    current.report = report.build(
        current.stats, current.planned, source=current.source, identities=_identities(tasks[0], seen), tied=tied
    )
    if current.stats is None or current.mode != "merge":
        return
    totals = current.stats.totals()
    for label, s in totals.items():
        if s.active == 0:
            LOG.warning(
                "ramplus: %s changes no weight by more than epsilon; it is identical to the base "
                "and adds nothing to the merge",
                label,
            )
    params = tasks[0].parameters
    table = tables.format_table(totals.values(), params["r"], params["alpha"], params["lambda_rule"])
    LOG.info("RAM+ statistics (%s):\n%s", current.source, table)
    if not planner.options.quiet and needs:
        print(f"RAM+ statistics ({current.source}):\n{table}", file=sys.stderr, flush=True)


def _planned_tasks(planner: Any) -> list[tuple[int, Any]]:
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper

    found = [
        (i, task)
        for i, (_, task) in enumerate(surface.planned(planner))
        if isinstance(task, ExecuteMergeMethodTask) and resolves_to_ours(task.method_name)
    ]
    if any(isinstance(t.gather_tensors, TensorDictWrapper) for _, t in found):
        raise ValueError("ramplus: raw tensor-dict inputs have no whole-model rho")
    return found


def _round_once_to_out_dtype(planner: Any, found: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Give each planned merge task the dtype it is written in, so the kernel rounds once, to it.

    mergekit plans merge tasks without `out_dtype` and casts when saving: the kernel's float32
    result would be rounded to the input dtype (bfloat16) first, then widened to float32.
    """
    wanted = getattr(planner.config, "out_dtype", None)
    out = []
    for index, task in found:
        dtype = task.output_weight.force_dtype or wanted
        if dtype and task.out_dtype is None:
            task = task.model_copy(update={"out_dtype": dtype})
            surface.replace_planned(planner, index, task)
        out.append((index, task))
    return out


def _tied_copies(planner: Any, tasks: list[Any]) -> dict[str, str]:
    """Planned tensors the output ties to another planned tensor (`tie_word_embeddings`: an exporter's
    stored `lm_head` copy of the embeddings): copy -> the tensor it is tied to.

    Such a pair is one set of parameters in the model transformers loads, so it is counted once,
    whether or not an exporter also stored the copy; the copy is merged and written as mergekit does,
    with the rho of the tensor it is tied to.
    """
    config: Any = planner.out_model_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    names = {t.output_weight.name for t in tasks}
    tied: dict[str, str] = {}
    for task in tasks:
        name = task.output_weight.name
        target = next((n for n in task.output_weight.tied_names or () if n in names and n != name), None)
        if target is not None and target not in tied:
            tied[name] = target
    return tied


def _summary(task: Any) -> Planned:
    agents = _agents(task)
    return Planned(
        name=task.output_weight.name,
        base=str(task.base_model),
        agents=tuple(str(m) for m in agents),
        parameters={k: task.parameters[k] for k in DEFAULTS},
        given_rho={str(m): task.input_parameters[m].get("rho") for m in agents},
    )


def _agents(task: Any) -> list[Any]:
    return [m for m in task.model_order if m != task.base_model]


def _weight_infos(task: Any) -> dict[Any, Any]:
    """model -> WeightInfo of the loading task under any wrappers (vocabulary alignment,
    `--unsafe-truncate-embeddings`: a wrapper's own `weight_info` is one WeightInfo, not a map)."""
    gather = task.gather_tensors
    while not hasattr(getattr(gather, "weight_info", None), "items") and hasattr(gather, "gather_tensors"):
        gather = gather.gather_tensors
    infos: Any = getattr(gather, "weight_info", None)
    return dict(infos.items()) if hasattr(infos, "items") else {}


def _stored_row(task: Any, headers: dict[str, dict]) -> tuple[str, str, bool, dict[str, input_checks.Stored]]:
    """What `input_checks.check_stored_tensors` needs of one task, from the models' indexes and headers."""
    from mergekit.io.tasks import GatherTensors, LoaderCache

    stored = {
        str(model): _stored(LoaderCache().get(model).index, weight, headers)
        for model, weight in _weight_infos(task).items()
    }
    weight = task.output_weight
    vocabulary = (
        not isinstance(task.gather_tensors, GatherTensors)
        or bool(getattr(weight, "is_embed", False))
        or getattr(weight, "vocabulary_axis", None) is not None
    )
    return weight.name, str(task.base_model), vocabulary, stored


def _stored(index: Any, weight: Any, headers: dict[str, dict]) -> input_checks.Stored:
    """(dtype, shape) of a weight as stored (None, None outside safetensors); None when absent."""
    for name in [weight.name, *(weight.aliases or ())]:
        path = index.tensor_paths.get(name)
        if path is None:
            continue
        path = path if os.path.isabs(path) else os.path.join(index.base_path, path)
        if not path.endswith(".safetensors"):
            return None, None
        if path not in headers:
            try:
                headers[path] = files.read_header(path)[1]
            except (OSError, ValueError):
                headers[path] = {}
        info = headers[path].get(name)
        return (info["dtype"], list(info["shape"])) if isinstance(info, dict) else (None, None)
    return None


def _warn_stored_dtypes(config: Any, row: tuple[str, str, bool, dict[str, input_checks.Stored]]) -> None:
    """The dtype warnings, from the stored dtypes of one planned tensor (`_stored_row`: headers read once)."""
    from mergekit.common import dtype_from_name

    _, base, _, found = row
    stored = {model: entry[0] for model, entry in found.items() if entry is not None and entry[0] is not None}
    wanted = dtype_from_name(config.dtype)
    input_checks.warn_stored_dtypes(stored, base, config.dtype, wanted.itemsize if wanted is not None else None)


def _statistics(
    planner: Any, tasks: list[Any], seen: dict[str, dict], *, compute: bool
) -> tuple[statistics.Statistics | None, str]:
    agents = [str(m) for m in _agents(tasks[0])]
    digest = _cache_key(tasks, seen)
    entry = cache.load(digest) if digest else None
    if digest and entry is not None and _covers(entry, agents, tasks):
        LOG.info("ramplus: statistics from cache %s (no tensor read)", digest[:12])
        return statistics.Statistics.from_json(entry["agents"], entry["tensors"]), "cache"
    if not compute:
        return None, "not computed"
    stats = statistics.Statistics(agents, _count(planner.options, tasks))
    if digest:
        cache.store(digest, agents, stats.to_json())
    return stats, "computed"


def _covers(entry: dict, agents: list[str], tasks: list[Any]) -> bool:
    """An entry must name these agents and every planned tensor (buffers aside)."""
    names = {t["name"] for t in entry["tensors"]}
    planned = {t.output_weight.name for t in tasks}
    if entry["agents"] == agents and names <= planned:
        return True
    LOG.warning("ramplus: statistics cache entry does not match the planned merge; recounting")
    return False


def _cache_key(tasks: list[Any], seen: dict[str, dict]) -> str | None:
    if cache.directory() is None:
        return None
    try:
        models = {m for t in tasks for m in t.model_order}
        parts = {
            "kernel": "active=|tau|>eps; tau in float32 (float64 for float64 inputs)",
            "models": {str(m): _folder_identity(m, seen) for m in sorted(models, key=str)},
            "tensors": [
                [
                    t.output_weight.name,
                    _plain(t.gather_tensors),
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


def _folder_identity(model: Any, seen: dict[str, dict]) -> dict:
    """The identity of `model`'s folder (`cache.folder_identity`), read once per statistics pass (`seen`)."""
    if str(model) not in seen:
        from mergekit.io.tasks import LoaderCache

        seen[str(model)] = cache.folder_identity(LoaderCache().get(model).index.base_path)
    return seen[str(model)]


def _identities(task: Any, seen: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for model in task.model_order:
        try:
            out[str(model)] = report.public_identity(_folder_identity(model, seen))
        except Exception:
            out[str(model)] = {}
    return out


def _plain(value: Any) -> Any:
    """A task as JSON-able data, without the device (it does not change counts)."""
    from mergekit.common import ImmutableMap
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        if type(value).__str__ is not BaseModel.__str__:
            return str(value)  # ModelReference and friends print their identity
        return {type(value).__name__: {k: _plain(getattr(value, k)) for k in type(value).model_fields if k != "device"}}
    if isinstance(value, (ImmutableMap, dict)):
        return sorted([[_plain(k), _plain(v)] for k, v in value.items()], key=lambda kv: json.dumps(kv, default=str))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _inject(
    planner: Any, found: list[tuple[int, Any]], stats: statistics.Statistics, needs: set[Any], tied: dict[str, str]
) -> None:
    from mergekit.common import ImmutableMap

    by_scope: dict[str, dict[str, dict[str, float]]] = {}
    for index, task in found:
        scope = task.parameters["rho_scope"]
        if scope not in by_scope:
            by_scope[scope] = stats.rho(scope)
        name = tied.get(task.output_weight.name, task.output_weight.name)  # a tied copy: its target's rho
        rhos = by_scope[scope].get(statistics.scope_group(name, scope))
        if rhos is None:
            continue  # a buffer: copied, never merged
        inputs = {}
        for model, params in task.input_parameters.items():
            if model in needs and params.get("rho") is None:
                params = ImmutableMap(data={**dict(params.items()), "rho": rhos[str(model)]})
            inputs[model] = params
        surface.replace_planned(planner, index, task.model_copy(update={"input_parameters": ImmutableMap(data=inputs)}))


def _count(options: Any, tasks: list[Any]) -> list[statistics.TensorCounts]:
    from mergekit.graph import Executor
    from mergekit.multigpu_executor import MultiGPUExecutor

    targets = [CountTask(merge_task=t) for t in tasks]
    if options.multi_gpu:
        executor = MultiGPUExecutor(targets=targets, storage_device=None if options.low_cpu_memory else "cpu")
        results = executor.run(quiet=options.quiet)
    elif os.environ.get("MERGEKIT_RAM_STATS_ORDER", "reverse") == "reverse":
        results = _run_reversed(targets, options)
    else:
        executor = Executor(
            targets=targets,
            math_device=options.device,
            storage_device=options.device if options.low_cpu_memory else "cpu",
        )
        results = executor.run(quiet=options.quiet, desc="RAM+ statistics")
    counted = {value.name: value for _, value in results if value is not None}
    return [counted[t.output_weight.name] for t in tasks if t.output_weight.name in counted]


#: The statistics pass runs in at most this many executors (slices of the merge's order, last slice first).
_SLICES = 64


def _run_reversed(targets: list[Any], options: Any) -> Iterator[tuple[Any, Any]]:
    """Count in the reverse of the order the merge will read, so the merge starts on what is still cached.

    mergekit's executor orders tasks by `group_label()` (the tensor name), so the merge pass reads
    tensors in that order. When the inputs exceed the page cache, a statistics pass in the same order
    leaves only its last tensors cached and the merge evicts them before it gets there (a scan defeats
    LRU): everything is read from disk twice. Counting slice by slice, last slice first, the merge pass
    starts on the tensors the statistics pass read last. The counts are the same in any order
    (`MERGEKIT_RAM_STATS_ORDER=forward` counts in the merge's order, in one executor).
    """
    from mergekit.graph import Executor

    keyed = [(t.group_label() or "", t) for t in targets]
    labels = sorted({label for label, _ in keyed})
    size = -(-len(labels) // _SLICES)
    slices = [set(labels[i : i + size]) for i in range(0, len(labels), size)]
    bar = None
    if not options.quiet:
        import tqdm  # type: ignore[import-untyped]  # mergekit's own progress bars

        bar = tqdm.tqdm(total=len(targets), desc="RAM+ statistics")
    for chunk in reversed(slices):
        part = [t for label, t in keyed if label in chunk]
        executor = Executor(
            targets=part,
            math_device=options.device,
            storage_device=options.device if options.low_cpu_memory else "cpu",
        )
        for item in executor.run(quiet=True):
            if bar is not None:
                bar.update(1)
            yield item
    if bar is not None:
        bar.close()


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
        return statistics.TensorCounts(
            name,
            group.base.tensor.numel(),
            dict(zip(labels, map(tuple, found.counts.tolist()), strict=True)),
            epsilon,
            statistics.Diagnostics.from_kernel(labels, found),
        )


# --------------------------------------------------------------------------- #
# ram_stats.json
# --------------------------------------------------------------------------- #
class WriteStatistics(Task[None]):
    """Writes ram_stats.json after the model itself has been written (a planner driven without run_merge)."""

    out_path: str
    payload: str
    after: Any

    def arguments(self):
        return {"after": self.after}

    def main_thread_only(self) -> bool:
        return True

    def execute(self, **_kwargs) -> None:
        write_statistics(self.out_path, self.payload)


def queue_statistics(current: MergeSession, tasks: list[Any], out_path: str) -> None:
    """ram_stats.json of `current`, written last: by `run_merge`'s wrapper, or as a task after the model."""
    assert current.report is not None
    payload = report.dumps(current.report)
    if current.in_run_merge:
        current.pending.append((out_path, payload))
    else:
        from mergekit.io.tasks import FinalizeModel

        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        tasks.append(WriteStatistics(out_path=out_path, payload=payload, after=finalize))


def write_statistics(out_path: str, payload: str) -> None:
    """Write ram_stats.json atomically; a failure names the file and leaves no temp file."""
    os.makedirs(out_path, exist_ok=True)
    files.write_atomic(
        os.path.join(out_path, output_checks.STATS_FILE), payload, private=False
    )  # readable like mergekit's files


# --------------------------------------------------------------------------- #
# inspect: the same pipeline, without merging
# --------------------------------------------------------------------------- #
def inspect(config: Any, options: Any) -> MergeSession:
    """Plan `config` as ramplus and count its statistics without merging; returns the finished session.

    Any config with a base model can be inspected: another method's config is planned
    as `ramplus` (its own parameters are not ours to judge). Needs the wrapped planner
    (`hooks.install`, which the start-up hook runs when mergekit.plan is imported).
    """
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    from mergekit_ram._mergekit import loading

    refuse_foreign(NAME)  # inspect plans as ramplus
    problems = surface.problems(surface.PREPASS) + surface.problems(surface.MERGE)
    if problems:
        raise RuntimeError("mergekit-ram cannot inspect: " + "; ".join(problems))
    ours = _ours(config)
    if not ours:
        config = config.model_copy(update={"merge_method": NAME})
    current = MergeSession(config=config, mode="inspect", check_parameters=ours, fast_loading=True)
    loading.install()
    with active(current):
        check_config(current)
        config_checks.check_devices(options)
        input_checks.check_input_files(config)
        arch_info = get_architecture_info(config, options)
        loaders = LoaderCache()
        loaders.setup(options=options)
        for model in config.referenced_models():
            loaders.get(model)
        out_config = surface.model_out_config(config, arch_info, options)
        planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
        surface.plan(planner)  # mergekit's planning, then `prepare` through the wrapped `_plan`
    if current.report is None:
        raise ValueError("nothing to inspect: the config plans no tensor")
    return current
