"""`mergekit_ram.environment`: one vocabulary for the on/off variables, the `.pth` start-up line's included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mergekit_ram import environment, errors
from mergekit_ram.core import native

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

PTH = Path(environment.__file__).with_name("mergekit_ram.pth")


@pytest.mark.parametrize(
    "value, default, on",
    [
        (None, False, False),
        (None, True, True),
        ("", True, True),  # set but empty: the default
        (" ", False, False),
        ("1", False, True),
        ("yes", False, True),
        ("On", False, True),
        ("2", False, True),  # any other value: on
        ("0", True, False),
        ("false", True, False),
        (" NO ", True, False),
        ("off", True, False),
    ],
)
def test_flag_reads_one_vocabulary(monkeypatch, value, default, on):
    if value is None:
        monkeypatch.delenv("MERGEKIT_RAM_SOMETHING", raising=False)
    else:
        monkeypatch.setenv("MERGEKIT_RAM_SOMETHING", value)
    assert environment.flag("MERGEKIT_RAM_SOMETHING", default) is on


def test_the_traceback_and_the_kernel_switch_read_it(monkeypatch):
    monkeypatch.setenv(environment.TRACEBACK, "off")  # was on: any value but "0" turned the traceback on
    assert not errors.wants_traceback() or errors.logging.getLogger().getEffectiveLevel() <= errors.logging.INFO
    monkeypatch.setenv(environment.TRACEBACK, "true")
    assert errors.wants_traceback()
    monkeypatch.setenv(environment.NATIVE, "")
    assert native.enabled()
    monkeypatch.setenv(environment.NATIVE, "Off")
    assert not native.enabled()


def test_the_start_up_line_uses_the_same_words():
    """The `.pth` line cannot import `environment` (that would load the plugin it may be told not to load): its own
    tuple of words must be `OFF` and the empty value."""
    line = PTH.read_text(encoding="utf-8").strip()
    assert environment.DISABLE in line
    words = re.search(r"in \(([^)]*)\)", line)
    assert words is not None, line
    assert {w.strip().strip("\"'") for w in words.group(1).split(",")} == {"", *environment.OFF}


@pytest.mark.parametrize("value, loaded", [("1", False), ("on", False), ("off", True), ("", True)])
def test_the_start_up_line_loads_the_plugin_unless_disabled(value, loaded):
    """A real interpreter start (the `.pth` line runs at start-up): MERGEKIT_RAM_DISABLE by the same words."""
    env = {**os.environ, environment.DISABLE: value}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; print('mergekit_ram' in sys.modules)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(loaded), (value, done.stdout, done.stderr)
