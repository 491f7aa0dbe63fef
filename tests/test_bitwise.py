"""`bitwise.py`: two tensors compared bit for bit (what `mergekit-ram verify` does to each tensor).

-0.0 against 0.0, NaN payloads, infinities, every dtype width, dtype and shape, absence, chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

from mergekit_ram.verify import bitwise

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool])
def test_every_single_element_change_is_counted_once(dtype):
    gen = torch.Generator().manual_seed(0)
    base = (torch.rand(37, 5, generator=gen) * 4 - 2).to(dtype) if dtype != torch.bool else torch.rand(37, 5) > 0.5
    for index in range(base.numel()):
        other = base.clone()
        if dtype == torch.bool:
            other.view(-1)[index] = ~other.view(-1)[index]
        else:
            other.view(-1).view(INTS[base.element_size()])[index] += 1
        found = bitwise.compare("t", base, other)
        assert (found.status, found.differing, found.elements) == ("differs", 1, base.numel()), index
        expect = abs(float(other.view(-1)[index].double() - base.view(-1)[index].double()))
        assert found.max_abs == expect, index
    assert bitwise.compare("t", base, base.clone()).identical


def test_bits_decide_zeros_nans_and_infinities():
    nan = torch.tensor([float("nan")])
    other_nan = nan.view(torch.int32).add(1).view(torch.float32)  # a NaN with another payload
    assert bitwise.compare("t", nan, nan.clone()).identical
    found = bitwise.compare("t", nan, other_nan)
    assert (found.differing, found.nan, found.max_abs) == (1, 1, None)
    found = bitwise.compare("t", torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert (found.status, found.differing, found.max_abs) == ("differs", 1, 0.0)
    found = bitwise.compare("t", torch.tensor([1.0, float("inf")]), torch.tensor([float("inf"), float("-inf")]))
    assert (found.differing, found.max_abs) == (2, math.inf)
    assert found.as_json()["max_abs_difference"] == "inf"
    found = bitwise.compare("t", torch.tensor([1.0, float("nan")]), torch.tensor([1.5, 2.0]))
    assert (found.differing, found.nan, found.max_abs) == (2, 1, 0.5)


def test_dtype_shape_and_absence_are_named():
    a = torch.zeros(4, 2, dtype=torch.bfloat16)
    assert bitwise.compare("t", a, a.float()).line() == "differs: t: published float32 [4, 2], recomputed bfloat16 [4, 2]"
    assert bitwise.compare("t", a, a.reshape(2, 4)).status == "shape"
    assert bitwise.compare("t", a, None).status == "missing"
    assert bitwise.compare("t", None, a).status == "extra"


def test_chunks_add_up():
    a = torch.arange(1000, dtype=torch.float32)
    b = a.clone()
    b[[0, 333, 999]] += torch.tensor([1.0, 4.0, 0.5])
    assert bitwise.bit_differences(a, b, chunk=7) == bitwise.bit_differences(a, b) == (3, 0, 4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.complex64, torch.bool])
def test_equal_bits_are_found_in_one_pass_and_a_difference_still_counted(dtype):
    """The pass that finds equal bits (`_same_bits`, torch.equal of integer views) says what the chunks say: a NaN
    equals the same NaN, -0.0 is not 0.0, and one change in the last chunk is found and counted once."""
    a = torch.arange(1000).to(dtype) if dtype == torch.bool else (torch.arange(1000) - 500).to(dtype)
    if dtype.is_floating_point:
        a[[3, 7]] = torch.tensor([float("nan"), -0.0]).to(dtype)
    assert bitwise.bit_differences(a, a.clone(), chunk=7) == (0, 0, None)
    b = a.clone()
    if dtype == torch.bool:
        b[999] = ~b[999]
    elif dtype.is_floating_point:
        b[7] = 0.0  # -0.0 against 0.0
    else:
        b[999] += 1
    assert bitwise.bit_differences(a, b, chunk=7)[0] == 1
