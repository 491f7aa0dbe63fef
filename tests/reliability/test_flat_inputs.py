"""`mergekit-pytorch` inputs: single files (safetensors, PyTorch pickles), tensors some files lack, output folders.

Decided behaviour: an input file is checked before mergekit opens it: a missing file, a folder, a
damaged safetensors file, a pickle that refers to anything but tensors (zip or older format) is an
error naming the file; a NaN, a shape mismatch or an integer tensor is an error naming the tensor and
the file; a weights-only pickle of either format merges and equals the reference. Tensors some files
lack follow `--tensor-union` / `--tensor-intersection` (`_mergekit/raw_pytorch.py`): an agent that lacks a
tensor left it unchanged; a tensor the base lacks is refused. The folder that holds an input file is
refused as the output folder; nothing is ever written beside an input.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import flat_config_text, forbid_count, no_weights, run_flat
from safetensors.torch import save_file

AGENTS = ("A", "B", "C")


def _floats(sd):
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def _inputs(flat, paths, fmt="safetensors", drop=None):
    base = _floats(flat.stored("base", fmt))
    agents = {}
    for a in AGENTS:
        sd = _floats(flat.stored(a, fmt))
        for name in (drop or {}).get(a, ()):
            sd[name] = base[name]
        agents[paths.get(a) or flat.path(a, fmt)] = sd
    return base, agents


def _copy(flat, root: Path, fmt="safetensors", who=("base", *AGENTS)) -> dict[str, str]:
    """Private copies of the files (their folder watched by the case)."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in who:
        src = Path(flat.path(name, fmt))
        dst = root / src.name
        dst.write_bytes(src.read_bytes())
        out[name] = str(dst)
    return out


class _Reduce:
    def __reduce__(self):
        return (os.system, ("true",))


def _refused(rel, text, out, *flags, match=None):
    with pytest.raises((ValueError, RuntimeError), match=match) as info:
        run_flat(text, out, *flags)
    no_weights(out)
    return info


# ---------------------------------------------------------------- pickles


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_weights_only_pickle_merges(rel, flat_mlp, tmp_path, zipped):
    paths = _copy(flat_mlp, tmp_path / "in", "pt")
    if not zipped:
        for a in AGENTS:
            torch.save(flat_mlp.stored(a, "pt"), paths[a], _use_new_zipfile_serialization=False)
    rel.watch(tmp_path / "in")
    tensors = run_flat(flat_config_text(flat_mlp, AGENTS, fmt="pt", dtype="bfloat16", paths=paths), tmp_path / "out")
    base, agents = _inputs(flat_mlp, paths, "pt")
    rel.matches_reference(tensors, base, agents)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pickle_that_runs_code_is_refused(rel, flat_mlp, tmp_path, monkeypatch, zipped):
    paths = _copy(flat_mlp, tmp_path / "in", "pt")
    torch.save({**flat_mlp.stored("B", "pt"), "x": _Reduce()}, paths["B"], _use_new_zipfile_serialization=zipped)
    rel.watch(tmp_path / "in")
    forbid_count(monkeypatch)
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, fmt="pt", paths=paths), tmp_path / "out", match="pickle")
    rel.names(info, paths["B"], "system" if zipped else "")


# ---------------------------------------------------------------- files mergekit would fail on


@pytest.mark.quick
def test_truncated_safetensors_is_named(rel, flat_mlp, tmp_path, monkeypatch):
    paths = _copy(flat_mlp, tmp_path / "in")
    data = Path(paths["C"]).read_bytes()
    Path(paths["C"]).write_bytes(data[: len(data) - 100])
    rel.watch(tmp_path / "in")
    forbid_count(monkeypatch)
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), tmp_path / "out", match="safetensors")
    rel.names(info, paths["C"], "truncated")


@pytest.mark.quick
def test_missing_file_and_folder_are_named(rel, flat_mlp, tmp_path, monkeypatch):
    forbid_count(monkeypatch)
    missing = str(tmp_path / "gone.safetensors")
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths={"A": missing}), tmp_path / "out", match="exist")
    rel.names(info, missing)
    folder = tmp_path / "a-folder.safetensors"
    folder.mkdir()
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths={"A": str(folder)}), tmp_path / "out2", match="folder")
    rel.names(info, str(folder), "mergekit-yaml")


# ---------------------------------------------------------------- tensors


def test_nan_in_a_pickle_is_named(rel, flat_mlp, tmp_path):
    paths = _copy(flat_mlp, tmp_path / "in", "pt")
    sd = flat_mlp.stored("A", "pt")
    sd["v.0.weight"] = sd["v.0.weight"].clone()
    sd["v.0.weight"].view(-1)[3] = float("nan")
    torch.save(sd, paths["A"])
    rel.watch(tmp_path / "in")
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, fmt="pt", paths=paths), tmp_path / "out", match="NaN")
    rel.names(info, "v.0.weight", paths["A"])


