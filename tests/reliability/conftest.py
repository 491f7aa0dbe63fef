"""Fixtures of the reliability suite: the `rel` recorder every case uses, model variants, configs."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import models
import pytest
import reference as R
import torch
import yaml

from reliability import harness


def tree(folders: Iterable[Path]) -> dict[str, tuple]:
    """Every file and folder below `folders`: kind, size, mtime (ns), mode. A folder's
    mtime changes when an entry is created or removed in it, even a temporary one."""
    out = {}
    for top in folders:
        top = Path(top)
        for root, dirs, files in os.walk(top):
            for name in [*dirs, *files, ""]:
                full = os.path.join(root, name) if name else root
                st = os.lstat(full)
                out[full] = (stat.S_IFMT(st.st_mode), st.st_size if name in files else 0, st.st_mtime_ns, st.st_mode)
    return out


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
    def names(self, message, *culprits) -> str:
        """The message names every culprit (tensor, model, parameter, file) and is no traceback."""
        message = str(message.value if hasattr(message, "value") else message)
        for culprit in culprits:
            assert str(culprit) in message, f"{culprit!r} not named in: {message}"
        assert "Traceback" not in message
        self.case.errors_checked += 1
        return message

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


# ---------------------------------------------------------------- outputs


def no_weights(out: Path) -> None:
    """An error before writing: no weights, no marker of a finished merge."""
    if out.exists():
        names = sorted(p.name for p in out.iterdir())
        assert not [n for n in names if n.endswith((".safetensors", ".json"))], names


def not_complete(out: Path) -> None:
    """An interrupted merge never looks finished: no ram_stats.json, no index beside a partial model."""
    if not out.exists():
        return
    names = {p.name for p in out.iterdir()}
    assert "ram_stats.json" not in names, sorted(names)
    assert "model.safetensors.index.json" not in names, sorted(names)
    assert not [n for n in names if n.startswith(".ram_stats.")], sorted(names)


def finished(out: Path) -> None:
    names = {p.name for p in out.iterdir()}
    assert {"ram_stats.json", "config.json", "model.safetensors"} <= names, sorted(names)
    assert not [n for n in names if n.startswith(".")], sorted(names)


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


def copy_models(paths: Mapping[str, Path], root: Path) -> dict[str, Path]:
    """Private copies (safe to damage) of model folders."""
    out = {}
    for name, path in paths.items():
        shutil.copytree(path, root / name, copy_function=shutil.copy2)
        out[name] = (root / name).resolve()
    return out


def config_yaml(
    base,
    agents,
    *,
    parameters: dict | None = None,
    model_parameters: Mapping[int, dict] | None = None,
    dtype: str | None = "bfloat16",
    method: str = "ramplus",
) -> str:
    """A mergekit config written with a YAML library, so any path (spaces, quotes, unicode) survives."""
    entries = []
    for i, agent in enumerate(agents):
        entry: dict = {"model": str(agent)}
        if model_parameters and i in model_parameters:
            entry["parameters"] = model_parameters[i]
        entries.append(entry)
    data: dict = {"merge_method": method, "base_model": str(base), "models": entries}
    if dtype:
        data["dtype"] = dtype
    if parameters:
        data["parameters"] = parameters
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def stored(path) -> dict[str, torch.Tensor]:
    return models.load_checkpoint(Path(path))


def inputs(base, agents, cast=None):
    """Stored base and agents keyed by path, as the reference wants them."""
    b = stored(base)
    a = {str(p): stored(p) for p in agents}
    if cast is not None:
        b = {k: v.to(cast) for k, v in b.items()}
        a = {p: {k: v.to(cast) for k, v in sd.items()} for p, sd in a.items()}
    return b, a


def forbid_count(monkeypatch) -> None:
    """The case must fail before the statistics pass reads a tensor."""
    from mergekit_ram import kernel

    def refuse(*_a, **_k):
        raise AssertionError("the statistics pre-pass ran")

    monkeypatch.setattr(kernel, "count", refuse)
    monkeypatch.setattr(kernel, "diagnose", refuse)


# ---------------------------------------------------------------- injected faults


class _FullFile:
    """A file whose writes fail with ENOSPC once `budget` characters are written."""

    def __init__(self, f, budget: int):
        self._f, self._budget = f, budget

    def write(self, data):
        if len(data) > self._budget:
            self._f.write(data[: self._budget])
            self._budget = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False


def full_disk(monkeypatch, folder, budget: int = 64) -> list:
    """Files opened with os.fdopen below `folder` (atomic writes: cache entries,
    ram_stats.json) hit ENOSPC after `budget` characters. Returns the paths hit."""
    real = os.fdopen
    folder = os.path.realpath(folder)
    hit: list = []

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(folder + os.sep):
            hit.append(path)
            return _FullFile(f, budget)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)
    return hit
