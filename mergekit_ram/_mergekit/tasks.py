"""mergekit's planned `ramplus` tasks as plain data, and rho written back into them.

Once mergekit has planned a merge, its `ExecuteMergeMethodTask`s say everything the statistics
pass needs: which tensor, which models in which order, the loading task under any vocabulary
wrappers, the parameters. Two doors plan them, and a `Plan` hides which from the pipeline:

- `of_planner`: `mergekit-yaml` (and `run_merge`, `mergekit-multi`, `inspect`): a `MergePlanner`'s
  list, models are folders (or hub ids) identified by `cache.folder_identity`;
- `of_flat`: `mergekit-pytorch` (`plan_flat_merge`): each tensor's merge task sits in a `SaveTensor`
  that `FinalizeModel` waits for, inputs are `SimpleLoadTensor`s of single files (safetensors or a
  PyTorch pickle) identified by `cache.file_identity`.

This module reads the tasks (`planned`, `summary`, `Plan.stored_row`, `tied_copies`, `plain`) and
writes into them (`round_once_to_out_dtype`, `inject`) through `Plan.replace`; for a planner that is
`surface`, which alone touches the planner's private list.

Tensors some models lack (`mergekit-pytorch --tensor-union`; without it or `--tensor-intersection`
mergekit refuses them, with `--tensor-intersection` it plans only the tensors every input stores):
a tensor an agent does not store counts as left unchanged by that agent (tau = 0 there). It is
counted over the agents that store it (the others' counts there are zero; every agent's numel and
density are over the planned tensors) and merged from them, as mergekit's merge task merges the
inputs it loads. A tensor that no agent stores is copied from the base and not counted (`KeepBase`);
mergekit-pytorch plans the tensors of the files under `models:` only, so that needs the base listed
there too: otherwise such tensors are not written (as for every method), and a warning names them.
A tensor the base does not store has no task vector: refused, naming the tensor and the models that
store it, before any tensor is read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from mergekit.graph import Task

from mergekit_ram import cache, files, input_checks, statistics
from mergekit_ram._mergekit import surface
from mergekit_ram.params import DEFAULTS
from mergekit_ram.session import Planned

LOG = logging.getLogger("mergekit_ram")

#: One stored row of a planned tensor, what `input_checks.check_stored_tensors` reads:
#: (name, base, whether vocabulary-aligned, model -> (dtype, shape) as stored or None when absent)
Row = tuple[str, str, bool, dict[str, input_checks.Stored]]


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

    def stored_row(self, task: Any, headers: dict[str, dict]) -> Row:
        """What `input_checks.check_stored_tensors` needs of one task (`headers`: each file's header, read once)."""
        raise NotImplementedError

    def identity(self, model: Any) -> dict:
        """What identifies `model`'s weights without reading them (`cache.folder_identity` / `file_identity`)."""
        raise NotImplementedError


class _PlannerPlan(Plan):
    def __init__(self, planner: Any):
        self.planner = planner
        self.config, self.options, self.out_model_config = planner.config, planner.options, planner.out_model_config

    def entries(self) -> list[tuple[int, Any]]:
        return [(i, task) for i, (_, task) in enumerate(surface.planned(self.planner))]

    def replace(self, index: int, task: Any) -> None:
        surface.replace_planned(self.planner, index, task)

    def stored_row(self, task: Any, headers: dict[str, dict]) -> Row:
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


def of_planner(planner: Any) -> Plan:
    """The plan of a `MergePlanner` that has planned (`mergekit-yaml`, `run_merge`, `inspect`)."""
    return _PlannerPlan(planner)


class FlatPlan(Plan):
    """The tasks `plan_flat_merge` returned (`SaveTensor`s, then `FinalizeModel`), the tensors some models
    lack settled (module docstring); `tasks()` is the list to execute, `FinalizeModel` waiting for the
    replaced `SaveTensor`s."""

    def __init__(
        self, planned: list[Any], config: Any, options: Any, ours: Callable[[str], bool], *, intersection: bool = False
    ):
        self._planned, self._original = list(planned), list(planned)
        self.config, self.options = config, options
        self._settle(ours)
        if not intersection:
            self._say_unplanned()

    def entries(self) -> list[tuple[int, Any]]:
        from mergekit.io.tasks import SaveTensor

        saves = sorted((t.tensor_name, i) for i, t in enumerate(self._planned) if isinstance(t, SaveTensor))
        return [(i, self._planned[i].tensor_task) for _, i in saves]  # by name: mergekit plans in set order

    def replace(self, index: int, task: Any) -> None:
        self._planned[index] = self._planned[index].model_copy(update={"tensor_task": task})

    def tasks(self) -> list[Any]:
        """The planned tasks with every replacement, `FinalizeModel` waiting for the replaced ones (mergekit's
        executor runs what it depends on: the replaced originals must go)."""
        from mergekit.io.tasks import FinalizeModel

        now = {id(old): new for old, new in zip(self._original, self._planned, strict=True)}
        return [
            t.model_copy(update={"tensor_save_tasks": tuple(now.get(id(s), s) for s in t.tensor_save_tasks)})
            if isinstance(t, FinalizeModel)
            else t
            for t in self._planned
        ]

    def stored_row(self, task: Any, headers: dict[str, dict]) -> Row:
        stored: dict[str, input_checks.Stored] = {}
        for model, load in task.gather_tensors.tensors.items():
            if _stores(load):  # one that lacks it: settled by the union rule
                stored[str(model)] = _header_entry(load.model, load.tensor_name, headers)
        return task.output_weight.name, str(task.base_model), False, stored

    def identity(self, model: Any) -> dict:
        return cache.file_identity(model.model.path)

    def _settle(self, ours: Callable[[str], bool]) -> None:
        """The rule for tensors some inputs lack (module docstring), before any tensor is read."""
        partly, kept = [], []
        for index, task in planned(self, ours):
            present = {m for m, load in task.gather_tensors.tensors.items() if _stores(load)}
            if len(present) == len(task.model_order):
                continue
            name = task.output_weight.name
            if task.base_model not in present:
                raise ValueError(
                    f"ramplus: tensor {name} is not in the base model {task.base_model} (it is in "
                    f"{', '.join(sorted(map(str, present)))}): RAM+ measures each agent's update against the base, "
                    "so it cannot merge it. Leave out the tensors some models lack with --tensor-intersection"
                )
            if not present - {task.base_model}:
                self.replace(index, KeepBase(tensors=task.gather_tensors, base_model=task.base_model,
                                             out_dtype=task.out_dtype))  # fmt: skip
                kept.append(name)
            else:
                partly.append(name)
        if partly:
            LOG.warning(
                "ramplus: %d tensor(s) are missing from some agents (%s): each is counted and merged over the "
                "agents that store it (the others left it unchanged)",
                len(partly),
                _some(partly),
            )
        if kept:
            LOG.warning("ramplus: %d tensor(s) only the base stores are copied from it (%s)", len(kept), _some(kept))

    def _say_unplanned(self) -> None:
        """Name the tensors of the base that mergekit-pytorch did not plan (it plans the `models:` files' tensors)."""
        from mergekit.io.tasks import SaveTensor
        from mergekit.scripts.merge_raw_pytorch import SimpleLoaderCache

        base = getattr(self.config, "base_model", None)
        if base is None:
            return
        planned = {t.tensor_name for t in self._planned if isinstance(t, SaveTensor)}
        left = sorted(set(SimpleLoaderCache().get(base).index.tensor_paths) - planned)
        if left:
            LOG.warning(
                "ramplus: %d tensor(s) of the base model %s are in no file under `models:` (%s); mergekit-pytorch "
                "merges the tensors of those files, so they are not written. List the base under `models:` too "
                "to keep them (with --tensor-union they are copied from the base)",
                len(left),
                base,
                _some(left),
            )


def of_flat(
    planned: list[Any], config: Any, options: Any, ours: Callable[[str], bool], *, intersection: bool = False
) -> FlatPlan:
    """The plan of `mergekit-pytorch`'s `plan_flat_merge` (`planned`: what it returned; `intersection`: planned
    with `--tensor-intersection`, which leaves out what some models lack on purpose)."""
    return FlatPlan(planned, config, options, ours, intersection=intersection)


class KeepBase(Task[Any]):
    """A tensor only the base stores (`--tensor-union`): every agent left it unchanged, so RAM+ keeps the
    base's value, in the dtype the merge task would have written."""

    tensors: Any
    base_model: Any
    out_dtype: str | None = None

    def arguments(self) -> dict[str, Any]:
        return {"tensors": self.tensors}

    def group_label(self) -> str | None:
        return self.tensors.group_label()

    def execute(self, tensors: dict[Any, Any], **_kwargs: Any) -> Any:
        from mergekit.common import dtype_from_name

        tensor = tensors[self.base_model]
        dtype = dtype_from_name(self.out_dtype)
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _stores(load: Any) -> bool:
    """Whether the file a `SimpleLoadTensor` reads stores its tensor (its index, read when mergekit planned)."""
    from mergekit.scripts.merge_raw_pytorch import SimpleLoaderCache

    return load.tensor_name in SimpleLoaderCache().get(load.model).index.tensor_paths


def _some(names: list[str], shown: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


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


def _stored(index: Any, weight: Any, headers: dict[str, dict]) -> input_checks.Stored:
    """(dtype, shape) of a weight as stored (None, None outside safetensors); None when absent."""
    for name in [weight.name, *(weight.aliases or ())]:
        path = index.tensor_paths.get(name)
        if path is None:
            continue
        path = path if os.path.isabs(path) else os.path.join(index.base_path, path)
        return _header_entry(path, name, headers)
    return None


def _header_entry(path: str, name: str, headers: dict[str, dict]) -> input_checks.Stored:
    """(dtype, shape) of tensor `name` in the file at `path` from its safetensors header, read once per file
    (`headers`); (None, None) outside safetensors or when the header does not say."""
    if not path.lower().endswith(".safetensors"):
        return None, None
    if path not in headers:
        try:
            headers[path] = files.read_header(path)[1]
        except (OSError, ValueError):
            headers[path] = {}
    info = headers[path].get(name)
    return (info["dtype"], list(info["shape"])) if isinstance(info, dict) else (None, None)


def warn_stored_dtypes(config: Any, row: Row) -> None:
    """The dtype warnings, from the stored dtypes of one planned tensor (`stored_row`: headers read once)."""
    from mergekit.common import dtype_from_name

    _, base, _, found = row
    stored = {model: entry[0] for model, entry in found.items() if entry is not None and entry[0] is not None}
    wanted = dtype_from_name(config.dtype)
    input_checks.warn_stored_dtypes(stored, base, config.dtype, wanted.itemsize if wanted is not None else None)


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
