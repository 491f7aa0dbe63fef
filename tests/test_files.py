"""Files on disk: the one safetensors header reader and the one atomic writer."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch
from safetensors.torch import save_file

from mergekit_ram import files

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_read_header_returns_the_raw_bytes_and_the_parsed_header(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(path))
    raw, header = files.read_header(str(path))
    assert json.loads(raw) == header
    assert header["w"]["dtype"] == "BF16" and header["w"]["shape"] == [2, 3]


def test_read_header_refuses_an_implausible_length(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((files.MAX_HEADER + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="implausible safetensors header size"):
        files.read_header(str(path))


def test_read_header_of_a_header_that_is_no_object(tmp_path):
    path = tmp_path / "list.safetensors"
    path.write_bytes((2).to_bytes(8, "little") + b"[]")
    assert files.read_header(str(path)) == (b"[]", {})


def test_check_safetensors_accepts_a_valid_file(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, str(path))
    files.check_safetensors(str(path))


def _lying(path, **entry):
    """A valid file, then one header entry of tensor `b` rewritten (same header length, same data)."""
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, str(path))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["b"].update(entry)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-3]), []),  # truncated data
        (lambda p: p.write_bytes(p.read_bytes() + b"\0"), []),  # a trailing byte
        (lambda p: p.write_bytes(b"\0\0"), []),  # shorter than the length field
        (lambda p: _lying(p, shape=[2, 3]), ["tensor b (F32 [2, 3]) needs 24 bytes, its offsets span 16"]),
        (lambda p: _lying(p, dtype="F64"), ["tensor b (F64 [2, 2]) needs 32 bytes, its offsets span 16"]),
    ],
    ids=["truncated", "trailing", "short", "shape-lies", "dtype-lies"],
)
def test_check_safetensors_names_the_file_the_fix_and_safetensors_reason(tmp_path, damage, words):
    from safetensors import SafetensorError, safe_open

    path = tmp_path / "bad.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, str(path))
    damage(path)
    with pytest.raises(SafetensorError) as own:
        safe_open(str(path), framework="pt")
    with pytest.raises(ValueError) as info:
        files.check_safetensors(str(path))
    message = str(info.value)
    reason = str(own.value).removeprefix("Error while deserializing header: ")
    for part in [f"input file {path} is not a valid safetensors file: {reason}", "fetch it again", *words]:
        assert part in message, (part, message)
    if not words:
        assert "needs" not in message  # no entry named when every entry fits its bytes


def test_check_safetensors_leaves_io_errors_alone(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.check_safetensors(str(tmp_path / "missing.safetensors"))


@pytest.mark.parametrize(
    "raised", [MemoryError("Cannot allocate memory (os error 12)"), OSError("Cannot allocate memory (os error 12)")]
)
def test_check_safetensors_names_a_file_the_address_space_cannot_map(tmp_path, monkeypatch, raised):
    """safetensors maps a file whole; under `ulimit -v` it raises MemoryError (0.8) or, before, an OSError without
    the file's name (found by CI's floor stage, safetensors 0.5.2): either is one line naming the file."""
    import safetensors

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4)}, str(path))

    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    with pytest.raises(files.RamError, match=re.escape(f"input file {path} (0.0 GiB) cannot be mapped into memory")):
        files.check_safetensors(str(path))


def test_a_shape_lie_of_the_same_size_is_no_file_damage(tmp_path):
    """Neither safetensors nor the old byte count sees it: the shape check against the base does."""
    path = tmp_path / "same-size.safetensors"
    _lying(path, shape=[4, 1])
    files.check_safetensors(str(path))


def test_indexed_weight_files(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors",
                                                                "c": "m-2.safetensors", "d": "sub/m-3.safetensors"}}))
    assert files.indexed_weight_files(str(index)) == ["m-1.safetensors", "m-2.safetensors", "sub/m-3.safetensors"]
    with pytest.raises(FileNotFoundError):
        files.indexed_weight_files(str(tmp_path / "none.json"))


@pytest.mark.parametrize(
    "text", ['{"weight_map": {"a": "m', "[1, 2]", '{"metadata": {}}', '{"weight_map": ["m"]}', "\xff"]
)
def test_an_unreadable_index_is_named(tmp_path, text):
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"input model index {index} is unreadable")):
        files.indexed_weight_files(str(index))


def test_write_atomic_replaces_and_is_private_by_default(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    files.write_atomic(str(target), "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_write_atomic_with_a_mode(tmp_path):
    target = tmp_path / "public.json"
    files.write_atomic(str(target), "x", mode=0o644)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_write_atomic_failure_names_the_file_and_leaves_nothing(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    target = folder / "sub"
    target.mkdir()  # a directory where the file should go: os.replace fails
    with pytest.raises(OSError, match=str(target)):
        files.write_atomic(str(target), "x")
    assert os.listdir(folder) == ["sub"]
