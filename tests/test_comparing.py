"""`_mergekit/comparing.py`: the compare task that stands where mergekit would save a tensor, on plain tensors.

The merge run again on mergekit's executors, against real folders: tests/test_verification.py.
"""

from __future__ import annotations

import pytest
import torch

from mergekit_ram._mergekit import comparing

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def compare_task(optional: bool = False, dtype: str | None = None) -> comparing.CompareTensor:
    upstream = comparing.PublishedTensor(folder="/nowhere", name="merged")  # any task: execute is called directly
    return comparing.compare_task("/nowhere", "t", upstream, optional, dtype)


def test_the_tensor_is_cast_as_mergekit_would_save_it():
    task = compare_task(dtype="bfloat16")
    published = torch.tensor([1.0, 2.0]).to(torch.bfloat16)
    assert task.execute(tensor=torch.tensor([1.0, 2.0]), published=published).identical
    found = compare_task().execute(tensor=torch.tensor([1.0, 2.0]), published=published)
    assert found.status == "dtype"
    assert task.published.name == "t" and task.published.folder == "/nowhere" and task.priority() == 1000


def test_what_cannot_be_compared():
    found = compare_task().execute(tensor=torch.zeros(1), published="OSError: gone")
    assert found.line() == "unreadable: t: OSError: gone"
    assert compare_task(optional=True).execute(tensor=None, published=None) is None
    assert compare_task(optional=True).execute(tensor=None, published=torch.zeros(1)).status == "extra"
    with pytest.raises(RuntimeError, match="No value for required tensor t"):
        compare_task().execute(tensor=None, published=torch.zeros(1))
