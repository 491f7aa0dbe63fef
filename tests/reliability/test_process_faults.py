"""Interrupted and starved merges: SIGKILL and SIGINT during the statistics pass, while the
weights are written and while the card is written; a full disk (a real EFBIG through
RLIMIT_FSIZE) for the model; ENOSPC injected for ram_stats.json. Then a rerun.

Decided behaviour: whatever the fault, no input changes, nothing half-written looks
finished (ram_stats.json is written last and marks a finished `ramplus` merge; no index
sits beside a partial shard), the cache holds only whole entries, a stop after the model
was planned is reported with the output folder named, and rerunning the same command
gives the float64 reference. The killed merges run mergekit's own CLI (`main` of
`mergekit-yaml`) in a fresh interpreter, with a pause planted at the fault point; the
full-disk run is the `mergekit-yaml` console script itself.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import config_yaml, finished, full_disk, inputs, not_complete

from mergekit_ram.core import cache

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time

    # Ctrl-C at a terminal: Python turns SIGINT into KeyboardInterrupt unless its parent left SIGINT
    # ignored, which a suite started in the background does (`nohup`, `&` in a script: SIGINT ignored
    # and inherited by every child); the worker would then sleep through the test's SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    point, marker = os.environ["RAM_FAULT_POINT"], os.environ["RAM_FAULT_MARKER"]

    def pause():
        open(marker, "w").close()
        time.sleep(300)

    if point == "statistics":  # the fifth tensor of the statistics pass (it counts with its diagnostics)
        import mergekit_ram.core.kernel as kernel
        real_diagnose, calls = kernel.diagnose, []

        def diagnose(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                pause()
            return real_diagnose(*args, **kwargs)

        kernel.diagnose = diagnose
    elif point == "weights":  # half of the shard on disk
        import safetensors.torch as st
        real_save = st.save_file

        def save_file(tensors, filename, *args, **kwargs):
            real_save(tensors, filename, *args, **kwargs)
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            pause()

        st.save_file = save_file
    elif point == "card":  # model and config.json written, the card not yet
        import mergekit_ram.reporting.card as card

        def card_section(*args, **kwargs):
            pause()

        card.card_section = card_section

    from mergekit.scripts.run_yaml import main

    sys.argv = ["mergekit-yaml", *sys.argv[1:]]
    main()
    """
)


def _env(cache_dir: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update(
        MERGEKIT_RAM_CACHE=str(cache_dir),
        MERGEKIT_RAM_NATIVE="0",  # no compiler run in the child: the fault is the point
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONIOENCODING="utf-8",
    )
    env.update(extra)
    return env


def _stopped_line(stderr: str) -> str:
    """mergekit-ram's one line about the interrupted output (beside mergekit's own output)."""
    # `mergekit-ram: error: the merge into ...` from a command (issue 54: the plugin's log records so), and
    # Python logging's `ERROR:mergekit_ram:mergekit-ram: the merge into ...` from a script
    said = ("mergekit-ram: error: the merge into", "mergekit-ram: the merge into")
    lines = [line for line in stderr.splitlines() if any(s in line for s in said)]
    assert lines, stderr[-3000:]
    return lines[-1]


def _cache_whole(cache_dir: Path, monkeypatch) -> list:
    """Only whole, valid entries; no temp file."""
    if not cache_dir.exists():
        return []
    names = sorted(p.name for p in cache_dir.iterdir() if p.is_file())
    assert not [n for n in names if n.startswith(".")], names
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(cache_dir))
    names = [name for name in names if name != cache.SECRET]  # beside the entries: the key they are signed with
    for name in names:
        assert cache.load(name[: -len(".json")]) is not None, name
    return names


