"""Errors of ours as one line, at every door (`mergekit_ram/errors.py`, installed by `_mergekit/hooks.py`).

mergekit's commands catch no error: before issue 31 a typo in a parameter was a 50-line traceback with the
useful sentence last. Each door is run as a user runs it (a console script in a fresh process): the last line
of stderr is ours, nothing else of a traceback, exit status 1; `-v` or `MERGEKIT_RAM_TRACEBACK=1` shows the
traceback. In Python the error is a `RamError` (a `ValueError`) with a one-line message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import console_script
from mergekit_ram import errors

TYPO = "unknown ramplus parameter 'alhpa' under parameters; did you mean 'alpha'?"


_exe = console_script


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}
    environ.pop(errors.TRACEBACK_ENV, None)
    environ.update(env)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=environ, cwd=str(cwd))


def _one_line(done: subprocess.CompletedProcess, prog: str, message: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == f"{prog}: error: {message}", done.stderr


def _config(qwen, root: Path, parameters: dict, **extra) -> Path:
    data = {
        **extra,
        "merge_method": "ramplus",
        "base_model": qwen.path("base"),
        "models": [{"model": qwen.path("A")}, {"model": qwen.path("B")}],
        "parameters": parameters,
        "dtype": "bfloat16",
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _typo_config(qwen, root: Path) -> Path:
    return _config(qwen, root, {"alhpa": 2.0})


@pytest.mark.real_process  # each door's one-line error and exit code from a real start
def test_mergekit_yaml_prints_one_line(qwen_bf16, tmp_path):
    config = _typo_config(qwen_bf16, tmp_path)
    _one_line(_run([_exe("mergekit-yaml"), str(config), str(tmp_path / "out")], tmp_path), "mergekit-yaml", TYPO)
    assert not (tmp_path / "out").exists()


def test_mergekit_yaml_v_or_the_variable_prints_the_traceback(qwen_bf16, tmp_path):
    config = _typo_config(qwen_bf16, tmp_path)
    command = [_exe("mergekit-yaml"), str(config), str(tmp_path / "out")]
    for done in (_run([*command, "-v"], tmp_path), _run(command, tmp_path, **{errors.TRACEBACK_ENV: "1"})):
        assert done.returncode == 1
        assert "Traceback" in done.stderr and done.stderr.rstrip().endswith(f"RamError: {TYPO}"), done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.real_process  # each door's one-line error and exit code from a real start
def test_mergekit_pytorch_prints_one_line(flat_mlp, tmp_path):
    """A nested training checkpoint: the file, the key and what to save instead, in one line."""
    base = tmp_path / "base.pt"
    torch.save({"model": flat_mlp.stored("base", "pt"), "step": 100}, base)
    data = {"merge_method": "ramplus", "base_model": str(base), "models": [{"model": flat_mlp.path(a, "pt")} for a in "AB"]}
    config = tmp_path / "flat.yaml"
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    done = _run([_exe("mergekit-pytorch"), str(config), str(tmp_path / "out"), "--tensor-intersection"], tmp_path)
    message = done.stderr.strip().splitlines()[-1]
    _one_line(done, "mergekit-pytorch", message.split("error: ", 1)[1])
    assert f"input file {base} holds a nested dict under 'model'" in message


@pytest.mark.real_process  # each door's one-line error and exit code from a real start
def test_mergekit_multi_prints_one_line(qwen_bf16, tmp_path):
    """The official script's `R` in a ramplus stage: an error saying what to write, not a warning and r = 0.1."""
    config = _config(qwen_bf16, tmp_path, {"R": 0.2}, name="ram")
    done = _run([_exe("mergekit-multi"), str(config), "--intermediate-dir", str(tmp_path / "inter")], tmp_path)
    message = done.stderr.strip().splitlines()[-1]
    _one_line(done, "mergekit-multi", message.split("error: ", 1)[1])
    assert "ramplus parameter 'R' under parameters is the official ram-main.py's --rescale_factor" in message
    assert "`r: 0.2`" in message


def test_a_script_calling_run_merge_prints_one_line(qwen_bf16, tmp_path):
    """Python's door: an uncaught error of ours ends a script in one line too (prog: the script's name)."""
    config = _typo_config(qwen_bf16, tmp_path)
    script = tmp_path / "merge.py"
    script.write_text(
        "import yaml\n"
        "from mergekit.config import MergeConfiguration\n"
        "from mergekit.merge import run_merge\n"
        "from mergekit.options import MergeOptions\n"
        f"config = MergeConfiguration.model_validate(yaml.safe_load(open({str(config)!r})))\n"
        f"run_merge(config, {str(tmp_path / 'out')!r}, options=MergeOptions(quiet=True))\n",
        encoding="utf-8",
    )
    _one_line(_run([sys.executable, str(script)], tmp_path), "merge.py", TYPO)


