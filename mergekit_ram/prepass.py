"""The statistics pre-pass, run inside mergekit's own planning.

RAM+'s rho_t is a whole-model quantity, but mergekit merges one tensor at a
time. We wrap `MergePlanner._plan`: once mergekit has planned the tensors, we
count every planned `ramplus` tensor with the very same input task (dtype,
vocabulary alignment, device), the same per-tensor epsilon and the kernel's own
mask, on the executor mergekit itself would use (or take the counts from the
cache); then we hand each merge task its agents' rho. `plan_to_disk` gains a
task that writes `ram_stats.json` once the model is written, and the model
card gains a "RAM+ statistics" section.

This is the only module that touches mergekit's private surface (`_plan`,
`_tensors`, `plan_to_disk`, `ExecuteMergeMethodTask`'s fields, the executors,
`mergekit.merge`'s card and config helpers). It checks that surface before
patching and says so clearly if mergekit changed shape.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch
from mergekit.graph import Task

from mergekit_ram import cache, kernel, loading, report, statistics
from mergekit_ram.method import NAME, ramplus

LOG = logging.getLogger("mergekit_ram")

GLOBAL_METHODS = frozenset({NAME})
STATS_FILE = "ram_stats.json"
_SUPPORTED = ((0, 1, 5), (0, 2, 0))
_TASK_FIELDS = (
    "method_name",
    "gather_tensors",
    "model_order",
    "base_model",
    "output_weight",
    "parameters",
    "input_parameters",
    "dtype",
)
_MARK = "__mergekit_ram_prepass__"
_unavailable: Optional[str] = None
_card_report: Optional[Tuple[Any, dict]] = None  # (config, report) of the merge being planned, for its card


class IncompatibleMergekit(RuntimeError):
    """mergekit's private planning surface is not what this release was built for."""


def unavailable_reason() -> Optional[str]:
    """Why the pre-pass could not be installed, or None when it is active."""
    return _unavailable


def check_surface() -> None:
    """Raise IncompatibleMergekit unless mergekit looks like the one we support."""
    from importlib.metadata import version

    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
    from mergekit.plan import MergePlanner

    found = version("mergekit")
    numbers = tuple(int(p) for p in found.split(".")[:3] if p.isdigit())
    if not (_SUPPORTED[0] <= numbers < _SUPPORTED[1]):
        raise IncompatibleMergekit(f"mergekit {found} is installed; mergekit-ram supports >=0.1.5,<0.2")
    missing = [f for f in _TASK_FIELDS if f not in ExecuteMergeMethodTask.model_fields]
    missing += [m for m in ("_plan", "plan_to_disk") if not callable(getattr(MergePlanner, m, None))]
    if missing:
        raise IncompatibleMergekit(
            f"mergekit {found} changed its planner (missing: {', '.join(missing)}); upgrade mergekit-ram"
        )


def install() -> None:
    """Wrap the planner (and, once loaded, mergekit.merge's card). Idempotent."""
    global _unavailable
    from mergekit.plan import MergePlanner

    if not getattr(MergePlanner._plan, _MARK, False):
        try:
            check_surface()
        except IncompatibleMergekit as error:
            _unavailable = str(error)
            LOG.warning("mergekit-ram: global RAM+ pre-pass disabled: %s", error)
            return
        _wrap(MergePlanner, "_plan", _plan)
        _wrap(MergePlanner, "plan_to_disk", _plan_to_disk)
        _unavailable = None
    install_card()


def install_card() -> None:
    """Append the RAM+ section to the model card `mergekit.merge` writes; load fast during `ramplus` merges."""
    merge = sys.modules.get("mergekit.merge")
    run_merge = getattr(merge, "run_merge", None)
    if run_merge is not None and not getattr(run_merge, _MARK, False):

        def run_merge_wrapper(merge_config, *args, **kwargs):
            if not _is_ours(merge_config.merge_method):
                return run_merge(merge_config, *args, **kwargs)
            with loading.active():
                return run_merge(merge_config, *args, **kwargs)

        _mark(run_merge_wrapper, run_merge)
        merge.run_merge = run_merge_wrapper
    current = getattr(merge, "generate_card", None)
    if current is None or getattr(current, _MARK, False):
        return

    def generate_card(config, *args, **kwargs):
        global _card_report
        card = current(config, *args, **kwargs)
        pending, _card_report = _card_report, None
        if pending is None or pending[0] is not config:
            return card
        return card.rstrip("\n") + "\n\n" + report.card_section(pending[1])

    _mark(generate_card, current)
    merge.generate_card = generate_card


def _wrap(cls, name, replacement) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        return replacement(original, self, *args, **kwargs)

    _mark(wrapper, original)
    setattr(cls, name, wrapper)


def _mark(wrapper, original) -> None:
    wrapper.__qualname__ = f"mergekit_ram[{original.__qualname__}]"
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, _MARK, True)


def _plan(original, planner) -> None:
    ours = _is_ours(planner.config.merge_method)
    if ours:
        check_config(planner.config)
    original(planner)
    if ours:
        run(planner)


