"""Model paths as people write them (issue 54): relative, without `./`, named like hub ids, run from another
folder, with the Hub offline (`HF_HUB_OFFLINE=1`) or unreachable (a loopback port nothing listens on).

* a finished `ramplus` merge keeps its card and `ram_stats.json` whatever the network: mergekit's card asks the
  Hub whether a local folder is also a repository (`is_hf`), which raised after every tensor was written;
* a relative path that is no folder from the working folder is one line before anything is retried, naming the
  working folder and the same path read from the config's folder;
* verify names the folder it looked in for a recorded relative input, and never asks the Hub about it.

Every command runs as a user runs it: the console script, in a subprocess, from a working folder of the test's.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import console_script, finished, read_stats
from hub_stub import hub_env, unreachable_url

#: transformers' line mergekit causes at every run, as it prints it (silenced in ramplus merges and our commands)
QUIET_ABOUT = {"[transformers] `torch_dtype` is deprecated! Use `dtype` instead!"}
#: the layout of a user's folder: the base and two agents named like hub ids (one slash, no `./`)
LAYOUT = {"base": "base", "A": "agents/code", "B": "acme/tooler"}


def network(tmp_path: Path, how: str) -> dict:
    """The environment of a process whose Hub is `offline` (HF_HUB_OFFLINE=1) or `unreachable`."""
    return hub_env(unreachable_url(), tmp_path / "hf-home", offline=how == "offline")


@pytest.fixture(scope="module")
def demo(qwen_bf16, tmp_path_factory) -> SimpleNamespace:
    """A user's folder: the models copied under relative names, `rel.yaml` naming them so, `other/` beside it."""
    root = tmp_path_factory.mktemp("demo")
    for who, name in LAYOUT.items():
        shutil.copytree(qwen_bf16.paths[who], root / name)
    config = {
        "merge_method": "ramplus",
        "base_model": LAYOUT["base"],
        "models": [{"model": LAYOUT["A"]}, {"model": LAYOUT["B"]}],
        "dtype": "bfloat16",
    }
    (root / "rel.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    (root / "other").mkdir()
    return SimpleNamespace(root=root, config=root / "rel.yaml", other=root / "other")


def run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=600)


