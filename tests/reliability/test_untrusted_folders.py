"""`mergekit-ram verify` on a stranger's folder: nothing from the folder runs code, every file a loader reads is
checked, "cannot check" is not "differs" (issue 29).

Decided behaviour: the folder's record is evidence, not an instruction: a recorded `trust_remote_code` runs an
input's `configuration_*.py` only with the user's own `--trust-remote-code` (else exit 3, saying what the
record asks); a recorded `lazy_unpickle` is never applied (pickles are read weights-only, the same tensors);
with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` set, a pickle mergekit would load without `weights_only` is refused
by name. A FIFO, a device or a link out of the folder is refused by name without being opened, at any depth an index names
(and a dangling link or a loop: exit 3, never 2); JSON and YAML are read bounded in size and nesting, and no
byte of a refused file is echoed. What a loader reads beside the weights is checked or a difference: the
single file transformers loads beside the index mergekit reads (and pickles with use_safetensors=False),
`config.json` against the config the merge writes, `ram_stats.json`'s statistics and the card's one visible
RAM+ section against the recomputed ones, the tokenizer and generation config files against the base's when
the merge copied them (a tokenizer it built is named as unchecked); a PEFT adapter, code, a tokenizer file the
base lacks are not the merge's (issue 39). An input that is gone, changed or unreadable is "cannot check" (exit 3), and
`--input RECORDED=LOCAL` reads a local copy (its identity checked). verify writes nothing: no statistics
cache entry, no kernel build, nothing under `$HOME`. Every failure is one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import config_yaml, flat_config_text, run_flat, tree
from safetensors.torch import load_file, save_file

MARKER_CODE = '''
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import Qwen2Config


class EvilConfig(Qwen2Config):
    pass
'''


def _verify(capsys, out, *flags) -> tuple[int, str, str]:
    from mergekit_ram import cli

    capsys.readouterr()
    code = cli.main(["verify", str(out), "-q", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _cannot_check(out: str, folder) -> str:
    """The reason verify gives for "cannot check" (exit 3): the line after its headline; no traceback."""
    lines = out.splitlines()
    assert lines[0].startswith(f"{folder}: CANNOT CHECK ("), out
    assert "Traceback" not in out
    return lines[1]


def _differs(out: str, folder) -> str:
    assert out.splitlines()[0].startswith(f"{folder}: NOT identical ("), out
    assert "Traceback" not in out
    return out


@pytest.fixture
def merged(qwen_bf16, run_yaml, tmp_path):
    """A fresh ramplus merge of A and B with its card (safe to damage)."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    return run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=tmp_path / "o").out


def _edit_stats(folder: Path, edit) -> None:
    path = folder / "ram_stats.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


class _Unblock:
    """Fail instead of hanging: a FIFO opened for reading blocks until a writer comes (inside safetensors, with the
    GIL held), so another process plays the writer, and says so, whenever someone opens `fifo` for reading."""

    WATCH = (
        "import os, sys, time\n"
        "while True:\n"
        "    try:\n"
        "        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK)\n"
        "    except OSError:\n"
        "        time.sleep(0.2)\n"
        "        continue\n"
        "    os.close(fd)\n"
        "    open(sys.argv[2], 'a').close()\n"
    )

    def __init__(self, fifo: Path):
        self.fifo, self.flag = fifo, fifo.parent.parent / "fifo-was-opened"

    @property
    def opened(self) -> bool:
        return self.flag.exists()

    def __enter__(self):
        self.watcher = subprocess.Popen([sys.executable, "-c", self.WATCH, str(self.fifo), str(self.flag)])
        return self

    def __exit__(self, *exc):
        self.watcher.kill()
        self.watcher.wait()


# ---------------------------------------------------------------- 1. no code from the folder runs


@pytest.fixture
def remote_code_merge(qwen_bf16, tmp_path):
    """A merge made with --trust-remote-code of inputs whose config.json names their own configuration module
    (`auto_map`), which writes a marker file when imported; the marker of the merge itself is removed."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    marker = tmp_path / "code-ran"
    inputs = {}
    for who in ("base", "A", "B"):
        folder = Path(shutil.copytree(qwen_bf16.paths[who], tmp_path / who))
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        (folder / "configuration_evil.py").write_text(MARKER_CODE.format(marker=str(marker)), encoding="utf-8")
        inputs[who] = folder
    text = config_yaml(inputs["base"], [inputs["A"], inputs["B"]])
    (tmp_path / "c.yml").write_text(text, encoding="utf-8")
    out = tmp_path / "merged"
    args = [str(tmp_path / "c.yml"), str(out), "--no-copy-tokenizer", "--quiet", "--trust-remote-code"]
    mergekit_yaml(args, standalone_mode=False)
    assert marker.exists()  # the merge ran the module, as asked
    marker.unlink()
    for name in [n for n in sys.modules if n.endswith("configuration_evil")]:
        del sys.modules[name]  # imported afresh by whoever imports it next
    yield out, marker, inputs
    _forget_copied_modules(inputs)


def _forget_copied_modules(inputs) -> None:
    """transformers copies a trusted model's module into its modules cache (under $HOME): remove our copies."""
    from transformers.dynamic_module_utils import HF_MODULES_CACHE

    for who in inputs:
        copied = Path(HF_MODULES_CACHE) / "transformers_modules" / who
        if any(copied.glob("**/configuration_evil.py")):
            shutil.rmtree(copied)


