"""`mergekit-ram verify`, step 3: the merge run again on the executor `run_merge` would use, each tensor
compared with the published one where mergekit would save it.

`CompareTensor` stands where mergekit plans a `SaveTensor` (cast to its dtype) and compares the tensor with
the published one, read from the folder by `PublishedTensor` through mergekit's loader, so the executor
holds what a merge holds (less: no output shard is buffered); `run` then names the tensors the folder holds
that the merge does not plan. The judging is `bitwise`' and `verdict`'s, on plain data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mergekit.graph import Task

from mergekit_ram._mergekit import counting
from mergekit_ram.errors import InputError, NonFiniteResultError
from mergekit_ram.verify import bitwise, record_checks, verdict


class PublishedTensor(Task[Any]):
    """One tensor as the folder holds it (None when the folder has none of that name; a str says why it
    cannot be read), read through mergekit's loader as the model's users read it."""

    folder: str
    name: str
    label: str | None = None

    def arguments(self):
        return {}

    def group_label(self) -> str | None:
        return self.label  # beside the merge of the same tensor

    def priority(self) -> int:
        return -2000  # after the merge task of its group: held for the shortest time

    def execute(self, **_kwargs) -> Any:
        try:
            return _published(self.folder).get_tensor(self.name, raise_on_missing=False)
        except Exception as error:
            return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


class CompareTensor(Task[Any]):
    """Where mergekit would save a tensor (`SaveTensor`: cast to its dtype), compare it with the published one."""

    name: str
    tensor_task: Task
    published: PublishedTensor
    optional: bool = False
    dtype: str | None = None

    def arguments(self):
        return {"tensor": self.tensor_task, "published": self.published}

    def group_label(self) -> str | None:
        return self.tensor_task.group_label()

    def priority(self) -> int:
        return 1000  # as SaveTensor

    def execute(self, tensor: Any, published: Any, **_kwargs) -> bitwise.Difference | None:
        from mergekit.common import dtype_from_name

        if isinstance(published, str):
            return bitwise.Difference(self.name, "unreadable", detail=published)
        if tensor is None and not self.optional:
            raise RuntimeError(f"No value for required tensor {self.name}")  # as SaveTensor
        if tensor is not None and self.dtype:
            tensor = tensor.to(dtype=dtype_from_name(self.dtype))
        if tensor is None and published is None:
            return None  # an optional tensor no input holds: neither written nor published
        return bitwise.compare(self.name, tensor, published)


def compare_task(folder: str, name: str, task: Any, optional: bool, dtype: str | None) -> CompareTensor:
    published = PublishedTensor(folder=folder, name=name, label=task.group_label())
    return CompareTensor(name=name, tensor_task=task, published=published, optional=optional, dtype=dtype)


def _published(folder: str) -> Any:
    """mergekit's loader of the folder's weights (one per folder, as for an input model)."""
    from mergekit.io.tasks import LoaderCache

    return LoaderCache().get(reference(folder))


def reference(folder: str) -> Any:
    from mergekit.common import ModelPath, ModelReference

    return ModelReference(model=ModelPath(path=folder))


def published_index(folder: str) -> dict[str, str]:
    """tensor -> file, as a loader reads the folder's weights (checked before any input is read)."""
    try:
        return dict(_published(folder).index.tensor_paths)
    except Exception as error:
        why = record_checks.damaged_weight_file(folder) or " ".join(str(error).split())[:300]
        raise InputError(f"the weights in {folder} cannot be read: {why}") from error


def run(
    targets: list[CompareTensor],
    index: dict[str, str],
    folder: str,
    options: Any,
    outcome: verdict.Outcome,
    planned_names: Iterable[str] = (),
) -> None:
    """Run the compare tasks on the executor `run_merge` would use; then name what the folder holds beyond them
    (`index`: the folder's tensors; `planned_names`: tensors the merge plans beside `targets`, a sample's others)."""
    planned = set(planned_names)
    try:
        for _task, value in counting.run_as_merge(targets, options, desc="Verifying"):
            if isinstance(value, bitwise.Difference):
                planned.add(value.name)
                outcome.add(value)
    except NonFiniteResultError as error:  # the merge stops there, writing nothing: the folder holds what it refuses
        name = error.tensor or "?"
        outcome.add(bitwise.Difference(name, "not finite", detail=f"{error} (verify stopped here, as the merge does)"))
        outcome.merged = True
        return
    except (OSError, RuntimeError, ValueError, KeyError) as error:  # what stops a merge stops its recomputation
        message = " ".join(str(error).split()) or type(error).__name__
        raise InputError(f"recomputing the merge failed: {message}") from error
    planned |= {t.name for t in targets}
    for name in sorted(set(index) - planned):
        outcome.add(bitwise.Difference(name, "extra", detail=f"in {index[name]}"))
    for name, why in sorted(record_checks.stray_tensors(folder, index).items()):
        if name not in index:
            outcome.add(bitwise.Difference(name, "extra", detail=why))
    outcome.merged = True
