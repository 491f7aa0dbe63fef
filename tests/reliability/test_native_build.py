"""The compiled kernel: a failing build and a corrupt, planted or exposed library.

Decided behaviour: loading a shared library runs its code, so it is built into and loaded
from a folder owned by the user and writable by no one else (nor is the cache folder
above it), and only a regular file owned by the user and writable by no one else is
loaded. Anything else (no compiler, `CC=/bin/false`, an unusable build folder, another
user's or an exposed library or folder) is one warning naming the cause, and the torch
path gives the same merge; a library that does not load is deleted and rebuilt.
Every case merges with whatever path it ends on and compares with the float64 reference.
Without a C compiler only the failing builds run (`CC=/bin/false`, a missing `CC`, none on PATH); the
cases that need a library built first skip, naming the reason.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import NEEDS_COMPILER

import mergekit_ram
from mergekit_ram.core import build, native

LOGGER = "mergekit_ram"


@pytest.fixture
def fresh(tmp_path, monkeypatch, caplog):
    """A process that has not looked for the library yet, with its own cache folder."""
    folder = tmp_path / "cache"

    def start(cache=folder):
        monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(cache))
        monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "1")
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_failed", None)
        caplog.set_level(logging.WARNING, logger=LOGGER)
        return cache

    start.folder = folder
    return start


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def _merge_checks(rel):
    """A merge on whatever path the kernel now takes equals the float64 reference."""
    gen = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 48, generator=gen).bfloat16()}
    agents = {}
    for name in "abc":
        mask = torch.rand(64, 48, generator=gen) < 0.3
        agents[name] = {"w": (base["w"].double() + 0.05 * mask).bfloat16()}
    rel.matches_reference(mergekit_ram.merge_state_dicts(base, agents), base, agents)


def _private(path):
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


@NEEDS_COMPILER
def test_fresh_build_is_private(rel, fresh):
    cache = fresh()
    assert native.library() is not None
    target = native.target()
    assert target.parent == cache / "native"
    assert stat.S_IMODE(os.stat(cache / "native").st_mode) == 0o700
    assert _private(target) and _private(target.parent) and _private(cache)
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]
    _merge_checks(rel)


#: a "compiler" that answers `--version` and fails every build (a compiler that cannot build the source)
FAILING_CC = '#!/bin/sh\nif [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\necho "fakecc: error: no" >&2\nexit 1\n'


@pytest.mark.parametrize(
    "cc, cause",
    [
        ("/bin/false", "no C compiler found"),
        ("/nonexistent/cc", "no C compiler found"),
        (None, "no C compiler found"),
        ("FAILING", "the build failed"),
    ],
    ids=["CC=/bin/false", "CC-missing", "no-compiler", "build-fails"],
)
@pytest.mark.quick
def test_build_failure_falls_back(rel, fresh, monkeypatch, caplog, tmp_path, cc, cause):
    """Issue 53: one line, once, naming why (the cause first) and what it costs; the torch kernel's merge."""
    rel.fault()
    cache = fresh()
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(build.shutil, "which", lambda _name: None)
    elif cc == "FAILING":
        cc = tmp_path / "fakecc"
        cc.write_text(FAILING_CC)
        cc.chmod(0o755)
        monkeypatch.setenv("CC", str(cc))
    else:
        monkeypatch.setenv("CC", cc)
    assert native.library() is None
    assert native.library() is None  # asked again: no second build, no second line
    _merge_checks(rel)
    (message,) = [m for m in _warnings(caplog) if "fast CPU kernel unavailable" in m]
    rel.names(message, f"unavailable: {cause} (", str(cc) if cc else "no cc or gcc on PATH", "torch kernel runs")
    # what is true on any machine, and where the measured cost is: not one machine's figures
    assert "same results, more slowly" in message and "docs/benchmarks.md" in message and "\n" not in message, message
    assert native.status() == f"cannot be built: {native._failed}; the torch kernel runs, the same results, slower"
    if cause == "the build failed":
        assert "fakecc: error: no" in message, message
    folder = cache / "native"
    assert not folder.exists() or not list(folder.iterdir()), "a temp or partial library was left"


@pytest.mark.quick
@NEEDS_COMPILER
def test_unusable_build_folder_falls_back(rel, fresh, caplog):
    rel.fault()
    cache = fresh()
    cache.mkdir(mode=0o700)
    (cache / "native").write_text("a file where the folder should be")
    assert native.library() is None
    (message,) = [m for m in _warnings(caplog) if "fast CPU kernel unavailable" in m]
    rel.names(message, cache / "native")
    _merge_checks(rel)


