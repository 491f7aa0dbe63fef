"""Shared fixtures: tiny checkpoints built once per session, and a mergekit runner."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The statistics cache would let one test's counts serve another's and would
# write into the user's cache folder: off by default, cache tests opt in.
import os  # noqa: E402

import models  # noqa: E402
import zygote  # noqa: E402
from reliability import harness as _reliability  # noqa: E402

import mergekit_ram  # noqa: E402,F401  (registers `ramplus` and the pre-pass)

os.environ["MERGEKIT_RAM_CACHE"] = "off"


def pytest_runtest_logreport(report):
    _reliability.logreport(report)  # counts for RELIABILITY.md (tests/reliability/harness.py)


def pytest_terminal_summary(terminalreporter):
    _reliability.finish(terminalreporter)
    if any(zygote.counts.values()):  # this process's (under pytest-xdist the workers' are not summed: none shown)
        terminalreporter.write_line(
            f"commands: {zygote.counts['forked']} forked from a warm interpreter, {zygote.counts['started']} started "
            "for real (tests/zygote.py)"
        )


def pytest_configure(config):
    # mergekit's own import-time noise, not ours
    config.addinivalue_line("filterwarnings", "ignore:numpy.core is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True, scope="session")
def _forked_commands():
    """`subprocess.run` of a console script forks a warm interpreter instead of starting one (tests/zygote.py)."""
    import subprocess

    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess, "run", zygote.run)
    yield
    mp.undo()
    zygote.stop_all()


def pytest_runtest_setup(item):
    # the tests that check what only a real start shows: the start-up hook, one start per door, ...
    zygote.real_only = item.get_closest_marker("real_process") is not None


@dataclass
class Written:
    """A model family on disk: in-memory state dicts and absolute folder paths."""

    family: models.Family
    paths: Dict[str, Path]

    def path(self, who: str) -> str:
        return str(self.paths[who])

    def stored(self, who: str) -> Dict[str, torch.Tensor]:
        return models.load_checkpoint(self.paths[who])


@pytest.fixture(scope="session")
def qwen_bf16(tmp_path_factory) -> Written:
    """Qwen2 (q/k/v biases), untied, bfloat16: base, A, B, C, Z (= base)."""
    fam = models.Family("qwen2", tied=False, dtype=torch.bfloat16, seed=1)
    root = tmp_path_factory.mktemp("qwen_bf16")
    paths = models.write_family(root, fam)
    # an agent with a NaN (only ever read, to check the error)
    nan_sd = {k: v.clone() for k, v in fam.agents["A"].items()}
    nan_sd["model.layers.1.mlp.down_proj.weight"].view(-1)[7] = float("nan")
    config = models.make_config("qwen2", False, torch.bfloat16)
    paths["NAN"] = models.write_checkpoint(root / "NAN", config, nan_sd).resolve()
    return Written(fam, paths)


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory) -> Written:
    """Llama with tied embeddings (no lm_head.weight in the files), bfloat16."""
    fam = models.Family("llama", tied=True, dtype=torch.bfloat16, seed=2)
    root = tmp_path_factory.mktemp("llama_tied")
    return Written(fam, models.write_family(root, fam, ("base", "A", "B", "C")))


@pytest.fixture(scope="session")
def llama_sharded(tmp_path_factory) -> Written:
    """Untied Llama, bfloat16; base and A in two shards with an index, B single-file."""
    fam = models.Family("llama", tied=False, dtype=torch.bfloat16, seed=3)
    root = tmp_path_factory.mktemp("llama_sharded")
    paths = models.write_family(root, fam, ("base", "A", "B"), shards={"base": 2, "A": 2})
    assert (paths["base"] / "model.safetensors.index.json").exists()
    return Written(fam, paths)


@pytest.fixture(scope="session")
def qwen_fp32(tmp_path_factory) -> Written:
    """Qwen2 untied, float32 storage: base, A, B, C."""
    fam = models.Family("qwen2", tied=False, dtype=torch.float32, seed=4)
    root = tmp_path_factory.mktemp("qwen_fp32")
    return Written(fam, models.write_family(root, fam, ("base", "A", "B", "C")))


@dataclass
class Flat:
    """A policy family as single files for `mergekit-pytorch`: fmt ("safetensors", "pt") -> member -> file."""

    family: models.Family
    files: Dict[str, Dict[str, Path]]
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)  # non-float buffers in every file

    def path(self, who: str, fmt: str = "safetensors") -> str:
        return str(self.files[fmt][who])

    def stored(self, who: str, fmt: str = "safetensors") -> Dict[str, torch.Tensor]:
        return models.load_flat(self.files[fmt][who])


def _flat(root: Path, family: models.Family, extra: Optional[Dict[str, torch.Tensor]] = None) -> Flat:
    files = {fmt: models.write_flat(root / fmt, family, fmt=fmt, extra=extra) for fmt in ("safetensors", "pt")}
    return Flat(family, files, dict(extra or {}))


@pytest.fixture(scope="session")
def flat_mlp(tmp_path_factory) -> Flat:
    """An MLP actor-critic (pi.*, v.*, log_std), bfloat16: base, A, B, C as .safetensors and as .pt files."""
    fam = models.Family("mlp", tied=False, dtype=torch.bfloat16, seed=11, shapes=models.MLP_SHAPES)
    return _flat(tmp_path_factory.mktemp("flat_mlp"), fam)


@pytest.fixture(scope="session")
def flat_cnn(tmp_path_factory) -> Flat:
    """A small CNN (4-D conv weights, batch norm with an int64 `num_batches_tracked`), float32: base, A, B, C
    as .safetensors and as .pt files."""
    fam = models.Family("cnn", tied=False, dtype=torch.float32, seed=12, shapes=models.CNN_SHAPES)
    return _flat(tmp_path_factory.mktemp("flat_cnn"), fam, {"bn.num_batches_tracked": torch.tensor(1000)})


@dataclass
class MergeRun:
    out: Path
    tensors: Dict[str, torch.Tensor]
    config: Dict[str, Any]
    stats: Optional[Dict[Any, Any]]  # what the pre-pass returned (None: no pre-pass work)
    prepass_calls: int
    count_calls: int
    files: List[str] = field(default_factory=list)


def _run(text: str, out: Path, options: Optional[Dict[str, Any]] = None) -> MergeRun:
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from mergekit_ram._mergekit import pipeline
    from mergekit_ram.core import kernel

    record = {"stats": None, "prepass": 0, "count": 0}
    real_run, real_count, real_diagnose = pipeline.prepare, kernel.count, kernel.diagnose

    def spy_run(planner, current):
        record["prepass"] += 1
        real_run(planner, current)
        record["stats"] = current.stats.totals() if current.stats is not None else None

    def spy_count(*args, **kwargs):
        record["count"] += 1
        return real_count(*args, **kwargs)

    def spy_diagnose(*args, **kwargs):  # the statistics pass counts with its diagnostics
        record["count"] += 1
        return real_diagnose(*args, **kwargs)

    opts = dict(copy_tokenizer=False, quiet=True, write_model_card=True)
    opts.update(options or {})
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(pipeline, "prepare", spy_run)
        mp.setattr(kernel, "count", spy_count)  # wraps a test's own replacement too
        mp.setattr(kernel, "diagnose", spy_diagnose)
        config = MergeConfiguration.model_validate(yaml.safe_load(text))
        run_merge(config, str(out), options=MergeOptions(**opts))
    finally:
        mp.undo()
    with open(out / "config.json") as fp:
        cfg = json.load(fp)
    return MergeRun(
        out=out,
        tensors=models.load_checkpoint(out),
        config=cfg,
        stats=record["stats"],
        prepass_calls=record["prepass"],
        count_calls=record["count"],
        files=sorted(p.name for p in out.iterdir()),
    )


@pytest.fixture
def run_yaml(tmp_path_factory):
    """run_yaml(text, out=None, **options) -> MergeRun, by default in a fresh output folder."""

    def runner(text: str, out: Optional[Path] = None, **options) -> MergeRun:
        return _run(text, out if out is not None else tmp_path_factory.mktemp("out"), options)

    return runner


@pytest.fixture(scope="session")
def merged(tmp_path_factory):
    """Like run_yaml, cached by config text for the whole session (outputs are reused)."""
    cache: Dict[str, MergeRun] = {}

    def runner(text: str) -> MergeRun:
        if text not in cache:
            cache[text] = _run(text, tmp_path_factory.mktemp("merged"))
        return cache[text]

    return runner


@pytest.fixture
def tensor_reads(monkeypatch):
    """collections.Counter of (model folder, tensor name) -> how often mergekit's loader
    (LazyTensorLoader.get_tensor) read it during the test; .clear() between runs."""
    import collections
    import os

    from mergekit.io.lazy_tensor_loader import LazyTensorLoader

    from mergekit_ram._mergekit import loading

    # fast loading checks mergekit's loader by its source once per process: installed first, it never sees the spy
    # (the first merge of a process under this spy left mergekit's own loading for every later test)
    loading.install()
    counter: collections.Counter = collections.Counter()
    real = LazyTensorLoader.get_tensor

    def spy(self, key, *args, **kwargs):
        counter[(os.path.realpath(self.index.base_path), key)] += 1
        return real(self, key, *args, **kwargs)

    monkeypatch.setattr(LazyTensorLoader, "get_tensor", spy)
    return counter
