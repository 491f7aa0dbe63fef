"""Damaged and odd files: truncated or corrupt safetensors, lying headers, missing config.json
or shards, read-only inputs, output folders that are inputs or hold files, unusual path
names, pickle (.bin) checkpoints.

Decided behaviour: a damaged input is an error naming the file (and the tensor, when a
header entry lies), raised before mergekit opens it; a folder mergekit cannot use is an
error naming it; a pickle that names anything but tensors is refused without being
unpickled (mergekit 0.1.5 has no opt-in for arbitrary pickles: it loads with
weights_only=True or its restricted lazy unpickler); everything else merges and equals
the reference. Older cases counted here: tests/test_report.py (output folder equal to,
inside, or a symlink to an input).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from helpers import config_yaml, console_script, copy_models, finished, inputs, no_weights


def _header(path: Path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _edit(fn):
    def damage(path: Path):
        header, data = _header(path)
        fn(header)
        _write(path, header, data)

    return damage


def _offsets_lie(h):
    h[_last(h)]["data_offsets"][1] += 2


def _overlap(h):
    name = _last(h)
    h[name]["data_offsets"] = [h[name]["data_offsets"][0] - 2, h[name]["data_offsets"][1] - 2]


def _shape_lies(h):
    h["model.layers.0.mlp.up_proj.weight"]["shape"] = [48, 16]


def _dtype_lies(h):
    h["model.layers.0.mlp.up_proj.weight"]["dtype"] = "F32"


def _bytes(fn):
    def damage(path: Path):
        path.write_bytes(fn(path.read_bytes()))

    return damage


def _not_json(raw: bytes) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[:8] + b"{" + b"\x00" * (n - 1) + raw[8 + n :]


DAMAGE = {
    # name: (damage, words the message must hold besides the file, the fix and safetensors' own reason:
    # None when that reason is all, or a function of the intact header)
    "truncated-in-data": (_bytes(lambda b: b[: len(b) // 2]), "truncated download"),
    "truncated-in-header": (_bytes(lambda b: b[:100]), "truncated download"),
    "empty-file": (_bytes(lambda b: b""), "truncated download"),
    "random-bytes": (_bytes(lambda b: os.urandom(4096)), None),
    "header-not-json": (_bytes(_not_json), None),
    "trailing-bytes": (_bytes(lambda b: b + b"\x00" * 100), None),
    "offsets-lie": (_edit(_offsets_lie), "offsets span"),
    "offsets-overlap": (_edit(_overlap), _last),
    "shape-lies": (_edit(_shape_lies), "model.layers.0.mlp.up_proj.weight"),
    "dtype-lies": (_edit(_dtype_lies), "model.layers.0.mlp.up_proj.weight"),
}


def _safetensors_reason(path: Path) -> str:
    """What safetensors itself says of the file (the check is its own; its wording changes between versions)."""
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError) as info, safe_open(str(path), framework="pt"):
        pass
    return str(info.value).removeprefix("Error while deserializing header: ")


@pytest.mark.quick
@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("who", ["agent", "base"])
def test_damaged_safetensors_is_named(rel, qwen_bf16, run_yaml, tmp_path, how, who):
    copies = copy_models({"base": qwen_bf16.paths["base"], "A": qwen_bf16.paths["A"]}, tmp_path / "m")
    target = copies["A" if who == "agent" else "base"] / "model.safetensors"
    damage, words = DAMAGE[how]
    if callable(words):
        words = words(_header(target)[0])
    damage(target)
    rel.watch(*copies.values(), qwen_bf16.paths["B"])
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(copies["base"], [copies["A"], qwen_bf16.path("B")]), out=tmp_path / "o")
    reason = _safetensors_reason(target)
    culprits = [target, "not a valid safetensors file", reason, "fetch it again"]
    rel.names(info, *culprits, *([words] if words else []))
    no_weights(tmp_path / "o")


@pytest.mark.quick
def test_index_naming_a_missing_shard(rel, qwen_bf16, make_model, run_yaml, tmp_path):
    sharded = make_model("A-2-shards", qwen_bf16.family.agents["A"], shards=2)
    (copy,) = copy_models({"A": sharded}, tmp_path / "m").values()
    (copy / "model-00002-of-00002.safetensors").unlink()
    rel.watch(copy, *qwen_bf16.paths.values())
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [copy, qwen_bf16.path("B")]), out=tmp_path / "o")
    rel.names(info, copy / "model-00002-of-00002.safetensors", "missing")
    no_weights(tmp_path / "o")


def test_unreadable_index(rel, qwen_bf16, make_model, run_yaml, tmp_path):
    sharded = make_model("A-2-shards", qwen_bf16.family.agents["A"], shards=2)
    (copy,) = copy_models({"A": sharded}, tmp_path / "m").values()
    index = copy / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    rel.watch(copy, *qwen_bf16.paths.values())
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [copy, qwen_bf16.path("B")]), out=tmp_path / "o")
    rel.names(info, index, "unreadable")
    no_weights(tmp_path / "o")


@pytest.mark.parametrize("missing", ["config.json", "weights"])
def test_folder_without_config_or_weights(rel, qwen_bf16, run_yaml, tmp_path, missing):
    copies = copy_models({"A": qwen_bf16.paths["A"]}, tmp_path / "m")
    for name in ["config.json"] if missing == "config.json" else ["model.safetensors"]:
        (copies["A"] / name).unlink()
    rel.watch(copies["A"], *qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [copies["A"], qwen_bf16.path("B")]), out=tmp_path / "o")
    rel.names(info, copies["A"], *(["config.json"] if missing == "config.json" else []))
    no_weights(tmp_path / "o")


@pytest.fixture
def read_only(qwen_bf16, tmp_path):
    copies = copy_models({k: qwen_bf16.paths[k] for k in ("base", "A", "B")}, tmp_path / "ro")
    for folder in copies.values():
        for f in folder.iterdir():
            f.chmod(0o444)
        folder.chmod(0o555)
    return copies  # left read-only: pytest's clean-up handles that, and `rel` compares modes last


def test_read_only_inputs_merge(rel, read_only, run_yaml):
    rel.watch(*read_only.values())
    agents = [read_only["A"], read_only["B"]]
    run = run_yaml(config_yaml(read_only["base"], agents))
    finished(run.out)
    rel.matches_reference(run.tensors, *inputs(read_only["base"], agents))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o555 for p in read_only.values())


@pytest.mark.quick
def test_output_folder_holding_an_earlier_merge(rel, qwen_bf16, run_yaml, tmp_path, caplog):
    """A rerun into a finished merge's folder (another r) replaces it, naming what it replaces in one warning (an r
    sweep into one folder lost its results without a word); its ram_stats.json is removed first, so an
    interrupted rerun could not pass for finished."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = tmp_path / "o"
    rel.watch(*qwen_bf16.paths.values())
    run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=out)
    assert json.loads((out / "ram_stats.json").read_text())["parameters"]["r"] == 0.1
    (out / "notes.txt").write_text("mine")
    caplog.set_level(logging.INFO, logger="mergekit_ram")
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents, parameters={"r": 0.3}), out=out)
    assert any("already holds model.safetensors" in r.getMessage() for r in caplog.records)  # said, as INFO
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "remov" in m], warned  # the rerun writes every file again: nothing removed
    (replaced,) = [m for m in warned if "replaces" in m]  # one line: the earlier merge's r, alpha and inputs
    assert "\n" not in replaced
    rel.names(replaced, f"replaces the earlier ramplus merge in {out}", "r=0.1", "alpha=2.0",
              f"base {qwen_bf16.path('base')}", f"agents {agents[0]}, {agents[1]}")  # fmt: skip
    assert json.loads((out / "ram_stats.json").read_text())["parameters"]["r"] == 0.3
    assert (out / "notes.txt").read_text() == "mine"
    finished(out)
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents), r=0.3)


