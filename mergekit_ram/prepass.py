"""The statistics pass: count every planned `ramplus` tensor, then hand each merge task its rho.

RAM+'s rho_t is a whole-model quantity, but mergekit merges one tensor at a
time. Once mergekit has planned the tensors (`mergekit_ram.hook` calls `run`
right after `MergePlanner._plan`), we count every planned `ramplus` tensor with
the very same input task (dtype, vocabulary alignment, device), the same
per-tensor epsilon and the kernel's own mask, on the executor mergekit itself
would use (`CountTask`, `_count`), or take the counts from the cache
(`_cache_key`, `_statistics`); then we hand each merge task its agents' rho
(`_inject`). `WriteStatistics` writes `ram_stats.json` after the model, and
`inspect_config` runs the same pass without merging (`mergekit-ram inspect`).

It reads mergekit's planned tasks (`planner._tensors`, `ExecuteMergeMethodTask`'s
fields, the executors), whose shape `mergekit_ram.hook` checks before it ever
calls us.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Any

from mergekit.graph import Task

from mergekit_ram import cache, checks, kernel, loading, report, statistics
from mergekit_ram.method import NAME, resolves_to_ours

LOG = logging.getLogger("mergekit_ram")

STATS_FILE = "ram_stats.json"


def run(planner) -> dict[str, statistics.AgentStats] | None:
    """Count (or load), reduce to rho per scope, inject into the planned tasks.

    Returns per-agent whole-model stats, or None when no statistics were needed
    (r = 0 or rho given for every agent) and none were cached.
    """
    planned = _planned(planner)
    if not planned:
        return None
    tasks = [task for _, task in planned]
    checks.check_stored_tensors(planner, tasks)
    checks.warn_stored_dtypes(planner, tasks[0])
    needs = {
        model
        for task in tasks
        if task.parameters["r"] != 0
        for model in _agents(task)
        if task.input_parameters[model].get("rho") is None
    }
    stats, source = _statistics(planner, tasks, compute=bool(needs))
    if not needs:
        LOG.info("ramplus: r = 0 or rho given for every agent; no statistics pre-pass")
    if stats is not None:
        _inject(planner, planned, stats, needs)
    planner._mergekit_ram_report = report.build(stats, tasks, source=source, identities=_identities(planner, tasks[0]))
    if stats is None:
        return None
    totals = stats.totals()
    for label, s in totals.items():
        if s.active == 0:
            LOG.warning(
                "ramplus: %s changes no weight by more than epsilon; it is identical to the base "
                "and adds nothing to the merge",
                label,
            )
    params = tasks[0].parameters
    table = statistics.format_table(totals.values(), params["r"], params["alpha"], params["lambda_rule"])
    LOG.info("RAM+ statistics (%s):\n%s", source, table)
    if not planner.options.quiet and needs:
        print(f"RAM+ statistics ({source}):\n{table}", file=sys.stderr, flush=True)
    return totals


def _planned(planner):
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper

    planned = [
        (i, task)
        for i, (_, task) in enumerate(planner._tensors)
        if isinstance(task, ExecuteMergeMethodTask) and resolves_to_ours(task.method_name)
    ]
    if any(isinstance(t.gather_tensors, TensorDictWrapper) for _, t in planned):
        raise ValueError("ramplus: raw tensor-dict inputs have no whole-model rho")
    return planned


def _agents(task) -> list[Any]:
    return [m for m in task.model_order if m != task.base_model]


def _statistics(planner, tasks, *, compute: bool) -> tuple[statistics.Statistics | None, str]:
    agents = [str(m) for m in _agents(tasks[0])]
    digest = _cache_key(planner, tasks)
    entry = cache.load(digest) if digest else None
    if digest and entry is not None and _covers(entry, agents, tasks):
        LOG.info("ramplus: statistics from cache %s (no tensor read)", digest[:12])
        return statistics.Statistics.from_json(entry["agents"], entry["tensors"]), "cache"
    if not compute:
        return None, "not computed"
    stats = statistics.Statistics(agents, _count(planner, tasks))
    if digest:
        cache.store(digest, agents, stats.to_json())
    return stats, "computed"


def _covers(entry: dict, agents: list[str], tasks) -> bool:
    """An entry must name these agents and every planned tensor (buffers aside)."""
    names = {t["name"] for t in entry["tensors"]}
    planned = {t.output_weight.name for t in tasks}
    if entry["agents"] == agents and names <= planned:
        return True
    LOG.warning("ramplus: statistics cache entry does not match the planned merge; recounting")
    return False


def _cache_key(planner, tasks) -> str | None:
    if cache.directory() is None:
        return None
    try:
        models = {m for t in tasks for m in t.model_order}
        parts = {
            "kernel": "active=|tau|>eps; tau in float32 (float64 for float64 inputs)",
            "models": {str(m): _folder_identity(m) for m in sorted(models, key=str)},
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


def _folder_identity(model) -> dict:
    from mergekit.io.tasks import LoaderCache

    return cache.folder_identity(LoaderCache().get(model).index.base_path)


def _identities(planner, task) -> dict[str, dict]:
    out = {}
    for model in task.model_order:
        try:
            out[str(model)] = report.public_identity(_folder_identity(model))
        except Exception:
            out[str(model)] = {}
    return out


def _plain(value):
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


def _inject(planner, planned, stats: statistics.Statistics, needs) -> None:
    from mergekit.common import ImmutableMap

    by_scope: dict[str, dict[str, dict[str, float]]] = {}
    for index, task in planned:
        scope = task.parameters["rho_scope"]
        if scope not in by_scope:
            by_scope[scope] = stats.rho(scope)
        rhos = by_scope[scope].get(statistics.scope_group(task.output_weight.name, scope))
        if rhos is None:
            continue  # a buffer: copied, never merged
        inputs = {}
        for model, params in task.input_parameters.items():
            if model in needs and params.get("rho") is None:
                params = ImmutableMap(data={**dict(params.items()), "rho": rhos[str(model)]})
            inputs[model] = params
        weight, _ = planner._tensors[index]
        planner._tensors[index] = (weight, task.model_copy(update={"input_parameters": ImmutableMap(data=inputs)}))


def _count(planner, tasks) -> list[statistics.TensorCounts]:
    from mergekit.graph import Executor
    from mergekit.multigpu_executor import MultiGPUExecutor

    targets = [CountTask(merge_task=t) for t in tasks]
    options = planner.options
    if options.multi_gpu:
        executor = MultiGPUExecutor(targets=targets, storage_device=None if options.low_cpu_memory else "cpu")
        results = executor.run(quiet=options.quiet)
    else:
        executor = Executor(
            targets=targets,
            math_device=options.device,
            storage_device=options.device if options.low_cpu_memory else "cpu",
        )
        results = executor.run(quiet=options.quiet, desc="RAM+ statistics")
    found = {value.name: value for _, value in results if value is not None}
    return [found[t.output_weight.name] for t in tasks if t.output_weight.name in found]


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
        counts = kernel.count(
            group.base.tensor,
            [e.tensor for e in agents],
            epsilon,
            names=labels,
            tensor_name=name,
            base_name=str(task.base_model),
        )
        return statistics.TensorCounts(
            name, group.base.tensor.numel(), dict(zip(labels, map(tuple, counts.tolist()), strict=True)), epsilon
        )


class WriteStatistics(Task[None]):
    """Writes ram_stats.json after the model itself has been written."""

    out_path: str
    payload: str
    after: Any

    def arguments(self):
        return {"after": self.after}

    def main_thread_only(self) -> bool:
        return True

    def execute(self, **_kwargs) -> None:
        write_statistics(self.out_path, self.payload)


def write_statistics(out_path: str, payload: str) -> None:
    """Write ram_stats.json atomically; a failure names the file and leaves no temp file."""
    os.makedirs(out_path, exist_ok=True)
    target = os.path.join(out_path, STATS_FILE)
    fd, tmp = tempfile.mkstemp(prefix=".ram_stats.", dir=out_path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as error:
        raise OSError(error.errno, f"could not write {target}: {error.strerror or error}") from error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_statistics(out_path: str) -> None:
    """An older merge's ram_stats.json would mark a new, unfinished merge as complete: remove it first."""
    path = os.path.join(out_path, STATS_FILE)
    if os.path.isfile(path) and not os.path.islink(path):
        LOG.info("ramplus: removing %s of an earlier merge (it is written again when this merge finishes)", path)
        os.unlink(path)
    weights = sorted(
        n for n in (os.listdir(out_path) if os.path.isdir(out_path) else []) if n.endswith((".safetensors", ".bin"))
    )
    if weights:
        LOG.warning(
            "ramplus: the output folder %s already holds %s; mergekit overwrites the files it writes again and "
            "leaves the others (remove stale shards yourself)",
            out_path,
            ", ".join(weights),
        )


