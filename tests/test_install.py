"""Packaging: the wheel ships the start-up hook, the editable install is current,
the README's set-up commands (its Development section) are the ones CI runs (its links: test_docs.py)."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import mergekit_ram

REPO = Path(__file__).resolve().parent.parent
REPO_PTH = REPO / "mergekit_ram" / "mergekit_ram.pth"
PURELIB = sysconfig.get_paths()["purelib"]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("MERGEKIT_RAM_DISABLE", None)
    env.pop("PYTHONPATH", None)
    env.update(HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONIOENCODING="utf-8")
    env.update(extra)
    return env


def _run(args, cwd, timeout=600) -> subprocess.CompletedProcess:
    # a bound against a hang, not a speed check: `pip wheel` took over 60 s on a busy 2-core machine
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


# --------------------------------------------------------------------------- #
# The .pth file itself
# --------------------------------------------------------------------------- #
@pytest.mark.quick
def test_pth_is_one_import_line():
    lines = [l for l in REPO_PTH.read_text().splitlines() if l.strip()]
    assert len(lines) == 1, lines
    # site.py executes only lines that start with "import " or "import\t".
    assert lines[0].startswith(("import ", "import\t")), lines[0]
    assert "MERGEKIT_RAM_DISABLE" in lines[0] and "mergekit_ram" in lines[0]


# --------------------------------------------------------------------------- #
# Wheel
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    try:
        import hatchling  # noqa: F401
    except ImportError:
        pytest.fail("building the wheel needs hatchling: pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(REPO)],
        cwd=out,
    )
    wheels = list(out.glob("mergekit_ram-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


def test_wheel_ships_pth_at_root_and_the_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "mergekit_ram.pth" in names, sorted(names)  # root of site-packages
        assert archive.read("mergekit_ram.pth").decode() == REPO_PTH.read_text()
        package = REPO / "mergekit_ram"
        shipped = {f"mergekit_ram/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
        shipped |= {"mergekit_ram/core/_native.c", "mergekit_ram/verify/__init__.py", "mergekit_ram/_mergekit/hooks.py"}
        assert shipped <= names, sorted(shipped - names)  # every module of every folder, and the kernel's C source
        assert not any("__pycache__" in n or n.startswith("tests/") for n in names), sorted(names)


def test_wheel_ships_license_typing_marker_and_one_version(wheel):
    import mergekit_ram

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "mergekit_ram/py.typed" in names, sorted(names)
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        for license_file in ("LICENSE", "COPYING"):
            assert archive.read(f"{info}/licenses/{license_file}") == (REPO / license_file).read_bytes()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert "GNU LESSER GENERAL PUBLIC LICENSE" in (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "License-Expression: LGPL-3.0-only" in metadata
    assert f"Version: {mergekit_ram.__version__}\n" in metadata
    assert wheel.name.startswith(f"mergekit_ram-{mergekit_ram.__version__}-")


def test_wheel_console_scripts_resolve(wheel):
    """Every [project.scripts] entry must point at a module that the wheel contains."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        if entry is None:
            return
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry).decode())
    scripts = dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}
    for script, target in scripts.items():
        module = target.split(":")[0].strip()
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, (
            f"console script {script!r} -> {target!r}, but the wheel has no {path}.py"
        )


def test_wheel_install_registers_from_its_own_files(wheel, tmp_path):
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--target", str(target), str(wheel)], cwd=tmp_path)
    assert (target / "mergekit_ram.pth").is_file()

    # -S: no site-packages, so no editable install and no repo on sys.path.
    # addsitedir(target) processes target/mergekit_ram.pth like a real site
    # dir; purelib is then appended without processing its .pth files, only to
    # find mergekit and torch.
    code = textwrap.dedent(
        f"""
        import json, sys, site
        r = {{'before': 'mergekit_ram' in sys.modules}}
        site.addsitedir({str(target)!r})
        r['hooked'] = 'mergekit_ram' in sys.modules
        r['torch_after_hook'] = 'torch' in sys.modules
        sys.path.append({PURELIB!r})
        import mergekit.merge_methods as m
        method = m.get('ramplus')
        r['same'] = method is sys.modules['mergekit_ram.method'].ramplus
        import mergekit.plan as p
        r['wrapped'] = getattr(p.MergePlanner._plan, '__mergekit_ram_prepass__', False)
        r['files'] = {{k: sys.modules[k].__file__ for k in
                      ('mergekit_ram', 'mergekit_ram._mergekit.finder', 'mergekit_ram.method',
                       'mergekit_ram._mergekit.pipeline', 'mergekit_ram._mergekit.tasks',
                       'mergekit_ram._mergekit.counting')}}
        r['finders'] = sum(type(f).__module__ == 'mergekit_ram._mergekit.finder' for f in sys.meta_path)
        print('RESULT ' + json.dumps(r))
        """
    )
    proc = _run([sys.executable, "-S", "-c", code], cwd=tmp_path)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["before"] is False
    assert result["hooked"] is True and result["torch_after_hook"] is False
    assert result["same"] is True and result["wrapped"] is True and result["finders"] == 1
    for name, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(target.resolve()), f"{name} loaded from {file}"
    assert "mergekit-ram" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- #
