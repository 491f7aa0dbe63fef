"""input_checks on plain data: which stored dtypes the `dtype:` of a config rounds (one width table, files.WIDTHS)."""

from __future__ import annotations

import logging

import pytest

from mergekit_ram import files
from mergekit_ram.checks import input_checks

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

LOGGER = "mergekit_ram"


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "stored, itemsize, rounded",
    [
        ("F32", 2, True),
        ("F64", 4, True),
        ("F64", 2, True),
        ("BF16", 2, False),
        ("F16", 2, False),
        ("F32", 4, False),
        ("F32", 8, False),
        ("I64", 2, False),  # integers are not floats the masks see: no rounding warning (refused elsewhere)
        ("I32", 2, False),
        ("F8_E4M3", 1, False),
        ("F4", 1, False),  # a dtype without a byte width
    ],
)
def test_the_config_dtype_rounds_wider_stored_floats(caplog, stored, itemsize, rounded):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    input_checks.warn_stored_dtypes(_rows({"base": stored, "agent": stored}), "some-dtype", itemsize)
    messages = _warnings(caplog)
    assert any("rounds the stored weights of agent, base" in m for m in messages) == rounded, messages


def test_no_config_dtype_rounds_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    input_checks.warn_stored_dtypes(_rows({"base": "F64", "agent": "F64"}), None, None)
    assert _warnings(caplog) == []


def test_an_agent_stored_otherwise_than_the_base_is_named(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    input_checks.warn_stored_dtypes(_rows({"base": "BF16", "agent": "F32"}), "bfloat16", 2)
    messages = _warnings(caplog)
    assert any("rounds the stored weights of agent " in m for m in messages), messages
    assert any("agent (F32) stored in a different dtype than the base (BF16)" in m for m in messages), messages


def _rows(*tensors: dict[str, str]) -> list:
    """`check_stored_tensors`' rows: one planned tensor per mapping model -> stored dtype, the base `base`."""
    return [(f"t{i}", "base", False, {m: (d, [2]) for m, d in found.items()}) for i, found in enumerate(tensors)]


def test_every_floating_tensor_of_every_input_is_looked_at(caplog):
    """issue 59: the first planned tensor an integer counter (`bn.num_batches_tracked`) hid a bf16 and an fp16 agent
    beside an fp32 base; the rounding warning and the other-dtype warning name each agent once."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rows = _rows(
        {"base": "I64", "a": "I64", "b": "I64"},
        {"base": "F32", "a": "BF16", "b": "F32"},
        {"base": "F32", "a": "BF16", "b": "F16"},
    )
    input_checks.warn_stored_dtypes(rows, "float32", 4)
    messages = _warnings(caplog)
    assert [m for m in messages if "different dtype" in m] == [
        "ramplus: a (BF16), b (F16) stored in a different dtype than the base (F32); rounding differences count as "
        "updates and inflate density"
    ], messages
    assert not [m for m in messages if "rounds the stored weights" in m], messages
    caplog.clear()
    input_checks.warn_stored_dtypes(_rows({"base": "F32", "a": "F32"}, {"base": "F64", "a": "F64"}), "float32", 4)
    assert [m for m in _warnings(caplog) if "rounds" in m] == [
        "ramplus: `dtype: float32` rounds the stored weights of a, base before masking; updates smaller than one "
        "float32 ULP become invisible to RAM+"
    ]


def test_float_widths_are_the_file_widths():
    assert {d: files.WIDTHS[d] for d in ("F64", "F32", "BF16", "F16")} == {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
