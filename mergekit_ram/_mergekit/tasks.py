"""mergekit's planned `ramplus` tasks as plain data, and rho written back into them.

Once mergekit has planned a merge, its `ExecuteMergeMethodTask`s say everything the statistics
pass needs: which tensor, which models in which order, the loading task under any vocabulary
wrappers, the parameters. Two doors plan them, and a `Plan` hides which from the pipeline:

- `of_planner`: `mergekit-yaml` (and `run_merge`, `mergekit-multi`, `inspect`): a `MergePlanner`'s
  list, models are folders (or hub ids) identified by `cache.folder_identity`;
- `raw_pytorch.of_flat`: `mergekit-pytorch` (`plan_flat_merge`): each tensor's merge task sits in a `SaveTensor`
  that `FinalizeModel` waits for, inputs are `SimpleLoadTensor`s of single files (safetensors or a
  PyTorch pickle) identified by `cache.file_identity`.

This module reads the tasks (`planned`, `summary`, `Plan.stored_row`, `tied_copies`, `plain`) and
writes into them (`round_once_to_out_dtype`, `inject`) through `Plan.replace`; for a planner that is
`surface`, which alone touches the planner's private list.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mergekit_ram import files
from mergekit_ram._mergekit import surface
from mergekit_ram.checks import input_checks
from mergekit_ram.core import cache, statistics
from mergekit_ram.core.params import DEFAULTS
from mergekit_ram.session import Planned

LOG = logging.getLogger("mergekit_ram")

#: One stored row of a planned tensor, what `input_checks.check_stored_tensors` reads:
#: (name, base, whether vocabulary-aligned, model -> (dtype, shape) as stored or None when absent)
Row = tuple[str, str, bool, dict[str, input_checks.Stored]]
#: (tensor name, its merge task, optional, the dtype it is saved in): where mergekit saves one tensor
Save = tuple[str, Any, bool, str | None]


class Plan:
    """One door's planned merge, as the pipeline reads and writes it.

    `config`: the merge's config (`dtype`, `out_dtype`); `options`: mergekit's `MergeOptions`;
    `out_model_config`: the output's model config where the door writes one (tied embeddings).
    """

    config: Any
    options: Any
    out_model_config: Any = None

    def entries(self) -> list[tuple[int, Any]]:
        """(index, task) of every planned tensor task, in the order the statistics are kept."""
        raise NotImplementedError

    def replace(self, index: int, task: Any) -> None:
        """Plan `task` for the tensor at `index` instead."""
        raise NotImplementedError

    def stored_row(self, task: Any, headers: files.Headers) -> Row:
        """What `input_checks.check_stored_tensors` needs of one task (`headers`: each file's header, read once)."""
        raise NotImplementedError

    def identity(self, model: Any) -> dict:
        """What identifies `model`'s weights without reading them (`cache.folder_identity` / `file_identity`)."""
        raise NotImplementedError

    def saves(self) -> list[Save]:
        """(tensor, task, optional, dtype) where mergekit would save each tensor: what `verify` compares."""
        raise NotImplementedError

    def sources(self, task: Any) -> dict[str, tuple[str, str]]:
        """model -> (file, tensor name) of each input tensor a planned merge task reads (`verify --sample`)."""
        raise NotImplementedError

    def reshapes(self, task: Any) -> bool:
        """Whether mergekit hands the task other rows than its inputs store (a vocabulary permuted for a union or a
        donor's tokenizer, or truncated): its shape is then not the inputs' headers' (`verify --sample`)."""
        return False


class _PlannerPlan(Plan):
    def __init__(self, planner: Any):
        self.planner = planner
        self.config, self.options, self.out_model_config = planner.config, planner.options, planner.out_model_config

    def entries(self) -> list[tuple[int, Any]]:
        return [(i, task) for i, (_, task) in enumerate(surface.planned(self.planner))]

    def replace(self, index: int, task: Any) -> None:
        surface.replace_planned(self.planner, index, task)

    def stored_row(self, task: Any, headers: files.Headers) -> Row:
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

    def identity(self, model: Any) -> dict:
        from mergekit.io.tasks import LoaderCache

        return cache.folder_identity(LoaderCache().get(model).index.base_path)

    def saves(self) -> list[Save]:
        out_dtype = self.planner.config.out_dtype
        return [(w.name, task, w.optional, w.force_dtype or out_dtype) for w, task in surface.planned(self.planner)]

    def reshapes(self, task: Any) -> bool:
        from mergekit.io.tasks import GatherTensors

        return not isinstance(task.gather_tensors, GatherTensors)

    def sources(self, task: Any) -> dict[str, tuple[str, str]]:
        from mergekit.io.tasks import LoaderCache

        found = {str(m): _located(LoaderCache().get(m).index, w) for m, w in _weight_infos(task).items()}
        return {model: where for model, where in found.items() if where is not None}


def of_planner(planner: Any) -> Plan:
    """The plan of a `MergePlanner` that has planned (`mergekit-yaml`, `run_merge`, `inspect`)."""
    return _PlannerPlan(planner)


def planned(plan: Plan, ours: Callable[[str], bool]) -> list[tuple[int, Any]]:
    """(index, task) of every planned merge task whose method is `ours`, in the plan's order."""
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask

    return [
        (i, task) for i, task in plan.entries() if isinstance(task, ExecuteMergeMethodTask) and ours(task.method_name)
    ]


def round_once_to_out_dtype(plan: Plan, found: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Give each planned merge task the dtype it is written in, so the kernel rounds once, to it.

    mergekit plans merge tasks without `out_dtype` and casts when saving: the kernel's float32
    result would be rounded to the input dtype (bfloat16) first, then widened to float32.
    """
    wanted = getattr(plan.config, "out_dtype", None)
    out = []
    for index, task in found:
        dtype = task.output_weight.force_dtype or wanted
        if dtype and task.out_dtype is None:
            task = task.model_copy(update={"out_dtype": dtype})
            plan.replace(index, task)
        out.append((index, task))
    return out


def tied_copies(out_model_config: Any, tasks: list[Any]) -> dict[str, str]:
    """Planned tensors the output ties to another planned tensor (`tie_word_embeddings`: an exporter's
    stored `lm_head` copy of the embeddings): copy -> the tensor it is tied to.

    Such a pair is one set of parameters in the model transformers loads, so it is counted once,
    whether or not an exporter also stored the copy; the copy is merged and written as mergekit does,
    with the rho of the tensor it is tied to.
    """
    config = out_model_config
    if config is None:
        return {}  # no model config written (mergekit-pytorch): nothing is tied
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


def summary(task: Any) -> Planned:
    """One planned tensor as plain data (`session.Planned`)."""
    names = agents(task)
    return Planned(
        name=task.output_weight.name,
        base=str(task.base_model),
        agents=tuple(str(m) for m in names),
        parameters={k: task.parameters[k] for k in DEFAULTS},
        given_rho={str(m): task.input_parameters[m].get("rho") for m in names},
    )


def agents(task: Any) -> list[Any]:
    """The task's models other than its base, in its order."""
    return [m for m in task.model_order if m != task.base_model]


def needing_rho(tasks: list[Any]) -> set[Any]:
    """The agents some task needs a counted rho for (r > 0 and no rho given)."""
    return {
        model
        for task in tasks
        if task.parameters["r"] != 0
        for model in agents(task)
        if task.input_parameters[model].get("rho") is None
    }


def _weight_infos(task: Any) -> dict[Any, Any]:
    """model -> WeightInfo of the loading task under any wrappers (vocabulary alignment,
    `--unsafe-truncate-embeddings`: a wrapper's own `weight_info` is one WeightInfo, not a map)."""
    gather = task.gather_tensors
    while not hasattr(getattr(gather, "weight_info", None), "items") and hasattr(gather, "gather_tensors"):
        gather = gather.gather_tensors
    infos: Any = getattr(gather, "weight_info", None)
    return dict(infos.items()) if hasattr(infos, "items") else {}


def _stored(index: Any, weight: Any, headers: files.Headers) -> input_checks.Stored:
    """(dtype, shape) of a weight as stored (None, None outside safetensors); None when absent."""
    found = _located(index, weight)
    return None if found is None else headers.stored(*found)


def _located(index: Any, weight: Any) -> tuple[str, str] | None:
    """(file, name) where a model's index stores a weight (under its name or an alias); None when absent."""
    for name in [weight.name, *(weight.aliases or ())]:
        path = index.tensor_paths.get(name)
        if path is not None:
            return (path if os.path.isabs(path) else os.path.join(index.base_path, path)), name
    return None


def warn_stored_dtypes(config: Any, rows: Sequence[Row]) -> None:
    """The dtype warnings, from the stored dtypes of every planned tensor (`stored_row`: headers read once)."""
    from mergekit.common import dtype_from_name

    wanted = dtype_from_name(config.dtype)
    input_checks.warn_stored_dtypes(rows, config.dtype, wanted.itemsize if wanted is not None else None)


def plain(value: Any) -> Any:
    """A task as JSON-able data, without the device (it does not change counts): the cache key's material."""
    from mergekit.common import ImmutableMap
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        if type(value).__str__ is not BaseModel.__str__:
            return str(value)  # ModelReference and friends print their identity
        return {type(value).__name__: {k: plain(getattr(value, k)) for k in type(value).model_fields if k != "device"}}
    if isinstance(value, (ImmutableMap, Mapping)):  # an ImmutableMap's own field is an `immutables.Map`
        return sorted([[plain(k), plain(v)] for k, v in value.items()], key=lambda kv: json.dumps(kv, default=str))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def inject(
    plan: Plan, found: list[tuple[int, Any]], stats: statistics.Statistics, needs: set[Any], tied: dict[str, str]
) -> None:
    """Write each agent's counted rho into the planned merge tasks, for the agents in `needs` that were given
    none (a tied copy takes the rho of the tensor it is tied to; a buffer, never merged, takes none)."""
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
        plan.replace(index, task.model_copy(update={"input_parameters": ImmutableMap(data=inputs)}))