def test_recorded_trust_remote_code_runs_nothing_without_the_users_flag(rel, remote_code_merge, capsys):
    out, marker, inputs = remote_code_merge
    assert json.loads((out / "ram_stats.json").read_text())["merge"]["options"]["trust_remote_code"] is True
    rel.watch(out, *inputs.values())
    code, text, err = _verify(capsys, out)
    assert not marker.exists(), "verify ran the input's configuration module"
    assert code == 3, text + err
    rel.names(_cannot_check(text, out), "records trust_remote_code: true", "--trust-remote-code")
    found = json.loads(_verify(capsys, out, "--json")[1])
    assert (found["result"], found["exit_code"], found["merged"]) == ("cannot check", 3, False)
    assert not marker.exists()


def test_the_users_trust_remote_code_flag_lets_the_recorded_code_run(rel, remote_code_merge, capsys):
    out, marker, inputs = remote_code_merge
    rel.watch(out, *inputs.values())
    code, text, err = _verify(capsys, out, "--trust-remote-code")
    assert code == 0 and "bit-identical" in text, text + err
    assert marker.exists()  # the user asked for it


def test_the_flag_alone_runs_no_code_the_record_does_not_ask_for(rel, qwen_bf16, run_yaml, tmp_path, capsys):
    """--trust-remote-code lets recorded code run; a merge made without it is verified without it."""
    marker = tmp_path / "code-ran"
    base = Path(shutil.copytree(qwen_bf16.paths["base"], tmp_path / "base"))
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (base / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (base / "configuration_evil.py").write_text(MARKER_CODE.format(marker=str(marker)), encoding="utf-8")
    run = run_yaml(config_yaml(base, [qwen_bf16.path("A"), qwen_bf16.path("B")]), out=tmp_path / "o")
    assert not marker.exists()
    rel.watch(run.out, base)
    code, text, err = _verify(capsys, run.out, "--trust-remote-code")
    assert code == 0, text + err
    assert not marker.exists()


class _Touch:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _code_pickle(path: Path, marker: Path, tensors: dict) -> None:
    """A PyTorch checkpoint holding `tensors` and an object whose unpickling touches `marker`."""
    torch.save({**tensors, "zz.payload": _Touch(str(marker))}, str(path))


@pytest.mark.parametrize("forced", [False, True], ids=["weights-only", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_a_published_pickle_that_runs_code_is_never_unpickled(rel, qwen_bf16, run_yaml, tmp_path, capsys, monkeypatch,
                                                              forced):  # fmt: skip
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=tmp_path / "o", safe_serialization=False).out
    (weights,) = out.glob("*.bin")
    marker = tmp_path / "code-ran"
    _code_pickle(weights, marker, torch.load(str(weights), weights_only=True))
    if forced:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    rel.watch(out, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, out)
    assert not marker.exists(), "verify unpickled code"
    assert code == 3, text + err
    line = rel.names(_cannot_check(text, out), weights)
    if forced:
        rel.names(line, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set", "could run code")


def test_an_input_pickle_is_refused_under_torch_force_no_weights_only_load(rel, qwen_bf16, run_yaml, tmp_path, capsys,
                                                                           monkeypatch):  # fmt: skip
    """mergekit indexes a folder's lone pytorch_model.bin with torch.load and no weights_only: with the variable
    set that would unpickle fully, so the input is refused by name before mergekit opens it."""
    agent = tmp_path / "A"
    agent.mkdir()
    shutil.copy2(qwen_bf16.paths["A"] / "config.json", agent / "config.json")
    torch.save(load_file(str(qwen_bf16.paths["A"] / "model.safetensors")), str(agent / "pytorch_model.bin"))
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o")
    marker = tmp_path / "code-ran"
    _code_pickle(agent / "pytorch_model.bin", marker, torch.load(str(agent / "pytorch_model.bin"), weights_only=True))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    rel.watch(run.out, agent)
    code, text, err = _verify(capsys, run.out)
    assert not marker.exists(), "an input's pickle ran code"
    assert code == 3, text + err
    rel.names(_cannot_check(text, run.out), agent / "pytorch_model.bin", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


def test_a_recorded_lazy_unpickle_is_not_applied(rel, merged, qwen_bf16, capsys):
    _edit_stats(merged, lambda d: d["merge"]["options"].update(lazy_unpickle=True))
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 0, text + err  # the record says how the merge was run: evidence, read weights-only anyway
    rel.names(err, "records lazy_unpickle: true; verify reads pickles weights-only")


# ---------------------------------------------------------------- 3. no false "bit-identical"


def _single_beside_index(folder: Path, tamper: bool) -> None:
    tensors = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        tensors.update(load_file(str(shard)))
    if tamper:
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("tamper", [True, False], ids=["tampered", "same-tensors"])
def test_a_single_file_beside_an_index_is_checked_as_transformers_loads_it(rel, llama_sharded, run_yaml, capsys,
                                                                          tmp_path, tamper):  # fmt: skip
    from helpers import config_text

    run = run_yaml(config_text(llama_sharded, ["A", "B"]), out=tmp_path / "o", out_shard_size=4096)
    assert (run.out / "model.safetensors.index.json").exists()
    _single_beside_index(run.out, tamper)
    rel.watch(run.out, *llama_sharded.paths.values())
    code, text, err = _verify(capsys, run.out)
    if tamper:
        assert code == 1, text + err
        rel.names(_differs(text, run.out), "model.safetensors (what transformers' from_pretrained loads; mergekit "
                  "reads model.safetensors.index.json): 1 tensor(s) differ")  # fmt: skip
    else:
        assert code == 0, text + err
        rel.names(text, "model.safetensors, which transformers loads instead of model.safetensors.index.json")


@pytest.mark.parametrize(
    "key, value",
    [("rope_theta", 20000.0), ("rope_parameters", {"rope_theta": 20000.0, "rope_type": "default"}), ("rms_norm_eps", 1e-3)],
    ids=["rope_theta", "rope_parameters", "rms_norm_eps"],
)
def test_an_edited_config_json_is_named(rel, merged, qwen_bf16, capsys, key, value):
    path = merged / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    was = config.get(key)
    config[key] = value
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), f"config.json: {key} is {json.dumps(value)}, the merge writes")
    assert was is None or json.dumps(was) in text
    assert text.count("config.json:") == 1, text


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda d: d["agents"][0].update(**{"lambda": 3.0}), "ram_stats.json: agents[0].lambda: ram_stats.json records 3.0"),
        (lambda d: d["agents"][1].update(density=0.5), "ram_stats.json: agents[1].density: ram_stats.json records 0.5"),
        (lambda d: d["tensors"][0]["counts"].popitem(), "ram_stats.json: tensors[0].counts."),
    ],
    ids=["lambda", "density", "counts"],
)
def test_edited_published_statistics_are_named(rel, merged, qwen_bf16, capsys, edit, named):
    _edit_stats(merged, edit)
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), named)


