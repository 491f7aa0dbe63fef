"""`mergekit-ram verify` given bad folders, and run on folders merged with mergekit's options.

Decided behaviour: a folder that is not one verify checks is a usage error (exit 2) in one line naming
what is wrong: no such folder, no `ram_stats.json` (another method's output, an unfinished merge), a
`ram_stats.json` another program wrote or a newer mergekit-ram, no `mergekit_config.yml` (merged
without the card). A file that is there but cannot be read means verify cannot check the folder
(exit 3), said in one line naming it: a corrupt `ram_stats.json`, a `mergekit_config.yml` mergekit
cannot read or whose parameters are invalid, a damaged published weight file; an input that is gone
is named as such (exit 3, "CANNOT CHECK", nothing recomputed). With `--json` it is also a JSON
document (`result` "cannot check"). The untrusted folders (code, pickles, special files, links):
tests/reliability/test_untrusted_folders.py. Merges made with mergekit's options that change what is merged (`ram_stats.json`
records them) or how it is written (shards, `.bin`, clones, asynchronous writes) verify as
bit-identical. In every case verify writes nothing into the folder or an input.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import models
import pytest
import torch
from helpers import config_yaml, console_script, forbid_count, tree
from hub_stub import HubStub, hub_env


def _verify(capsys, out, *flags) -> tuple[int, str, str]:
    from mergekit_ram import cli

    capsys.readouterr()
    code = cli.main(["verify", str(out), "-q", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str, prefix: str = "mergekit-ram verify: error: ") -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def _cannot_check(out: str, folder) -> str:
    """The reason verify gives for "cannot check" (exit 3): the line after its headline, no traceback."""
    lines = out.splitlines()
    assert lines[0] == f"{folder}: CANNOT CHECK (1 reason):", out
    assert "Traceback" not in out
    return lines[1]


@pytest.fixture
def merged_ab(qwen_bf16, run_yaml, tmp_path):
    """A fresh ramplus merge of A and B (safe to damage)."""
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")]), out=tmp_path / "o")
    return run.out


# ---------------------------------------------------------------- usage errors: exit 2


@pytest.mark.quick
def test_no_such_folder(rel, capsys, tmp_path):
    code, out, err = _verify(capsys, tmp_path / "nowhere")
    assert code == 2 and out == ""
    rel.names(_one_line(err), "no such folder", tmp_path / "nowhere")


@pytest.mark.quick
def test_a_file_given_as_the_folder(rel, capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    rel.watch(tmp_path)
    code, _, err = _verify(capsys, tmp_path / "f")
    assert code == 2
    rel.names(_one_line(err), "not a folder", tmp_path / "f")


@pytest.mark.quick
def test_another_methods_folder(rel, qwen_bf16, run_yaml, capsys, tmp_path):
    """A merge by one of mergekit's own methods is checked from its mergekit_config.yml (issue 70), writing nothing;
    without the config, nothing says what was merged: exit 3, saying so."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    text = config_yaml(qwen_bf16.path("base"), agents, method="task_arithmetic", model_parameters={0: {"weight": 1.0}, 1: {"weight": 1.0}})
    run = run_yaml(text, out=tmp_path / "o")
    rel.watch(run.out, *qwen_bf16.paths.values())
    code, out, err = _verify(capsys, run.out)
    assert code == 0, out + err
    bare = Path(shutil.copytree(run.out, tmp_path / "bare"))
    (bare / "mergekit_config.yml").unlink()
    code, out, _ = _verify(capsys, bare)
    assert code == 3
    rel.names(_cannot_check(out, bare), bare, "neither ram_stats.json nor mergekit_config.yml")


@pytest.mark.parametrize(
    "content, named",
    [
        ('{"format": "someone-else", "method": "ramplus"}', "was not written by mergekit-ram"),
        ("[1, 2, 3]", "was not written by mergekit-ram"),
        ("RAMSTATS", "is not valid JSON"),
    ],
    ids=["foreign-format", "not-an-object", "not-json"],
)
def test_ram_stats_json_of_another_program_or_not_json(rel, merged_ab, qwen_bf16, capsys, content, named):
    (merged_ab / "ram_stats.json").write_text(content, encoding="utf-8")
    rel.watch(merged_ab, *qwen_bf16.paths.values())
    code, out, err = _verify(capsys, merged_ab)
    assert code == (3 if named == "is not valid JSON" else 2)
    rel.names(_cannot_check(out, merged_ab) if code == 3 else _one_line(err), merged_ab / "ram_stats.json", named)