def test_output_path_is_a_file(rel, qwen_bf16, run_yaml, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("not a folder")
    rel.watch(*qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A")]), out=out)
    rel.names(info, out)
    assert out.read_text() == "not a folder"


ODD = ["with spaces", "ünïcødé 模型", "$(touch PWNED) `touch PWNED2`; 'q' \"dq\" & | > *"]


def _odd_models(rel, qwen_bf16, tmp_path):
    root = tmp_path / ODD[0] / ODD[1] / ODD[2]
    copies = copy_models({k: qwen_bf16.paths[k] for k in ("base", "A", "B")}, root)
    rel.watch(*copies.values())
    return root, copies["base"], [copies["A"], copies["B"]]


def test_odd_path_names(rel, qwen_bf16, tmp_path):
    """Spaces, unicode and shell metacharacters in every path, through the `mergekit-yaml` console script."""
    root, base, agents = _odd_models(rel, qwen_bf16, tmp_path)
    config, out = root / "ramplus $x.yml", root / "merged $HOME ü"
    config.write_text(config_yaml(base, agents), encoding="utf-8")
    script = Path(sys.executable).parent / "mergekit-yaml"
    if not script.exists():
        pytest.skip("the mergekit-yaml console script is not installed")
    proc = subprocess.run(
        [str(script), str(config), str(out), "--no-copy-tokenizer"],
        env={**os.environ, "MERGEKIT_RAM_CACHE": "off"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished(out)
    assert str(agents[0]) in (out / "README.md").read_text(encoding="utf-8")
    rel.matches_reference(models.load_checkpoint(out), *inputs(base, agents))
    assert not list(tmp_path.rglob("PWNED*"))


def test_odd_path_names_api_without_yaml_text(rel, qwen_bf16, run_yaml, tmp_path):
    """mergekit 0.1.5 cannot serialise a path with a space into the card (pydantic: "Circular
    reference detected"), after writing every weight; a `ramplus` merge says so before reading any."""
    root, base, agents = _odd_models(rel, qwen_bf16, tmp_path)
    out = root / "merged"
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(base, agents), out=out)
    rel.names(info, str(base), "config_source", "space")
    no_weights(out)


def _bin_model(folder: Path, state_dict, obj=None) -> Path:
    folder.mkdir(parents=True)
    models.make_config("qwen2", False, torch.bfloat16).save_pretrained(str(folder))
    torch.save(obj if obj is not None else dict(state_dict), folder / "pytorch_model.bin")
    return folder.resolve()


def test_pickle_agent_with_plain_tensors_merges(rel, qwen_bf16, run_yaml, tmp_path):
    agent = _bin_model(tmp_path / "bin-A", qwen_bf16.family.agents["A"])
    rel.watch(agent, *qwen_bf16.paths.values())
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [agent, qwen_bf16.path("B")]))
    base, sds = inputs(qwen_bf16.path("base"), [qwen_bf16.path("B")])
    sds = {str(agent): dict(qwen_bf16.family.agents["A"]), **sds}
    rel.matches_reference(run.tensors, base, sds)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


@pytest.mark.parametrize("lazy", [False, True], ids=["default", "lazy-unpickle"])
def test_pickle_that_runs_code_is_never_unpickled(rel, qwen_bf16, run_yaml, tmp_path, lazy):
    marker = tmp_path / "code-ran"
    sd = dict(qwen_bf16.family.agents["A"])
    sd["model.norm.weight"] = _Payload(marker)
    agent = _bin_model(tmp_path / "evil", sd)
    rel.watch(agent, *qwen_bf16.paths.values())
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [agent]), out=tmp_path / "o", lazy_unpickle=lazy)
    rel.names(info, agent / "pytorch_model.bin", "system")
    assert not marker.exists(), "the pickle's code ran"
    no_weights(tmp_path / "o")