@pytest.mark.quick
def test_run_merge_in_python_raises_a_ram_error_of_one_line(qwen_bf16, run_yaml, tmp_path):
    config = _typo_config(qwen_bf16, tmp_path)
    with pytest.raises(errors.RamError) as info:
        run_yaml(config.read_text(encoding="utf-8"), out=tmp_path / "out")
    assert str(info.value) == TYPO and isinstance(info.value, ValueError)


@pytest.mark.real_process  # each door's one-line error and exit code from a real start
def test_inspect_prints_one_line(qwen_bf16, tmp_path):
    config = _typo_config(qwen_bf16, tmp_path)
    done = _run([_exe("mergekit-ram"), "inspect", str(config)], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"mergekit-ram inspect: error: {TYPO}"


def test_inspect_v_prints_the_traceback(qwen_bf16, tmp_path):
    config = _typo_config(qwen_bf16, tmp_path)
    verbose = _run([_exe("mergekit-ram"), "inspect", str(config), "-v"], tmp_path)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr, verbose.stderr


# ---------------------------------------------------------------- the pieces, in this process


@pytest.mark.quick
def test_one_line_is_a_ram_error_only_not_one_raised_from_it():
    assert errors.one_line(ValueError("not ours")) is None
    assert errors.one_line(errors.RamError("a\n  b"), "prog") == "prog: error: a b"
    try:
        try:
            raise errors.RamError("inner")
        except errors.RamError as error:
            raise RuntimeError("wrapped") from error
    except RuntimeError as outer:
        assert errors.one_line(outer, "p") is None  # the raiser's error, with its own type and message


def test_excepthook_shortens_ram_errors_for_pythons_hook_only(capsys, monkeypatch):
    import logging

    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    seen = []
    monkeypatch.setattr(sys, "__excepthook__", lambda *args: seen.append(args[1]))  # Python's own, recorded
    hook = errors.excepthook(sys.__excepthook__)
    other = KeyError("x")
    hook(KeyError, other, None)
    assert seen == [other]
    hook(errors.RamError, errors.RamError("refused"), None)
    assert capsys.readouterr().err.endswith("error: refused\n") and len(seen) == 1
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
    hook(errors.RamError, errors.RamError("refused"), None)
    assert len(seen) == 2
    monkeypatch.delenv(errors.TRACEBACK_ENV)
    reporter = []
    custom = errors.excepthook(lambda *args: reporter.append(args[1]))  # a program's own hook
    refused = errors.RamError("refused")
    custom(errors.RamError, refused, None)
    assert reporter == [refused] and capsys.readouterr().err == ""


SCRIPT_HEAD = (
    "import sys, yaml\n"
    "{before}"
    "from mergekit.config import MergeConfiguration\n"
    "from mergekit.merge import run_merge\n"
    "from mergekit.options import MergeOptions\n"
    "config = MergeConfiguration.model_validate(yaml.safe_load(open({config!r})))\n"
)


def _script(tmp_path: Path, config: Path, body: str, before: str = "") -> Path:
    script = tmp_path / "job.py"
    text = SCRIPT_HEAD.format(config=str(config), before=before) + body.format(out=str(tmp_path / "out"))
    script.write_text(text, encoding="utf-8")
    return script


def test_a_script_raising_its_own_error_from_a_ram_error_keeps_its_traceback(qwen_bf16, tmp_path):
    """A program that catches our error and raises its own from it shows its own error (issue 39, case 7)."""
    script = _script(tmp_path, _typo_config(qwen_bf16, tmp_path), (
        "try:\n"
        "    run_merge(config, {out!r}, options=MergeOptions(quiet=True))\n"
        "except ValueError as e:\n"
        "    raise RuntimeError('JOB-17 failed') from e\n"
    ))  # fmt: skip
    done = _run([sys.executable, str(script)], tmp_path)
    assert done.returncode == 1
    assert "Traceback" in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith("RuntimeError: JOB-17 failed"), done.stderr
    assert TYPO in done.stderr  # the cause, as Python chains it


def test_a_programs_own_excepthook_still_sees_our_errors(qwen_bf16, tmp_path):
    """A crash reporter installed before mergekit is imported is called for a RamError too (issue 39, case 7)."""
    reporter = (
        "def report(kind, error, tb):\n"
        "    print('REPORTER saw ' + kind.__name__ + ': ' + str(error), file=sys.stderr)\n"
        "sys.excepthook = report\n"
    )
    script = _script(tmp_path, _typo_config(qwen_bf16, tmp_path),
                     "run_merge(config, {out!r}, options=MergeOptions(quiet=True))\n", before=reporter)  # fmt: skip
    done = _run([sys.executable, str(script)], tmp_path)
    assert done.returncode == 1
    assert f"REPORTER saw RamError: {TYPO}" in done.stderr, done.stderr


@pytest.mark.quick
def test_the_hook_is_installed_once_mergekit_is_loaded():
    import mergekit.plan  # noqa: F401  (loads the hooks)

    from mergekit_ram._mergekit import surface

    assert surface.marked(sys.excepthook, surface.HOOKED)
