"""Helpers shared by the test modules: configs as a user writes them, reference checks, schema checks.

Test modules import from here (and from `models`, `reference`), never from each other.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import sys
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

import models
import pytest
import reference as R
import torch
import yaml

BF16 = torch.bfloat16
HEX64 = re.compile(r"^[0-9a-f]{64}$")

DTYPE_OF = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ---------------------------------------------------------------- helpers


def config_text(
    written,
    agents: Sequence[str],
    *,
    method: str = "ramplus",
    dtype: Optional[str] = "bfloat16",
    out_dtype: Optional[str] = None,
    parameters: str = "",
    model_parameters: Optional[Dict[str, str]] = None,
    base_in_models: bool = False,
) -> str:
    """A mergekit YAML config with absolute paths, written as a user would."""
    lines = [f"merge_method: {method}", f"base_model: {written.path('base')}", "models:"]
    if base_in_models:
        lines.append(f"  - model: {written.path('base')}")
    for agent in agents:
        lines.append(f"  - model: {written.path(agent)}")
        extra = (model_parameters or {}).get(agent)
        if extra:
            lines.append("    parameters:")
            lines.append(f"      {extra}")
    if dtype:
        lines.append(f"dtype: {dtype}")
    if out_dtype:
        lines.append(f"out_dtype: {out_dtype}")
    if parameters:
        lines.append("parameters:")
        lines.extend(f"  {line}" for line in parameters.strip().splitlines())
    return "\n".join(lines) + "\n"


def inputs_of(written, agents: Iterable[str], cast: Optional[torch.dtype] = None):
    """Stored base and agents (as the files hold them), keyed by absolute path."""
    base = written.stored("base")
    agent_sds = {written.path(a): written.stored(a) for a in agents}
    if cast is not None:
        base = {k: v.to(cast) for k, v in base.items()}
        agent_sds = {p: {k: v.to(cast) for k, v in sd.items()} for p, sd in agent_sds.items()}
    return base, agent_sds


def check_against_reference(run, written, agents, *, eps=1e-5, r=0.1, alpha=2.0, rho=None, cast=None, out_dtype=BF16):
    """Every written tensor has out_dtype and equals the reference up to one rounding: the
    kernel writes `out_dtype` directly, also when `dtype` is narrower (bf16 in, float32 out)."""
    base, agent_sds = inputs_of(written, agents, cast)
    names = list(base)  # every stored tensor (a tied lm_head is not stored)
    ref = R.reference_merge(base, agent_sds, eps, r, alpha, names=names, rho=rho)
    mags = R.reference_magnitudes(base, agent_sds, names)
    assert set(run.tensors) == set(names)
    for name, tensor in run.tensors.items():
        assert tensor.dtype == out_dtype, (name, tensor.dtype)
    R.assert_state_dict_matches(run.tensors, ref, mags)
    return base, agent_sds, ref


def stats_by_path(stats) -> Dict[str, tuple]:
    return {str(k): (s.active, s.shared, s.unique) for k, s in stats.items()}


def stat_of(run, path: str):
    """The pre-pass AgentStats of one model (keys are mergekit ModelReferences)."""
    return next(s for k, s in run.stats.items() if str(k) == path)


def no_nan_written(out_dir) -> None:
    for f in out_dir.glob("*.safetensors"):
        for name, t in models.load_checkpoint(out_dir).items():
            assert not torch.isnan(t).any(), f"NaN written to {f.name}:{name}"


def no_weights_written(out_dir) -> None:
    assert not list(out_dir.glob("*.safetensors")), sorted(p.name for p in out_dir.iterdir())


AGENT_KEYS = {
    "label", "active", "shared", "unique", "shared_with_1", "shared_with_2plus", "numel",
    "density", "unique_share", "shared_with_1_share", "shared_with_2plus_share", "rho_counted", "rho",
    "rho_source", "lambda",
    # diagnostics (format_version 2)
    "single_step", "single_step_share", "magnitude_unique", "magnitude_shared", "magnitude_unique_share",
}


# ---------------------------------------------------------------- closed form


def closed_form(family: models.Family, merged, epsilon: float = 1e-5):
    """From the region sizes alone: per agent (active, unique, pair) per tensor, and totals
    with shared = active - unique, shared_with_1 = pair (exactly one other agent)."""
    per_tensor: Dict[str, Dict[str, list]] = {}
    for name, regions in family.regions.items():
        row = {a: [0, 0, 0] for a in merged}
        for region, members in models.REGIONS.items():
            size = regions[region].numel()
            on = [a for a in merged if a in members and models.magnitude_of(members[a]) > epsilon]
            for a in on:
                row[a][0] += size
                row[a][1] += size if len(on) == 1 else 0
                row[a][2] += size if len(on) == 2 else 0
        per_tensor[name] = row
    numel = sum(t.numel() for t in family.base.values())
    totals = {}
    for a in merged:
        active = sum(r[a][0] for r in per_tensor.values())
        unique = sum(r[a][1] for r in per_tensor.values())
        pair = sum(r[a][2] for r in per_tensor.values())
        rho = (active - unique) / unique if unique else math.inf
        totals[a] = dict(
            active=active, unique=unique, shared=active - unique, shared_with_1=pair,
            shared_with_2plus=active - unique - pair, numel=numel, density=active / numel, rho=rho,
        )
    return per_tensor, totals


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def read_stats(out: Path) -> dict:
    return strict_json((out / "ram_stats.json").read_text(encoding="utf-8"))


def rows_by_model(report: dict) -> dict:
    """input as the config names it -> its row in `agents` (format 4 names agents by label; the inputs table
    maps each label to its input)."""
    return {report["inputs"][row["label"]]["model"]: row for row in report["agents"]}


def model_of(report: dict, label: str) -> str:
    """The input (path or hub id) a report's label stands for."""
    return report["inputs"][label]["model"]