def _plan_to_disk(original, planner, out_path: str):
    global _card_report
    ours = _is_ours(planner.config.merge_method)
    if ours:
        _check_output(planner.config, out_path)
    tasks = original(planner, out_path)
    found = getattr(planner, "_mergekit_ram_report", None)
    if ours and found is not None:
        from mergekit.io.tasks import FinalizeModel

        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        _card_report = (planner.config, found)  # one merge at a time: an older report never reaches a card
        tasks.append(WriteStatistics(out_path=out_path, payload=report.dumps(found), after=finalize))
    return tasks


def _is_ours(name: str) -> bool:
    """Our method, not another plugin's that took the same name first."""
    from mergekit import merge_methods

    from mergekit_ram.startup import is_ours

    if name not in GLOBAL_METHODS:
        return False
    try:
        return is_ours(merge_methods.get(name))
    except RuntimeError:
        return False


def check_config(config, *, parameters: bool = True) -> None:
    """Plan-time errors for what RAM+ cannot honour or would silently ignore."""
    bases = {config.base_model} if config.base_model else set()
    slices = list(config.slices or [])
    for module in (config.modules or {}).values():
        slices.extend(module.slices or [])
    bases.update(s.base_model for s in slices if s.base_model is not None)
    if not bases:
        raise ValueError("ramplus needs `base_model`: task vectors are measured against it")
    if len(bases) > 1:
        raise ValueError(
            "ramplus needs one base model for the whole merge (rho is counted over the whole model); "
            f"this config uses {len(bases)}: " + ", ".join(sorted(str(b) for b in bases))
        )
    if parameters:
        _check_parameter_names(config)


def _check_parameter_names(config) -> None:
    shared = {p.name for p in ramplus.spec.shared_parameters}
    per_model = {p.name for p in ramplus.spec.input_parameters}
    places: List[Tuple[str, Optional[dict], bool]] = [("parameters", config.parameters, True)]
    for i, m in enumerate(config.models or []):
        places.append((f"models[{i}] ({m.model}).parameters", m.parameters, False))
    groups = [("", config.slices or [])] + [
        (f"modules.{name}.", module.slices or []) for name, module in (config.modules or {}).items()
    ]
    for name, module in (config.modules or {}).items():
        places.append((f"modules.{name}.parameters", module.parameters, True))
        for i, m in enumerate(module.models or []):
            places.append((f"modules.{name}.models[{i}] ({m.model}).parameters", m.parameters, False))
    for prefix, slices in groups:
        for i, s in enumerate(slices):
            places.append((f"{prefix}slices[{i}].parameters", s.parameters, True))
            for j, src in enumerate(s.sources):
                places.append((f"{prefix}slices[{i}].sources[{j}] ({src.model}).parameters", src.parameters, False))
    for where, params, allows_shared in places:
        for key in params or {}:
            if key in per_model or (allows_shared and key in shared):
                continue
            if key in shared:
                raise ValueError(
                    f"ramplus parameter '{key}' is set under {where}, where mergekit ignores it: it is "
                    f"shared by all models; put it under the top-level `parameters:` (filters allow per-tensor values)"
                )
            close = difflib.get_close_matches(key, sorted(shared | per_model), n=1, cutoff=0.6)
            if close:
                raise ValueError(f"unknown ramplus parameter '{key}' under {where}; did you mean '{close[0]}'?")
            LOG.warning(
                "ramplus: parameter '%s' under %s is not a ramplus parameter and is ignored "
                "(ramplus takes %s; per model: %s)",
                key,
                where,
                ", ".join(sorted(shared)),
                ", ".join(sorted(per_model)),
            )


def _check_output(config, out_path: str) -> None:
    out = os.path.realpath(out_path)
    for model in config.referenced_models():
        path = model.model.path
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if out == real or out.startswith(real + os.sep):
                raise ValueError(
                    f"output folder {out_path} is inside the input model {model}; "
                    "the merge would overwrite it. Choose another output folder."
                )


def run(planner) -> Optional[Dict[str, statistics.AgentStats]]:
    """Count (or load), reduce to rho per scope, inject into the planned tasks.

    Returns per-agent whole-model stats, or None when no statistics were needed
    (r = 0 or rho given for every agent) and none were cached.
    """
    planned = _planned(planner)
    if not planned:
        return None
    tasks = [task for _, task in planned]
    _warn_stored_dtypes(planner, tasks[0])
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
    planner._mergekit_ram_report = report.build(
        stats, tasks, source=source, identities=_identities(planner, tasks[0])
    )
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
        if isinstance(task, ExecuteMergeMethodTask) and _is_ours(task.method_name)
    ]
    if any(isinstance(t.gather_tensors, TensorDictWrapper) for _, t in planned):
        raise ValueError("ramplus: raw tensor-dict inputs have no whole-model rho")
    return planned


def _agents(task) -> List[Any]:
    return [m for m in task.model_order if m != task.base_model]


