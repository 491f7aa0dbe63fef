"""One verdict whatever the hash seed (issue 73): verify's exit code, first problem line and `--json` result, and
the first bad input a merge or `inspect` names, are the same under every `PYTHONHASHSEED`.

mergekit hands its models over as a set's list (`referenced_models()`), whose order follows each process's string
hashing: where the plugin walked it to name the first bad input, or mapped two inputs to one copy, the same command
said one thing at one seed and another at the next (one local copy given for two inputs: exit 3 or exit 1 by the
seed). Each kind of check verify makes, on right and changed merges, full and sampled, runs here under three seeds
(`seeded_commands.SEEDS`, one process each); the verdict matrix's own verifies do so in
tests/reliability/test_verdict_matrix.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from helpers import config_yaml
from seeded_commands import by_seed, differing

SAMPLE = ["--sample", "0.3", "--sample-seed", "11"]


def _verify(folder, *flags) -> list[str]:
    return ["mergekit-ram", "verify", str(folder), "-q", "--json", *flags]


def _bits_plus_one(folder: Path, tensor: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(torch.int16).add_(1)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def commands(qwen_bf16, merged, tmp_path_factory):
    """(commands, the outcome each must have): a right merge and folders made wrong in each way verify checks."""
    root = tmp_path_factory.mktemp("hash-seeds")
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B"), qwen_bf16.path("C")]
    right = merged(config_yaml(qwen_bf16.path("base"), agents)).out
    tensor = "model.layers.0.mlp.down_proj.weight"
    tampered = Path(shutil.copytree(right, root / "tampered"))
    _bits_plus_one(tampered, tensor)
    edited = Path(shutil.copytree(right, root / "edited"))  # a parameter changed in mergekit_config.yml
    config = yaml.safe_load((edited / "mergekit_config.yml").read_text())
    config["parameters"] = {**(config.get("parameters") or {}), "r": 0.3}
    (edited / "mergekit_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    carded = Path(shutil.copytree(right, root / "carded"))  # a card whose front matter is not mergekit's
    card = (carded / "README.md").read_text()
    assert "\n- ramplus\n" in card
    (carded / "README.md").write_text(card.replace("\n- ramplus\n", "\n- another-method\n", 1))
    # inputs that are gone: a merge of copies, two of which are then removed
    gone_inputs = {who: root / "gone-inputs" / who for who in ("base", "A", "B")}
    for who, path in gone_inputs.items():
        shutil.copytree(qwen_bf16.path(who), path)
    gone = merged(config_yaml(gone_inputs["base"], [gone_inputs["A"], gone_inputs["B"]])).out
    shutil.rmtree(gone_inputs["A"])
    shutil.rmtree(gone_inputs["B"])
    # local copies named by label (--input-dir), one of them not the input it stands for
    copies = root / "copies"
    for label, who in (("base", "base"), ("A", "A"), ("B", "B"), ("C", "A")):
        shutil.copytree(qwen_bf16.path(who), copies / label)
    labels = _labels(right)
    missing = [str(root / "nowhere" / name) for name in ("one", "two", "three")]
    two_missing = root / "two-missing.yaml"
    two_missing.write_text(config_yaml(missing[0], missing[1:]))
    return [
        (_verify(right), (0, "identical")),
        (_verify(right, *SAMPLE), (0, "no difference in sample")),
        (_verify(tampered), (1, None)),
        (_verify(tampered, *SAMPLE), (1, None)),
        (_verify(edited), (1, None)),
        (_verify(carded), (1, None)),
        (_verify(gone), (3, None)),
        (_verify(right, "--input-dir", str(copies)), (3, None)),
        # issue 73's repro: one copy given for two recorded inputs
        (
            _verify(right, "--input", f"{labels[0]}={copies / 'base'}", "--input", f"{labels[1]}={copies / 'base'}"),
            (2, None),
        ),
        (_verify(right, "--input", f"{labels[1]}={qwen_bf16.path('base')}"), (2, None)),
        (["mergekit-ram", "inspect", str(two_missing)], (1, None)),
        (["mergekit-yaml", str(two_missing), str(root / "never"), "--quiet"], (1, None)),
    ]


def _labels(folder: Path) -> list[str]:
    import json

    return list(json.loads((folder / "ram_stats.json").read_text())["inputs"])


def test_every_kind_of_check_says_the_same_under_every_seed(commands):
    argvs = [argv for argv, _ in commands]
    found = by_seed(argvs)
    assert not differing(found, argvs), "\n".join(differing(found, argvs))
    for (argv, (code, result)), outcome in zip(commands, next(iter(found.values())), strict=True):
        assert outcome["exit"] == code, (argv, outcome)
        assert result is None or outcome["result"] == result, (argv, outcome)
        assert outcome["first"] and "Traceback" not in outcome["first"], (argv, outcome)
        if "two-missing.yaml" in argv[2]:  # of three inputs that are not there, the config's first is named
            assert "nowhere/one: no such folder" in outcome["first"], (argv, outcome)


@pytest.mark.quick
def test_one_copy_for_two_inputs_is_a_usage_error_naming_both(qwen_bf16, merged, capsys, tmp_path):
    from mergekit_ram import cli

    right = merged(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")])).out
    base, first = _labels(right)[:2]
    copy = Path(shutil.copytree(qwen_bf16.path("base"), tmp_path / "copy"))
    (tmp_path / "link").symlink_to(copy)
    for second in (copy, tmp_path / "link"):  # the same folder, or one reached through a link
        code = cli.main(["verify", str(right), "-q", "--input", f"{base}={copy}", "--input", f"{first}={second}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0, err
        for named in (f"inputs {base} ", f" and {first} ", f"--input {first}={second}", f"read from {copy}"):
            assert named in err, (named, err)
