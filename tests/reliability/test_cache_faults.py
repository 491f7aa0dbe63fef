"""The statistics cache: hand-edited, foreign-owned, special-file and unwritable entries, a
full disk while writing one, and inputs rewritten behind its back.

Decided behaviour: the cache can only ever save time. An entry that is not exactly what
this user's mergekit-ram wrote for these inputs is ignored with a warning naming it and
recomputed; a cache that cannot be written is a warning; every merge equals a fresh
count's (the float64 reference). Older cases counted here: tests/test_cache.py
(eleven kinds of corrupt, truncated and foreign-version entries, inconsistent entries,
two processes and four threads sharing one cache, an unwritable cache folder, an agent
rewritten in place with its mtime restored).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import models
import pytest
from helpers import config_yaml, copy_models, full_disk, inputs
from safetensors.torch import load_file, save_file

LOGGER = "mergekit_ram"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "ram-cache"
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(folder))
    return folder


def _entries(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith(".json") and not p.name.startswith("."))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def _cold(run_yaml, qwen, cache_dir):
    agents = [qwen.path("A"), qwen.path("B"), qwen.path("C")]
    text = config_yaml(qwen.path("base"), agents)
    cold = run_yaml(text)
    assert cold.count_calls > 0
    (entry,) = _entries(cache_dir)
    return text, agents, entry


def _swap_counts(entry: dict) -> dict:
    for t in entry["tensors"]:
        a, b = list(t["counts"])[:2]
        t["counts"][a], t["counts"][b] = t["counts"][b], t["counts"][a]
    return entry


def _chown_other(path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 65534, 65534)


def _dev_zero(path):
    path.unlink()
    path.symlink_to("/dev/zero")


def _directory(path):
    path.unlink()
    path.mkdir()


EDITS = {
    # name: (edit(path), recomputed?, words of the warning)
    "hand-edited-counts": (
        lambda p: p.write_text(json.dumps(_swap_counts(json.loads(p.read_text())))),
        True,
        "checksum",
    ),
    "owned-by-another-user": (_chown_other, True, "uid 65534"),
    "symlink-to-dev-zero": (_dev_zero, True, "regular file"),
    "a-directory": (_directory, True, "statistics cache entry"),
    "pretty-printed-same-content": (
        lambda p: p.write_text(json.dumps(json.loads(p.read_text()), indent=2)),
        False,
        None,
    ),
}


@pytest.mark.parametrize("how", list(EDITS))
def test_edited_entry(rel, qwen_bf16, run_yaml, cache_dir, caplog, how):
    rel.watch(*qwen_bf16.paths.values())
    text, agents, entry = _cold(run_yaml, qwen_bf16, cache_dir)
    edit, recomputed, words = EDITS[how]
    edit(entry)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run = run_yaml(text)
    warnings = _warnings(caplog)
    if recomputed:
        assert run.count_calls > 0, "an edited entry was trusted"
        assert any(str(entry) in m and words in m for m in warnings), warnings
        rel.names(next(m for m in warnings if str(entry) in m), entry, words)
    else:
        assert run.count_calls == 0 and not warnings, warnings
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))


@pytest.mark.quick
def test_full_disk_while_writing_an_entry(rel, qwen_bf16, run_yaml, cache_dir, caplog, monkeypatch):
    rel.fault()
    rel.watch(*qwen_bf16.paths.values())
    cache_dir.mkdir()
    hit = full_disk(monkeypatch, cache_dir)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents))
    assert hit, "the fault was not injected"
    message = next(m for m in _warnings(caplog) if "could not write the statistics cache" in m)
    rel.names(message, cache_dir, "No space left on device")
    left = [p.name for p in cache_dir.iterdir() if p.is_file() and p.name != "secret.key"]  # the key: 32 bytes, whole
    assert left == [], "a partial entry or temp file was left"
    assert json.loads((run.out / "ram_stats.json").read_text())["statistics"] == "computed"
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))


@pytest.mark.quick
def test_cache_folder_is_a_dangling_symlink(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch, caplog):
    link = tmp_path / "cache-link"
    link.symlink_to(tmp_path / "nowhere" / "cache")
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(link))
    rel.watch(*qwen_bf16.paths.values())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents))
    rel.names(next(m for m in _warnings(caplog) if "statistics cache" in m), link)
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))


def test_agent_replaced_by_rename_with_mtime_restored(rel, qwen_bf16, run_yaml, cache_dir, tmp_path):
    """`mv new old` (a new inode) with the old size and mtime: counted afresh, never stale."""
    copies = copy_models({k: qwen_bf16.paths[k] for k in ("base", "A", "B")}, tmp_path / "m")
    agents = [copies["A"], copies["B"]]
    text = config_yaml(copies["base"], agents)
    run_yaml(text)
    fam = qwen_bf16.family
    name = "model.layers.1.mlp.gate_proj.weight"
    idx = fam.regions[name]["B"].tolist()  # entries unique to B become shared with A
    target = copies["A"] / "model.safetensors"
    st = os.stat(target)
    fresh = tmp_path / "new.safetensors"
    save_file(
        models.perturb(fam.agents["A"], {name: dict.fromkeys(idx, 0.03125)}), str(fresh), metadata={"format": "pt"}
    )
    assert os.stat(fresh).st_size == st.st_size
    shutil.move(str(fresh), str(target))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    from mergekit.io.tasks import LoaderCache

    LoaderCache().flush_all()  # in-process only: a new mergekit-yaml starts without open files
    rel.watch(*copies.values())
    after = run_yaml(text)
    assert after.count_calls > 0, "statistics of the replaced file were reused"
    rel.matches_reference(after.tensors, *inputs(copies["base"], agents))


def test_shard_in_a_sub_folder_rewritten_in_place(rel, qwen_bf16, run_yaml, cache_dir, tmp_path):
    """An index naming shards in a sub-folder: a shard rewritten in place (same size, mtime
    restored) is part of the cache identity like the top-level files, so it is counted afresh."""
    fam = qwen_bf16.family
    agent = tmp_path / "m" / "A"
    models.write_checkpoint(agent, models.make_config("qwen2", False, fam.dtype), fam.agents["A"], shards=2)
    (agent / "weights").mkdir()
    index = json.loads((agent / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        (agent / shard).rename(agent / "weights" / shard)
    index["weight_map"] = {k: f"weights/{v}" for k, v in index["weight_map"].items()}
    (agent / "model.safetensors.index.json").write_text(json.dumps(index))
    agents = [str(agent), qwen_bf16.path("B")]
    text = config_yaml(qwen_bf16.path("base"), agents)
    run_yaml(text)
    name = "model.layers.1.mlp.gate_proj.weight"
    shard = agent / index["weight_map"][name]
    changed = models.perturb(fam.agents["A"], {name: dict.fromkeys(fam.regions[name]["B"].tolist(), 0.03125)})
    part = {k: v for k, v in changed.items() if index["weight_map"][k] == index["weight_map"][name]}
    fresh = tmp_path / "new.safetensors"
    save_file(part, str(fresh), metadata={"format": "pt"})
    st = os.stat(shard)
    assert os.stat(fresh).st_size == st.st_size
    with open(shard, "r+b") as f:  # in place: same inode
        f.write(fresh.read_bytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    from mergekit.io.tasks import LoaderCache

    LoaderCache().flush_all()
    rel.watch(agent, *qwen_bf16.paths.values())
    after = run_yaml(text)
    assert after.count_calls > 0, "statistics of the rewritten shard were reused"
    base, sds = inputs(qwen_bf16.path("base"), agents[1:])
    rewritten = {}
    for f in sorted((agent / "weights").glob("*.safetensors")):
        rewritten.update(load_file(str(f)))
    rel.matches_reference(after.tensors, base, {str(agent): rewritten, **sds})


# ---------------------------------------------------------------- the cache is a hint, never evidence


def _forge(entry_path, agent: str, *, signed: bool) -> None:
    """An entry edited by hand: `agent`'s unique counts set to 0, its unkeyed checksum recomputed (as format 3
    kept one), and its authentication code too where the editor holds the folder's secret (the user themself)."""
    import hashlib
    import hmac

    from mergekit_ram.core import cache

    entry = json.loads(entry_path.read_text())
    for t in entry["tensors"]:
        t["counts"][agent] = [t["counts"][agent][0], 0, t["counts"][agent][2]]
    blob = json.dumps({"agents": entry["agents"], "tensors": entry["tensors"]}, sort_keys=True)
    entry["checksum"] = hashlib.sha256(blob.encode()).hexdigest()
    key = getattr(cache, "secret", lambda _folder: None)(entry_path.parent) if signed else None
    if key is not None:
        signed = json.dumps({"key": entry["key"], "agents": entry["agents"], "tensors": entry["tensors"]}, sort_keys=True)
        entry["mac"] = hmac.new(key, signed.encode(), hashlib.sha256).hexdigest()
    entry_path.write_text(json.dumps(entry))