def test_corrupt_ram_stats_json_is_a_data_error_also_in_json(rel, merged_ab, qwen_bf16, capsys):
    path = merged_ab / "ram_stats.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    rel.watch(merged_ab, *qwen_bf16.paths.values())
    code, out, err = _verify(capsys, merged_ab, "--json")
    assert code == 3 and err == ""
    rel.names(json.loads(out)["headline"], merged_ab, "CANNOT CHECK")
    found = json.loads(out)
    assert found["result"] == "cannot check" and found["merged"] is False and str(path) in found["error"]
    assert found["problems"] == [found["error"]]


def test_a_newer_format_version(rel, merged_ab, qwen_bf16, capsys):
    path = merged_ab / "ram_stats.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**data, "format_version": 99}), encoding="utf-8")
    rel.watch(merged_ab, *qwen_bf16.paths.values())
    code, _, err = _verify(capsys, merged_ab)
    assert code == 2
    rel.names(_one_line(err), path, "format_version 99", "upgrade mergekit-ram")


def test_a_merge_without_the_card_has_no_config_to_run(rel, qwen_bf16, run_yaml, capsys, tmp_path):
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=tmp_path / "o", write_model_card=False)
    rel.watch(run.out, *qwen_bf16.paths.values())
    code, _, err = _verify(capsys, run.out)
    assert code == 2
    rel.names(_one_line(err), run.out, "mergekit_config.yml", "--no-write-model-card")


# ---------------------------------------------------------------- data errors: exit 1


@pytest.mark.parametrize(
    "content, named",
    [
        ("merge_method: [unclosed\n", "is not valid YAML (line 2, column 1: "),
        ("just: text\n", "is not a mergekit config mergekit can read"),
        (None, "r"),  # an invalid parameter: the config's checks name it
    ],
    ids=["not-yaml", "not-a-config", "invalid-r"],
)
def test_a_config_that_cannot_be_run(rel, merged_ab, qwen_bf16, capsys, content, named):
    path = merged_ab / "mergekit_config.yml"
    if content is None:
        content = path.read_text(encoding="utf-8") + "parameters:\n  r: -1\n"
    path.write_text(content, encoding="utf-8")
    rel.watch(merged_ab, *qwen_bf16.paths.values())
    code, out, _ = _verify(capsys, merged_ab)
    assert code == 3
    rel.names(_cannot_check(out, merged_ab), path, named)


def test_an_input_that_is_gone_is_named(rel, qwen_bf16, run_yaml, capsys, tmp_path):
    agent = Path(shutil.copytree(qwen_bf16.paths["A"], tmp_path / "A"))
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o")
    shutil.rmtree(agent)
    rel.watch(run.out, *qwen_bf16.paths.values())
    code, out, _ = _verify(capsys, run.out)
    assert code == 3
    line = rel.names(_cannot_check(out, run.out), f"input A ({agent}, agent) cannot be read: no such folder")
    rel.names(line, "--input LABEL=COPY", "--input-dir DIR")  # a downloader is told how to point at local copies
    assert "nothing recomputed" in out


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_published_weight_file_is_named(rel, merged_ab, qwen_bf16, capsys, monkeypatch, damage):
    path = merged_ab / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header}")
    rel.watch(merged_ab, *qwen_bf16.paths.values())
    forbid_count(monkeypatch)  # the folder's weights are checked before any input is read
    code, out, _ = _verify(capsys, merged_ab)
    assert code == 3
    rel.names(_cannot_check(out, merged_ab), f"the weights in {merged_ab} cannot be read: {path}: ")


# ---------------------------------------------------------------- a Hub that lies: exit 3, nothing written outside


CRAFTED = "../../../../../escaped"  # from the Hub cache's snapshots folder: out of HF_HOME, beside it


