"""The global statistics pre-pass, run inside mergekit's own planning.

RAM+'s rho_t is a whole-model quantity, but mergekit merges one tensor at a
time. We wrap `MergePlanner._plan`: once mergekit has planned the tensors, we
count every planned `ramplus` tensor with the very same input task (dtype,
vocabulary alignment, device), the same per-tensor epsilon and the kernel's own
mask, on the executor mergekit itself would use; then we hand each merge task
its agents' rho.

This is the only module that touches mergekit's private surface (`_plan`,
`_tensors`, `ExecuteMergeMethodTask`'s fields, the executors). It checks that
surface before patching and says so clearly if mergekit changed shape.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch
from mergekit.graph import Task

from mergekit_ram import kernel, statistics
from mergekit_ram.method import NAME

LOG = logging.getLogger("mergekit_ram")

GLOBAL_METHODS = frozenset({NAME})
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
        raise IncompatibleMergekit(
            f"mergekit {found} is installed; mergekit-ram supports >=0.1.5,<0.2"
        )
    missing = [f for f in _TASK_FIELDS if f not in ExecuteMergeMethodTask.model_fields]
    if missing or not callable(getattr(MergePlanner, "_plan", None)):
        raise IncompatibleMergekit(
            f"mergekit {found} changed its planner (missing: "
            f"{', '.join(missing) or 'MergePlanner._plan'}); upgrade mergekit-ram"
        )


def install() -> None:
    """Wrap MergePlanner._plan once. Idempotent; records why if it cannot."""
    global _unavailable
    from mergekit.plan import MergePlanner

    current = MergePlanner._plan
    if getattr(current, _MARK, False):
        return
    try:
        check_surface()
    except IncompatibleMergekit as error:
        _unavailable = str(error)
        LOG.warning("mergekit-ram: global RAM+ pre-pass disabled: %s", error)
        return

    def _plan(self):
        ours = _is_ours(self.config.merge_method)
        if ours:
            _check_config(self.config)
        current(self)
        if ours:
            run(self)

    _plan.__doc__ = current.__doc__
    _plan.__wrapped__ = current
    setattr(_plan, _MARK, True)
    MergePlanner._plan = _plan
    _unavailable = None


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


def _check_config(config) -> None:
    bases = {config.base_model} if config.base_model else set()
    slices = list(config.slices or [])
    for module in (config.modules or {}).values():
        slices.extend(module.slices or [])
    bases.update(s.base_model for s in slices if s.base_model is not None)
    if not bases:
        raise ValueError(
            "ramplus needs `base_model`: task vectors are measured against it"
        )
    if len(bases) > 1:
        raise ValueError(
            "ramplus needs one base model for the whole merge (rho is counted over "
            f"the whole model); this config uses {len(bases)}: "
            + ", ".join(sorted(str(b) for b in bases))
        )


def run(planner) -> Optional[Dict[Hashable, statistics.AgentStats]]:
    """Count, reduce to rho, inject into the planned tasks. Returns the stats."""
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper

    planned = [
        (i, task)
        for i, (_, task) in enumerate(planner._tensors)
        if isinstance(task, ExecuteMergeMethodTask) and _is_ours(task.method_name)
    ]
    if not planned:
        return None
    if any(isinstance(t.gather_tensors, TensorDictWrapper) for _, t in planned):
        raise ValueError("ramplus: raw tensor-dict inputs have no whole-model rho")
    _warn_stored_dtypes(planner, planned[0][1])

    needs = {
        model
        for _, task in planned
        if task.parameters["r"] != 0
        for model in _agents(task)
        if task.input_parameters[model].get("rho") is None
    }
    if not needs:
        LOG.info("ramplus: r = 0 or rho given for every agent; no statistics pre-pass")
        return None

    counts = _count(planner, [task for _, task in planned])
    order = [m for m in planned[0][1].model_order if m != planned[0][1].base_model]
    stats = statistics.reduce_counts(counts, order)
    for model, s in stats.items():
        if s.active == 0:
            LOG.warning(
                "ramplus: %s changes no weight by more than epsilon; it is identical "
                "to the base and adds nothing to the merge",
                model,
            )
    r, alpha = planned[0][1].parameters["r"], planned[0][1].parameters["alpha"]
    table = statistics.format_table(stats.values(), r, alpha)
    LOG.info("RAM+ global statistics:\n%s", table)
    if not planner.options.quiet:
        print(f"RAM+ global statistics:\n{table}", file=sys.stderr, flush=True)

    from mergekit.common import ImmutableMap

    for index, task in planned:
        inputs = {}
        for model, params in task.input_parameters.items():
            if model in needs and model in stats and params.get("rho") is None:
                params = ImmutableMap(data={**dict(params.items()), "rho": stats[model].rho})
            inputs[model] = params
        weight, _ = planner._tensors[index]
        planner._tensors[index] = (
            weight,
            task.model_copy(update={"input_parameters": ImmutableMap(data=inputs)}),
        )
    planner._mergekit_ram_statistics = stats
    return stats


def _agents(task) -> List[Hashable]:
    return [m for m in task.model_order if m != task.base_model]


def _count(planner, tasks) -> List[statistics.TensorCounts]:
    from mergekit.graph import Executor
    from mergekit.multigpu_executor import MultiGPUExecutor

    targets = [CountTask.for_merge_task(t) for t in tasks]
    options = planner.options
    if options.multi_gpu:
        executor = MultiGPUExecutor(
            targets=targets, storage_device=None if options.low_cpu_memory else "cpu"
        )
        results = executor.run(quiet=options.quiet)
    else:
        executor = Executor(
            targets=targets,
            math_device=options.device,
            storage_device=options.device if options.low_cpu_memory else "cpu",
        )
        results = executor.run(quiet=options.quiet, desc="RAM+ statistics")
    return [value for _, value in results if value is not None]


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
        narrow = [
            str(m) for m, d in stored.items() if widths.get(d, 0) > wanted.itemsize
        ]
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


class CountTask(Task[Optional[Tuple[int, Dict[Hashable, Tuple[int, int]]]]]):
    """Counts one planned tensor exactly as its ExecuteMergeMethodTask will see it."""

    merge_task: Any

    @classmethod
    def for_merge_task(cls, task) -> "CountTask":
        return cls(merge_task=task)

    def arguments(self):
        return {"tensors": self.merge_task.gather_tensors}

    def group_label(self) -> Optional[str]:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return True

    def execute(self, tensors, **_kwargs):
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
        get(task.method_name).validate_inputs(
            [e.id for e in entries], task.base_model, group_name=name
        )
        if not all(e.tensor.is_floating_point() for e in entries):
            return None  # buffers are copied, never merged: not counted
        group = TensorGroup(entries=entries, metadata=TensorMetadata.from_weight_info(task.output_weight))
        group.validate_tensors()
        group = align_dtype(group, dtype_from_name(task.dtype))
        agents = group.non_base
        with torch.no_grad():
            counts = kernel.count(
                group.base.tensor,
                [e.tensor for e in agents],
                task.parameters["epsilon"],
                names=[str(e.id) for e in agents],
                tensor_name=name,
            ).tolist()
        return (
            group.base.tensor.numel(),
            {e.id: (c[0], c[1]) for e, c in zip(agents, counts)},
        )
