"""The on-disk statistics cache (mergekit_ram/core/cache.py) through real merges.

conftest turns the cache off for the session; every test here opts in with its
own folder (`cache_dir`). Tensor reads are counted at mergekit's loader
(`LazyTensorLoader.get_tensor`, conftest's `tensor_reads`), so "reads no tensor for
statistics" means: the cached merge reads every input tensor exactly once (the merge pass only), the cold
one exactly twice (pre-pass + merge), and `kernel.count` is never called.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import models
import pytest
import reference as R
import torch
from helpers import check_against_reference, config_text, stats_by_path
from safetensors.torch import save_file

LOGGER = "mergekit_ram"


# ---------------------------------------------------------------- helpers


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "ram-cache"
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(folder))
    return folder


def entries(folder: Path):
    """Files directly in the cache folder (sub-folders, e.g. the compiled native
    kernel's, are not statistics entries)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix == ".json") if folder.exists() else []


def files_under(folder: Path):
    """Every file below `folder` except the compiled native kernel's folder."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "native" not in p.relative_to(folder).parts
    )


def json_entries(folder: Path):
    return [n for n in entries(folder) if n.endswith(".json") and not n.startswith(".")]


def ram_stats(run) -> dict:
    return json.loads((run.out / "ram_stats.json").read_text())


def assert_same_tensors(a, b) -> None:
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def mergekit_ram_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


class Copy:
    """Private copies of some members of a written family (safe to rewrite)."""

    def __init__(self, written, root: Path, who):
        self.family = written.family
        self.paths = {}
        for name in who:
            shutil.copytree(written.paths[name], root / name, copy_function=shutil.copy2)
            self.paths[name] = (root / name).resolve()

    def path(self, who: str) -> str:
        return str(self.paths[who])

    def stored(self, who: str):
        return models.load_checkpoint(self.paths[who])


def forget_open_files() -> None:
    """mergekit's LoaderCache is process-wide and keeps the last shard open; a file
    rewritten between two in-process merges would otherwise be read through the old
    handle (a mergekit-yaml process starts afresh)."""
    from mergekit.io.tasks import LoaderCache

    LoaderCache().flush_all()


# ---------------------------------------------------------------- hits


@pytest.mark.quick
def test_other_r_reuses_counts_and_reads_each_tensor_once(run_yaml, qwen_bf16, cache_dir, tensor_reads, monkeypatch):
    agents = "ABC"
    n_tensors = len(qwen_bf16.family.base)
    cold = run_yaml(config_text(qwen_bf16, agents))
    assert cold.count_calls > 0
    assert len(tensor_reads) == 4 * n_tensors  # base + 3 agents, every tensor
    assert set(tensor_reads.values()) == {2}, "cold: pre-pass + merge read each tensor once each"
    assert ram_stats(cold)["statistics"] == "computed"
    assert len(json_entries(cache_dir)) == 1 and entries(cache_dir) == json_entries(cache_dir)
    cold_keys = set(tensor_reads)

    tensor_reads.clear()
    warm = run_yaml(config_text(qwen_bf16, agents, parameters="r: 0.2"))
    assert warm.count_calls == 0, "the cached merge counted again"
    assert set(tensor_reads) == cold_keys
    assert set(tensor_reads.values()) == {1}, "cached: only the merge pass reads"
    assert ram_stats(warm)["statistics"] == "cache"
    assert stats_by_path(warm.stats) == stats_by_path(cold.stats)
    assert len(json_entries(cache_dir)) == 1  # r is not part of the key

    # the cached run equals a cold run with r = 0.2 without any cache, and the reference
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", "off")
    tensor_reads.clear()
    plain = run_yaml(config_text(qwen_bf16, agents, parameters="r: 0.2"))
    assert plain.count_calls > 0 and set(tensor_reads.values()) == {2}
    assert_same_tensors(warm, plain)
    assert stats_by_path(warm.stats) == stats_by_path(plain.stats)
    check_against_reference(warm, qwen_bf16, agents, r=0.2)
    warm_report, plain_report = ram_stats(warm), ram_stats(plain)
    assert warm_report.pop("statistics") == "cache" and plain_report.pop("statistics") == "computed"
    assert warm_report == plain_report


@pytest.mark.quick
def test_what_changes_the_key(run_yaml, qwen_bf16, cache_dir):
    """r and rho_scope reuse the counts; epsilon, dtype and the set of models do not."""
    first = run_yaml(config_text(qwen_bf16, "ABC"))
    assert first.count_calls > 0 and len(json_entries(cache_dir)) == 1

    layer = run_yaml(config_text(qwen_bf16, "ABC", parameters="r: 0.3\nrho_scope: layer"))
    assert layer.count_calls == 0 and len(json_entries(cache_dir)) == 1
    base, agent_sds = qwen_bf16.stored("base"), {qwen_bf16.path(a): qwen_bf16.stored(a) for a in "ABC"}
    ref = R.reference_merge(base, agent_sds, 1e-5, 0.3, 2.0, names=list(base), rho_scope="layer")
    R.assert_state_dict_matches(layer.tensors, ref, R.reference_magnitudes(base, agent_sds, list(base)))

    misses = [
        ("epsilon", config_text(qwen_bf16, "ABC", parameters="epsilon: 1e-3")),
        ("dtype", config_text(qwen_bf16, "ABC", dtype="float32", out_dtype="bfloat16")),
        ("models", config_text(qwen_bf16, "AB")),
        ("another agent", config_text(qwen_bf16, "ABD")),
    ]
    for i, (what, text) in enumerate(misses, start=2):
        run = run_yaml(text)
        assert run.count_calls > 0, f"changing {what} hit the cache"
        assert ram_stats(run)["statistics"] == "computed", what
        assert len(json_entries(cache_dir)) == i, what
        again = run_yaml(text)
        assert again.count_calls == 0 and ram_stats(again)["statistics"] == "cache", what
        assert_same_tensors(run, again)
    # epsilon really changed the counts (the `mid` regions go inactive at 1e-3)
    eps_run = run_yaml(misses[0][1])
    closed = qwen_bf16.family.expected_counts("ABC", epsilon=1e-3)
    assert stats_by_path(eps_run.stats) == {qwen_bf16.path(a): closed[a] for a in "ABC"}


# ---------------------------------------------------------------- invalidation


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewritten", "rewritten-mtime-restored"])
def test_rewritten_agent_invalidates(run_yaml, qwen_bf16, cache_dir, tmp_path, keep_mtime):
    """A new model.safetensors in an agent's folder (same size, same names; with
    `keep_mtime` also the old mtime, as `cp -p` leaves it) is counted again."""
    w = Copy(qwen_bf16, tmp_path / "models", ("base", "A", "B"))
    text = config_text(w, "AB")
    before = run_yaml(text)
    assert before.count_calls > 0
    assert stats_by_path(before.stats)[w.path("A")] == qwen_bf16.family.expected_counts("AB")["A"]

    # A now also changes the entries of one tensor that were unique to B: they become shared
    fam = qwen_bf16.family
    name = "model.layers.0.mlp.up_proj.weight"
    idx = fam.regions[name]["B"].tolist()
    n = len(idx)
    assert n >= 10
    new_a = models.perturb(fam.agents["A"], {name: {i: 0.03125 for i in idx}})
    target = w.paths["A"] / "model.safetensors"
    st = os.stat(target)
    save_file({k: v.contiguous() for k, v in new_a.items()}, str(target), metadata={"format": "pt"})
    assert os.stat(target).st_size == st.st_size
    if keep_mtime:
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(target).st_mtime_ns == st.st_mtime_ns
    forget_open_files()

    after = run_yaml(text)
    assert after.count_calls > 0, "statistics of the old file were reused"
    assert ram_stats(after)["statistics"] == "computed"
    assert len(json_entries(cache_dir)) == 2
    old_a, old_b = qwen_bf16.family.expected_counts("AB").values()
    got = stats_by_path(after.stats)
    assert got[w.path("A")] == (old_a[0] + n, old_a[1] + n, old_a[2])
    assert got[w.path("B")] == (old_b[0], old_b[1] + n, old_b[2] - n)
    base, agent_sds, _ = check_against_reference(after, w, "AB")
    assert torch.equal(agent_sds[w.path("A")][name], new_a[name])  # the reference saw the new file
    ref_stats = R.reference_stats(base, agent_sds, names=list(base))
    assert got == {p: (s.active, s.shared, s.unique) for p, s in ref_stats.items()}


# ---------------------------------------------------------------- corrupt entries


def _truncate(entry_text: str, _entry: dict) -> str:
    return entry_text[: len(entry_text) // 2]


def _short_row(_text, entry):
    entry["tensors"][3]["counts"][next(iter(entry["tensors"][3]["counts"]))] = [1, 2]
    return json.dumps(entry)


def _count_above_numel(_text, entry):
    t = entry["tensors"][0]
    t["counts"][next(iter(t["counts"]))][0] = t["numel"] + 1
    return json.dumps(entry)


def _float_counts(_text, entry):
    t = entry["tensors"][0]
    t["counts"][next(iter(t["counts"]))] = [1.5, 0, 0]
    return json.dumps(entry)


CORRUPT = {
    "truncated": _truncate,
    "empty-file": lambda _t, _e: "",
    "counts-row-of-2": _short_row,
    "count-above-numel": _count_above_numel,
    "float-counts": _float_counts,
    "foreign-object": lambda _t, _e: json.dumps({"model_type": "qwen2", "hidden_size": 32}),
    "foreign-list": lambda _t, _e: json.dumps([1, 2, 3]),
    "json-null": lambda _t, _e: "null",
    "other-format": lambda _t, e: json.dumps({**e, "format": 999}),
    "other-key": lambda _t, e: json.dumps({**e, "key": "0" * 64}),
    "binary-garbage": lambda _t, _e: "\x00\xff" * 50,
}


def _corrupt_then_merge(run_yaml, written, cache_dir, caplog, corrupt, agents="AB"):
    text = config_text(written, agents)
    cold = run_yaml(text)
    (entry_path,) = [cache_dir / n for n in json_entries(cache_dir)]
    good_text = entry_path.read_text()
    entry_path.write_text(corrupt(good_text, json.loads(good_text)), encoding="utf-8")
    caplog.clear()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    again = run_yaml(text)
    return cold, again, entry_path, good_text


@pytest.mark.parametrize("how", list(CORRUPT))
def test_corrupt_entry_warns_recomputes_and_is_rewritten(run_yaml, qwen_bf16, cache_dir, caplog, how):
    from mergekit_ram.core import cache

    cold, again, entry_path, good_text = _corrupt_then_merge(run_yaml, qwen_bf16, cache_dir, caplog, CORRUPT[how])
    warnings = mergekit_ram_warnings(caplog)
    assert any("statistics cache entry" in m and str(entry_path) in m for m in warnings), warnings
    assert again.count_calls > 0
    assert ram_stats(again)["statistics"] == "computed"
    assert_same_tensors(again, cold)
    assert stats_by_path(again.stats) == stats_by_path(cold.stats)
    # a valid entry is back, the same as the first one, and serves the next merge
    assert entries(cache_dir) == [entry_path.name]
    assert json.loads(entry_path.read_text()) == json.loads(good_text)
    assert cache.load(entry_path.stem) is not None
    third = run_yaml(config_text(qwen_bf16, "AB"))
    assert third.count_calls == 0


def _drop_agents(_text, entry):
    del entry["agents"]
    return json.dumps(entry)


def _rename_agents_in_counts(_text, entry):
    for t in entry["tensors"]:
        t["counts"] = {a + "-renamed": c for a, c in t["counts"].items()}
    return json.dumps(entry)


def _drop_first_tensor(_text, entry):
    entry["tensors"] = entry["tensors"][1:]
    return json.dumps(entry)


@pytest.mark.parametrize("how", [_drop_agents, _rename_agents_in_counts], ids=["no-agents", "foreign-agent-keys"])
def test_entry_with_inconsistent_agents_is_recomputed(run_yaml, qwen_bf16, cache_dir, caplog, how):
    cold, again, entry_path, good_text = _corrupt_then_merge(run_yaml, qwen_bf16, cache_dir, caplog, how)
    assert any("statistics cache entry" in m for m in mergekit_ram_warnings(caplog))
    assert again.count_calls > 0
    assert stats_by_path(again.stats) == stats_by_path(cold.stats)
    assert json.loads(entry_path.read_text()) == json.loads(good_text)


def test_entry_missing_a_tensor_is_not_trusted(run_yaml, qwen_bf16, cache_dir, caplog):
    cold, again, entry_path, good_text = _corrupt_then_merge(run_yaml, qwen_bf16, cache_dir, caplog, _drop_first_tensor)
    assert stats_by_path(again.stats) == stats_by_path(cold.stats)
    assert again.count_calls > 0


# ---------------------------------------------------------------- concurrency

_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import yaml
    import mergekit_ram  # noqa: F401
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config_file, out, ready, go = sys.argv[1:5]
    config = MergeConfiguration.model_validate(yaml.safe_load(open(config_file).read()))
    open(ready, "w").close()
    deadline = time.time() + 600
    while not os.path.exists(go):
        if time.time() > deadline:
            sys.exit("never told to start")
        time.sleep(0.002)
    run_merge(config, out, options=MergeOptions(copy_tokenizer=False, quiet=True))
    """
)