def test_an_edited_card_section_is_named(rel, merged, qwen_bf16, capsys):
    card = merged / "README.md"
    text = card.read_text(encoding="utf-8")
    assert "## RAM+ statistics" in text
    card.write_text(text.replace("| agent |", "| agent (edited) |"), encoding="utf-8")
    rel.watch(merged, *qwen_bf16.paths.values())
    code, out, err = _verify(capsys, merged)
    assert code == 1, out + err
    rel.names(_differs(out, merged), "README.md: its RAM+ statistics section is not the one this merge writes")


@pytest.fixture
def with_tokenizer(qwen_bf16, tmp_path):
    """The base with tokenizer, chat template and generation config files (mergekit copies them byte for byte)."""
    base = Path(shutil.copytree(qwen_bf16.paths["base"], tmp_path / "base"))
    (base / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}', encoding="utf-8")
    (base / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}', encoding="utf-8")
    (base / "generation_config.json").write_text('{"temperature": 0.7}', encoding="utf-8")
    (base / "vocab.json").write_text('{"a": 0}', encoding="utf-8")
    return base


def test_copied_tokenizer_files_are_checked_and_the_rest_named(rel, with_tokenizer, qwen_bf16, run_yaml, tmp_path,
                                                               capsys):  # fmt: skip
    run = run_yaml(config_yaml(with_tokenizer, [qwen_bf16.path("A")]), out=tmp_path / "o", copy_tokenizer=True)
    assert (run.out / "generation_config.json").exists()
    (run.out / "vocab.json").write_text('{"b": 0}', encoding="utf-8")  # mergekit does not copy it
    rel.watch(with_tokenizer)
    code, text, err = _verify(capsys, run.out)
    assert code == 0, text + err
    summary = text.split("\nchecked:", 1)[1]  # one item a line
    rel.names(summary, "tokenizer_config.json, tokenizer.json, generation_config.json (copies of the base's)")
    rel.names(summary, "not checked:\n  vocab.json")
    (run.out / "generation_config.json").write_text('{"temperature": 2.0}', encoding="utf-8")
    code, text, err = _verify(capsys, run.out)
    assert code == 1, text + err
    rel.names(_differs(text, run.out), f"generation_config.json: not the base's ({with_tokenizer})")


