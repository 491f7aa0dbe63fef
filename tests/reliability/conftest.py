"""Fixtures of the reliability suite: the `rel` recorder every case uses, model variants. The helpers its cases
share (configs, what an output folder holds, injected faults) are in tests/helpers.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import models
import pytest
import reference as R
import torch
from helpers import tree

from mergekit_ram.errors import one_line
from reliability import harness


class Recorder:
    """What one case checked; see harness.py. Every assertion here is counted."""

    def __init__(self, nodeid: str):
        self.case = harness.case(nodeid)
        self._watched: list = []

    # inputs -----------------------------------------------------------------
    def watch(self, *folders) -> None:
        """Snapshot input folders now; compared when the case ends (teardown)."""
        folders = [Path(f) for f in folders]
        self._watched.append((folders, tree(folders)))

    def finish(self) -> None:
        for folders, before in self._watched:
            after = tree(folders)
            changed = sorted(set(before) ^ set(after) | {k for k in before if k in after and before[k] != after[k]})
            self.case.inputs_checked += 1
            self.case.input_writes += len(changed)
            assert not changed, f"input folders changed: {changed[:10]}"

    # merges -----------------------------------------------------------------
    def matches_reference(self, tensors: Mapping[str, torch.Tensor], base, agents, *, names=None, **kwargs):
        """Every tensor equals the float64 reference merge (tests/reference.py) up to one rounding."""
        names = list(base) if names is None else list(names)
        try:
            ref = R.reference_merge(base, agents, names=names, **kwargs)
            assert set(tensors) == set(names), f"tensor names differ: {sorted(set(tensors) ^ set(names))}"
            R.assert_state_dict_matches(tensors, ref, R.reference_magnitudes(base, agents, names))
        except AssertionError:
            self.case.wrong_merges += 1
            raise
        self.case.merges_compared += 1

    # errors -----------------------------------------------------------------
    def names(self, message, *culprits, traceback_ok: str = "") -> str:
        """The message names every culprit (tensor, model, parameter, file) and is no traceback.

        An exception (pytest's `ExceptionInfo`) must also be one that a command prints as one line by default
        (`mergekit_ram.errors.one_line`: ours, a `RamError`), not as a traceback; `traceback_ok` says why one
        may be (a fault injected into the process, not a bad input), and it is still counted."""
        error = message.value if hasattr(message, "value") else None
        message = str(error if error is not None else message)
        for culprit in culprits:
            assert str(culprit) in message, f"{culprit!r} not named in: {message}"
        assert "Traceback" not in message
        self.case.errors_checked += 1
        if error is not None and one_line(error) is None:
            self.case.tracebacks += 1
            assert traceback_ok, f"a command would print a traceback for {type(error).__name__}: {message}"
        return message

    # verdicts ---------------------------------------------------------------
    def verdict(self, right: bool, what: str, found: dict, *, tamper: bool = False) -> None:
        """One verify verdict checked: `right` whether it is the true one (a right merge exit 0, a changed one
        exit 1 naming the change); a false one is counted, then fails the case."""
        self.case.verdicts += 1
        self.case.tampers += tamper
        if not right:
            self.case.false_verdicts += 1
            shown = {k: found.get(k) for k in ("exit", "result", "problems", "stderr", "error")}
            raise AssertionError(f"false verdict ({what}): {shown}")

    def fault(self) -> None:
        self.case.fault = True


@pytest.fixture(autouse=True)
def rel(request):
    recorder = Recorder(request.node.nodeid)
    yield recorder
    try:
        recorder.finish()
    finally:  # the counts travel with the teardown report: under pytest-xdist they are made in a worker
        request.node.user_properties.append((harness.PROPERTY, harness.counts(recorder.case)))


# ---------------------------------------------------------------- models and configs


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(name, state_dict, arch=, tied=, dtype=, shards=) -> path, written once per session."""
    root = tmp_path_factory.mktemp("reliability-models")
    made: dict[str, Path] = {}

    def make(name: str, state_dict, *, arch="qwen2", tied=False, dtype=torch.bfloat16, shards=1) -> Path:
        if name not in made:
            config = models.make_config(arch, tied, dtype)
            made[name] = models.write_checkpoint(root / name, config, state_dict, shards=shards).resolve()
        return made[name]

    return make