# Editable install
# --------------------------------------------------------------------------- #
@pytest.mark.quick
def test_editable_install_has_current_pth():
    if not Path(mergekit_ram.__file__).resolve().is_relative_to(REPO):
        pytest.skip(f"mergekit_ram is not installed editable from {REPO}")
    dist = metadata.distribution("mergekit-ram")
    installed = Path(dist.locate_file("mergekit_ram.pth"))
    if not installed.is_file():
        found = [Path(d) / "mergekit_ram.pth" for d in sys.path if (Path(d) / "mergekit_ram.pth").is_file()]
        assert found, "no mergekit_ram.pth in any site directory: reinstall with pip install -e ."
        installed = found[0]
    assert installed.read_text() == REPO_PTH.read_text(), (
        f"{installed} is stale; reinstall with pip install -e ."
    )
    # The editable path hook must run first, or the import in mergekit_ram.pth fails.
    path_hooks = [
        p for p in installed.parent.glob("*.pth")
        if p != installed and str(REPO) in p.read_text(errors="replace")
    ]
    assert path_hooks, "no .pth adds the repo to sys.path"
    assert all(p.name < installed.name for p in path_hooks), [p.name for p in path_hooks]


# --------------------------------------------------------------------------- #
# README set-up commands (section "Development") == CI
# --------------------------------------------------------------------------- #
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_SHELL = {"", "bash", "sh", "shell", "console", "zsh"}


def _logical_lines(text: str) -> list[str]:
    """Commands of a shell snippet: continuations joined, comments/blank lines and `$ ` dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:].strip()
        subshell = re.fullmatch(r"\(\s+(.*?)\s+\)", line)  # `( cmd )` runs cmd unchanged
        if subshell:
            line = subshell.group(1)
        if line and not line.startswith("#"):
            lines.append(re.sub(r"\s+", " ", line))
    return lines


def _setup_blocks(readme: str):
    """(heading, [block text, ...]) for the first heading titled "Development": the contributor's set-up."""
    lines = readme.splitlines()
    fence = None
    heading = level = None
    blocks, current = [], None
    for line in lines:
        match = _FENCE.match(line)
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not match.group(2):
                if current is not None:
                    blocks.append((current[0], "\n".join(current[1])))
                fence, current = None, None
            elif current is not None:
                current[1].append(line)
            continue
        if match:
            fence = match.group(1)
            if heading is not None:
                current = (match.group(2).lower(), [])
            continue
        found = _HEADING.match(line)
        if found:
            if heading is not None and len(found.group(1)) <= level:
                break
            if heading is None and re.fullmatch(r"development", found.group(2), re.I):
                heading, level = found.group(2), len(found.group(1))
    return heading, blocks


@pytest.mark.quick
def test_readme_setup_commands_are_what_ci_runs():
    readme_path, ci_path = REPO / "README.md", REPO / ".ci" / "run"
    assert readme_path.is_file(), "README.md is missing"
    assert ci_path.is_file(), ".ci/run is missing"
    heading, blocks = _setup_blocks(readme_path.read_text())
    assert heading is not None, "README.md has no heading 'Development' (e.g. '## Development')"
    assert len(blocks) == 2, (
        f"README section {heading!r} must hold exactly two fenced shell blocks "
        f"(1: install + example merge, 2: tests); found {len(blocks)}"
    )
    not_shell = [lang for lang, _ in blocks if lang not in _SHELL]
    assert not not_shell, f"README set-up blocks must be shell code, got {not_shell}"
    commands = [_logical_lines(text) for _, text in blocks]
    assert all(commands), f"an empty set-up block in README section {heading!r}"
    assert any("install" in c for c in commands[0]), f"first set-up block does not install: {commands[0]}"
    assert any("pytest" in c for c in commands[1]), f"second set-up block does not run pytest: {commands[1]}"

    ci = _logical_lines(ci_path.read_text())
    position = 0
    for block in commands:
        for command in block:
            assert command in ci[position:], (
                f".ci/run does not run the README set-up command (in order):\n  {command}\n"
                f".ci/run commands: {ci}"
            )
            position = ci.index(command, position) + 1