# ---------------------------------------------------------------- 4. robustness: special files, links, depth


def _fifo_refused(rel, capsys, folder: Path, path: Path, inputs) -> None:
    """`path` made a FIFO: verify refuses it by name (exit 3) without opening it, writing nothing."""
    os.mkfifo(path)
    rel.watch(folder, *inputs)
    with _Unblock(path) as fifo:
        code, text, err = _verify(capsys, folder)
    assert not fifo.opened, "verify opened the FIFO"
    assert code == 3, text + err
    rel.names(_cannot_check(text, folder), f"{path} is a FIFO: not read")


@pytest.mark.quick
def test_a_fifo_named_model_safetensors_is_refused_unread(rel, merged, qwen_bf16, capsys):
    (merged / "model.safetensors").unlink()
    _fifo_refused(rel, capsys, merged, merged / "model.safetensors", qwen_bf16.paths.values())


def test_a_flat_record_naming_dev_zero_is_refused_unread(rel, flat_mlp, tmp_path, capsys):
    out = tmp_path / "flat-out"
    run_flat(flat_config_text(flat_mlp, ["A", "B"]), out)
    _edit_stats(out, lambda d: d["merge"]["config"]["models"][0].update(model="/dev/zero"))
    rel.watch(out)
    code, text, err = _verify(capsys, out)
    assert code == 3, text + err
    rel.names(_cannot_check(text, out), "/dev/zero is not a regular file", "not read")


def test_deeply_nested_ram_stats_json_is_one_line(rel, merged, capsys):
    (merged / "ram_stats.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    rel.watch(merged)
    code, text, err = _verify(capsys, merged)
    assert code == 3, text + err
    rel.names(_cannot_check(text, merged), merged / "ram_stats.json", "nests deeper than 64 levels")


@pytest.mark.quick
def test_deeply_nested_yaml_is_one_line(rel, merged, capsys):
    (merged / "mergekit_config.yml").write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    rel.watch(merged)
    code, text, err = _verify(capsys, merged)
    assert code == 3, text + err
    rel.names(_cannot_check(text, merged), merged / "mergekit_config.yml", "nests deeper than 64 levels")


@pytest.mark.parametrize("name", ["mergekit_config.yml", "ram_stats.json", "config.json"])
def test_a_link_out_of_the_folder_is_refused_and_not_echoed(rel, merged, capsys, name):
    path = merged / name
    path.unlink()
    path.symlink_to("/etc/passwd")
    rel.watch(merged)
    code, text, err = _verify(capsys, merged, "--json")
    assert code == 3, text + err
    found = json.loads(text)
    rel.names(found["error"], f"{path} is a link out of {merged}: not read")
    code, text, err = _verify(capsys, merged)
    assert "root:" not in text + err and "/bin/" not in text + err


def test_verify_writes_nothing_with_a_cold_cache_and_no_kernel_built(rel, qwen_bf16, run_yaml, tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    from mergekit_ram.core import native

    out = run_yaml(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")]),
                   out=tmp_path / "o").out  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(home / ".cache" / "mergekit-ram"))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_failed", None)
    before = tree([home, out])
    rel.watch(out, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, out)
    assert code == 0, text + err
    assert tree([home, out]) == before, "verify wrote files"
    assert not (home / ".cache").exists()


# ---------------------------------------------------------------- 4b. every file a loader reads, at any depth (issue 39)


@pytest.fixture
def sharded(qwen_bf16, run_yaml, tmp_path):
    """A fresh ramplus merge of A and B in several shards, with its index (safe to damage)."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=tmp_path / "o", out_shard_size=16384)
    assert (run.out / "model.safetensors.index.json").exists()
    return run.out


def _move_last_shard(folder: Path, where: str) -> tuple[Path, Path]:
    """The index's last shard moved to `where/` (a subfolder, created): (its new path, the index's old name for
    it, moved aside beside the folder). transformers and mergekit both join the index's name to the folder."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    last = sorted(set(index["weight_map"].values()))[-1]
    moved = folder / where / last
    moved.parent.mkdir(parents=True, exist_ok=True)
    aside = folder.parent / f"aside-{last}"
    shutil.move(str(folder / last), str(aside))
    index["weight_map"] = {k: (f"{where}/{v}" if v == last else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index), encoding="utf-8")
    return moved, aside


@pytest.mark.parametrize("where", ["sub", "a/b/c"], ids=["depth-1", "depth-3"])
def test_a_shard_an_index_names_in_a_subfolder_is_checked(rel, sharded, qwen_bf16, capsys, where):
    """The index may name a shard in a subfolder: read and compared, not listed as unchecked (issue 39, case 1)."""
    moved, aside = _move_last_shard(sharded, where)
    shutil.copy2(aside, moved)
    rel.watch(sharded, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, sharded)
    assert code == 0 and "bit-identical" in text, text + err
    assert "not checked:" not in text, text