@pytest.mark.quick
def test_an_entry_edited_with_its_checksum_recomputed_is_recounted_with_one_warning(
    rel, qwen_bf16, run_yaml, cache_dir, caplog
):
    text, agents, entry = _cold(run_yaml, qwen_bf16, cache_dir)
    rel.watch(*qwen_bf16.paths.values())
    _forge(entry, str(agents[0]), signed=False)  # another's edit, or malware's: without the secret
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run = run_yaml(text)
    warnings = [m for m in _warnings(caplog) if "statistics cache" in m]
    assert run.count_calls > 0, "an edited entry was trusted"
    assert len(warnings) == 1, warnings
    rel.names(warnings[0], entry, "keyed checksum")
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))


def test_verify_never_takes_a_cache_entrys_word(rel, qwen_bf16, run_yaml, cache_dir, capsys, tmp_path):
    """A merge made with an entry its user edited (keyed with their own secret: the one edit the key cannot tell)
    is no reference merge, and verify, on the same machine with the same cache, says it differs: it counts
    again, reading no entry."""
    from mergekit_ram import cli

    text, agents, entry = _cold(run_yaml, qwen_bf16, cache_dir)
    _forge(entry, str(agents[0]), signed=True)
    poisoned = run_yaml(text, out=tmp_path / "poisoned")
    assert poisoned.count_calls == 0  # the merge believed the entry
    rel.watch(poisoned.out, *qwen_bf16.paths.values())
    capsys.readouterr()
    code = cli.main(["verify", str(poisoned.out), "-q"])
    out = capsys.readouterr().out
    assert code == 1 and f"{poisoned.out}: bit-identical" not in out, out
    rel.names(out.splitlines()[0], poisoned.out, "NOT identical")