def base_of(report: dict) -> dict:
    """The base's row of the inputs table: role, model, identity."""
    return report["inputs"][report["base_model"]]


def number(value):
    """A JSON rho/lambda back to a float ("inf" is the documented spelling of infinity)."""
    return math.inf if value == "inf" else value


def validate_schema(report: dict, *, counted: bool = True) -> None:
    """The schema documented in mergekit_ram/reporting/report.py (format_version 4)."""
    assert report["format"] == "mergekit-ram/ram_stats"
    assert report["format_version"] == 4
    assert report["merge"]["entry_point"] in ("run_merge", "mergekit-pytorch")
    assert report["method"] == "ramplus"
    params = report["parameters"]
    assert set(params) == {"epsilon", "r", "alpha", "rho_scope", "lambda_rule"}
    assert all(isinstance(params[k], (int, float)) and params[k] >= 0 for k in ("epsilon", "r", "alpha"))
    assert params["rho_scope"] in ("model", "layer", "tensor")
    assert params["lambda_rule"] in ("clip", "soft")
    assert isinstance(report["per_tensor_parameters"], dict)
    assert report["statistics"] in ("computed", "cache", "not computed")
    assert report["versions"] == {
        "mergekit": version("mergekit"), "mergekit-ram": version("mergekit-ram"), "torch": version("torch"),
    }
    inputs = report["inputs"]
    assert list(inputs) == [report["base_model"], *(row["label"] for row in report["agents"])]
    assert [row["role"] for row in inputs.values()] == ["base"] + ["agent"] * len(report["agents"])
    for label, row in inputs.items():
        assert set(row) == {"role", "model", "identity"} and isinstance(row["model"], str), label
        assert HEX64.match(row["identity"]["content_id"]), label
        assert set(row["identity"]) <= {"content_id", "revision"}, label
    assert report["agents"], "no agents"
    for row in report["agents"]:
        if counted:
            assert set(row) == AGENT_KEYS, sorted(set(row) ^ AGENT_KEYS)
            for key in ("active", "shared", "unique", "shared_with_1", "shared_with_2plus", "numel"):
                assert isinstance(row[key], int) and row[key] >= 0, key
            assert row["active"] == row["shared"] + row["unique"]
            assert row["shared"] == row["shared_with_1"] + row["shared_with_2plus"]
            for key in ("density", "unique_share", "shared_with_1_share", "shared_with_2plus_share"):
                assert isinstance(row[key], float) and 0 <= row[key] <= 1, key
            assert row["rho_source"] in ("counted", "given")
            assert row["rho_counted"] == "inf" or isinstance(row["rho_counted"], float)
            assert isinstance(row["single_step"], int) and 0 <= row["single_step"] <= row["active"]
            for key in ("single_step_share", "magnitude_unique_share"):
                assert isinstance(row[key], float) and 0 <= row[key] <= 1, key
            assert row["magnitude_unique"] >= 0 and row["magnitude_shared"] >= 0
        assert row["rho"] is None or row["rho"] == "inf" or isinstance(row["rho"], float)
        assert row["lambda"] is None or isinstance(row["lambda"], float)
    assert ("rho_by_group" in report) == (counted and params["rho_scope"] != "model")
    agents = [a["label"] for a in report["agents"]]
    n = len(agents)
    assert len(report["pairs"]) == (n * (n - 1) // 2 if counted else 0)
    for pair in report["pairs"]:
        assert pair["agents"][0] in agents and pair["agents"][1] in agents
        assert 0 <= pair["same_sign"] <= pair["common"]
        assert pair["same_sign_share"] is None or 0 <= pair["same_sign_share"] <= 1
        assert pair["cosine"] is None or -1 - 1e-12 <= pair["cosine"] <= 1 + 1e-12
    for t in report["tensors"]:
        assert set(t) == {"name", "numel", "epsilon", "counts", "diagnostics"}
        assert set(t["counts"]) == set(agents), t["name"]
        for row in t["counts"].values():
            assert len(row) == 3 and all(isinstance(x, int) and 0 <= x <= t["numel"] for x in row), t["name"]
        assert set(t["diagnostics"]) == {"single", "magnitude", "pairs"}
    if not counted:
        assert report["tensors"] == [] and report["pairs"] == []


# ---------------------------------------------------------------- ram_stats.json


# ---------------------------------------------------------------- mergekit-pytorch (single files)


def flat_config_text(
    flat,
    agents: Sequence[str],
    *,
    fmt: str = "safetensors",
    method: str = "ramplus",
    dtype: Optional[str] = None,
    out_dtype: Optional[str] = None,
    parameters: str = "",
    paths: Optional[Dict[str, str]] = None,
) -> str:
    """A mergekit-pytorch config (models are files) with absolute paths; `paths` overrides a member's file."""
    where = lambda who: (paths or {}).get(who) or flat.path(who, fmt)  # noqa: E731
    lines = [f"merge_method: {method}", f"base_model: {where('base')}", "models:"]
    lines += [f"  - model: {where(a)}" for a in agents]
    if dtype:
        lines.append(f"dtype: {dtype}")
    if out_dtype:
        lines.append(f"out_dtype: {out_dtype}")
    if parameters:
        lines.append("parameters:")
        lines.extend(f"  {line}" for line in parameters.strip().splitlines())
    return "\n".join(lines) + "\n"


def run_flat(text: str, out: Path, *flags: str) -> Dict[str, torch.Tensor]:
    """`mergekit-pytorch CONFIG OUT FLAGS` in this process (mergekit's own `main`, which calls the wrapped
    planner); returns the written tensors."""
    from mergekit.scripts import merge_raw_pytorch

    config = out.parent / f"{out.name}.yaml"
    config.write_text(text, encoding="utf-8")
    merge_raw_pytorch.main.main([str(config), str(out), "--quiet", *flags], standalone_mode=False)
    return models.load_checkpoint(out)


def differing(out: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """tensor -> how many entries differ from the float64 reference rounded once to the output's dtype."""
    assert set(out) == set(ref), sorted(set(out) ^ set(ref))
    found = {}
    for name, tensor in out.items():
        assert tensor.shape == ref[name].shape, name
        found[name] = int((tensor != ref[name].to(tensor.dtype)).sum())
    return {k: v for k, v in found.items() if v}


# ---------------------------------------------------------------- planned tasks


def planner_of(text: str, **options):
    """A MergePlanner of the config `text`, planned by mergekit alone (nothing of ours runs): real planned
    tasks for the seam's unit tests."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_ram._mergekit import planner

    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    return planner.plan(config, MergeOptions(**{"quiet": True, "copy_tokenizer": False, **options}))


# ---------------------------------------------------------------- console scripts


def console_script(name: str) -> str:
    """The console script `name` installed next to this interpreter (the test skips without it)."""
    import pytest

    exe = Path(sys.executable).parent / name
    if not exe.exists():
        pytest.skip(f"the {name} console script is not installed next to this interpreter")
    return str(exe)


# --------------------------------------------------------------------------- #
# The reliability suite's (tests/reliability/): folders watched, what an output holds, configs, faults
# --------------------------------------------------------------------------- #
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
    from mergekit_ram.core import kernel

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


# ---------------------------------------------------------------- the machine


def _has_compiler() -> bool:
    import shutil

    from mergekit_ram.core import native

    found = native.find_compiler()
    return bool(found and shutil.which(found))


HAS_COMPILER = _has_compiler()
NO_COMPILER = "no C compiler ($CC, cc or gcc): the native kernel cannot be built here"
#: tests of the compiled kernel's build itself; without a compiler every merge takes the torch kernel, tested as it is
NEEDS_COMPILER = pytest.mark.skipif(not HAS_COMPILER, reason=NO_COMPILER)