@pytest.mark.quick
def test_ci_stops_when_a_chained_command_fails():
    """`set -e` ignores a failure inside `a && b`: each chained line of .ci/run runs in a subshell."""
    text = re.sub(r"\\\n\s*", " ", (REPO / ".ci" / "run").read_text())
    chained = [line.strip() for line in text.splitlines()
               if "&&" in line and not line.strip().startswith("#")]
    assert chained, "expected the README's chained set-up line in .ci/run"
    bare = [line for line in chained if not re.fullmatch(r"\(\s+.*\s+\)", line)]
    assert not bare, f".ci/run goes on after a failure in these lines (wrap each in `( ... )`): {bare}"


#: the README's test command, stage 1 of .ci/run
TESTS = "python -m pytest -q -n 2"


@pytest.mark.quick
def test_contributing_checks_command_is_what_ci_runs():
    """CONTRIBUTING.md's checks command runs in .ci/run, after set-up command 1, before the tests."""
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## Checks", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, blocks
    (command,) = _logical_lines(blocks[0])
    assert "ruff check" in command and "ruff format --check" in command and "mypy" in command
    ci = _logical_lines((REPO / ".ci" / "run").read_text())
    assert command in ci, f".ci/run does not run the checks command:\n  {command}"
    assert ci.index(command) < ci.index(TESTS), "the checks must run before the tests"


@pytest.mark.quick
def test_ci_runs_the_suite_again_with_every_command_started_for_real():
    """The suite's commands are forks of warm interpreters (tests/zygote.py), which no CI stage checked against real
    starts: right after stage 1's suite, CI runs it again with forking off, and CONTRIBUTING.md names that stage."""
    command = 'MERGEKIT_RAM_TEST_FORK=0 python -m pytest -q -n 2 -p no:cacheprovider -m "not stage_one"'
    ci = _logical_lines((REPO / ".ci" / "run").read_text())
    assert command in ci, f".ci/run does not run the suite with every command started for real:\n  {command}"
    between = ci[ci.index(TESTS) + 1 : ci.index(command)]
    assert all(line.startswith(("set ", "stage ")) for line in between), between
    assert command in (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8"), "CONTRIBUTING.md does not name it"



# --------------------------------------------------------------------------- #
# README install lines say what they do on any machine (issue 31)
# --------------------------------------------------------------------------- #
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _install_groups() -> dict[str, list[str]]:
    """The Install section's shell block: each group is a comment (what it claims) and its commands."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Install section has no bash block"
    groups: dict[str, list[str]] = {}
    for chunk in block.group(1).strip().split("\n\n"):
        lines = chunk.strip().splitlines()
        assert lines[0].startswith("# "), f"an install group without its claim: {lines}"
        groups[lines[0][2:]] = [line for line in lines[1:] if line.strip()]
    return groups


@pytest.mark.quick
def test_readme_install_says_the_compiled_kernel_its_compiler_and_the_torch_path(tmp_path):
    """Issue 61: the README never said a C compiler is used, nor what happens without one. Its Install section names
    the folder the kernel is built into (`cachedir.native()` for this HOME), the compilers `build.find_compiler`
    looks for, and the torch path's same results, as `mergekit-ram --version` says them without a compiler."""
    section = (REPO / "README.md").read_text(encoding="utf-8").split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())  # as read, wherever its lines break
    code = (
        "import os\nfrom mergekit_ram.core import build, cachedir\n"
        "print(str(cachedir.native()).replace(os.path.expanduser('~'), '~', 1))\n"
        "print(build.find_compiler.__doc__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "XDG_CACHE_HOME", "MERGEKIT_RAM_CACHE")}
    folder, doc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                                 check=True).stdout.strip().split("\n", 1)  # fmt: skip
    assert f"`{folder}/`" in section and "`$XDG_CACHE_HOME/mergekit-ram`" in section, section
    assert "`$CC`, else `cc` or `gcc`" in doc and "`$CC` names, else `cc` or `gcc`" in section
    assert "compiled on first use" in section and "`MERGEKIT_RAM_NATIVE=0`" in section
    # without a compiler, `--version` says what the README says: the torch path, the same results
    empty = tmp_path / "bin"
    empty.mkdir()
    env.update(PATH=str(empty), HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "mergekit_ram.cli", "--version"], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.splitlines()[1]
    said = "cannot be built: no C compiler found ($CC unset, no cc or gcc on PATH); the torch kernel runs, the same results"
    assert line == f"fused CPU kernel: {said}, slower", line
    assert "the torch path runs instead and gives the same results" in section and "`mergekit-ram --version`" in section