def test_shape_mismatch_in_a_pickle_is_named(rel, flat_mlp, tmp_path):
    paths = _copy(flat_mlp, tmp_path / "in", "pt")
    sd = flat_mlp.stored("C", "pt")
    sd["pi.2.weight"] = sd["pi.2.weight"][:16].contiguous()
    torch.save(sd, paths["C"])
    rel.watch(tmp_path / "in")
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, fmt="pt", paths=paths), tmp_path / "out", match="shape")
    rel.names(info, "pi.2.weight", paths["C"], "(16, 32)")


def test_integer_tensor_is_named(rel, flat_mlp, tmp_path, monkeypatch):
    paths = _copy(flat_mlp, tmp_path / "in")
    sd = flat_mlp.stored("B")
    sd["pi.0.weight"] = torch.zeros(sd["pi.0.weight"].shape, dtype=torch.int8)
    save_file(sd, paths["B"])
    rel.watch(tmp_path / "in")
    forbid_count(monkeypatch)
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), tmp_path / "out", match="I8")
    rel.names(info, "pi.0.weight", paths["B"])


# ---------------------------------------------------------------- tensors some files lack


def _ragged(flat, root: Path, lacks) -> dict[str, str]:
    paths = _copy(flat, root)
    for a, names in lacks.items():
        save_file({k: v for k, v in flat.stored(a).items() if k not in names}, paths[a])
    return paths


def test_union_merges_what_an_agent_lacks_as_unchanged(rel, flat_mlp, tmp_path):
    lacks = {"A": {"pi.4.weight"}, "C": {"pi.4.weight", "v.0.bias"}}
    paths = _ragged(flat_mlp, tmp_path / "in", lacks)
    rel.watch(tmp_path / "in")
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths)
    tensors = run_flat(text, tmp_path / "out", "--tensor-union")
    base, agents = _inputs(flat_mlp, paths, drop=lacks)
    rel.matches_reference(tensors, base, agents)


def test_intersection_merges_the_common_tensors(rel, flat_mlp, tmp_path):
    lacks = {"B": {"log_std", "v.2.bias"}}
    paths = _ragged(flat_mlp, tmp_path / "in", lacks)
    rel.watch(tmp_path / "in")
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths)
    tensors = run_flat(text, tmp_path / "out", "--tensor-intersection")
    base, agents = _inputs(flat_mlp, paths)
    rel.matches_reference(tensors, base, agents, names=sorted(set(base) - lacks["B"]))


def test_union_refuses_a_tensor_the_base_lacks(rel, flat_mlp, tmp_path, monkeypatch):
    paths = _copy(flat_mlp, tmp_path / "in")
    save_file({**flat_mlp.stored("C"), "head.extra": torch.ones(2, dtype=torch.bfloat16)}, paths["C"])
    rel.watch(tmp_path / "in")
    forbid_count(monkeypatch)
    text = flat_config_text(flat_mlp, AGENTS, paths=paths)
    info = _refused(rel, text, tmp_path / "out", "--tensor-union", match="not in the base model")
    rel.names(info, "head.extra", paths["base"], paths["C"], "--tensor-intersection")


# ---------------------------------------------------------------- output folders


def test_output_into_the_folder_of_an_input_file_is_refused(rel, flat_mlp, tmp_path, monkeypatch):
    folder = tmp_path / "in"
    paths = _copy(flat_mlp, folder)
    config = tmp_path / "cfg.yaml"
    config.write_text(flat_config_text(flat_mlp, AGENTS, paths=paths), encoding="utf-8")
    rel.watch(folder)
    forbid_count(monkeypatch)
    from mergekit.scripts import merge_raw_pytorch

    for out in (folder, folder / ".", Path(paths["A"])):
        with pytest.raises(ValueError, match="is the (folder of the )?input file") as info:
            merge_raw_pytorch.main.main([str(config), str(out), "--quiet"], standalone_mode=False)
        rel.names(info, str(out))


def test_output_in_a_new_folder_beside_the_inputs_writes_only_there(rel, flat_mlp, tmp_path):
    folder = tmp_path / "in"
    paths = _copy(flat_mlp, folder)
    config = tmp_path / "cfg.yaml"
    config.write_text(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths), encoding="utf-8")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    from mergekit.scripts import merge_raw_pytorch

    merge_raw_pytorch.main.main([str(config), str(folder / "merged"), "--quiet"], standalone_mode=False)
    after = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != "merged"}
    assert after == before  # the inputs untouched, nothing new beside them
    assert sorted(p.name for p in (folder / "merged").iterdir()) == ["model.safetensors", "ram_stats.json"]
    import models

    base, agents = _inputs(flat_mlp, paths)
    rel.matches_reference(models.load_checkpoint(folder / "merged"), base, agents)


# ---------------------------------------------------------------- training checkpoints and non-checkpoints (issue 31)