@NEEDS_COMPILER
def test_corrupt_library_is_rebuilt(rel, fresh, caplog):
    rel.fault()
    cache = fresh()
    target = native.target()
    target.parent.mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    target.write_bytes(b"not a library\n" * 150)
    target.chmod(0o700)
    assert native.library() is not None
    rel.names(next(m for m in _warnings(caplog) if "does not load" in m), target, "rebuilding")
    assert target.read_bytes()[:4] == b"\x7fELF", "the corrupt library is still there"
    _merge_checks(rel)


def _plant(fresh, mode=0o700, owner=None):
    cache = fresh()
    target = native.target()
    target.parent.mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    target.write_bytes(b"planted, never to be loaded")
    target.chmod(mode)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(target, owner, owner)
    return cache, target


@NEEDS_COMPILER
@pytest.mark.parametrize("how", ["other-user", "writable-by-others"])
def test_exposed_library_is_refused(rel, fresh, caplog, how):
    _, target = _plant(fresh, **({"owner": 65534} if how == "other-user" else {"mode": 0o777}))
    assert native.library() is None
    (message,) = [m for m in _warnings(caplog) if "fast CPU kernel unavailable" in m]
    rel.names(
        message,
        "the folder is unsafe (refusing the compiled kernel",
        target,
        "uid 65534" if how == "other-user" else "others can write",
    )
    assert target.read_bytes() == b"planted, never to be loaded", "a refused library was touched"
    _merge_checks(rel)


@pytest.mark.quick
@NEEDS_COMPILER
@pytest.mark.parametrize("how", ["world-writable-cache", "group-writable-kernel-folder", "kernel-folder-symlink"])
def test_exposed_folder_is_refused(rel, fresh, tmp_path, caplog, how):
    cache = fresh()
    cache.mkdir(mode=0o700)
    if how == "world-writable-cache":
        os.chmod(cache, 0o777)
        culprit, words = cache, "others can write"
    elif how == "group-writable-kernel-folder":
        (cache / "native").mkdir()
        os.chmod(cache / "native", 0o770)
        culprit, words = cache / "native", "others can write"
    else:
        private = tmp_path / "elsewhere"
        private.mkdir(mode=0o700)
        (cache / "native").symlink_to(private, target_is_directory=True)
        culprit, words = cache / "native", "symbolic link"
    said = native.status()  # --version's line, before any build
    rel.names(said, "cannot be built: the folder is unsafe (refusing", culprit, words)
    assert native.library() is None
    (message,) = [m for m in _warnings(caplog) if "fast CPU kernel unavailable" in m]
    rel.names(message, "the folder is unsafe (refusing", culprit, words)
    _merge_checks(rel)


@NEEDS_COMPILER
def test_cache_folder_with_odd_characters_builds(rel, fresh, tmp_path):
    cache = fresh(tmp_path / "sp ace" / "$(touch PWNED); 'q' ü")
    assert native.library() is not None
    assert native.target().parent == cache / "native"
    assert not list(tmp_path.rglob("PWNED*"))
    _merge_checks(rel)


def test_without_a_compiler_the_build_cases_skip(tmp_path):
    """This module and the kernel-folder test on a machine with no C compiler (PATH without one, no `CC`): the
    failing builds still run and fall back, the cases that need a built library skip; none fails."""
    if os.environ.get("MERGEKIT_RAM_TEST_NO_COMPILER"):
        pytest.skip("already the run without a compiler")
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(empty), MERGEKIT_RAM_TEST_NO_COMPILER="1", MERGEKIT_RAM_CACHE=str(tmp_path / "cache"))
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs",
         str(Path(__file__)), str(tests / "test_cachedir.py") + "::test_the_kernel_is_built_in_the_kernels_folder"],
        cwd=tests.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    summary = out.strip().splitlines()[-1]
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert " failed" not in summary and " error" not in summary, summary
    # CC=/bin/false, CC missing, no compiler, a failing build run (4); the kernel-folder test x3, 4 + 2 + 3 here,
    # and this test, skip
    assert re.search(r"\b4 passed\b", summary) and skipped == 3 + 4 + 2 + 3 + 1, summary
    assert out.count("no C compiler ($CC, cc or gcc)") >= 1, out[-3000:]
