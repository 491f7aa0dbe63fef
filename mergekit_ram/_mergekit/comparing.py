"""What verify puts where mergekit would save a tensor, and the published tensor's bytes: the tasks and reads
`recompute` runs a recorded merge with.

`CompareTensor` stands where mergekit plans a `SaveTensor` (cast to its dtype) and compares the tensor with the
published one (`PublishedTensor`, read through mergekit's loader as the model's users read it), so the executor
holds what a merge holds (less: no output shard is buffered). For a sample, `read` takes the drawn elements of a
tensor from a safetensors file by their byte ranges (`files.Headers` places them) and `published_mismatch` names a
published tensor of another dtype or shape than the plan writes. The judging is `verify.bitwise`'s.
"""

from __future__ import annotations

import math
import os
from typing import Any

from mergekit.graph import Task

from mergekit_ram import errors, files
from mergekit_ram.errors import InputError
from mergekit_ram.verify import bitwise, record_checks


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
            return f"{type(error).__name__}: {errors.said(error)[:300]}"


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
        why = record_checks.damaged_weight_file(folder) or errors.said(error)[:300]
        raise InputError(f"the weights in {folder} cannot be read: {why}") from error


def compare_task(folder: str, name: str, task: Any, optional: bool, dtype: str | None) -> CompareTensor:
    published = PublishedTensor(folder=folder, name=name, label=task.group_label())
    return CompareTensor(name=name, tensor_task=task, published=published, optional=optional, dtype=dtype)


def stored_entry(path: str, name: str, headers: files.Headers) -> dict:
    """Tensor `name`'s entry in the header of `path` ({} when absent); errors.Unreadable naming a damaged file."""
    try:
        return headers.entry(path, name)
    except (OSError, ValueError) as error:
        raise errors.Unreadable(f"{path}: its safetensors header cannot be read ({error})") from error


def read(path: str, name: str, spans: list[tuple[int, int]], headers: files.Headers) -> Any:
    """The elements `spans` of tensor `name` in the safetensors file `path`, flat, read by their byte ranges;
    errors.Unreadable naming the file when its header does not place them inside it."""
    import torch

    entry = stored_entry(path, name, headers)
    said = files.FLOAT_NAMES.get(str(entry.get("dtype")))
    if said is None:
        raise errors.Unreadable(f"{path}: tensor {name} is not stored as a float (safetensors header)")
    dtype = getattr(torch, said)
    start, placed = headers.get(path)[0], headers.span(path, name)
    if placed is None:
        raise errors.Unreadable(f"{path}: tensor {name} has no byte offsets (safetensors header)")
    size, itemsize = os.path.getsize(path), torch.empty((), dtype=dtype).element_size()
    first, last = placed
    numel = math.prod(int(n) for n in entry["shape"])
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


def published_mismatch(
    path: str, name: str, planned: list[int], dtype: str | None, headers: files.Headers
) -> bitwise.Difference | None:
    """A published tensor whose dtype or shape is not what the plan writes (the base's shape, the saved dtype)."""
    entry = stored_entry(path, name, headers)
    if not entry:
        return bitwise.Difference(name, "missing")
    said = files.FLOAT_NAMES.get(str(entry.get("dtype"))) or str(entry.get("dtype"))
    shape = [int(n) for n in entry.get("shape") or []]
    wanted = str(dtype) if dtype else said
    if said != wanted or shape != planned:
        status = "dtype" if said != wanted else "shape"
        return bitwise.Difference(name, status, published=f"{said} {shape}", recomputed=f"{wanted} {planned}")
    return None
