"""With mergekit-ram broken in each way the suite can break it, mergekit's own methods
still run and give exactly mergekit's own results.

mergekit's own results come from one fresh interpreter with the plugin switched off
(`MERGEKIT_RAM_DISABLE=1`); each broken variant then merges in this process, with the
plugin loaded, and must give the same bytes. Older cases counted here:
tests/test_finder.py (unimportable or raising registration, an incompatible mergekit,
another plugin owning the name `ramplus`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import models
import pytest
import torch
from helpers import HAS_COMPILER, NO_COMPILER, config_yaml

from mergekit_ram._mergekit import loading, pipeline
from mergekit_ram.checks import config_checks, input_checks
from mergekit_ram.core import native
from mergekit_ram.reporting import card

METHODS = {
    "linear": {"weight": 0.5},
    "task_arithmetic": {"weight": 0.7},
}


def _config(qwen, method):
    agents = [qwen.path("A"), qwen.path("B")]
    text = config_yaml(qwen.path("base"), agents, method=method, dtype="bfloat16")
    data = __import__("yaml").safe_load(text)
    for entry in data["models"]:
        entry["parameters"] = METHODS[method]
    if method == "linear":
        data["models"].insert(0, {"model": qwen.path("base"), "parameters": {"weight": 0.5}})
        del data["base_model"]
    return __import__("yaml").safe_dump(data)


@pytest.fixture(scope="module")
def mergekits_own(qwen_bf16, tmp_path_factory):
    """method -> tensors, merged by mergekit alone (plugin disabled) in a fresh interpreter."""
    root = tmp_path_factory.mktemp("mergekit-own")
    jobs = {}
    for method in METHODS:
        (root / f"{method}.yml").write_text(_config(qwen_bf16, method))
        jobs[method] = [str(root / f"{method}.yml"), str(root / method)]
    script = textwrap.dedent(
        """
        import json, sys, yaml
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions
        assert "mergekit_ram" not in sys.modules
        for config, out in json.loads(sys.argv[1]).values():
            run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(config).read())), out,
                      options=MergeOptions(copy_tokenizer=False, quiet=True))
        assert "mergekit_ram" not in sys.modules
        """
    )
    env = {**os.environ, "MERGEKIT_RAM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(jobs)], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {method: models.load_checkpoint(root / method) for method in METHODS}


def _compiler_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_failed", None)


def _planted_library(monkeypatch, tmp_path):
    _compiler_fails(monkeypatch, tmp_path)
    monkeypatch.delenv("CC")
    if not HAS_COMPILER:
        pytest.skip(NO_COMPILER)  # where the library would lie depends on the compiler
    target = native.target()
    target.parent.mkdir(parents=True, mode=0o700)
    target.write_bytes(b"planted")
    os.chmod(target, 0o777)


def _corrupt_cache(monkeypatch, tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    for i in range(3):
        (folder / f"{i:064x}.json").write_text("{not json")
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(folder))


def _cache_is_a_file(monkeypatch, tmp_path):
    (tmp_path / "blocker").write_text("x")
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "blocker" / "cache"))


def _raises(*_args, **_kwargs):
    raise RuntimeError("mergekit-ram is broken (simulated)")


BREAKERS = {
    "compiler-fails": _compiler_fails,
    "planted-library": _planted_library,
    "corrupt-world-writable-cache": _corrupt_cache,
    "cache-path-unusable": _cache_is_a_file,
    "statistics-pass-raises": lambda m, _t: m.setattr(pipeline, "prepare", _raises),
    "config-checks-raise": lambda m, _t: (
        m.setattr(config_checks, "check_config", _raises),
        m.setattr(input_checks, "check_input_files", _raises),
    ),
    "fast-loading-raises": lambda m, _t: m.setattr(loading, "install", _raises),
    "card-section-raises": lambda m, _t: m.setattr(card, "card_section", _raises),
    "stats-writer-raises": lambda m, _t: m.setattr(pipeline, "write_statistics", _raises),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_mergekit_methods_unaffected(rel, qwen_bf16, mergekits_own, run_yaml, monkeypatch, tmp_path, breaker, method):
    rel.fault()
    rel.watch(*qwen_bf16.paths.values())
    BREAKERS[breaker](monkeypatch, tmp_path)
    run = run_yaml(_config(qwen_bf16, method))
    theirs = mergekits_own[method]
    try:
        assert set(run.tensors) == set(theirs)
        for name, tensor in theirs.items():
            assert run.tensors[name].dtype == tensor.dtype and torch.equal(run.tensors[name], tensor), name
    except AssertionError:
        rel.case.wrong_merges += 1
        raise
    rel.case.merges_compared += 1
    assert "ram_stats.json" not in run.files


FOREIGN = textwrap.dedent(
    """
    import json, sys, torch
    import mergekit.merge_methods as m

    # another package (a mergekit fork) registers its own `ramplus` before mergekit-ram loads
    @m.merge_method(name="ramplus", pretty_name="a fork's RAM+")
    def forks_ramplus(group: m.TensorGroup) -> torch.Tensor:
        return group.entries[0].tensor

    m.register(forks_ramplus)
    import mergekit_ram, mergekit.plan
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    import yaml
    config, out, inspect_config = sys.argv[1:]
    result = {}
    try:
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(config).read())), out,
                  options=MergeOptions(copy_tokenizer=False, quiet=True))
        result["merge"] = None
    except Exception as error:
        result["merge"] = f"{type(error).__name__}: {error}"
    from mergekit_ram import cli
    result["inspect_rc"] = cli.main(["inspect", inspect_config, "--quiet"])
    print(json.dumps(result))
    """
)


@pytest.mark.quick
def test_ramplus_owned_by_another_package_is_refused(rel, qwen_bf16, tmp_path):
    """A `ramplus` registered first by another package: neither a merge nor `inspect` runs that
    method under our name; both say which module owns the name and what to do."""
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")]))
    out = tmp_path / "merged"
    rel.watch(*qwen_bf16.paths.values())
    env = {**os.environ, "MERGEKIT_RAM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "MERGEKIT_RAM_CACHE": "off"}
    proc = subprocess.run(
        [sys.executable, "-c", FOREIGN, str(config), str(out), str(config)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["merge"] is not None, "the other package's ramplus merged under our name"
    rel.names(result["merge"], "registered by __main__", "not by mergekit-ram", "MERGEKIT_RAM_DISABLE=1")
    assert not out.exists() or not list(out.iterdir()), sorted(p.name for p in out.iterdir())
    assert result["inspect_rc"] == 2
    rel.names(proc.stderr, "mergekit-ram inspect: error", "registered by __main__", "MERGEKIT_RAM_DISABLE=1")
