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
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import console_script, finished, read_stats
from hub_stub import hub_env

#: the layout of a user's folder: the base and two agents named like hub ids (one slash, no `./`)
LAYOUT = {"base": "base", "A": "agents/code", "B": "acme/tooler"}


def unreachable_url() -> str:
    """A loopback URL nothing listens on: every request is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


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