# --------------------------------------------------------------------------- #
# A finished merge is never lost to the card's question
# --------------------------------------------------------------------------- #
@pytest.mark.quick
@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_relative_merge_keeps_its_card_whatever_the_network(demo, tmp_path, how):
    out = tmp_path / "out"
    done = run([console_script("mergekit-yaml"), "rel.yaml", str(out)], demo.root, network(tmp_path, how))
    assert done.returncode == 0, done.stderr[-3000:]
    finished(out)
    for name in ("README.md", "mergekit_config.yml", "ram_stats.json"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "* agents/code\n" in card and "* acme/tooler\n" in card  # local: no link to the Hub
    assert "huggingface.co/acme" not in card
    assert "Traceback" not in done.stderr
    assert read_stats(out)["inputs"]
    assert QUIET_ABOUT.isdisjoint(done.stderr.splitlines()) and "WARNING:mergekit_ram" not in done.stderr


def test_run_merge_keeps_its_card_offline(demo, tmp_path, monkeypatch):
    """`run_merge` called by a script, from the folder the paths are relative to, with the Hub offline."""
    from huggingface_hub import constants
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # repo_exists raises OfflineModeIsEnabled
    monkeypatch.chdir(demo.root)
    config = MergeConfiguration.model_validate(yaml.safe_load(demo.config.read_text(encoding="utf-8")))
    out = tmp_path / "out"
    run_merge(config, str(out), MergeOptions(quiet=True, write_model_card=True))
    finished(out)
    assert "* acme/tooler\n" in (out / "README.md").read_text(encoding="utf-8")


def test_mergekit_multi_keeps_its_card_unreachable(demo, tmp_path):
    recipe = demo.config.read_text(encoding="utf-8")
    (demo.root / "multi.yaml").write_text("name: ram\n" + recipe, encoding="utf-8")
    command = [console_script("mergekit-multi"), "multi.yaml", "--intermediate-dir", str(tmp_path / "inter")]
    done = run(command, demo.root, network(tmp_path, "unreachable"))
    assert done.returncode == 0, done.stderr[-3000:]
    finished(tmp_path / "inter" / "ram")
    assert (tmp_path / "inter" / "ram" / "README.md").is_file()


def test_another_methods_card_is_mergekits(demo, tmp_path, monkeypatch):
    """Outside a ramplus merge, `is_hf` is mergekit's own: it still asks about a folder named like a hub id."""
    from mergekit import card

    asked = []
    monkeypatch.setattr(card.huggingface_hub, "repo_exists", lambda path, **_: asked.append(path) or False)
    monkeypatch.chdir(demo.root)
    assert card.is_hf("acme/tooler") is False and asked == ["acme/tooler"]


def test_a_ramplus_card_never_asks_about_a_local_folder(demo, monkeypatch):
    import mergekit.merge  # noqa: F401  # is_hf is wrapped once mergekit.merge loads (as every merge loads it)
    from mergekit import card

    from mergekit_ram import session

    monkeypatch.setattr(card.huggingface_hub, "repo_exists", lambda *_, **__: pytest.fail("asked the Hub"))
    monkeypatch.chdir(demo.root)
    with session.active(session.MergeSession(config=None)):
        assert card.is_hf("acme/tooler") is False
        assert card.is_hf("org/elsewhere") is True  # not here: a hub id, said without asking






# --------------------------------------------------------------------------- #
# A relative path that is not here: one line before anything is retried
# --------------------------------------------------------------------------- #
def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 3, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Retry" not in done.stderr and "Traceback" not in done.stderr
    return lines[-1]


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_a_relative_config_run_from_elsewhere_is_one_line(demo, tmp_path, how):
    command = [console_script("mergekit-yaml"), "../rel.yaml", str(tmp_path / "out")]
    line = _one_line(run(command, demo.other, network(tmp_path, how)))
    assert f"is neither a folder in {demo.other} (paths are read from the folder you run in; " in line, line
    assert "from the config's folder it is " + str(demo.root) in line, line
    assert ("HF_HUB_OFFLINE is set" if how == "offline" else "could not be asked") in line, line
    assert not (tmp_path / "out").exists()


def test_inspect_of_a_relative_config_from_elsewhere_is_one_line(demo, tmp_path):
    command = [console_script("mergekit-ram"), "inspect", "../rel.yaml"]
    line = _one_line(run(command, demo.other, network(tmp_path, "unreachable")))
    assert line.startswith("mergekit-ram inspect: error: input model ") and f"in {demo.other} (" in line, line
    assert "from the config's folder it is " + str(demo.root) in line, line


def test_a_relative_input_file_of_mergekit_pytorch_from_elsewhere(flat_mlp, tmp_path):
    from helpers import flat_config_text

    here = tmp_path / "policies"
    here.mkdir()
    for who in ("base", "A", "B"):
        shutil.copy(flat_mlp.path(who), here / Path(flat_mlp.path(who)).name)
    names = {who: Path(flat_mlp.path(who)).name for who in ("base", "A", "B")}
    (here / "flat.yml").write_text(flat_config_text(flat_mlp, ("A", "B"), paths=names), encoding="utf-8")
    (tmp_path / "elsewhere").mkdir()
    command = [console_script("mergekit-pytorch"), "../policies/flat.yml", str(tmp_path / "out")]
    line = _one_line(run(command, tmp_path / "elsewhere", network(tmp_path, "offline")))
    assert f"does not exist in {tmp_path / 'elsewhere'} (paths are read from the folder you run in; " in line, line
    assert "from the config's folder it is " + str(here) in line, line


@pytest.mark.quick
def test_the_nearest_is_a_folder_for_a_folder_and_a_file_for_a_file(tmp_path, monkeypatch):
    from mergekit_ram.checks import paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "code.pt").write_bytes(b"")
    (tmp_path / "agents" / "codes").mkdir()
    (tmp_path / "agents_code.pt").write_bytes(b"")
    assert paths.nearest("agents/code", "folder") == "; did you mean agents/codes?"
    assert paths.nearest("agents/code", "file") == "; did you mean agents/code.pt?"
    assert paths.nearest("agent/code", "folder") == "; did you mean agents/codes?"  # not agents_code.pt
    assert paths.nearest(str(tmp_path / "agents" / "cod"), "file") == f"; did you mean {tmp_path}/agents/code.pt?"