@pytest.mark.parametrize(
    "sig, point",
    [
        (signal.SIGKILL, "statistics"),
        (signal.SIGKILL, "weights"),
        (signal.SIGKILL, "card"),
        (signal.SIGINT, "statistics"),
        (signal.SIGINT, "weights"),
    ],
    ids=["kill-statistics", "kill-weights", "kill-card", "int-statistics", "int-weights"],
)
def test_interrupted_merge_then_rerun(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch, sig, point):
    rel.fault()
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B"), qwen_bf16.path("C")]
    text = config_yaml(qwen_bf16.path("base"), agents)
    (tmp_path / "ramplus.yml").write_text(text)
    (tmp_path / "worker.py").write_text(WORKER)
    out, cache_dir, marker = tmp_path / "out", tmp_path / "cache", tmp_path / "paused"
    rel.watch(*qwen_bf16.paths.values())
    env = _env(cache_dir, RAM_FAULT_POINT=point, RAM_FAULT_MARKER=str(marker))
    args = [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "ramplus.yml"), str(out), "--no-copy-tokenizer"]
    log = tmp_path / "stderr.txt"  # a file, not a pipe: a full pipe would stall the child
    with open(log, "w") as stderr:
        proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.time() + 600  # a bound against a hang; a busy machine starts a merge slowly
        while not marker.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the merge never reached the fault point"
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode != 0
    if sig == signal.SIGINT:
        assert "Traceback" not in err, err[-3000:]
        assert "Aborted" in err, err[-3000:]
        if point == "weights":
            rel.names(_stopped_line(err), str(out), "stopped", "incomplete")
    not_complete(out)
    if point == "card":  # the weights and config.json were finished: only the marker is missing
        assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    entries = _cache_whole(cache_dir, monkeypatch)
    assert len(entries) == (0 if point == "statistics" else 1)

    again = run_yaml(text, out=out)  # the same command again, the same cache
    assert (again.count_calls > 0) == (point == "statistics")
    finished(out)
    rel.matches_reference(again.tensors, *inputs(qwen_bf16.path("base"), agents))


def _mergekit_yaml() -> str:
    beside = Path(sys.executable).parent / "mergekit-yaml"
    found = str(beside) if beside.exists() else shutil.which("mergekit-yaml")
    if found is None:
        pytest.skip("the mergekit-yaml console script is not installed")
    return found


def test_output_disk_full_then_rerun(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch):
    """A file-size limit makes the model's write fail for real (EFBIG), as a full disk would."""
    rel.fault()
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    text = config_yaml(qwen_bf16.path("base"), agents)
    (tmp_path / "ramplus.yml").write_text(text)
    out, cache_dir = tmp_path / "out", tmp_path / "cache"
    rel.watch(*qwen_bf16.paths.values())

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run(
        [_mergekit_yaml(), str(tmp_path / "ramplus.yml"), str(out), "--no-copy-tokenizer"],
        env=_env(cache_dir),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert proc.returncode != 0, proc.stderr[-2000:]
    rel.names(_stopped_line(proc.stderr), str(out), "stopped", "incomplete")
    not_complete(out)
    assert not (out / "model.safetensors").exists()
    _cache_whole(cache_dir, monkeypatch)

    again = run_yaml(text, out=out)
    finished(out)
    rel.matches_reference(again.tensors, *inputs(qwen_bf16.path("base"), agents))


@pytest.mark.quick
def test_disk_full_for_ram_stats(rel, qwen_bf16, run_yaml, tmp_path, monkeypatch):
    rel.fault()
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    text = config_yaml(qwen_bf16.path("base"), agents)
    out = tmp_path / "out"
    out.mkdir()
    rel.watch(*qwen_bf16.paths.values())
    with monkeypatch.context() as m:
        hit = full_disk(m, out)
        with pytest.raises(OSError) as info:
            run_yaml(text, out=out)
    assert hit
    rel.names(info, out / "ram_stats.json", "No space left on device")
    not_complete(out)
    again = run_yaml(text, out=out)
    finished(out)
    assert json.loads((out / "ram_stats.json").read_text())["parameters"]["r"] == 0.1
    rel.matches_reference(again.tensors, *inputs(qwen_bf16.path("base"), agents))