def _statistics(planner, tasks, *, compute: bool) -> Tuple[Optional[statistics.Statistics], str]:
    agents = [str(m) for m in _agents(tasks[0])]
    digest = _cache_key(planner, tasks)
    entry = cache.load(digest) if digest else None
    if entry is not None and _covers(entry, agents, tasks):
        LOG.info("ramplus: statistics from cache %s (no tensor read)", digest[:12])
        return statistics.Statistics.from_json(entry["agents"], entry["tensors"]), "cache"
    if not compute:
        return None, "not computed"
    stats = statistics.Statistics(agents, _count(planner, tasks))
    if digest:
        cache.store(digest, agents, stats.to_json())
    return stats, "computed"


def _covers(entry: dict, agents: List[str], tasks) -> bool:
    """An entry must name these agents and every planned tensor (buffers aside)."""
    names = {t["name"] for t in entry["tensors"]}
    planned = {t.output_weight.name for t in tasks}
    if entry["agents"] == agents and names <= planned:
        return True
    LOG.warning("ramplus: statistics cache entry does not match the planned merge; recounting")
    return False


def _cache_key(planner, tasks) -> Optional[str]:
    if cache.directory() is None:
        return None
    try:
        models = {m for t in tasks for m in t.model_order}
        parts = {
            "kernel": "active=|tau|>eps; tau in float32 (float64 for float64 inputs)",
            "models": {str(m): _folder_identity(m) for m in sorted(models, key=str)},
            "tensors": [
                [t.output_weight.name, _plain(t.gather_tensors), t.parameters["epsilon"], t.dtype, [str(m) for m in t.model_order], str(t.base_model)]
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


def _identities(planner, task) -> Dict[str, dict]:
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

    by_scope: Dict[str, Dict[str, Dict[str, float]]] = {}
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


def _count(planner, tasks) -> List[statistics.TensorCounts]:
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


def _warn_stored_dtypes(planner, task) -> None:
    """Masks see tensors as loaded: say so when that hides or inflates updates."""
    from mergekit.common import dtype_from_name
    from mergekit.io.tasks import LoaderCache

    stored = {}
    for model, weight in _weight_infos(task).items():
        try:
            index = LoaderCache().get(model).index
            name = next(n for n in [weight.name, *(weight.aliases or ())] if n in index.tensor_paths)
            path = index.tensor_paths[name]
            path = path if os.path.isabs(path) else os.path.join(index.base_path, path)
            if not path.endswith(".safetensors"):
                continue
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                stored[model] = f.get_slice(name).get_dtype()
        except Exception:  # best effort: a warning must never stop a merge
            continue
    widths = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
    wanted = dtype_from_name(planner.config.dtype)
    if wanted is not None:
        narrow = [str(m) for m, d in stored.items() if widths.get(d, 0) > wanted.itemsize]
        if narrow:
            LOG.warning(
                "ramplus: `dtype: %s` rounds the stored weights of %s before masking; "
                "updates smaller than one %s ULP become invisible to RAM+",
                planner.config.dtype,
                ", ".join(narrow),
                planner.config.dtype,
            )
    base = stored.get(task.base_model)
    odd = [str(m) for m, d in stored.items() if base is not None and d != base]
    if odd:
        LOG.warning(
            "ramplus: %s stored in a different dtype than the base (%s); rounding "
            "differences count as updates and inflate density",
            ", ".join(odd),
            base,
        )


def _weight_infos(task):
    gather = task.gather_tensors
    while not hasattr(gather, "weight_info") and hasattr(gather, "gather_tensors"):
        gather = gather.gather_tensors
    return dict(gather.weight_info.items()) if hasattr(gather, "weight_info") else {}


class CountTask(Task[Optional[statistics.TensorCounts]]):
    """Counts one planned tensor exactly as its ExecuteMergeMethodTask will see it."""

    merge_task: Any

    def arguments(self):
        return {"tensors": self.merge_task.gather_tensors}

    def group_label(self) -> Optional[str]:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return True

    def execute(self, tensors, **_kwargs) -> Optional[statistics.TensorCounts]:
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
        counts = kernel.count(group.base.tensor, [e.tensor for e in agents], epsilon, names=labels, tensor_name=name)
        return statistics.TensorCounts(
            name, group.base.tensor.numel(), dict(zip(labels, map(tuple, counts.tolist()))), epsilon
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
        os.makedirs(self.out_path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ram_stats.", dir=self.out_path)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self.payload)
        os.replace(tmp, os.path.join(self.out_path, STATS_FILE))


def inspect_config(config, options):
    """Plan `config` as ramplus and return (report, Statistics) without merging."""
    install()
    with loading.active():
        return _inspect(config, options)


def _inspect(config, options):
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import _model_out_config
    from mergekit.plan import MergePlanner

    ours = _is_ours(config.merge_method)
    if not ours:  # inspect any config with a base: its own parameters are not ours to judge
        config = config.model_copy(update={"merge_method": NAME})
    check_config(config, parameters=ours)
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
    _warn_stored_dtypes(planner, tasks[0])
    stats, source = _statistics(planner, tasks, compute=True)
    return report.build(stats, tasks, source=source, identities=_identities(planner, tasks[0])), stats