def test_two_processes_merging_at_once_share_one_entry(merged, qwen_bf16, cache_dir, tmp_path, monkeypatch):
    from mergekit_ram.core import cache

    text = config_text(qwen_bf16, "ABC")
    cfg = tmp_path / "ramplus.yml"
    cfg.write_text(text)
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    go = tmp_path / "go"
    # MERGEKIT_RAM_NATIVE=0: two fresh processes would otherwise each compile the
    # optional C kernel into this fresh cache folder first (seconds); same counts either way
    env = {**os.environ, "MERGEKIT_RAM_CACHE": str(cache_dir), "MERGEKIT_RAM_NATIVE": "0"}
    procs = []
    for i in range(2):
        args = [sys.executable, str(script), str(cfg), str(tmp_path / f"out{i}"), str(tmp_path / f"ready{i}"), str(go)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.time() + 600  # bounds against a hang, not speed checks
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.time() < deadline, "workers did not start"
            time.sleep(0.01)
        go.touch()  # both have imported everything: the merges (and cache writes) overlap
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    assert entries(cache_dir) == json_entries(cache_dir), "temp files left behind"
    (name,) = json_entries(cache_dir)
    entry = cache.load(Path(name).stem)
    assert entry is not None
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", "off")
    one = models.load_checkpoint(tmp_path / "out0")
    two = models.load_checkpoint(tmp_path / "out1")
    inproc = merged(text).tensors  # the same config without a cache
    for tensor in inproc:
        assert torch.equal(one[tensor], inproc[tensor]) and torch.equal(two[tensor], inproc[tensor]), tensor
    # and the entry holds the closed-form counts
    closed = qwen_bf16.family.expected_counts("ABC")
    totals = collections.defaultdict(lambda: [0, 0])
    for t in entry["tensors"]:
        for agent, (active, unique, _pair) in t["counts"].items():
            totals[agent][0] += active
            totals[agent][1] += unique
    assert {a: tuple(v) for a, v in totals.items()} == {
        qwen_bf16.path(a): (closed[a][0], closed[a][2]) for a in "ABC"
    }


def test_concurrent_store_and_load_from_threads(cache_dir, caplog):
    from mergekit_ram.core import cache

    caplog.set_level(logging.WARNING, logger=LOGGER)
    agents = ["a", "b"]
    tensors = [
        {"name": f"layers.{i}.w", "numel": 4096, "epsilon": 1e-5, "counts": {"a": [i, 0, i], "b": [2 * i, i, 0]}}
        for i in range(400)
    ]
    shared_key = hashlib.sha256(b"one key").hexdigest()
    own_keys = [hashlib.sha256(f"key {i}".encode()).hexdigest() for i in range(4)]
    seen, errors = [], []
    stop = threading.Event()

    def writer(i):
        try:
            for _ in range(10):
                assert cache.store(shared_key, agents, tensors) == cache_dir / f"{shared_key}.json"
            cache.store(own_keys[i], agents, tensors)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def reader():
        while not stop.is_set():
            got = cache.load(shared_key)
            seen.append(None if got is None else (got["key"], len(got["tensors"])))

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(json_entries(cache_dir)) == sorted(f"{k}.json" for k in [shared_key, *own_keys])
    assert entries(cache_dir) == json_entries(cache_dir), "temp files left behind"
    # a reader sees nothing or a whole entry, never half of one
    assert set(seen) <= {None, (shared_key, 400)}
    assert not mergekit_ram_warnings(caplog), mergekit_ram_warnings(caplog)
    entry = cache.load(shared_key)
    assert entry["agents"] == agents and entry["tensors"] == tensors


# ---------------------------------------------------------------- location and switches


@pytest.mark.parametrize("value", ["off", "OFF", "0"])
def test_cache_off_writes_nothing(run_yaml, qwen_bf16, tmp_path, monkeypatch, value):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    first = run_yaml(config_text(qwen_bf16, "AB"))
    second = run_yaml(config_text(qwen_bf16, "AB"))
    assert first.count_calls > 0 and second.count_calls > 0
    assert ram_stats(second)["statistics"] == "computed"
    assert files_under(tmp_path) == []  # nothing in the default place, the home or the working folder


def test_default_location_follows_xdg_cache_home(run_yaml, qwen_bf16, tmp_path, monkeypatch):
    monkeypatch.delenv("MERGEKIT_RAM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_yaml(config_text(qwen_bf16, "AB"))
    assert len(json_entries(tmp_path / "xdg" / "mergekit-ram")) == 1
    assert run_yaml(config_text(qwen_bf16, "AB")).count_calls == 0


@pytest.mark.quick
def test_unwritable_cache_only_warns(run_yaml, merged, qwen_bf16, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(blocker / "cache"))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run = run_yaml(config_text(qwen_bf16, "ABC"))
    warnings = mergekit_ram_warnings(caplog)
    assert any("could not write the statistics cache" in m for m in warnings), warnings
    assert run.count_calls > 0 and (run.out / "ram_stats.json").exists()
    assert blocker.read_text() == "not a folder"
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", "off")
    assert_same_tensors(run, merged(config_text(qwen_bf16, "ABC")))


def test_unusable_cache_folder_does_not_claim_a_corrupt_entry(run_yaml, qwen_bf16, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(blocker / "cache"))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run_yaml(config_text(qwen_bf16, "AB"))
    warnings = mergekit_ram_warnings(caplog)
    assert not any("unreadable statistics cache entry" in m for m in warnings), warnings


def test_an_entry_of_the_format_before_diagnostics_is_recounted_never_misread(run_yaml, qwen_bf16, cache_dir, monkeypatch):
    """Format 2 held counts without diagnostics. Its entries have other keys (the format is part of
    the key), and one placed at today's key is refused: the merge recounts and reports diagnostics."""
    from mergekit_ram.core import cache

    parts = {"models": {"a": 1}}
    assert cache.key(parts) != (monkeypatch.setattr(cache, "FORMAT", 2) or cache.key(parts))
    monkeypatch.undo()
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(cache_dir))
    cold = run_yaml(config_text(qwen_bf16, "AB"))
    (name,) = entries(cache_dir)
    entry = json.loads((cache_dir / name).read_text())
    for t in entry["tensors"]:
        del t["diagnostics"]
    entry["format"] = 2
    entry["mac"] = cache._mac(cache.secret(cache_dir), entry["key"], entry["agents"], entry["tensors"])
    (cache_dir / name).write_text(json.dumps(entry))
    again = run_yaml(config_text(qwen_bf16, "AB"))
    assert again.count_calls > 0
    report = ram_stats(again)
    assert report["statistics"] == "computed" and len(report["pairs"]) == 1
    assert ram_stats(cold)["pairs"] == report["pairs"]
