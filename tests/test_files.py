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