def inspect_config(config, options):
    """Plan `config` as ramplus and return (report, Statistics) without merging.

    Needs the planner hook installed (`mergekit_ram.hook.install()`, which the
    start-up hook runs as soon as `mergekit.plan` is imported): it plans with
    mergekit's own, unwrapped `_plan`.
    """
    with loading.active():
        return _inspect(config, options)


def _inspect(config, options):
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import _model_out_config
    from mergekit.plan import MergePlanner

    ours = resolves_to_ours(config.merge_method)
    if not ours:  # inspect any config with a base: its own parameters are not ours to judge
        config = config.model_copy(update={"merge_method": NAME})
    checks.check_config(config, parameters=ours)
    checks.check_input_files(config)
    arch_info = get_architecture_info(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in config.referenced_models():
        loaders.get(model)
    out_config = _model_out_config(config, arch_info, trust_remote_code=options.trust_remote_code)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    MergePlanner._plan.__wrapped__(planner)
    planned = _planned(planner)
    if not planned:
        raise ValueError("nothing to inspect: the config plans no tensor")
    tasks = [t for _, t in planned]
    checks.check_stored_tensors(planner, tasks)
    checks.warn_stored_dtypes(planner, tasks[0])
    stats, source = _statistics(planner, tasks, compute=True)
    return report.build(stats, tasks, source=source, identities=_identities(planner, tasks[0])), stats