@pytest.mark.parametrize("where", ["sub", "a/b/c"], ids=["depth-1", "depth-3"])
def test_a_fifo_an_index_names_in_a_subfolder_is_refused_unread(rel, sharded, qwen_bf16, capsys, where):
    """Before: verify blocked in open() for ever (issue 39, case 1)."""
    moved, _ = _move_last_shard(sharded, where)
    _fifo_refused(rel, capsys, sharded, moved, qwen_bf16.paths.values())


@pytest.mark.parametrize(
    "target, named",
    [("/dev/zero", "is a link out of"), ("outside", "is a link out of"),
     ("nothing", "is a link to nothing: not read"), ("loop", "is a loop of links: not read")],
    ids=["device", "out-of-the-folder", "dangling", "loop"],
)  # fmt: skip
def test_a_link_an_index_names_in_a_subfolder_is_refused_unread(rel, sharded, qwen_bf16, capsys, target, named):
    """Before: /dev/zero was opened and read; a dangling link or a loop exited 2, the usage error (case 1, 5)."""
    moved, aside = _move_last_shard(sharded, "sub")
    if target == "outside":
        moved.symlink_to(aside)  # the genuine shard, but outside the folder
    elif target == "loop":
        moved.symlink_to(moved.with_name("other"))
        moved.with_name("other").symlink_to(moved)
    else:
        moved.symlink_to(target if target.startswith("/") else moved.with_name(target))
    rel.watch(sharded, *qwen_bf16.paths.values())
    for flags in ((), ("--json",)):
        code, text, err = _verify(capsys, sharded, *flags)
        assert code == 3, text + err
        assert "Traceback" not in text + err
    assert json.loads(text)["exit_code"] == 3
    rel.names(_cannot_check(_verify(capsys, sharded)[1], sharded), moved, named)


@pytest.mark.parametrize("target", ["nothing", "loop"])
def test_a_dangling_link_or_loop_beside_the_weights_cannot_be_checked(rel, merged, qwen_bf16, capsys, target):
    """Before: exit 2, the usage error, with errno's text (issue 39, case 5)."""
    link = merged / "notes.txt"
    if target == "loop":
        (merged / "other.txt").symlink_to(link)
    link.symlink_to(merged / ("other.txt" if target == "loop" else "nothing"))
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged, "--json")
    assert code == 3 and json.loads(text)["exit_code"] == 3, text + err
    code, text, err = _verify(capsys, merged)
    assert code == 3, text + err
    rel.names(_cannot_check(text, merged), link, "a loop of links" if target == "loop" else "a link to nothing")


def _lora(folder: Path, q_proj: str, rows: int, cols: int) -> None:
    """A PEFT LoRA adapter on one q_proj, as `peft` saves one."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
              "base_model_name_or_path": str(folder), "layers_to_transform": [0]}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    prefix = "base_model.model." + q_proj.removesuffix(".weight")
    save_file({f"{prefix}.lora_A.weight": torch.ones(2, cols), f"{prefix}.lora_B.weight": torch.ones(rows, 2)},
              str(folder / "adapter_model.safetensors"))  # fmt: skip


def test_a_peft_adapter_beside_the_weights_is_a_difference(rel, merged, qwen_bf16, capsys):
    """transformers' from_pretrained applies it whenever peft is importable; before: exit 0, "bit-identical",
    both files under "Not checked" (issue 39, case 2)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    rows, cols = load_file(str(merged / "model.safetensors"))[name].shape
    _lora(merged, name, rows, cols)
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), "adapter_config.json, adapter_model.safetensors: a PEFT adapter",
              "a merge writes none")  # fmt: skip


def test_python_code_beside_the_weights_is_a_difference(rel, merged, qwen_bf16, capsys):
    """Code transformers runs with trust_remote_code (custom_generate/ at depth too); the merge wrote none."""
    (merged / "custom_generate").mkdir()
    (merged / "custom_generate" / "generate.py").write_text("import os\n", encoding="utf-8")
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), "custom_generate/generate.py: Python code", "trust_remote_code")


def test_a_named_chat_template_or_a_tokenizer_file_the_base_lacks_is_a_difference(rel, with_tokenizer, qwen_bf16,
                                                                                 run_yaml, tmp_path, capsys):  # fmt: skip
    """The tokenizer's loader reads them; the merge copies the base's files only."""
    run = run_yaml(config_yaml(with_tokenizer, [qwen_bf16.path("A")]), out=tmp_path / "o", copy_tokenizer=True)
    (run.out / "additional_chat_templates").mkdir()
    (run.out / "additional_chat_templates" / "tool_use.jinja").write_text("{{ evil }}", encoding="utf-8")
    (run.out / "special_tokens_map.json").write_text('{"eos_token": "<x>"}', encoding="utf-8")
    rel.watch(with_tokenizer)
    code, text, err = _verify(capsys, run.out)
    assert code == 1, text + err
    found = _differs(text, run.out)
    rel.names(found, "additional_chat_templates/tool_use.jinja: a loader reads it, and the merge writes none")
    rel.names(found, f"special_tokens_map.json: a loader reads it, and the merge writes none (it copies the base's "
              f"tokenizer files, and {with_tokenizer} has no special_tokens_map.json)")  # fmt: skip


