"""The suite's forked commands (tests/zygote.py) against real starts of the same commands: what a test reads of a
process (exit code, stdout, stderr, files, a signal's end) is the same, and what a fork cannot give starts for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import zygote
from helpers import console_script
from hub_stub import hub_env, unreachable_url

# with forking off (the CI stage that starts every command for real) there is no fork to compare
pytestmark = pytest.mark.skipif(
    os.environ.get("MERGEKIT_RAM_TEST_FORK") == "0", reason="MERGEKIT_RAM_TEST_FORK=0: no command is forked"
)


def _both(argv, *, made=(), prepare=None, **kwargs):
    """(forked, real) runs of argv, real first, once each has left the same bytes in every file under the paths of
    `made` (each path removed, then `prepare()` called, before each run, so that both write the same paths)."""
    runs = []
    for fork in (False, True):
        for path in map(Path, made):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if prepare is not None:
            prepare()
        before = zygote.counts["forked"]
        zygote.real_only, zygote.eager = not fork, fork  # forked from the first command: its zygote starts now
        try:
            done = subprocess.run(argv, **kwargs)
        finally:
            zygote.real_only = zygote.eager = False
        assert zygote.counts["forked"] == before + fork, (fork, zygote.counts)
        runs.append((done, {str(path): _files(Path(path)) for path in made}))
    (real, real_files), (forked, forked_files) = runs
    assert forked_files == real_files, _differences(real_files, forked_files)
    return forked, real


def _differences(real: dict, forked: dict) -> dict:
    """Each file that differs: a few of the lines only the real run wrote, and of those only the forked one did."""
    found = {}
    for path in real:
        a, b = real[path] or {}, forked[path] or {}
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                was, now = (set((x.get(name) or b"").splitlines()) for x in (a, b))
                found[os.path.join(path, name) if name else path] = (sorted(was - now)[:5], sorted(now - was)[:5])
    return found


def _files(path: Path) -> dict[str, bytes] | None:
    if path.is_file():
        return {"": path.read_bytes()}
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _same(forked, real) -> None:
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


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


def test_a_forked_example_and_merge_write_what_real_ones_write(tmp_path, run_yaml):
    """`mergekit-ram example demo`, then `mergekit-yaml` of its RAM+ config into a folder that holds its RAM merge,
    forked and real in the same folders: the same exit code, the same bytes on stdout and stderr (the plugin's
    warning that the merge replaces the earlier one; `--quiet`, as mergekit's progress bars print their rates) and
    in every file written."""
    run = {"capture_output": True, "timeout": 600, "cwd": tmp_path}
    demo = tmp_path / "demo"
    forked, real = _both([console_script("mergekit-ram"), "example", "demo"], made=[demo], **run)
    _same(forked, real)
    assert real.returncode == 0 and (demo / "ramplus.yaml").is_file(), real.stderr
    earlier = run_yaml((demo / "ram.yaml").read_text(encoding="utf-8")).out
    out = tmp_path / "merged"
    argv = [console_script("mergekit-yaml"), str(demo / "ramplus.yaml"), str(out), "--quiet"]
    forked, real = _both(argv, made=[out], prepare=lambda: shutil.copytree(earlier, out), **run)
    _same(forked, real)
    said = f"mergekit-ram: warning: ramplus: this merge replaces the earlier ramplus merge in {out} (r=0.0"
    assert real.returncode == 0 and said.encode() in real.stderr and (out / "ram_stats.json").is_file(), real


def test_a_forked_inspect_prints_what_a_real_one_prints(tmp_path):
    """`inspect` of a config with a parameter ramplus ignores, as `mergekit-ram` and as `python -m mergekit_ram.cli`,
    forked and real: the same table, JSON file, exit code and warning, whose prefix the plugin's import-time hooks
    choose from argv[0] (a mergekit command's `mergekit-ram: warning:`, logging's `WARNING:` for `python -m`)."""
    from mergekit_ram import cli

    assert cli.main(["example", str(tmp_path / "demo")]) == 0
    config = yaml.safe_load((tmp_path / "demo" / "ramplus.yaml").read_text(encoding="utf-8"))
    config["models"][0]["parameters"] = {"note": 1}
    (tmp_path / "odd.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    report = tmp_path / "report.json"
    said = b"ramplus: parameter 'note' under models[0]"
    for argv, prefix in (
        ([console_script("mergekit-ram"), "inspect"], b"mergekit-ram: warning: "),
        ([sys.executable, "-m", "mergekit_ram.cli", "inspect"], b"WARNING: "),
    ):
        argv = [*argv, "odd.yaml", "--quiet", "--json", "report.json"]
        forked, real = _both(argv, made=[report], capture_output=True, timeout=600, cwd=tmp_path)
        _same(forked, real)
        assert real.returncode == 0 and report.is_file() and b"rho" in real.stdout, real
        assert prefix + said in real.stderr.splitlines()[0], real.stderr


#: the names of the modules a process has loaded when it ends, beyond the standard library (which the zygote's own
#: work adds to), in the file $MERGEKIT_RAM_TEST_MODULES names (a name the zygotes read per command), written once
_MODULES = """
import atexit, os, sys

def _write():
    top = set(sys.stdlib_module_names) | {"sitecustomize"}
    try:
        with open(os.environ["MERGEKIT_RAM_TEST_MODULES"], "x") as f:  # not the zygote's own at its end
            f.write("\\n".join(sorted(m for m in sys.modules if m.partition(".")[0] not in top)))
    except (KeyError, OSError):
        pass

atexit.register(_write)
"""


def test_a_forked_command_has_imported_what_a_real_one_has(tmp_path):
    """A forked `mergekit-pytorch` or `mergekit-yaml` has loaded the modules a real start has (a zygote runs its
    console script's imports, no more: a real `mergekit-pytorch` never imports `mergekit.merge`, whose import
    hooks wrap mergekit's `run_merge`), checked by a `sitecustomize` both start with."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_MODULES, encoding="utf-8")
    for name, module in (("mergekit-pytorch", "mergekit.scripts.merge_raw_pytorch"),
                         ("mergekit-yaml", "mergekit.scripts.run_yaml")):  # fmt: skip
        modules = tmp_path / f"{name}.txt"
        path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "MERGEKIT_RAM_TEST_MODULES": str(modules)}
        forked, real = _both([console_script(name), "--help"], made=[modules], capture_output=True, env=env,
                             timeout=600)  # fmt: skip
        _same(forked, real)
        assert module in modules.read_text().split(), modules.read_text()


def test_what_a_fork_cannot_give_starts_for_real(tmp_path):
    before = dict(zygote.counts)
    env = {**os.environ, "PYTHONHASHSEED": "7"}  # read when the interpreter starts
    done = subprocess.run([console_script("mergekit-ram"), "--version"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and zygote.counts["forked"] == before["forked"], zygote.counts
    assert zygote._signature(env) != zygote._signature(dict(os.environ))
    assert zygote._signature({**env, "MERGEKIT_RAM_CACHE": "x", "PYTEST_CURRENT_TEST": "y"}) == zygote._signature(env)
