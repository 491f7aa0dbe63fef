"""Tests for the synthetic RL-like workload generator and the `mergekit-ram example` command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from mergekit_ram import cli
from mergekit_ram import example_models as synthetic
from mergekit_ram.example_models import build_workload, write_example

INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
DENSITIES = (0.03, 0.46, 0.54)


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder (single file or sharded)."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def is_norm(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 1 and "norm" in name


def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = INT_VIEW[a.dtype]
    return a.view(view) != b.view(view)


def folder_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def bf16_workload(tmp_path_factory):
    wl = build_workload(tmp_path_factory.mktemp("bf16"), seed=3)
    base = load_folder(wl.base)
    agents = {name: load_folder(path) for name, path in wl.agents.items()}
    return wl, base, agents


def test_layout_and_parameter_count(bf16_workload):
    wl, base, agents = bf16_workload
    assert list(wl.agents) == ["agent0", "agent1", "agent2"]
    assert wl.base == wl.base.parent / "base" and wl.base.is_absolute()
    for folder in [wl.base, *wl.agents.values()]:
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).is_file(), folder / name
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["model_type"] == "qwen2" and cfg["dtype"] == "bfloat16"
    assert wl.num_parameters == sum(t.numel() for t in base.values())
    for tensors in agents.values():
        assert tensors.keys() == base.keys()
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())


@pytest.mark.quick
def test_densities_exact_per_tensor_and_overall(bf16_workload):
    _, base, agents = bf16_workload
    for (name, tensors), density in zip(agents.items(), DENSITIES):
        n_changed = n_total = 0
        for key, b in base.items():
            if is_norm(key, b):
                continue
            c = int(changed(tensors[key], b).sum())
            assert c == math.floor(density * b.numel() + 0.5), (name, key)
            n_changed += c
            n_total += b.numel()
        assert abs(n_changed / n_total - density) < 0.01, name


def test_norm_weights_identical_and_updates_everywhere_else(bf16_workload):
    _, base, agents = bf16_workload
    norms = [k for k, t in base.items() if is_norm(k, t)]
    assert norms and all(torch.equal(base[k], torch.ones_like(base[k])) for k in norms)
    for tensors in agents.values():
        for key, b in base.items():
            if is_norm(key, b):
                assert not changed(tensors[key], b).any(), key
            elif b.numel() >= 100:
                assert changed(tensors[key], b).any(), key


def test_changes_are_one_to_three_ulps_same_sign_finite(bf16_workload):
    _, base, agents = bf16_workload
    for tensors in agents.values():
        for key, b in base.items():
            a = tensors[key]
            mask = changed(a, b)
            ia = a.view(torch.int16).to(torch.int32)[mask]
            ib = b.view(torch.int16).to(torch.int32)[mask]
            assert torch.isfinite(a).all()
            assert torch.equal(ia < 0, ib < 0), key  # no sign crossing
            ulps = ((ia & 0x7FFF) - (ib & 0x7FFF)).abs()
            assert ulps.numel() == 0 or (ulps.min() >= 1 and ulps.max() <= 3), key
            both_up = (ulps > 0) & ((ia & 0x7FFF) > (ib & 0x7FFF))
            if mask.sum() > 200:  # both directions occur
                assert 0 < int(both_up.sum()) < int(mask.sum()), key


def test_supports_overlap_above_chance(bf16_workload):
    _, base, agents = bf16_workload
    masks = [
        torch.cat([changed(t[k], b).flatten() for k, b in base.items() if not is_norm(k, b)])
        for t in agents.values()
    ]
    sparse, tool, memory = masks
    inside_both = float((sparse & tool & memory).sum() / sparse.sum())
    # the default overlap (0.35) follows the paper's Fig. 2: the sparse agent is
    # mostly shared with both dense agents (~45% vs ~25% by chance)
    assert inside_both > 0.4 > DENSITIES[1] * DENSITIES[2]
    assert float((tool & memory).float().mean()) > DENSITIES[1] * DENSITIES[2] * 1.03


def test_deterministic_and_seed_dependent(tmp_path):
    kwargs = dict(hidden_size=32, num_layers=1, vocab_size=64, num_heads=2, densities=(0.1, 0.5))
    a = build_workload(tmp_path / "a", seed=7, **kwargs)
    b = build_workload(tmp_path / "b", seed=7, **kwargs)
    c = build_workload(tmp_path / "c", seed=8, **kwargs)
    files_a, files_b = folder_bytes(tmp_path / "a"), folder_bytes(tmp_path / "b")
    assert files_a.keys() == files_b.keys() and files_a == files_b
    assert (a.base / "model.safetensors").read_bytes() != (c.base / "model.safetensors").read_bytes()
    for name in a.agents:
        assert (a.agents[name] / "model.safetensors").read_bytes() != (
            c.agents[name] / "model.safetensors"
        ).read_bytes()
    # Rebuilding in place gives the same bytes too.
    build_workload(tmp_path / "a", seed=7, **kwargs)
    assert folder_bytes(tmp_path / "a") == files_a


def test_parallel_build_writes_the_same_bytes(tmp_path, monkeypatch):
    """`jobs` threads write every tensor in place: the same files as one job, sharded or not, chunked or not."""
    monkeypatch.setattr(synthetic, "_CHUNK", 1000)  # big tensors streamed in chunks too
    kwargs = dict(hidden_size=32, num_layers=2, vocab_size=256, num_heads=2, densities=(0.1, 0.5), seed=5)
    for shard_size in (None, 20_000):
        one = tmp_path / f"one-{shard_size}"
        build_workload(one, shard_size=shard_size, **kwargs)
        build_workload(tmp_path / f"three-{shard_size}", shard_size=shard_size, jobs=3, **kwargs)
        assert folder_bytes(tmp_path / f"three-{shard_size}") == folder_bytes(one)
    assert len(list((tmp_path / "one-20000" / "base").glob("*.safetensors"))) > 1
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        build_workload(tmp_path / "none", jobs=0, **kwargs)


def test_chunked_approximate_path(tmp_path, monkeypatch):
    """Big tensors use chunks and a closed-form threshold; densities stay within 1%."""
    monkeypatch.setattr(synthetic, "_CHUNK", 1000)
    monkeypatch.setattr(synthetic, "_EXACT_LIMIT", 2000)
    wl = build_workload(tmp_path, hidden_size=64, num_layers=1, vocab_size=512, tokenizer=False)
    base = load_folder(wl.base)
    for density, folder in zip(DENSITIES, wl.agents.values()):
        tensors = load_folder(folder)
        emb = changed(tensors["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
        assert abs(float(emb.float().mean()) - density) < 0.01
    assert not any(wl.base.glob("tokenizer*"))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_loads_with_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wl = build_workload(tmp_path, arch=arch, hidden_size=32, num_layers=2, vocab_size=128,
                        num_heads=4, num_kv_heads=2, densities=(0.2,))
    files = load_folder(wl.agents["agent0"])
    assert ("model.layers.0.self_attn.q_proj.bias" in files) == (arch == "qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(wl.agents["agent0"]))
    state = model.state_dict()
    for key, t in files.items():
        assert torch.equal(state[key], t), key
    assert model.config.num_key_value_heads == 2
    tok = AutoTokenizer.from_pretrained(str(wl.base))
    assert len(tok) == 128
    ids = tok("Hello, world!", return_tensors="pt")["input_ids"]
    assert ids.shape[1] == len("Hello, world!")  # byte-level, no merges
    assert tok.decode(ids[0]) == "Hello, world!"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert model(ids).logits.shape[-1] == 128


def test_tied_embeddings_write_no_lm_head(tmp_path):
    from transformers import AutoModelForCausalLM

    wl = build_workload(tmp_path, hidden_size=32, num_layers=1, vocab_size=64, num_heads=2,
                        tie_word_embeddings=True, densities=(0.3,), tokenizer=False)
    for folder in [wl.base, wl.agents["agent0"]]:
        assert "lm_head.weight" not in load_folder(folder)
        assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(str(wl.agents["agent0"]))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_sharded_output_has_complete_index(tmp_path):
    wl = build_workload(tmp_path, hidden_size=32, num_layers=2, vocab_size=128, num_heads=2,
                        densities=(0.1, 0.5), shard_size=20_000, tokenizer=False)
    for folder in [wl.base, *wl.agents.values()]:
        assert not (folder / "model.safetensors").exists()
        shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
        assert len(shards) > 1
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        weight_map = index["weight_map"]
        in_files = {}
        for shard in shards:
            with safe_open(str(folder / shard), "pt") as handle:
                in_files.update({k: shard for k in handle.keys()})
        assert weight_map == in_files
        assert set(weight_map.values()) == set(shards)
        assert index["metadata"]["total_size"] == wl.num_parameters * 2
    assert load_folder(wl.base).keys() == load_folder(wl.agents["agent0"]).keys()


def test_float32_variant(tmp_path):
    wl = build_workload(tmp_path, hidden_size=32, num_layers=1, vocab_size=64, num_heads=2,
                        densities=(0.05, 0.5), dtype=torch.float32, tokenizer=False)
    base = load_folder(wl.base)
    assert json.loads((wl.base / "config.json").read_text())["dtype"] == "float32"
    for density, folder in zip((0.05, 0.5), wl.agents.values()):
        tensors = load_folder(folder)
        n_changed = n_total = 0
        for key, b in base.items():
            a = tensors[key]
            assert a.dtype == torch.float32 and torch.isfinite(a).all()
            mask = changed(a, b)
            if is_norm(key, b):
                assert not mask.any()
                continue
            n_changed += int(mask.sum())
            n_total += b.numel()
            rel = ((a - b).abs() / b.abs())[mask]
            assert rel.numel() == 0 or (rel.min() > 1e-4 and rel.max() < 1e-2), key
            assert torch.equal(torch.sign(a), torch.sign(b))
        assert abs(n_changed / n_total - density) < 0.01


def test_perturb_edge_values_stay_finite_and_keep_sign():
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-38, -1e-38, 3.3e38, -3.3e38, 1.0, -2.0])
    for dtype, view in INT_VIEW.items():
        base = specials.to(dtype).repeat(200)
        mask = torch.ones_like(base, dtype=torch.bool)
        out = synthetic._perturb(base, mask, torch.Generator().manual_seed(0))
        assert torch.isfinite(out).all()
        assert (out.view(view) != base.view(view)).all()
        ob, bb = out.view(view), base.view(view)
        assert torch.equal(ob < 0, bb < 0)


@pytest.mark.quick
def test_argument_validation(tmp_path):
    with pytest.raises(ValueError):
        build_workload(tmp_path, densities=(0.1, 0.2), agent_names=["only"])
    with pytest.raises(ValueError):
        build_workload(tmp_path, densities=(1.5,))
    with pytest.raises(ValueError):
        build_workload(tmp_path, arch="gpt2")


def test_write_example(tmp_path):
    out = tmp_path / "demo"
    ramplus = write_example(out)
    assert ramplus == out.resolve() / "ramplus.yaml"
    configs = {name: yaml.safe_load((out / name).read_text()) for name in ("ramplus.yaml", "ram.yaml")}
    for name, cfg in configs.items():
        assert cfg["merge_method"] == "ramplus" and cfg["dtype"] == "bfloat16"
        paths = [cfg["base_model"]] + [m["model"] for m in cfg["models"]]
        assert [Path(p).name for p in paths] == ["base", "code", "tool", "memory"]
        for p in paths:
            assert Path(p).is_absolute() and (Path(p) / "model.safetensors").is_file(), p
        assert cfg["parameters"]["epsilon"] == pytest.approx(1e-5)
        assert cfg["parameters"]["alpha"] == pytest.approx(2.0)
    assert configs["ramplus.yaml"]["parameters"]["r"] == pytest.approx(0.1)
    assert configs["ram.yaml"]["parameters"]["r"] == 0
    base = load_folder(out / "base")
    for name, density in {"code": 0.03, "tool": 0.46, "memory": 0.54}.items():
        tensors = load_folder(out / "agents" / name)
        mask = torch.cat([changed(tensors[k], b).flatten() for k, b in base.items() if not is_norm(k, b)])
        assert abs(float(mask.float().mean()) - density) < 0.01

    with pytest.raises(FileExistsError, match="not empty"):
        write_example(out)
    assert write_example(out, overwrite=True) == ramplus
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_example(empty).is_file()


def test_cli_example(tmp_path, capsys):
    out = tmp_path / "cli-demo"
    assert cli.main(["example", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"mergekit-yaml {out.resolve() / 'ramplus.yaml'} {out.resolve() / 'merged'}" in printed
    assert (out / "ram.yaml").is_file()

    assert cli.main(["example", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not empty" in err and "Traceback" not in err
    assert cli.main(["example", str(out), "--force"]) == 0


@pytest.mark.quick
def test_cli_usage_errors(capsys):
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert cli.main(["--help"]) == 0
    assert "example" in capsys.readouterr().out


def test_example_prints_the_densities_its_table_shows(tmp_path, capsys):
    """`mergekit-ram example` printed its targets (3%, 46%, 54%) while the table showed 2.86%, 43.81%, 51.39%:
    it prints what it wrote, as `inspect`'s table (a merge's) counts it."""
    import re

    capsys.readouterr()
    assert cli.main(["example", str(tmp_path / "demo")]) == 0
    printed = dict(re.findall(r"agent (\w+) +\S+ +\(([\d.]+%) of weights changed\)", capsys.readouterr().out))
    assert list(printed) == ["code", "tool", "memory"]
    assert cli.main(["inspect", str(tmp_path / "demo" / "ramplus.yaml"), "-q"]) == 0
    table = capsys.readouterr().out
    for name, density in printed.items():
        row = next(line for line in table.splitlines() if line.split() and line.split()[0].split("/")[-1] == name)
        assert row.split()[2] == density, (name, row)
