"""Where mergekit-ram came from, in every way pip installs it, as `ram_stats.json` records it and the card says it
(issue 40, item 2).

Each install mode is a fake distribution put first on `sys.path` (a `mergekit_ram-0.1.0.dist-info` holding
METADATA and the `direct_url.json` pip writes, PEP 610), so `importlib.metadata` finds it as it finds an
installed one; checkouts are real git repositories in a temporary folder. A project URL is declared in the
fake METADATA (`Project-URL: Source, ...`), never in pyproject.toml. For every mode: no local path in the
record or the card, and where a command can install that code, the card gives one pip accepts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mergekit_ram.reporting import card, report

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SOURCE = "https://example.org/ram/mergekit-ram"
VERSIONS = {"mergekit-ram": "0.1.0", "mergekit": "0.1.5", "torch": "2.13.0"}


def install(root: Path, monkeypatch, direct_url: dict | None, *, source: str | None = None) -> None:
    """A fake installed mergekit-ram 0.1.0 found first on sys.path: its METADATA (with a declared Source URL) and
    the direct_url.json pip writes for the install (None: an index install, which writes none)."""
    site = root / "site"
    info = site / "mergekit_ram-0.1.0.dist-info"
    info.mkdir(parents=True)
    metadata = ["Metadata-Version: 2.4", "Name: mergekit-ram", "Version: 0.1.0", "Project-URL: Paper, https://arxiv.org/abs/2601.13572"]
    if source:
        metadata.append(f"Project-URL: Source, {source}")
    (info / "METADATA").write_text("\n".join(metadata) + "\n", encoding="utf-8")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url), encoding="utf-8")
    monkeypatch.syspath_prepend(str(site))


def git_repo(path: Path, *, origin: str | None = None) -> str:
    """A git work tree at `path` with one commit (and `origin`); its commit."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path.mkdir(parents=True)
    env = ["-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false"]
    (path / "pyproject.toml").write_text("[project]\nname = 'mergekit-ram'\n", encoding="utf-8")
    for args in (["init", "-q"], ["add", "."], [*env, "commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True)
    if origin:
        subprocess.run(["git", "-C", str(path), "remote", "add", "origin", origin], check=True, capture_output=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def recorded(tmp_path: Path) -> tuple[dict, str]:
    """What a merge records now (`report.installed_from`) and the card's reproduce sentence; neither holds a local
    path."""
    found = report.installed_from()
    sentence = card.reproduce_sentence({"versions": VERSIONS, "mergekit_ram_source": found, "merge": {}})
    assert str(tmp_path) not in json.dumps(found) and str(tmp_path) not in sentence, (found, sentence)
    assert "file:" not in json.dumps(found) and "file:" not in sentence
    return found, sentence


def pip_spec(sentence: str) -> str:
    """The argument of the card's `pip install "..."`, checked to be one pip accepts (a PEP 508 requirement, or a
    URL it installs from); "" when the card gives no command."""
    from packaging.requirements import Requirement

    if '`pip install "' not in sentence:
        return ""
    spec = sentence.split('`pip install "', 1)[1].split('"`', 1)[0]
    Requirement(spec if spec.startswith("mergekit-ram") else f"mergekit-ram @ {spec}")  # raises when malformed
    return spec


def test_a_git_url_install_gives_that_url_at_its_commit_without_credentials(tmp_path, monkeypatch):
    url = "https://user:token@example.org/ram/mergekit-ram.git"
    install(tmp_path, monkeypatch, {"url": url, "vcs_info": {"vcs": "git", "commit_id": COMMIT}})
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "git", "url": "https://example.org/ram/mergekit-ram.git", "commit": COMMIT}
    assert pip_spec(sentence) == f"git+https://example.org/ram/mergekit-ram.git@{COMMIT}"
    assert "token" not in sentence and "user" not in json.dumps(found)


@pytest.mark.parametrize("origin, declared, url", [
    ("git@example.org:ram/mergekit-ram.git", None, "ssh://git@example.org/ram/mergekit-ram.git"),
    ("/srv/local/mirror.git", SOURCE, SOURCE),  # a local origin is no public repository: the declared Source
    (None, None, None),
], ids=["origin", "declared-source", "neither"])  # fmt: skip
def test_a_file_git_url_is_treated_as_a_checkout(tmp_path, monkeypatch, origin, declared, url):
    """`pip install "git+file:///<clone>@<commit>"` recorded the clone's path in the card and ram_stats.json."""
    clone = tmp_path / "clone"
    commit = git_repo(clone, origin=origin)
    install(tmp_path, monkeypatch, {"url": f"file://{clone}", "vcs_info": {"vcs": "git", "commit_id": commit}},
            source=declared)  # fmt: skip
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "git", "commit": commit, **({"url": url} if url else {})}
    if url:
        assert pip_spec(sentence) == f"git+{url}@{commit}"
    else:
        assert pip_spec(sentence) == "" and "names no public repository" in sentence and commit in sentence


def test_an_editable_checkout_says_its_commit_and_uncommitted_changes(tmp_path, monkeypatch):
    """A checkout with uncommitted changes was recorded as its commit, with no mark that the code differed."""
    tree = tmp_path / "checkout"
    commit = git_repo(tree, origin="https://example.org/ram/mergekit-ram.git")
    install(tmp_path, monkeypatch, {"url": f"file://{tree}", "dir_info": {"editable": True}})
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "editable", "url": "https://example.org/ram/mergekit-ram.git", "commit": commit}
    assert pip_spec(sentence) == f"git+https://example.org/ram/mergekit-ram.git@{commit}"
    assert "uncommitted" not in sentence
    (tree / "pyproject.toml").write_text("[project]\nname = 'changed'\n", encoding="utf-8")
    found, sentence = recorded(tmp_path)
    assert found["changes"] == "uncommitted" and "plus uncommitted changes" in sentence


