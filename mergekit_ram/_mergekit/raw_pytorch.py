"""`mergekit-pytorch`'s planned tasks (`plan_flat_merge`) as a `tasks.Plan` (its door: `door_pytorch`).

Each tensor's merge task sits in a `SaveTensor` that `FinalizeModel` waits for; inputs are
`SimpleLoadTensor`s of single files (safetensors or a PyTorch pickle) identified by
`cache.file_identity`.

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

import contextlib
import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

from mergekit.graph import Task

from mergekit_ram import files
from mergekit_ram._mergekit.tasks import Plan, Row, Save, planned
from mergekit_ram.checks import input_checks
from mergekit_ram.core import cache
from mergekit_ram.errors import RamError

LOG = logging.getLogger("mergekit_ram")


class FlatPlan(Plan):
    """The tasks `plan_flat_merge` returned (`SaveTensor`s, then `FinalizeModel`), the tensors some models
    lack settled (module docstring); `tasks()` is the list to execute, `FinalizeModel` waiting for the
    replaced `SaveTensor`s."""

    def __init__(
        self, planned: list[Any], config: Any, options: Any, ours: Callable[[str], bool], *, intersection: bool = False
    ):
        self._planned, self._original = list(planned), list(planned)
        self.config, self.options = config, options
        if not planned_tensors(self._planned):
            raise RamError(
                "ramplus: this mergekit-pytorch merge would write no tensor: "
                + (
                    "no tensor is stored by every input file (--tensor-intersection keeps only those); "
                    if intersection
                    else "the input files plan none; "
                )
                + "check that each file holds the same model's state_dict (torch.save(model.state_dict(), path))"
            )
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

    def stored_row(self, task: Any, headers: files.Headers) -> Row:
        stored: dict[str, input_checks.Stored] = {}
        for model, load in task.gather_tensors.tensors.items():
            if _stores(load):  # one that lacks it: settled by the union rule
                found = headers.stored(load.model, load.tensor_name)
                if found is None or found[0] is None:  # a PyTorch pickle: its dtype for the warnings, shape later
                    found = (pickled_dtype(load.model, load.tensor_name, headers), None)
                stored[str(model)] = found
        return task.output_weight.name, str(task.base_model), False, stored

    def identity(self, model: Any) -> dict:
        return cache.file_identity(model.model.path)

    def sources(self, task: Any) -> dict[str, tuple[str, str]]:
        loads = getattr(getattr(task, "gather_tensors", None), "tensors", {})
        return {str(model): (load.model, load.tensor_name) for model, load in loads.items() if _stores(load)}

    def saves(self) -> list[Save]:
        from mergekit.io.tasks import SaveTensor

        return [(t.tensor_name, t.tensor_task, t.optional, t.dtype) for t in self.tasks() if isinstance(t, SaveTensor)]

    def _settle(self, ours: Callable[[str], bool]) -> None:
        """The rule for tensors some inputs lack (module docstring), before any tensor is read."""
        partly, kept = [], []
        for index, task in planned(self, ours):
            present = {m for m, load in task.gather_tensors.tensors.items() if _stores(load)}
            if len(present) == len(task.model_order):
                continue
            name = task.output_weight.name
            if task.base_model not in present:
                raise RamError(
                    f"ramplus: tensor {name} is not in the base model {task.base_model} (it is in "
                    f"{', '.join(sorted(map(str, present)))}): RAM+ measures each agent's update against the base, "
                    "so it cannot merge it. Leave out the tensors some models lack with --tensor-intersection"
                )
            if not present - {task.base_model}:
                self.replace(
                    index, KeepBase(tensors=task.gather_tensors, base_model=task.base_model, out_dtype=task.out_dtype)
                )
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
        from mergekit.scripts.merge_raw_pytorch import SimpleLoaderCache

        base = getattr(self.config, "base_model", None)
        if base is None:
            return
        planned = set(planned_tensors(self._planned))
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


@contextlib.contextmanager
def planning(options: Any) -> Iterator[None]:
    """Around mergekit-pytorch's own planning (a merge's and `inspect`'s):

    - its bars ("Preparing model loaders", "Planning operations") are drawn whatever `--quiet` says; with
      `quiet`, what it writes to stderr while it plans is dropped (logging keeps its own stream: warnings and
      errors still show);
    - its bare `RuntimeError("Missing tensors")` (files that store different tensors, named in its log) becomes
      ours, saying which flag decides (`RamError`, one line)."""
    quiet = contextlib.redirect_stderr(io.StringIO()) if getattr(options, "quiet", False) else contextlib.nullcontext()
    try:
        with quiet:
            yield
    except RuntimeError as error:
        if str(error) != "Missing tensors":
            raise
        raise RamError(
            "some input files lack tensors the others store (mergekit-pytorch's log names them); pass "
            "--tensor-intersection to leave those tensors out, or --tensor-union to merge them"
        ) from error


def planned_tensors(planned: list[Any]) -> list[str]:
    """The tensors a `plan_flat_merge` task list writes (its `SaveTensor`s)."""
    from mergekit.io.tasks import SaveTensor

    return [t.tensor_name for t in planned if isinstance(t, SaveTensor)]


def _stores(load: Any) -> bool:
    """Whether the file a `SimpleLoadTensor` reads stores its tensor (its index, read when mergekit planned)."""
    from mergekit.scripts.merge_raw_pytorch import SimpleLoaderCache

    return load.tensor_name in SimpleLoaderCache().get(load.model).index.tensor_paths


def _some(names: list[str], shown: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


#: torch's floating dtypes by safetensors' names (what the stored-dtype warnings compare)
_NAMES = {f"torch.{name}": code for code, name in files.FLOAT_NAMES.items()}


def pickled_dtype(path: str, name: str, headers: files.Headers) -> str | None:
    """The dtype a PyTorch pickle (zip format, already checked safe by `input_checks`) stores tensor `name` in,
    by safetensors' name, as a header would say it: loaded on the meta device (no tensor data read), once per file
    (`headers`); None when it cannot say (a legacy pickle is not read for this)."""
    import zipfile

    if not headers.known(path):
        header: dict = {}
        try:
            if zipfile.is_zipfile(path):
                import torch

                found = torch.load(path, map_location="meta", weights_only=True, mmap=True)
                if isinstance(found, dict):
                    tensors = {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}
                    header = {k: {"dtype": _NAMES.get(str(v.dtype), str(v.dtype))} for k, v in tensors.items()}
        except Exception:  # the input checks and mergekit name a file they cannot read
            header = {}
        headers.remember(path, header)
    return headers.entry(path, name).get("dtype")