# ---------------------------------------------------------------- a path that is not there, the wrong door (issue 43)
# A mistyped model path was 65 lines and two tracebacks ending in huggingface_hub's "Repo id must be in the form
# ..."; a mergekit-pytorch config given to mergekit-yaml 60 lines ending in "is not a valid JSON file". Now one line
# naming the path (and the nearest existing one) or the door, from every door, before any weight is read.


@pytest.fixture
def workdir(qwen_bf16, tmp_path):
    """work/base, work/agents/code, work/agents/tool (links to the tiny Qwen2 models), as a user lays them out."""
    work = tmp_path / "work"
    (work / "agents").mkdir(parents=True)
    (work / "base").symlink_to(qwen_bf16.paths["base"], target_is_directory=True)
    for name, who in (("code", "A"), ("tool", "B")):
        (work / "agents" / name).symlink_to(qwen_bf16.paths[who], target_is_directory=True)
    return work


def _cli(name: str, *args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0", **(env or {})}
    return subprocess.run([console_script(name), *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env=env)  # fmt: skip


def _one_line(rel, done: subprocess.CompletedProcess, *culprits) -> None:
    """Cases 1 and 2 of issue 43: exit 1, at most 3 lines of output, no traceback, the culprits named."""
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 3, done.stdout[-2000:] + done.stderr[-4000:]
    rel.names(lines[-1], *culprits)


def test_a_mistyped_model_path_is_one_line_through_mergekit_yaml(rel, qwen_bf16, workdir, tmp_path):
    rel.watch(*qwen_bf16.paths.values())
    config = tmp_path / "typo.yml"
    config.write_text(config_yaml(workdir / "base", [workdir / "agents" / "code", workdir / "agents" / "tol"]))
    done = _cli("mergekit-yaml", config, tmp_path / "out", cwd=tmp_path)
    _one_line(rel, done, f"input model {workdir}/agents/tol: no such folder", f"did you mean {workdir}/agents/tool?")
    no_weights(tmp_path / "out")


# (path as written, working folder below `work`, the suggestion); a relative org/name is asked of the hub (offline:
# of its cache) before it is called missing
MISSING = {
    "absolute": ("{work}/agnts/tool", ".", "did you mean {work}/agents/tool?"),
    "./": ("./agents/tol", ".", "did you mean agents/tool?"),
    "../": ("../agents/tol", "agents", "did you mean ../agents/tool?"),
    "org/name, offline": ("agents/tol", ".", "neither a folder in {work} nor in the hub cache at revision main ("
                          "{cache}/models--agents--tol; HF_HUB_OFFLINE is set); did you mean agents/tool?"),  # fmt: skip
}


@pytest.mark.quick
@pytest.mark.parametrize("form", list(MISSING))
def test_a_missing_model_path_is_named_through_run_merge(rel, qwen_bf16, workdir, run_yaml, tmp_path, monkeypatch,
                                                         form):  # fmt: skip
    import huggingface_hub.constants

    from mergekit_ram.errors import RamError

    written, where, suggestion = (text.format(work=workdir, cache=tmp_path / "hub-cache") for text in MISSING[form])
    monkeypatch.chdir(workdir / where)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # nothing leaves the machine
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    rel.watch(*qwen_bf16.paths.values())
    with pytest.raises(RamError) as info:
        run_yaml(config_yaml(workdir / "base", [workdir / "agents" / "code", written]), out=tmp_path / "out")
    rel.names(info, f"input model {written}", suggestion)
    no_weights(tmp_path / "out")


def test_an_org_name_the_hub_does_not_know_is_named(rel, qwen_bf16, workdir, tmp_path):
    """Online: the hub (tests/hub_stub.py, serving nothing) is asked once, and says it has no such model."""
    from hub_stub import HubStub, hub_env

    config = tmp_path / "typo.yml"
    config.write_text(config_yaml(workdir / "base", [workdir / "agents" / "code", "agents/tol"]))
    rel.watch(*qwen_bf16.paths.values())
    with HubStub({}, lifetime=600) as stub:
        done = _cli("mergekit-yaml", config, tmp_path / "out", cwd=workdir, env=hub_env(stub.url, tmp_path / "hf"))
        asked = [(method, path.split("?")[0]) for method, path, _ in stub.requests]
    _one_line(rel, done, f"input model agents/tol is neither a folder in {workdir} nor a model on the hub",
              "agents/tool")  # fmt: skip
    assert asked == [("GET", "/api/models/agents/tol")], asked
    no_weights(tmp_path / "out")


def test_a_missing_model_path_through_inspect_and_mergekit_multi(rel, qwen_bf16, workdir, tmp_path, capsys):
    from mergekit_ram import cli

    rel.watch(*qwen_bf16.paths.values())
    missing = workdir / "agents" / "tol"
    stage = config_yaml(workdir / "base", [workdir / "agents" / "code", missing])
    config = tmp_path / "typo.yml"
    config.write_text(stage)
    capsys.readouterr()
    assert cli.main(["inspect", str(config)]) == 1  # an input that cannot be read
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    rel.names(err, f"mergekit-ram inspect: error: input model {missing}: no such folder", "agents/tool")
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"name: ram\n{stage}")
    done = _cli("mergekit-multi", recipe, "--intermediate-dir", tmp_path / "inter", cwd=tmp_path)
    _one_line(rel, done, f"input model {missing}: no such folder", f"did you mean {workdir}/agents/tool?")
    no_weights(tmp_path / "inter" / "ram")


def test_a_mergekit_pytorch_config_given_to_mergekit_yaml_names_the_door(rel, flat_mlp, tmp_path):
    """Models that are files (.safetensors, .pt) are mergekit-pytorch's."""
    from helpers import flat_config_text

    config = tmp_path / "policies.yml"
    config.write_text(flat_config_text(flat_mlp, ("A", "B"), fmt="pt"))
    rel.watch(*{p.parent for files in flat_mlp.files.values() for p in files.values()})
    done = _cli("mergekit-yaml", config, tmp_path / "out", cwd=tmp_path)
    folder = Path(flat_mlp.path("base", "pt")).parent
    _one_line(rel, done, f"input model {folder}{os.sep}", ".pt is a file, not a model folder", "use mergekit-pytorch")
    no_weights(tmp_path / "out")


def test_a_missing_input_file_of_mergekit_pytorch_names_the_nearest(rel, flat_mlp, tmp_path):
    from helpers import flat_config_text

    typo = flat_mlp.path("A").replace("A.safetensors", "A.safetensor")
    config = tmp_path / "policies.yml"
    config.write_text(flat_config_text(flat_mlp, ("A", "B"), paths={"A": typo}))
    done = _cli("mergekit-pytorch", config, tmp_path / "out", cwd=tmp_path)
    _one_line(rel, done, f"input file {typo} does not exist; did you mean {flat_mlp.path('A')}?")
    no_weights(tmp_path / "out")


@pytest.mark.parametrize("command", ["mergekit-yaml", "mergekit-pytorch", "mergekit-multi", "inspect", "verify"])
def test_a_config_holding_a_tab_is_one_line_with_its_line_and_column(rel, qwen_bf16, run_yaml, tmp_path, command):
    """YAML errors in every command's config: one line giving the line and column, never a traceback."""
    text = config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")])
    lines = text.splitlines()
    lines[2] = "\t" + lines[2]  # a tab YAML cannot start a token with
    bad = "\n".join(lines) + "\n"
    config = tmp_path / "config.yml"
    config.write_text(bad, encoding="utf-8")
    rel.watch(*qwen_bf16.paths.values())
    if command == "verify":  # a merge folder whose mergekit_config.yml holds the tab
        folder = run_yaml(text, out=tmp_path / "merged").out
        (folder / "mergekit_config.yml").write_text(bad, encoding="utf-8")
    argv = {
        "mergekit-yaml": [console_script("mergekit-yaml"), str(config), str(tmp_path / "out")],
        "mergekit-pytorch": [console_script("mergekit-pytorch"), str(config), str(tmp_path / "out")],
        "mergekit-multi": [console_script("mergekit-multi"), str(config), "--intermediate-dir", str(tmp_path / "i")],
        "inspect": [console_script("mergekit-ram"), "inspect", str(config)],
        "verify": [console_script("mergekit-ram"), "verify", str(tmp_path / "merged")],
    }[command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    said = (done.stdout + done.stderr).strip().splitlines()
    line = next((x for x in said if "YAML" in x), said[-1] if said else "")
    rel.names(line, "not valid YAML (line 3, column 1: found character '\\t'")
    assert not (tmp_path / "out").exists()


def test_the_same_agent_listed_twice_through_a_symlink_is_named(rel, qwen_bf16, run_yaml, tmp_path, caplog):
    """Identity by content, not by path: a link to an agent's folder is that agent again, and a warning names
    both (each counts as an agent that agrees with the other on every change)."""
    link = tmp_path / "A-again"
    link.symlink_to(qwen_bf16.paths["A"], target_is_directory=True)
    agents = [qwen_bf16.path("A"), str(link), qwen_bf16.path("B")]
    rel.watch(*qwen_bf16.paths.values())
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents))
    said = [r.getMessage() for r in caplog.records if "have the same content" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    rel.names(said[0], qwen_bf16.path("A"), link)
    assert qwen_bf16.path("B") not in said[0]
    rel.matches_reference(run.tensors, *inputs(qwen_bf16.path("base"), agents))