def test_pickles_beside_safetensors_are_compared_as_transformers_loads_them(rel, merged, qwen_bf16, capsys):
    """transformers' from_pretrained(..., use_safetensors=False) reads pytorch_model.bin: compared too."""
    tensors = load_file(str(merged / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    torch.save(tensors, str(merged / "pytorch_model.bin"))
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), "pytorch_model.bin (what transformers' from_pretrained with "
              "use_safetensors=False loads; mergekit reads model.safetensors): 1 tensor(s) differ")  # fmt: skip


def _forge_card(folder: Path, how: str) -> None:
    card = folder / "README.md"
    text = card.read_text(encoding="utf-8")
    start = text.index("## RAM+ statistics")
    genuine = text[start:]
    forged = genuine.replace("r = 0.1,", "r = 0.5,")
    forged = re.sub(r"\| \d+\.\d\d% \|", "| 0.10% |", forged)
    assert forged != genuine
    if how == "copy-before":
        text = text[:start] + forged + "\n" + genuine
    elif how == "genuine-in-a-comment":
        text = text[:start] + "<!--\n" + genuine + "\n-->\n" + forged
    elif how == "genuine-in-code":
        text = text[:start] + forged + "\n```\n" + genuine + "\n```\n"
    elif how == "genuine-hidden":
        text = text[:start] + '<div style="display:none">\n\n' + genuine
    elif how == "table-appended":
        text = text + "\n| /tmp/x | 99.00% | 0.10% | 0.10% | 0.10% | 0.5 | 1.0500 |\n"
    elif how == "setext-copy-after":
        text = text + "\n\nRAM+ statistics\n---------------\n\n" + forged[len("## RAM+ statistics") :]
    card.write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "how, named",
    [("copy-before", "it has 2 RAM+ statistics sections a reader sees"),
     ("genuine-in-a-comment", "its RAM+ statistics section is not the one this merge writes"),
     ("genuine-in-code", "its RAM+ statistics section is not the one this merge writes"),
     ("genuine-hidden", "its RAM+ statistics section lies inside <div>, left open before it"),
     ("table-appended", "its RAM+ statistics section is not the one this merge writes"),
     ("setext-copy-after", "it has 2 RAM+ statistics sections a reader sees")],
    ids=["copy-before", "genuine-in-a-comment", "genuine-in-code", "genuine-hidden", "table-appended", "setext-copy"],
)  # fmt: skip
def test_a_forged_card_section_is_named(rel, merged, qwen_bf16, capsys, how, named):
    """The card holds exactly one RAM+ section a reader sees, the recomputed one; before: a forged copy before the
    genuine one, or the genuine one in an HTML comment, passed as "bit-identical" (issue 39, case 3)."""
    _forge_card(merged, how)
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), f"README.md: {named}")


def test_text_of_the_users_outside_the_section_is_the_users(rel, merged, qwen_bf16, capsys):
    """A license set and a section of one's own after the RAM+ one (the card is the user's to complete)."""
    card = merged / "README.md"
    text = card.read_text(encoding="utf-8").replace("# license:", "license: mit\n# was:")
    card.write_text(text + "\n## Evaluation\n\nOur own numbers.\n", encoding="utf-8")
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged)
    assert code == 0 and "the card's RAM+ section" in text, text + err