class HostileHub(HubStub):
    """The suite's stand-in Hub serving `org/merged` at two commits (a: another merge's files, b: main), made to
    lie one way (`how`)."""

    def __init__(self, repos, how: str):
        self.how, self.release = how, threading.Event()
        super().__init__(repos, lifetime=900)
        self.a, self.b = self.shas["org/merged"]

    def close(self) -> None:
        self.release.set()  # a stalled answer ends
        super().close()

    def _commit(self, repo_id, revision):
        repo, sha = super()._commit(repo_id, revision)
        if self.how == "pinned-answered-by-another" and sha == self.a:
            return repo, self.b  # asked for commit a, it answers with b
        if self.how == "crafted-commit" and repo is not None and sha is None:
            return repo, repo.main  # answers whatever revision it is asked for (its own crafted one too)
        return repo, sha

    def _file(self, handler, repo_id, revision, filename, body):
        if self.how == "files-of-another-commit" and revision in ("main", self.b):
            revision = self.a  # the listing says b, every file comes from a
        return super()._file(handler, repo_id, revision, filename, body)

    def _json(self, handler, data, headers, body):
        if self.how == "listing-and-tree-disagree" and isinstance(data, list):
            data = [entry for entry in data if entry["path"] != "ram_stats.json"]  # the listing names it
        if self.how == "crafted-commit" and isinstance(data, dict):
            data = {**data, "sha": CRAFTED}
        return super()._json(handler, data, headers, body)

    def _send(self, handler, status, data, headers, body, content_type="text/plain"):
        path = handler.path.split("?")[0]
        if self.how == "crafted-commit" and "X-Repo-Commit" in headers:
            headers = {**headers, "X-Repo-Commit": CRAFTED}
        metadata = path.startswith("/api/models/") and "/tree/" not in path
        if body and status == 200 and self.how == {True: "stall-in-metadata", False: "stall-in-the-tree"}.get(
            metadata if path.startswith("/api/") else None
        ):
            with self._lock:
                self.requests.append((handler.command, handler.path, status))
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            self.release.wait(900)  # stops answering mid-answer
            return
        return super()._send(handler, status, data, headers, body, content_type)


LIES = {
    # how: (what verify is asked, words of its one line: {a}, {b} the two commits)
    "crafted-commit": ("org/merged", [repr(CRAFTED), "not 40 hex digits"]),
    "pinned-answered-by-another": ("org/merged@{a}", ["commit {b}", "not the commit {a}"]),
    "files-of-another-commit": ("org/merged", ["commit {a}", "not the commit {b}"]),
    "listing-and-tree-disagree": ("org/merged", ["answers disagree", "commit {b}", "ram_stats.json"]),
    "stall-in-metadata": ("org/merged", ["could not be asked", "Timeout"]),
    "stall-in-the-tree": ("org/merged", ["could not be asked", "Timeout"]),
}


#: lies told in the tree listing, which only a huggingface_hub that asks for it hears
TREE_LIES = ("listing-and-tree-disagree", "stall-in-the-tree")


@pytest.mark.parametrize("how", list(LIES))
def test_a_hub_that_lies_is_cannot_check_in_one_line(rel, merged_ab, qwen_bf16, tmp_path, how):
    """`mergekit-ram verify ORG/NAME` believes only what it checks: a commit id that is no commit, a pinned commit
    answered by another, files of another commit, a listing its tree contradicts, an answer that stops midway:
    exit 3 in one line naming the commits, within the bounds huggingface_hub's timeouts set (2 s here), and
    nothing written outside HF_HOME. A huggingface_hub that never asks the tree (the floors') never hears its lies:
    then the verdict is the true one."""
    other = Path(shutil.copytree(merged_ab, tmp_path / "other"))
    (other / "README.md").write_text("another merge's card\n", encoding="utf-8")
    root = tmp_path / "root"  # HF_HOME's parent: nothing may appear here but HF_HOME
    (root / "cwd").mkdir(parents=True)
    home = root / "home"
    rel.watch(merged_ab, other, *qwen_bf16.paths.values())
    before = tree([tmp_path])
    with HostileHub({"org/merged": [other, merged_ab]}, how) as stub:
        env = {**hub_env(stub.url, home), "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
        asked, words = LIES[how]
        started = time.monotonic()
        done = subprocess.run(
            [console_script("mergekit-ram"), "verify", asked.format(a=stub.a, b=stub.b), "-q"],
            capture_output=True, text=True, timeout=300, env=env, cwd=str(root / "cwd"),
        )  # fmt: skip
        took = time.monotonic() - started
        commits = {"a": stub.a, "b": stub.b}
        tree_asked = any("/tree/" in path for _, path, _ in stub.requests)
    if how in TREE_LIES and not tree_asked:
        # huggingface_hub before 1.22 (pip takes 1.16.1 at the floors) downloads what the metadata lists, never
        # asking the tree: the lie is never told, and the verdict is the true one, of commit b's files
        assert done.returncode == 0, (took, done.stdout[-3000:] + done.stderr[-3000:])
        assert done.stdout.startswith(f"org/merged@{stub.b}: bit-identical"), done.stdout[-3000:]
    else:
        assert done.returncode == 3, (took, done.stdout[-3000:] + done.stderr[-3000:])
        assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr[-3000:]
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("mergekit-ram verify: cannot check: org/merged@"), done.stderr[-3000:]
        rel.names(line, *(w.format(**commits) for w in words))
    after = tree([tmp_path])
    outside = sorted(p for p in set(after) ^ set(before) if not p.startswith(str(home)) and p != str(root))
    assert outside == [], outside  # nothing written outside HF_HOME
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.glob("escaped*"))