def test_a_fifo_at_an_entrys_name_hangs_neither_merge_nor_verify(rel, qwen_bf16, run_yaml, cache_dir, caplog, capsys):
    """Opened without blocking and read only once seen to be a regular file: a warning, and a recount."""
    import threading

    from mergekit_ram import cli

    text, agents, entry = _cold(run_yaml, qwen_bf16, cache_dir)
    entry.unlink()
    os.mkfifo(entry)
    rel.watch(*qwen_bf16.paths.values())
    unblocked = []

    def unblock():  # a guard: a reader blocked on the FIFO gets its end of file, and the test fails
        try:
            fd = os.open(entry, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # no reader waiting
        unblocked.append(1)
        os.close(fd)

    guard = threading.Timer(120, unblock)
    guard.start()
    try:
        caplog.set_level(logging.WARNING, logger=LOGGER)
        run = run_yaml(text)
        capsys.readouterr()
        code = cli.main(["verify", str(run.out), "-q"])
        out = capsys.readouterr().out
    finally:
        guard.cancel()
    assert not unblocked, "a read of the FIFO blocked"
    assert code == 0 and "bit-identical" in out, out
    assert run.count_calls > 0
    rel.names(next(m for m in _warnings(caplog) if str(entry) in m), entry, "not a regular file")
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))


@pytest.mark.parametrize("how", ["secret-others-may-read", "folder-others-may-write"])
def test_a_secret_or_folder_others_may_reach_is_not_used(rel, qwen_bf16, run_yaml, cache_dir, caplog, how):
    text, agents, entry = _cold(run_yaml, qwen_bf16, cache_dir)
    secret = cache_dir / "secret.key"
    assert secret.is_file() and secret.stat().st_mode & 0o777 == 0o600
    target, mode = (secret, 0o644) if how == "secret-others-may-read" else (cache_dir, 0o777)
    target.chmod(mode)
    rel.watch(*qwen_bf16.paths.values())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run = run_yaml(text)
    warnings = _warnings(caplog)
    assert run.count_calls > 0 and len(warnings) == 1, warnings
    rel.names(warnings[0], "not using the statistics cache", f"{mode:o}")
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))