@pytest.mark.quick
def test_readme_install_lines_name_what_they_claim():
    """The README said `pip install torch==2.13.0 .` "pins the CPU build": on PyPI, torch 2.13.0 for Linux x86-64
    is the CUDA build (it needs cuda-toolkit and nvidia-cudnn-cu13, measured with an isolated `pip install --dry-run
    --report`); it stayed CPU-only here because this machine's pip configuration finds a local torch-2.13.0+cpu."""
    groups = _install_groups()
    claims = {claim.split(":")[0].split(",")[0].strip(): commands for claim, commands in groups.items()}
    assert set(claims) == {"CPU only", "GPU machine", "wheel"}, list(groups)
    for claim, commands in claims.items():
        torch_lines = [c for c in commands if re.match(r"pip install torch\b", c)]
        if claim == "CPU only":
            assert torch_lines and all(CPU_INDEX in c for c in torch_lines), commands
        if claim == "GPU machine":
            assert torch_lines and not any("whl/cpu" in c for c in torch_lines), commands
        if claim == "wheel":
            assert any("python -m build" in c for c in commands) and any(
                re.fullmatch(r"pip install dist/mergekit_ram-\*\.whl", c) for c in commands
            ), commands
        else:
            assert commands[-1] == "pip install .", commands  # mergekit-ram from the checkout, after torch
    # nowhere does the README call a bare torch pin (no CPU index) the CPU build
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for sentence in re.split(r"(?<=[.:;])\s", text):
        if re.search(r"torch==[\d.]+", sentence) and re.search(r"\bCPU\b", sentence):
            assert "CUDA" in sentence or "whl/cpu" in sentence, sentence
    assert "pins the CPU build" not in text


# --------------------------------------------------------------------------- #
# The suite's extra installs what the suite needs; the policies stack is its own (issue 43)
# --------------------------------------------------------------------------- #
def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the test extra installs tomli
        import tomli as tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _extras() -> dict[str, list[str]]:
    return _pyproject()["project"]["optional-dependencies"]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.quick
def test_the_test_extra_leaves_the_policies_stack_out_and_ci_runs_it():
    """`pip install torch==2.13.0 -e ".[test]"` installed metaworld, mujoco, gymnasium and stable-baselines3 (86
    packages, 1.8 GB) for the policies benchmark's tests: they are the `policies` extra, and one CI stage
    installs it and runs them."""
    extras = _extras()
    policies = {_name(r) for r in extras["policies"]} - {"packaging"}
    assert {"metaworld", "mujoco", "gymnasium", "stable-baselines3"} <= policies
    test = {_name(r) for r in extras["test"]}
    assert not test & policies and not any(r.startswith("mergekit-ram[") for r in extras["test"]), extras["test"]
    ci = _logical_lines((REPO / ".ci" / "run").read_text())
    assert 'pip install -e ".[policies]" && python -m pytest -q tests/test_policies.py' in ci, ci
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        assert 'pip install -e ".[policies]"' in text and "tests/test_policies.py" in text, doc


def test_the_policies_tests_skip_without_their_extra_saying_how_to_install_it(tmp_path):
    block = "import sys; sys.modules.update(stable_baselines3=None, metaworld=None)\n"  # as if not installed
    (tmp_path / "sitecustomize.py").write_text(block)
    env = {**_env(), "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_policies.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode in (0, 5), done.stdout[-3000:] + done.stderr[-3000:]  # 5: the module skipped whole
    assert "1 skipped" in done.stdout and 'pip install -e ".[policies]"' in done.stdout, done.stdout[-3000:]


# --------------------------------------------------------------------------- #
# A quick way into the suite, and a quiet one (issue 43)
# --------------------------------------------------------------------------- #
def _test_modules() -> list[Path]:
    return sorted(p for p in (REPO / "tests").rglob("test_*.py"))


@pytest.mark.quick
def test_the_quick_subset_covers_every_test_module_and_is_documented():
    """`python -m pytest -q -m quick -n 2`: at least one test of each module is marked (a module's `pytestmark`
    counts too), the marker is registered (pytest warns about an unknown one), and README and CONTRIBUTING say so."""
    marked = re.compile(r"^\s*@pytest\.mark\.quick\b|^pytestmark\b.*\bpytest\.mark\.quick\b", re.M)
    unmarked = [str(p.relative_to(REPO)) for p in _test_modules() if not marked.search(p.read_text("utf-8"))]
    assert not unmarked, f"test modules with no test in the quick subset (mark one fast test): {unmarked}"
    options = _pyproject()["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("quick:") for m in options["markers"]), options
    for doc in ("README.md", "CONTRIBUTING.md"):
        assert "python -m pytest -q -m quick -n 2" in (REPO / doc).read_text(encoding="utf-8"), doc


@pytest.mark.quick
def test_no_test_writes_past_pytests_capture():
    """`-q` shows dots: a test's output is captured and shown only when it fails (or with `-rP`). A print under
    `capsys.disabled()` landed among the dots."""
    escapes = ("capsys.disabled(", "capfd.disabled(", "capsysbinary.disabled(", "sys.__stdout__", "sys.__stderr__")
    modules = [p for p in _test_modules() if p != Path(__file__).resolve()]
    found = [f"{p.relative_to(REPO)}: {e}" for p in modules for e in escapes if e in p.read_text("utf-8")]
    assert not found, found
