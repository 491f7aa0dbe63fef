"""The suite's forked commands (tests/zygote.py) against real starts of the same commands: what a test reads of a
process (exit code, stdout, stderr, files, a signal's end) is the same, and what a fork cannot give starts for real."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zygote
from helpers import console_script
from hub_stub import hub_env, unreachable_url


def _both(argv, **kwargs):
    """(forked, real) runs of argv: the second command with the suite's environment is the first one forked."""
    zygote.real_only = True
    try:
        real = subprocess.run(argv, **kwargs)
    finally:
        zygote.real_only = False
    before = dict(zygote.counts)
    for _ in range(2):  # the first command of an environment may start for real; the second is forked
        forked = subprocess.run(argv, **kwargs)
    assert zygote.counts["forked"] > before["forked"], zygote.counts
    return forked, real


@pytest.mark.quick
def test_a_forked_command_prints_and_exits_as_a_real_start(tmp_path):
    for argv in (
        [console_script("mergekit-ram"), "verify", str(tmp_path / "absent")],  # exit 2, one line on stderr
        [console_script("mergekit-yaml"), str(tmp_path / "absent.yaml"), str(tmp_path / "out")],
        [sys.executable, "-m", "mergekit_ram.cli", "--version"],
    ):
        forked, real = _both(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr), argv


def test_a_forked_command_takes_its_environment_and_folder(tmp_path):
    env = {**os.environ, "MERGEKIT_RAM_NATIVE": "0"}  # read when the command runs: the zygote's environment serves
    forked, real = _both([console_script("mergekit-ram"), "--version"], capture_output=True, text=True, env=env)
    assert forked.stdout == real.stdout and "MERGEKIT_RAM_NATIVE=0" in forked.stdout, (forked, real)
    # huggingface_hub read HF_ENDPOINT and HF_HOME when the zygote imported it: a child re-reads them (_rehome)
    url = unreachable_url()
    env = hub_env(url, tmp_path / "home")
    forked, real = _both([console_script("mergekit-ram"), "verify", "org/merged"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.returncode == 3 and f"the Hub at {url} could not be asked" in forked.stderr, forked.stderr
    made = {}
    for where in ("real", "forked"):
        (tmp_path / where).mkdir()
        zygote.real_only = where == "real"
        try:
            done = subprocess.run([console_script("mergekit-ram"), "example", "demo"], capture_output=True, text=True,
                                  cwd=tmp_path / where, timeout=600)  # fmt: skip
        finally:
            zygote.real_only = False
        assert done.returncode == 0, done.stderr
        folder = tmp_path / where / "demo"
        made[where] = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*.safetensors")}
    assert made["real"] and made["real"] == made["forked"]


def test_what_a_fork_cannot_give_starts_for_real(tmp_path):
    before = dict(zygote.counts)
    env = {**os.environ, "PYTHONHASHSEED": "7"}  # read when the interpreter starts
    done = subprocess.run([console_script("mergekit-ram"), "--version"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and zygote.counts["forked"] == before["forked"], zygote.counts
    assert zygote._signature(env) != zygote._signature(dict(os.environ))
    assert zygote._signature({**env, "MERGEKIT_RAM_CACHE": "x", "PYTEST_CURRENT_TEST": "y"}) == zygote._signature(env)