def _save_each(flat, root: Path, wrap) -> dict[str, str]:
    """Each member's tensors saved as `wrap(state_dict)` with torch.save."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for who in ("base", *AGENTS):
        out[who] = str(root / f"{who}.pt")
        torch.save(wrap(flat.stored(who, "pt")), out[who])
    return out


@pytest.mark.parametrize("flags", [(), ("--tensor-intersection",), ("--tensor-union",)], ids=["plain", "inter", "union"])
def test_nested_training_checkpoint_is_named(rel, flat_mlp, tmp_path, monkeypatch, flags):
    """`torch.save({"model": sd, "step": 100})`: with --tensor-intersection it merged zero tensors and exited 0;
    without, mergekit failed on a dict. Now: the file, the key, and what to save instead."""
    forbid_count(monkeypatch)
    paths = _save_each(flat_mlp, tmp_path / "in", lambda sd: {"model": sd, "step": 100})
    rel.watch(tmp_path / "in")
    out = tmp_path / "out"
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), out, *flags)
    rel.names(info, paths["A"], "nested dict under 'model'", "'step'", "state_dict()")
    assert not out.exists()


def test_entry_that_is_not_a_tensor_is_named(rel, flat_mlp, tmp_path, monkeypatch):
    forbid_count(monkeypatch)
    paths = _save_each(flat_mlp, tmp_path / "in", lambda sd: {**sd, "step": 100})
    rel.watch(tmp_path / "in")
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), tmp_path / "out")
    rel.names(info, paths["A"], "'step', a int, not a tensor", "state_dict()")


@pytest.mark.quick
@pytest.mark.parametrize("content", [b"hello, this is text\n", b""], ids=["text", "empty"])
def test_file_that_is_no_checkpoint_is_named(rel, flat_mlp, tmp_path, monkeypatch, content):
    """A text file named `.pt` was "a pickle that holds more than tensors" with torch's advice appended."""
    forbid_count(monkeypatch)
    paths = _copy(flat_mlp, tmp_path / "in", fmt="pt")
    Path(paths["B"]).write_bytes(content)
    rel.watch(tmp_path / "in")
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), tmp_path / "out")
    message = rel.names(info, paths["B"], "is not a PyTorch checkpoint", "empty" if not content else "b'hello, ")
    assert len(message) < 300, message


def test_merge_that_would_write_no_tensor_is_an_error(rel, flat_mlp, tmp_path, monkeypatch):
    """Files that share no tensor, merged with --tensor-intersection: an empty folder and exit 0 before."""
    forbid_count(monkeypatch)
    root = tmp_path / "in"
    root.mkdir()
    paths = {}
    for who in ("base", *AGENTS):
        paths[who] = str(root / f"{who}.safetensors")
        save_file({f"{who}.{k}": v for k, v in flat_mlp.stored(who).items()}, paths[who])
    rel.watch(root)
    out = tmp_path / "out"
    info = _refused(rel, flat_config_text(flat_mlp, AGENTS, paths=paths), out, "--tensor-intersection")
    rel.names(info, "would write no tensor", "--tensor-intersection", "state_dict")
    assert not out.exists()


def test_integer_buffer_that_differs_is_named_before_any_work(rel, flat_cnn, tmp_path, monkeypatch):
    """BatchNorm's `num_batches_tracked` differing between files: mergekit refused it mid-merge (after the
    statistics pass) with its own ValueError and a traceback; now one line naming the tensor and both files."""
    forbid_count(monkeypatch)
    paths = _copy(flat_cnn, tmp_path / "in", fmt="pt")
    sd = torch.load(paths["B"], weights_only=True)
    sd["bn.num_batches_tracked"] = sd["bn.num_batches_tracked"] + 200
    torch.save(sd, paths["B"])
    rel.watch(tmp_path / "in")
    out = tmp_path / "out"
    info = _refused(rel, flat_config_text(flat_cnn, AGENTS, fmt="pt", dtype="float32", paths=paths), out)
    rel.names(info, "bn.num_batches_tracked", paths["base"], paths["B"], "1000", "1200", "save the same value")
    assert not out.exists()


def test_a_pickled_agent_stored_in_another_dtype_than_the_base_warns_as_mergekit_yaml_does(rel, flat_mlp, tmp_path, caplog):
    """A PyTorch pickle has no header to read its dtype from: it is loaded on the meta device (no data read), and
    warned about as a safetensors input is."""
    import logging

    paths = _copy(flat_mlp, tmp_path / "in")
    other = tmp_path / "in" / "A-float32.pt"  # the base: bfloat16
    torch.save({k: (v.float() if v.is_floating_point() else v) for k, v in flat_mlp.stored("A").items()}, other)
    rel.watch(tmp_path / "in")
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run_flat(flat_config_text(flat_mlp, AGENTS, paths={**paths, "A": str(other)}), tmp_path / "out")
    said = [r.getMessage() for r in caplog.records if "stored in a different dtype than the base" in r.getMessage()]
    assert len(said) == 1, said
    rel.names(said[0], other, "BF16")
