"""Every option of mergekit's own runner with `ramplus` and with `mergekit-ram inspect`.

The list is mergekit's: the fields of `mergekit.options.MergeOptions`, which mergekit's
`add_merge_options` turns into `mergekit-yaml`'s flags (the flag of each is read from the
click command itself). An option mergekit adds later is a new case here, and fails until
its expected behaviour is written down in OPTIONS.

Decided behaviour: every option merges through `mergekit-yaml` to the float64 reference, or
is refused with an error naming the flag before any weight is read (`--cuda`, `--gpu-rich`,
`--multi-gpu`, a `--device` without that device on the machine). `mergekit-ram inspect`
takes every option but those of writing a model (shards, serialisation, card, tokenizer, the
seed of a randomized method: `WRITES`, which it does not offer) and counts exactly what the
reference counts, or refuses the same device flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
import reference as R
import torch
from helpers import config_yaml, inputs, no_weights
from mergekit.options import MergeOptions

from mergekit_ram._mergekit.options import WRITES

GPU = torch.cuda.is_available()
NEEDS_GPU = "needs a GPU"  # merges on a machine with one, refused naming the flag elsewhere

# field -> (value set on the command line, expectation); the value differs from mergekit's default
OPTIONS = {
    "allow_crimes": (True, "merges"),
    "unsafe_truncate_embeddings": (True, "merges"),
    "transformers_cache": ("{tmp}/hf-cache", "merges"),
    "lora_merge_cache": ("{tmp}/lora-cache", "merges"),
    "lora_merge_dtype": ("float32", "merges"),
    "cuda": (True, NEEDS_GPU),
    "device": ("auto", "merges"),
    "low_cpu_memory": (True, "merges"),
    "out_shard_size": ("4K", "merges"),
    "copy_tokenizer": (False, "merges"),
    "clone_tensors": (True, "merges"),
    "trust_remote_code": (True, "merges"),
    "random_seed": (7, "merges"),
    "lazy_unpickle": (True, "merges"),
    "write_model_card": (False, "merges"),
    "safe_serialization": (False, "merges"),
    "verbosity": (2, "merges"),
    "quiet": (True, "merges"),
    "read_to_gpu": (True, "merges"),
    "multi_gpu": (True, NEEDS_GPU),
    "num_threads": (1, "merges"),
    "gpu_rich": (True, NEEDS_GPU),
    "async_write": (True, "merges"),
    "write_threads": (2, "merges"),
}
# global side effects (torch's interop threads can be set once per process): a fresh `mergekit-yaml`
IN_SUBPROCESS = {"num_threads"}
# what `--gpu-rich` turns on, named in its refusal
FLAG_IN_ERROR = {"cuda": "--cuda", "gpu_rich": "--multi-gpu", "multi_gpu": "--multi-gpu"}


def _command():
    from mergekit.scripts.run_yaml import main

    return main


def _flag(field: str, value, tmp: Path) -> list[str]:
    """The mergekit-yaml arguments that set `field` to `value`, read from mergekit's click command."""
    (param,) = [p for p in _command().params if p.name == field]
    if field == "verbosity":
        return [param.opts[0]] * int(value)
    if isinstance(value, bool):
        if param.is_flag and not param.secondary_opts:
            return [param.opts[0]]
        return [param.opts[0]] if value else [param.secondary_opts[0]]
    return [param.opts[0], str(value).format(tmp=tmp)]


@pytest.mark.quick
def test_every_option_has_a_case():
    """mergekit's options, its CLI flags and this file's cases are the same set."""
    fields = set(MergeOptions.model_fields)
    flags = {p.name for p in _command().params} - {"config_file", "out_path"}
    assert flags == fields, sorted(flags ^ fields)
    assert set(OPTIONS) == fields, f"options without a case here: {sorted(fields - set(OPTIONS))}"
    for field, (value, _) in OPTIONS.items():
        assert value != MergeOptions.model_fields[field].default, field


def _load(out: Path) -> dict[str, torch.Tensor]:
    tensors = models.load_checkpoint(out)
    for f in sorted(out.glob("pytorch_model*.bin")):
        tensors.update(torch.load(f, weights_only=True))
    return tensors


def _run_cli(args: list[str], field: str, tmp: Path) -> None:
    if field in IN_SUBPROCESS:
        script = Path(sys.executable).parent / "mergekit-yaml"
        proc = subprocess.run(
            [str(script), *args],
            env={**os.environ, "MERGEKIT_RAM_CACHE": "off"},
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return
    _command().main(args, standalone_mode=False)


@pytest.mark.parametrize("field", list(MergeOptions.model_fields))
def test_mergekit_yaml_option_with_ramplus(rel, qwen_bf16, tmp_path, field):
    assert field in OPTIONS, f"mergekit option {field} has no case: add it to OPTIONS"
    value, expect = OPTIONS[field]
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), agents))
    out = tmp_path / "merged"
    args = [str(config), str(out), *_flag(field, value, tmp_path)]
    if field != "copy_tokenizer":
        args.append("--no-copy-tokenizer")
    rel.watch(*qwen_bf16.paths.values())
    if expect == NEEDS_GPU and not GPU:
        with pytest.raises(ValueError) as info:
            _run_cli(args, field, tmp_path)
        rel.names(info, FLAG_IN_ERROR[field], "torch sees no")
        no_weights(out)
        return
    _run_cli(args, field, tmp_path)
    names = sorted(p.name for p in out.iterdir())
    assert "ram_stats.json" in names and "config.json" in names, names
    if field == "out_shard_size":
        assert "model.safetensors.index.json" in names and "model.safetensors" not in names, names
    if field == "safe_serialization":
        assert "pytorch_model.bin" in names and not [n for n in names if n.endswith(".safetensors")], names
    if field == "write_model_card":
        assert "README.md" not in names, names
    tensors = {k: v.cpu() for k, v in _load(out).items()}
    rel.matches_reference(tensors, *inputs(qwen_bf16.path("base"), agents))