def test_a_published_tensor_the_merge_now_refuses_is_named(rel, qwen_bf16, make_model, run_yaml, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """A folder an earlier mergekit-ram wrote with inf from finite inputs (float16, lambda past 65,504): the merge
    now stops there, so the folder is not what it records (before: "bit-identical", exit 0; issue 39, case 4)."""
    from mergekit_ram.core import kernel

    fam = qwen_bf16.family
    name = "model.layers.1.mlp.down_proj.weight"
    half = lambda sd: {k: v.to(torch.float16) for k, v in sd.items()}  # noqa: E731
    a = half(fam.agents["A"])
    a[name].view(-1)[7] = 64992.0
    b = half(fam.agents["B"])
    b[name].view(-1)[7] = half(fam.base)[name].view(-1)[7]
    paths = [make_model(f"published-inf-{who}", sd, dtype=torch.float16)
             for who, sd in (("base", half(fam.base)), ("A", a), ("B", b))]  # fmt: skip
    with monkeypatch.context() as m:  # as before issue 39: the result written, inf and all
        m.setattr(kernel, "_raise_non_finite_result", lambda *args: None)
        run = run_yaml(config_yaml(paths[0], paths[1:], parameters={"r": 1.0}, dtype="float16"), out=tmp_path / "o")
    assert torch.isinf(load_file(str(run.out / "model.safetensors"))[name]).any()
    rel.watch(run.out, *paths)
    code, text, err = _verify(capsys, run.out)
    assert code == 1, text + err
    rel.names(_differs(text, run.out), f"not finite: {name}: tensor {name}: the merge of finite inputs is not finite "
              f"in float16", f"only {paths[1]} changed it", "verify stopped here, as the merge does")  # fmt: skip
    found = json.loads(_verify(capsys, run.out, "--json")[1])
    assert found["exit_code"] == 1 and found["tensors"][0]["status"] == "not finite"


def test_a_non_finite_recorded_value_still_prints_json(rel, merged, qwen_bf16, capsys):
    """Before: --json exited 2 with "Out of range float values are not JSON compliant" (issue 39, case 5)."""
    _edit_stats(merged, lambda d: d["inputs"][d["agents"][0]["label"]]["identity"].update(content_id=float("nan")))
    rel.watch(merged, *qwen_bf16.paths.values())
    code, text, err = _verify(capsys, merged, "--json")
    assert code == 3, text + err
    found = json.loads(text)  # strict JSON: no NaN token
    assert found["exit_code"] == 3 and found["inputs"][1]["recorded"]["content_id"] == "nan"
    assert _verify(capsys, merged)[0] == 3


def test_an_input_larger_than_the_address_space_limit_cannot_be_checked(rel, qwen_bf16, run_yaml, tmp_path):
    """safetensors maps a weight file whole: under `ulimit -v` (HPC schedulers) an input beyond it was a 40-line
    MemoryError traceback (issue 39, case 5). Here a sparse 256 GiB file under a 32 GiB limit."""
    import resource
    import struct

    from helpers import console_script

    agent = Path(shutil.copytree(qwen_bf16.paths["A"], tmp_path / "A"))
    run_dir = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o").out
    count = 128 << 30  # bf16 entries: 256 GiB, sparse
    header = json.dumps({"big": {"dtype": "BF16", "shape": [count], "data_offsets": [0, 2 * count]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(agent / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * count)
    limit = 32 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    rel.watch(agent)
    done = subprocess.run([console_script("mergekit-ram"), "verify", str(run_dir), "-q"], capture_output=True,
                          text=True, timeout=600, preexec_fn=cap)  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    rel.names(_cannot_check(done.stdout, run_dir), agent / "model.safetensors", "cannot be mapped into memory",
              "ulimit -v")  # fmt: skip


# ---------------------------------------------------------------- 5. for downloaders: cannot check, --input


def test_inputs_read_from_local_copies(rel, qwen_bf16, run_yaml, tmp_path, capsys):
    agent = Path(shutil.copytree(qwen_bf16.paths["A"], tmp_path / "A"))
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o")
    copy = tmp_path / "downloads" / "A"
    shutil.move(str(agent), str(copy))
    rel.watch(run.out, copy)
    code, text, _ = _verify(capsys, run.out)
    assert code == 3
    rel.names(_cannot_check(text, run.out), f"input A ({agent}, agent) cannot be read", "--input LABEL=COPY",
              "--input-dir DIR", "--inputs-from RECORDED_PARENT=LOCAL_PARENT")  # fmt: skip
    code, text, err = _verify(capsys, run.out, "--input", f"{agent}={copy}")
    assert code == 0 and "bit-identical" in text, text + err
    code, text, err = _verify(capsys, run.out, "--input", f"A={copy}")  # by its label
    assert code == 0 and "bit-identical" in text, text + err
    # a copy of another model stands for it: its identity is checked, not trusted
    code, text, err = _verify(capsys, run.out, "--input", f"{agent}={qwen_bf16.path('C')}")
    assert code == 3, text + err
    rel.names(_cannot_check(text, run.out), f"input A ({agent}, agent) changed: the copy {qwen_bf16.path('C')}")


def test_copies_that_map_no_input_or_one_twice_are_usage_errors(rel, qwen_bf16, run_yaml, tmp_path, capsys):
    """--inputs-from a folder no input lies under, --input-dir holding no copy named by a label, and one input
    mapped by two options: exit 2, one line naming it (issue 40, item 4)."""
    agent = Path(shutil.copytree(qwen_bf16.paths["A"], tmp_path / "runs" / "A"))
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o")
    empty = tmp_path / "empty"
    empty.mkdir()
    rel.watch(run.out, agent)
    for args, named in (
        (["--inputs-from", f"{tmp_path / 'elsewhere'}={tmp_path}"], f"no recorded input lies under {tmp_path / 'elsewhere'}"),
        (["--input-dir", str(empty)], f"--input-dir {empty} holds no copy named by an input's label (base, A, B)"),
        (["--input-dir", str(tmp_path / "runs"), "--input", f"A={agent}"], f"and --input-dir {tmp_path / 'runs'} both map {agent}"),
        (["--input-dir", str(tmp_path / "nothing")], f"--input-dir {tmp_path / 'nothing'}: no such folder"),
    ):  # fmt: skip
        code, text, err = _verify(capsys, run.out, *args)
        assert code == 2 and text == "", text + err
        (line,) = err.strip().splitlines()
        rel.names(line, "mergekit-ram verify: error: ", named)
    code, text, err = _verify(capsys, run.out, "--inputs-from", f"{tmp_path / 'runs'}={tmp_path / 'runs'}")
    assert code == 0 and "bit-identical" in text, text + err


def test_an_input_the_record_does_not_name_is_a_usage_error(rel, merged, capsys, tmp_path):
    code, text, err = _verify(capsys, merged, "--input", f"{tmp_path / 'nothing'}={tmp_path}")
    assert code == 2 and text == ""
    rel.names(err, "ram_stats.json records no input", tmp_path / "nothing")
    code, _, err = _verify(capsys, merged, "--input", "no-equals-sign")
    assert code == 2
    rel.names(err, "--input no-equals-sign: expected RECORDED=LOCAL")


def test_an_input_recorded_under_a_sweep_folder_is_mapped_once(rel, qwen_bf16, run_yaml, tmp_path, capsys):
    """A recorded name holding `=` (Hydra's `runs/lr=1e-5,seed=1/agent`) maps to its copy; two mappings of one
    input are a usage error naming it (issue 39, case 6)."""
    agent = Path(shutil.copytree(qwen_bf16.paths["A"], tmp_path / "runs" / "lr=1e-5,seed=1" / "agent"))
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]), out=tmp_path / "o")
    copy = tmp_path / "downloads" / "seed=1"
    shutil.move(str(agent), str(copy))
    rel.watch(run.out, copy)
    code, text, err = _verify(capsys, run.out, "--input", f"{agent}={copy}")
    assert code == 0 and "bit-identical" in text, text + err
    code, text, err = _verify(capsys, run.out, "--input", f"{agent}={copy}", "--input", f"{agent}={tmp_path}")
    assert code == 2 and text == "", text + err
    rel.names(err, f"--input maps {agent} twice ({copy} and {tmp_path})")


def test_a_mergekit_pytorch_input_read_from_a_local_copy(rel, flat_mlp, tmp_path, capsys):
    """The mergekit-pytorch door: the record names input files; --input maps one to a local copy."""
    private = tmp_path / "inputs"
    private.mkdir()
    paths = {}
    for who in ("base", "A", "B"):
        src = Path(flat_mlp.path(who, "safetensors"))
        paths[who] = str(shutil.copy2(src, private / src.name))
    out = tmp_path / "flat-out"
    run_flat(flat_config_text(flat_mlp, ["A", "B"], paths=paths), out)
    moved = tmp_path / "downloads" / Path(paths["A"]).name
    moved.parent.mkdir()
    shutil.move(paths["A"], moved)
    rel.watch(out, private, moved.parent)
    code, text, _ = _verify(capsys, out)
    assert code == 3
    rel.names(_cannot_check(text, out), f"input A.safetensors ({paths['A']}, agent)", "--input LABEL=COPY")
    code, text, err = _verify(capsys, out, "--input", f"{paths['A']}={moved}")
    assert code == 0 and "bit-identical" in text, text + err


def test_a_key_another_mergekit_ram_writes_is_a_note_not_a_difference(rel, merged, qwen_bf16, capsys):
    """ram_stats.json by another mergekit-ram version may hold keys this one does not write: a note; by this
    version, the same key is a difference."""
    from mergekit_ram.reporting import versions

    _edit_stats(merged, lambda d: d.update(future_key=1))
    rel.watch(qwen_bf16.paths["base"])
    code, text, err = _verify(capsys, merged)
    assert code == 1, text + err
    rel.names(_differs(text, merged), "ram_stats.json: future_key: ram_stats.json records it, the merge does not")
    now = versions.installed("mergekit-ram")
    _edit_stats(merged, lambda d: d["versions"].update(**{"mergekit-ram": "0.0.1"}))
    card = merged / "README.md"
    text = card.read_text(encoding="utf-8")
    assert text.count(f"mergekit-ram {now} ") == 2, text  # "Merged with ..." and the reproduce line
    card.write_text(text.replace(f"mergekit-ram {now} ", "mergekit-ram 0.0.1 "), encoding="utf-8")
    code, text, err = _verify(capsys, merged)
    assert code == 0, text + err
    rel.names(err, "future_key: ram_stats.json records it, the merge does not (written by mergekit-ram 0.0.1")
