"""`mergekit-ram verify --sample P [--sample-seed N]`: a sample of the output tensors, drawn by size, checked bit for
bit, reading only what they are computed from.

* the draw (`verify/sample.py`): the same seed draws the same tensors, the drawn ones hold at least P of the
  elements, P = 1 draws all; the bound the verdict states holds empirically over 200 seeds (1 tensor in 50
  differing; 10 % of the weights differing in a few large tensors), on the Llama-3.2-3B layout;
* a folder: exit 0 says "no difference in a sample", with its seed, the chance a differing merge passes and what
  was not checked; `--json`'s `sample`; only the drawn tensors are read from the inputs;
* a drawn differing tensor is exit 1, named; an undrawn one passes (what a sample cannot see); a planned tensor
  missing from the folder is exit 1 whether drawn or not; ram_stats.json's counts: totals that are not the sums of
  the per-tensor counts are exit 1, and a per-tensor edit that keeps the sums is caught only when drawn;
* bad input: `--sample 0|-0.1|1.5|abc`, `--sample-seed` without `--sample` or not an integer: exit 2, one line;
* `--sample 1` is a full verify; the `mergekit-pytorch` door and `mergekit-multi` stages sample too.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import test_verification as tv
from helpers import config_text

from mergekit_ram.verify import sample

# ---------------------------------------------------------------- the draw, on plain data


def llama_3b() -> dict[str, int]:
    """The tensors of Llama-3.2-3B (28 layers, tied embeddings): name -> elements."""
    hidden, inter, kv, vocab = 3072, 8192, 1024, 128256
    sizes = {"model.embed_tokens.weight": vocab * hidden, "model.norm.weight": hidden}
    for i in range(28):
        at = f"model.layers.{i}."
        sizes |= {
            at + "self_attn.q_proj.weight": hidden * hidden,
            at + "self_attn.k_proj.weight": kv * hidden,
            at + "self_attn.v_proj.weight": kv * hidden,
            at + "self_attn.o_proj.weight": hidden * hidden,
            at + "mlp.gate_proj.weight": inter * hidden,
            at + "mlp.up_proj.weight": inter * hidden,
            at + "mlp.down_proj.weight": hidden * inter,
            at + "input_layernorm.weight": hidden,
            at + "post_attention_layernorm.weight": hidden,
        }
    return sizes


@pytest.mark.quick
def test_the_draw_is_repeatable_holds_the_share_and_favours_large_tensors():
    sizes = llama_3b()
    first = sample.draw(sizes, 0.02, 7)
    assert sample.draw(sizes, 0.02, 7).names == first.names
    assert sample.draw(sizes, 0.02, 8).names != first.names
    total = sum(sizes.values())
    for seed in range(50):
        drawn = sample.draw(sizes, 0.02, seed)
        assert drawn.elements >= 0.02 * total
        assert drawn.elements - sizes[drawn.names[-1]] < 0.02 * total  # it stops at the first draw that holds P
        assert len(drawn.names) >= drawn.least
    assert set(sample.draw(sizes, 1.0, 3).names) == set(sizes)
    assert sample.least_draws(sizes, 0.02) == 1  # the embeddings alone hold 12.5 %
    assert sample.least_draws({"a": 1, "b": 1, "c": 2}, 0.5) == 1 and sample.least_draws({"a": 1, "b": 1}, 0.75) == 2
    norms = [n for n in sizes if n.endswith("norm.weight")]
    hits = sum(n in norms for seed in range(200) for n in sample.draw(sizes, 0.02, seed).names)
    assert hits < 10  # a norm holds 0.0001 % of the weights: almost never drawn


def _upper(n: int, p: float) -> int:
    """The upper end of the central 95 % interval of Binomial(n, p)."""
    cumulative = 0.0
    for k in range(n + 1):
        cumulative += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if cumulative >= 0.975:
            return k
    return n


@pytest.mark.quick
@pytest.mark.parametrize("case", ["1 tensor in 50", "10 % in a few large tensors"])
def test_the_stated_bound_holds_over_200_seeds(case):
    """A sample misses the differing tensors (and the merge passes) at most as often as the verdict's bound says:
    the passes in 200 seeds are inside the 95 % binomial interval of the bound or below it."""
    sizes = llama_3b()
    names = sorted(sizes)
    rng = random.Random(50)
    if case == "1 tensor in 50":
        differ = set(rng.sample(names, len(names) // 50))
    else:
        mlp = [n for n in names if "mlp" in n]
        rng.shuffle(mlp)
        differ: set[str] = set()
        while sum(sizes[n] for n in differ) < 0.1 * sum(sizes.values()):
            differ.add(mlp.pop())
    share = sum(sizes[n] for n in differ) / sum(sizes.values())
    passes = sum(not differ & set(sample.draw(sizes, 0.05, seed).names) for seed in range(200))
    bound = sample.pass_bound(sample.least_draws(sizes, 0.05), share)
    assert passes <= _upper(200, bound), (passes, bound, share)
    assert 0 < passes < 200  # the test can fail both ways: some samples miss, some catch


# ---------------------------------------------------------------- a folder


def run(out: Path, capsys, *flags: str) -> tuple[int, dict, str]:
    code, text, err = tv.verify(out, capsys, "--json", *flags)
    return code, json.loads(text), err


@pytest.fixture
def folder(qwen_bf16, merged, tmp_path) -> Path:
    """A private copy of a bfloat16 merge of three agents (safe to damage)."""
    return tv.copy_of(merged(config_text(qwen_bf16, list("ABC"))).out, tmp_path)


def _draws(out: Path, capsys, seeds=range(12), share: str = "0.2") -> dict[int, list[str]]:
    found = {}
    for seed in seeds:
        code, verdict, err = run(out, capsys, "--sample", share, "--sample-seed", str(seed))
        assert code == 0, verdict["problems"]
        found[seed] = verdict["sample"]["tensors"]
    return found


@pytest.mark.quick
def test_a_sample_of_a_folder_says_what_it_checked(qwen_bf16, folder, capsys, tensor_reads):
    code, text, err = tv.verify(folder, capsys, "--sample", "0.2", "--sample-seed", "7")
    assert code == 0, text + err
    headline, odds, *summary_lines = text.strip().splitlines()
    summary = "\n".join(summary_lines)  # checked: and not checked:, one item a line
    assert summary_lines[0] == "checked:" and "not checked:" in summary_lines
    assert headline.startswith(f"{folder}: no difference in a sample of ") and headline.endswith(", seed 7)")
    assert "bit-identical" not in text and "passes a sample like this with a chance of at most" in odds
    assert "the bits of the " in summary and "tensors not drawn" in summary
    assert "caught only where the sample draws it" in summary
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "7")
    drawn = verdict["sample"]
    assert {"seed", "tensors_checked", "tensors_total", "elements_checked", "elements_total", "bytes_read",
            "tensors"} <= set(drawn)  # fmt: skip
    assert drawn["seed"] == 7 and drawn["tensors_checked"] == len(drawn["tensors"]) < drawn["tensors_total"]
    assert drawn["elements_checked"] >= 0.2 * drawn["elements_total"]
    assert verdict["tensors_compared"] == drawn["tensors_checked"] and verdict["result"] == "no difference in sample"
    assert any("caught only where the sample draws it" in line for line in verdict["not_checked"])
    read = [folder, *(qwen_bf16.paths[who] for who in ("base", "A", "B", "C"))]  # what a full verify reads whole
    weights = sum(p.stat().st_size for where in read for p in Path(where).glob("*.safetensors"))
    # these files are smaller than an identity's sixteen 64 KiB windows, which read each input whole: the folder's
    # undrawn tensors are the bytes saved here (benchmarks/verify_sample.py measures a larger layout)
    assert weights - 42_192 < drawn["bytes_read"] < weights
    inputs = {name for where, name in tensor_reads if not where.startswith(str(folder.resolve()))}
    assert inputs and inputs <= set(drawn["tensors"])  # only the drawn tensors are read from the inputs
    code, again, _ = run(folder, capsys, "--sample", "0.2")  # a seed from the operating system, recorded
    assert isinstance(again["sample"]["seed"], int) and f"seed {again['sample']['seed']})" in again["headline"]


def test_sample_one_is_a_full_verify(folder, capsys):
    code, whole, _ = run(folder, capsys)
    code_one, one, _ = run(folder, capsys, "--sample", "1", "--sample-seed", "3")
    assert code == code_one == 0 and "sample" not in one and one["headline"] == whole["headline"]
    assert "bit-identical" in one["headline"]


def test_a_drawn_difference_is_named_and_an_undrawn_one_is_not_seen(folder, capsys):
    draws = _draws(folder, capsys)
    name = next(n for seed, names in draws.items() for n in names if n != "lm_head.weight")
    hit = next(seed for seed, names in draws.items() if name in names)
    miss = next(seed for seed, names in draws.items() if name not in names)
    tv.move_one_ulp(folder, {name: 0})
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(hit))
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]
    assert verdict["sample"]["seed"] == hit
    code, text, _ = tv.verify(folder, capsys, "--sample", "0.2", "--sample-seed", str(hit))
    assert f"differs: {name}: 1 of" in text and "  sample: a sample of" in text
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(miss))
    assert code == 0 and "no difference in a sample" in verdict["headline"]  # what a sample cannot see


def test_a_missing_tensor_is_named_drawn_or_not(folder, capsys):
    draws = _draws(folder, capsys, range(4))
    name = "model.layers.0.input_layernorm.weight"
    seed = next(seed for seed, names in draws.items() if name not in names)
    drawn = draws[seed][0]  # and one the same draw takes
    tv.rewrite(folder, lambda tensors: [tensors.pop(name), tensors.pop(drawn)])
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(seed))
    assert code == 1 and f"missing: {name}: planned by the merge, not in the folder" in verdict["problems"]
    assert f"missing: {drawn}: planned by the merge, not in the folder" in verdict["problems"], verdict["problems"]


def _edit_counts(out: Path, edit) -> None:
    path = out / "ram_stats.json"
    stats = json.loads(path.read_text(encoding="utf-8"))
    edit({row["name"]: row for row in stats["tensors"]}, stats)
    path.write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


def test_counts_are_checked_through_their_sums_and_in_the_drawn_tensors(folder, capsys, tmp_path):
    draws = _draws(folder, capsys)
    every = {n for names in draws.values() for n in names}
    x = next(n for n in sorted(every) if n != "lm_head.weight")
    y = next(n for n in ["model.layers.0.input_layernorm.weight", "model.norm.weight"] if n != x)
    hit = next(seed for seed, names in draws.items() if x in names and y not in names)
    miss = next((seed for seed, names in draws.items() if x not in names and y not in names), None)
    careless = tv.copy_of(folder, tmp_path, "careless")

    def one(rows, _stats):  # the sums no longer hold
        rows[x]["counts"]["A"][0] += 1

    _edit_counts(careless, one)
    code, verdict, _ = run(careless, capsys, "--sample", "0.2", "--sample-seed", str(miss if miss is not None else hit))
    assert code == 1 and any(line.startswith("ram_stats.json: agents[0].active") for line in verdict["files"]), verdict

    def kept(rows, _stats):  # one entry moved from y to x: the totals, rho and lambda are the same
        rows[x]["counts"]["A"][0] += 1
        rows[y]["counts"]["A"][0] -= 1

    _edit_counts(folder, kept)
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(hit))
    assert code == 1 and any(f"({x}, counted again)" in line for line in verdict["files"]), verdict["problems"]
    if miss is not None:
        code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(miss))
        assert code == 0, verdict["problems"]  # caught only by the sample: the verdict says so


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags, said",
    [
        (["--sample", "0"], "--sample 0: expected a fraction of the weights in (0, 1]"),
        (["--sample", "-0.1"], "--sample -0.1: expected a fraction"),
        (["--sample", "1.5"], "--sample 1.5: expected a fraction"),
        (["--sample", "abc"], "--sample abc: expected a fraction"),
        (["--sample", "nan"], "--sample nan: expected a fraction"),
        (["--sample-seed", "3"], "--sample-seed 3: it seeds --sample's draw; give --sample P too"),
        (["--sample", "0.1", "--sample-seed", "x"], "--sample-seed x: expected an integer"),
        (["--sample", "0.1", "--sample-seed", "1.5"], "--sample-seed 1.5: expected an integer"),
    ],
)
def test_bad_sample_options_are_one_line(tmp_path, capsys, flags, said):
    code, out, err = tv.verify(tmp_path, capsys, *flags)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"mergekit-ram verify: error: {said}"), err


def test_a_mergekit_pytorch_merge_samples(qwen_bf16, tmp_path, capsys):
    files = {who: qwen_bf16.paths[who] / "model.safetensors" for who in ("base", "A", "B")}
    out = tv.flat_merge(files, tmp_path)
    code, verdict, err = run(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert code == 0 and "no difference in a sample of" in verdict["headline"], verdict["problems"]
    name = verdict["sample"]["tensors"][0]
    tv.move_one_ulp(out, {name: 0})
    code, verdict, err = run(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]


def test_a_merge_without_counts_samples(qwen_bf16, merged, tmp_path, capsys):
    """r = 0: the merge needs no rho and records no counts; a sample checks the drawn tensors."""
    out = tv.copy_of(merged(config_text(qwen_bf16, list("AB"), parameters="r: 0")).out, tmp_path)
    code, verdict, err = run(out, capsys, "--sample", "0.3", "--sample-seed", "2")
    assert code == 0 and verdict["sample"]["tensors_checked"] > 0, verdict["problems"]
    shutil.rmtree(out)


def test_an_index_naming_an_absent_shard_is_named(llama_sharded, run_yaml, capsys, tmp_path):
    made = run_yaml(config_text(llama_sharded, list("AB")), out_shard_size=4096)
    out = tv.copy_of(made.out, tmp_path)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    code, verdict, _ = run(out, capsys, "--sample", "0.2", "--sample-seed", "1")
    said = f"{shards[-1].name}: model.safetensors.index.json names it, the folder does not hold it"
    assert code == 1 and said in verdict["problems"], verdict["problems"]


def test_mergekit_multi_stages_sample(qwen_bf16, tmp_path, capsys):
    """Each stage of a `mergekit-multi` recipe (the second merges the first's folder) verifies by a sample."""
    inter = tv.multi_stages(qwen_bf16, tmp_path)
    for stage in ("first", "second"):
        code, verdict, err = run(inter / stage, capsys, "--sample", "0.3", "--sample-seed", "5")
        assert code == 0 and "no difference in a sample of" in verdict["headline"], verdict["problems"]