def _inspect_flags() -> set[str]:
    from mergekit_ram import cli

    return {o for p in cli.COMMANDS["inspect"][1]().params for o in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("field", list(MergeOptions.model_fields))
def test_inspect_option(rel, qwen_bf16, tmp_path, capsys, field):
    from mergekit_ram import cli

    assert field in OPTIONS, f"mergekit option {field} has no case: add it to OPTIONS"
    value, expect = OPTIONS[field]
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), agents))
    flag = _flag(field, value, tmp_path)
    rel.watch(*qwen_bf16.paths.values())
    args = ["inspect", str(config), "--json", str(tmp_path / "s.json"), *flag]
    if field in WRITES:  # how a merge writes its folder: inspect writes none, and does not offer it
        assert flag[0] not in _inspect_flags()
        capsys.readouterr()
        assert cli.main(args) == 2
        rel.names(capsys.readouterr().err, "No such option", flag[0])  # click's words, by version: ':' or quotes
        assert not (tmp_path / "s.json").exists()
        return
    assert flag[0] in _inspect_flags(), f"inspect lacks {flag[0]}"
    if field in IN_SUBPROCESS:
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "mergekit-ram"), *args],
            env={**os.environ, "MERGEKIT_RAM_CACHE": "off"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, err = proc.returncode, proc.stderr
    else:
        capsys.readouterr()
        code = cli.main(args)
        err = capsys.readouterr().err
    if expect == NEEDS_GPU and not GPU:
        assert code == 2
        rel.names(err, "mergekit-ram inspect: error", FLAG_IN_ERROR[field], "torch sees no")
        return
    assert code == 0, err
    found = json.loads((tmp_path / "s.json").read_text())
    base, sds = inputs(qwen_bf16.path("base"), agents)
    ref = R.reference_stats(base, sds)
    for row in found["agents"]:
        assert (row["active"], row["unique"], row["shared"]) == (
            ref[row["model"]].active,
            ref[row["model"]].unique,
            ref[row["model"]].shared,
        ), row["model"]
    rel.case.merges_compared += 1


def _wider_vocabulary(qwen, folder: Path, rows: int):
    """Agent A with `rows` extra vocabulary rows (embeddings and lm_head), as after adding tokens."""
    gen = torch.Generator().manual_seed(5)
    sd = dict(qwen.family.agents["A"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = (torch.rand(rows, sd[name].shape[1], generator=gen) - 0.5).to(sd[name].dtype)
        sd[name] = torch.cat([sd[name], extra])
    config = models.make_config("qwen2", False, torch.bfloat16)
    config.vocab_size += rows
    return models.write_checkpoint(folder, config, sd).resolve()


@pytest.mark.parametrize("via", ["mergekit-yaml", "inspect"])
def test_unsafe_truncate_embeddings_with_a_wider_agent_vocabulary(rel, qwen_bf16, tmp_path, capsys, via):
    """`--unsafe-truncate-embeddings` with an agent holding 8 more vocabulary rows: its rows beyond
    the base's are dropped, then merged (and counted) as the reference with the truncated agent."""
    from mergekit_ram import cli

    wide = _wider_vocabulary(qwen_bf16, tmp_path / "A-wider-vocabulary", 8)
    agents = [str(wide), qwen_bf16.path("B")]
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), agents))
    rel.watch(wide, *qwen_bf16.paths.values())
    base, sds = inputs(qwen_bf16.path("base"), agents)
    sds[str(wide)] = {k: v[: base[k].shape[0]] if v.shape != base[k].shape else v for k, v in sds[str(wide)].items()}
    if via == "inspect":
        code = cli.main(["inspect", str(config), "--json", str(tmp_path / "s.json"), "--unsafe-truncate-embeddings"])
        assert code == 0, capsys.readouterr().err
        ref = R.reference_stats(base, sds)
        for row in json.loads((tmp_path / "s.json").read_text())["agents"]:
            assert (row["active"], row["unique"]) == (ref[row["model"]].active, ref[row["model"]].unique)
        rel.case.merges_compared += 1
        return
    out = tmp_path / "merged"
    _command().main(
        [str(config), str(out), "--unsafe-truncate-embeddings", "--no-copy-tokenizer"], standalone_mode=False
    )
    rel.matches_reference(_load(out), base, sds)
