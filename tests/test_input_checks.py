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
    input_checks.warn_stored_dtypes({"base": stored, "agent": stored}, "base", "some-dtype", itemsize)
    messages = _warnings(caplog)
    assert any("rounds the stored weights of base, agent" in m for m in messages) == rounded, messages


def test_no_config_dtype_rounds_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    input_checks.warn_stored_dtypes({"base": "F64", "agent": "F64"}, "base", None, None)
    assert _warnings(caplog) == []


def test_an_agent_stored_otherwise_than_the_base_is_named(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    input_checks.warn_stored_dtypes({"base": "BF16", "agent": "F32"}, "base", "bfloat16", 2)
    messages = _warnings(caplog)
    assert any("rounds the stored weights of agent " in m for m in messages), messages
    assert any("agent stored in a different dtype than the base (BF16)" in m for m in messages), messages


def test_float_widths_are_the_file_widths():
    assert {d: files.WIDTHS[d] for d in ("F64", "F32", "BF16", "F16")} == {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