# ---------------------------------------------------------------- no false alarm across mergekit's options


def _wider_agent(qwen, folder: Path, rows: int) -> Path:
    """Agent A with `rows` more vocabulary rows (embeddings and lm_head)."""
    gen = torch.Generator().manual_seed(5)
    sd = dict(qwen.family.agents["A"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = (torch.rand(rows, sd[name].shape[1], generator=gen) - 0.5).to(sd[name].dtype)
        sd[name] = torch.cat([sd[name], extra])
    config = models.make_config("qwen2", False, torch.bfloat16)
    config.vocab_size += rows
    return models.write_checkpoint(folder, config, sd).resolve()


OPTIONS = {
    # mergekit-yaml flags: those that change what is merged are recorded in ram_stats.json and verify uses them
    "unsafe-truncate-embeddings": ["--unsafe-truncate-embeddings"],
    "lazy-unpickle": ["--lazy-unpickle"],
    "allow-crimes": ["--allow-crimes"],
    "out-shard-size": ["--out-shard-size", "4K"],
    "no-safe-serialization": ["--no-safe-serialization"],
    "clone-tensors": ["--clone-tensors"],
    "async-write": ["--async-write", "--write-threads", "2"],
    "low-cpu-memory": ["--low-cpu-memory"],
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_merges_with_mergekit_options_verify(rel, qwen_bf16, capsys, tmp_path, option):
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    first = _wider_agent(qwen_bf16, tmp_path / "A-wide", 8) if option == "unsafe-truncate-embeddings" else None
    agents = [str(first or qwen_bf16.path("A")), qwen_bf16.path("B")]
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), agents), encoding="utf-8")
    out = tmp_path / "merged"
    mergekit_yaml([str(config), str(out), "--no-copy-tokenizer", "--quiet", *OPTIONS[option]], standalone_mode=False)
    recorded = json.loads((out / "ram_stats.json").read_text(encoding="utf-8"))["merge"]["options"]
    flag = OPTIONS[option][0].removeprefix("--").replace("-", "_")
    if flag in recorded:
        assert recorded[flag] is True, recorded
    names = sorted(p.name for p in out.iterdir())
    rel.watch(out, *qwen_bf16.paths.values(), *([first] if first else []))
    code, text, err = _verify(capsys, out)
    assert code == 0, text + err
    assert "bit-identical" in text, text
    if option == "no-safe-serialization":
        assert "pytorch_model.bin" in names, names
    if option == "unsafe-truncate-embeddings":  # without the recorded option the wider agent cannot be planned
        stats = out / "ram_stats.json"
        data = json.loads(stats.read_text(encoding="utf-8"))
        data["merge"]["options"]["unsafe_truncate_embeddings"] = False
        copy = Path(shutil.copytree(out, tmp_path / "without-the-option"))
        (copy / "ram_stats.json").write_text(json.dumps(data), encoding="utf-8")
        code, text, err = _verify(capsys, copy)
        assert code == 3, text + err
        rel.names(_cannot_check(text, copy), "Tensor size mismatch for model.embed_tokens.weight")