# --------------------------------------------------------------------------- #
# verify: a recorded relative input is looked for here, and never asked of the Hub
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def mixed(demo, tmp_path_factory) -> SimpleNamespace:
    """A merge of `./base` (no hub id), `agents/code` and `acme/tooler` (named like hub ids), run in the demo's
    folder offline: its record names its inputs as written."""
    config = yaml.safe_load(demo.config.read_text(encoding="utf-8"))
    config["base_model"] = "./base"
    (demo.root / "mixed.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    env = network(tmp_path_factory.mktemp("hf"), "offline")
    done = run([console_script("mergekit-yaml"), "mixed.yaml", "merged-mixed"], demo.root, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return SimpleNamespace(folder=demo.root / "merged-mixed", labels=("base", "code", "tooler"))


def _verify(args: list[str], cwd: Path, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    """`mergekit-ram verify ARGS` with the Hub a stand-in that holds nothing: (the run, the requests it got)."""
    from hub_stub import HubStub

    with HubStub({}, lifetime=600) as stub:
        done = run([console_script("mergekit-ram"), "verify", *args], cwd, {**hub_env(stub.url, tmp_path), **env})
        return done, list(stub.requests)


def test_verify_names_the_folder_it_looked_in_and_asks_no_hub(demo, mixed, tmp_path):
    done, asked = _verify([str(mixed.folder)], demo.other, tmp_path / "hf")
    assert done.returncode == 3, done.stdout + done.stderr
    for written in ("./base", "agents/code", "acme/tooler"):
        line = next(line for line in done.stdout.splitlines() if f"({written}, " in line)
        assert f"cannot be read: no such folder in {demo.other} (a recorded relative input" in line, line
        assert "--input-dir DIR" in line, line
    assert "Repo id" not in done.stdout + done.stderr
    assert asked == []  # a recorded local folder is never asked of the Hub


def test_verify_from_the_merges_folder_asks_no_hub(demo, mixed, tmp_path):
    done, asked = _verify(["merged-mixed"], demo.root, tmp_path / "hf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert asked == []
    assert not any("torch_dtype" in line for line in done.stderr.splitlines()), done.stderr
    assert "WARNING:mergekit_ram" not in done.stderr


def test_verify_input_dir_expands_tilde(demo, mixed, tmp_path):
    home = tmp_path / "home"
    for label, name in zip(mixed.labels, ("base", "agents/code", "acme/tooler")):
        shutil.copytree(demo.root / name, home / "copies" / label)
    done, asked = _verify([str(mixed.folder), "--input-dir=~/copies"], demo.other, tmp_path / "hf", HOME=str(home))
    assert done.returncode == 0, done.stdout + done.stderr
    assert asked == []
    missing, _ = _verify([str(mixed.folder), "--input-dir=~/nothing"], demo.other, tmp_path / "hf", HOME=str(home))
    assert f"--input-dir {home}/nothing: no such folder" in missing.stderr, missing.stderr


@pytest.mark.quick
def test_verify_of_a_typo_that_is_neither_a_folder_nor_on_the_hub(demo, tmp_path):
    (demo.root / "merged").mkdir(exist_ok=True)
    done = run([console_script("mergekit-ram"), "verify", f"{demo.root.name}/mergd"], demo.root.parent,
               network(tmp_path, "unreachable"))  # fmt: skip
    line = done.stderr.strip()
    assert done.returncode == 3 and len(line.splitlines()) == 1, done.stdout + done.stderr
    assert line.startswith(f"mergekit-ram verify: cannot check: {demo.root.name}/mergd@main: the Hub at "), line
    assert f"; nor is {demo.root.name}/mergd a folder in {demo.root.parent}; did you mean " in line, line
    assert line.endswith(f"{demo.root.name}/merged?"), line


@pytest.mark.quick
def test_verify_of_a_local_typo_offers_the_nearest_folder(demo, capsys, monkeypatch):
    """Issue 61: `verify ./mereged` was `no such folder` alone, where `demo/mergd` (shaped like a hub id) got `did you
    mean`; now both, and a file, get the nearest existing folder (`paths.where`), as --input-dir does."""
    from mergekit_ram import cli

    (demo.root / "merged").mkdir(exist_ok=True)
    monkeypatch.chdir(demo.root)
    for typo in ("./mereged", "mereged"):
        assert cli.main(["verify", typo]) == 2
        out, err = capsys.readouterr()
        said = f"no such folder: {demo.root / 'mereged'}; did you mean {demo.root / 'merged'}?"
        assert out == "" and err == f"mergekit-ram verify: error: {said}\n"
    assert cli.main(["verify", "rel.yaml"]) == 2  # a file: the folder that holds it
    said = f"not a folder: {demo.root / 'rel.yaml'}; the nearest existing folder is {demo.root}"
    assert capsys.readouterr().err == f"mergekit-ram verify: error: {said}\n"
    assert cli.main(["verify", "merged", "--input-dir", "agnets"]) == 2
    assert capsys.readouterr().err == "mergekit-ram verify: error: --input-dir agnets: no such folder in " + (
        f"{demo.root}; did you mean agents?\n"
    )


def test_verify_of_a_mergekit_pytorch_merge_with_relative_files(flat_mlp, tmp_path):
    from helpers import flat_config_text

    here = tmp_path / "policies"
    here.mkdir()
    names = {who: Path(flat_mlp.path(who)).name for who in ("base", "A", "B")}
    for who, name in names.items():
        shutil.copy(flat_mlp.path(who), here / name)
    (here / "flat.yml").write_text(flat_config_text(flat_mlp, ("A", "B"), paths=names), encoding="utf-8")
    env = network(tmp_path, "offline")
    assert run([console_script("mergekit-pytorch"), "flat.yml", "merged"], here, env).returncode == 0
    done = run([console_script("mergekit-ram"), "verify", "policies/merged"], tmp_path, env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.count(f"cannot be read: no such file in {tmp_path} (a recorded relative input") == 3


# --------------------------------------------------------------------------- #
# What a run prints beside its answer
# --------------------------------------------------------------------------- #
def test_inspect_prints_no_deprecation_line(demo, tmp_path):
    done = run([console_script("mergekit-ram"), "inspect", "rel.yaml"], demo.root, network(tmp_path, "offline"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any("torch_dtype" in line for line in done.stderr.splitlines()), done.stderr
    assert "WARNING:mergekit_ram" not in done.stderr


@pytest.mark.quick
def test_a_commands_warnings_are_mergekit_ram_lines(tmp_path):
    """In a command's process our warnings read `mergekit-ram: warning: ...` (mergekit's basicConfig would print
    `WARNING:mergekit_ram:`); transformers' deprecation line is dropped, and only that line."""
    import sys

    script = (
        "import logging, sys\n"
        "sys.argv = ['mergekit-yaml']\n"
        "from mergekit_ram import errors\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "errors.show_warnings_as_lines(); errors.quiet_deprecated_dtype()\n"
        "logging.getLogger('mergekit_ram').warning('mergekit-ram: a said once')\n"
        "logging.getLogger('mergekit_ram').warning('ramplus: b')\n"
        "logging.getLogger('transformers.configuration_utils').warning(errors.DEPRECATED_DTYPE)\n"
        "logging.getLogger('transformers.configuration_utils').warning('another line')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines() == [
        "mergekit-ram: warning: a said once",
        "mergekit-ram: warning: ramplus: b",
        "WARNING:transformers.configuration_utils:another line",
    ], done.stderr


class _Terminal:
    """A stderr that says it is a terminal (`tty`) or a log file."""

    def __init__(self, tty: bool):
        import io

        self.text, self.tty = io.StringIO(), tty

    def write(self, text: str) -> int:
        return self.text.write(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "log"])
def test_our_progress_bars_count_tensors_and_keep_out_of_logs(monkeypatch, tty):
    import sys

    from mergekit_ram._mergekit import counting

    err = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert list(counting.counted(iter([(1, "a"), (2, "b"), (3, "c")]), 3, "Verifying", quiet=False)) == [
        (1, "a"), (2, "b"), (3, "c"),
    ]  # fmt: skip
    shown = err.text.getvalue()
    assert "Verifying: 100%" in shown and "3/3" in shown and "tensor" in shown, shown
    drawn = shown.split("\r")
    assert len(drawn) > 2 if tty else [part.split("|")[0] for part in drawn if part] == ["Verifying:   0%", "Verifying: 100%"]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_tilde_is_expanded_in_mergekits_path_options(command):
    import os

    from mergekit_ram import cli

    built = cli.COMMANDS[command][1]()
    given = built.make_context(command, ["x.yaml", "--transformers-cache=~/hc", "--lora-merge-cache=~/lora"])
    assert given.params["transformers_cache"] == os.path.expanduser("~/hc")
    assert given.params["lora_merge_cache"] == os.path.expanduser("~/lora")


def test_a_merge_of_local_folders_asks_the_hub_nothing_online(demo, tmp_path):
    """Online (a stand-in Hub that answers), folders named like hub ids are local in every step: not one request."""
    from hub_stub import HubStub

    with HubStub({}, lifetime=600) as stub:
        env = hub_env(stub.url, tmp_path / "hf")
        done = run([console_script("mergekit-yaml"), "rel.yaml", str(tmp_path / "out")], demo.root, env)
        asked = list(stub.requests)
    assert done.returncode == 0, done.stderr[-3000:]
    finished(tmp_path / "out")
    assert asked == []