def test_a_checkout_without_a_public_repository_says_what_is_missing(tmp_path, monkeypatch):
    tree = tmp_path / "checkout"
    commit = git_repo(tree)  # no origin, and the project declares no Source URL
    install(tmp_path, monkeypatch, {"url": f"file://{tree}", "dir_info": {"editable": True}})
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "editable", "commit": commit}
    assert pip_spec(sentence) == ""
    assert f"at commit `{commit}`, which names no public repository" in sentence and "Source URL" in sentence


def test_the_declared_source_url_is_read_from_the_distributions_metadata(tmp_path, monkeypatch):
    """What the maintainers add to pyproject.toml's [project.urls] (one line, `Source = "..."`) reaches the card
    through the installed metadata."""
    tree = tmp_path / "checkout"
    commit = git_repo(tree)
    install(tmp_path, monkeypatch, {"url": f"file://{tree}", "dir_info": {"editable": True}}, source=SOURCE)
    found, sentence = recorded(tmp_path)
    assert found["url"] == SOURCE and pip_spec(sentence) == f"git+{SOURCE}@{commit}"


def test_a_folder_installed_without_e_says_its_changes_are_unknown(tmp_path, monkeypatch):
    tree = tmp_path / "checkout"
    commit = git_repo(tree)
    install(tmp_path, monkeypatch, {"url": f"file://{tree}", "dir_info": {}}, source=SOURCE)
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "checkout", "url": SOURCE, "commit": commit, "changes": "unknown"}
    assert pip_spec(sentence) == f"git+{SOURCE}@{commit}"
    assert "pip records neither the commit nor the uncommitted changes" in sentence


def test_a_folder_that_is_no_git_checkout_names_no_commit(tmp_path, monkeypatch):
    (tmp_path / "plain").mkdir()
    install(tmp_path, monkeypatch, {"url": f"file://{tmp_path / 'plain'}", "dir_info": {}}, source=SOURCE)
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "checkout"} and pip_spec(sentence) == ""
    assert "not a git checkout" in sentence


@pytest.mark.parametrize("file, kind", [
    ("mergekit_ram-0.1.0-py3-none-any.whl", "wheel"), ("mergekit_ram-0.1.0.tar.gz", "sdist"),
])  # fmt: skip
def test_a_local_wheel_or_sdist_names_itself_and_the_declared_source(tmp_path, monkeypatch, file, kind):
    """An sdist was called "the wheel `….tar.gz`"."""
    url = f"file://{tmp_path}/dist/{file}"
    install(tmp_path, monkeypatch, {"url": url, "archive_info": {"hashes": {"sha256": "f0" * 32}}}, source=SOURCE)
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": kind, "archive": file, "sha256": "f0" * 32, "project_url": SOURCE}
    assert f"the {kind} `{file}` (sha256 `{'f0' * 32}`)" in sentence and pip_spec(sentence) == ""
    assert SOURCE in sentence and f"not the commit the {kind} was built from" in sentence


def test_a_wheel_from_a_url_gives_that_url(tmp_path, monkeypatch):
    url = "https://example.org/dist/mergekit_ram-0.1.0-py3-none-any.whl"
    install(tmp_path, monkeypatch, {"url": url, "archive_info": {"hash": "sha256=" + "ab" * 32}})
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "wheel", "url": url, "archive": url.rsplit("/", 1)[1], "sha256": "ab" * 32}
    assert pip_spec(sentence) == url


def test_an_index_install_gives_its_version(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, None)
    found, sentence = recorded(tmp_path)
    assert found == {"installed_from": "index"} and pip_spec(sentence) == "mergekit-ram==0.1.0"
