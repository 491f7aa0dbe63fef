"""`mergekit-ram verify --sample P [--sample-seed N]`: a slice of every output tensor, drawn by the seed, recomputed
from the same elements of the inputs and checked bit for bit.

* the draw (`verify/sample.py`): the same seed draws the same runs, each tensor's slice holds at least P of it and at
  least one row, small tensors whole; the stated bound holds empirically over 200 seeds on the Llama-3.2-3B layout
  (a tensor changed in 10 % of its elements in one block, the worst place; one whole tensor of 50 changed: caught
  at every seed);
* a folder: exit 0 says "no difference in a slice of every tensor", with its seed, the bound in one sentence and
  what was not checked; `--json`'s `sample` with each tensor's share and runs; only the slices are read;
* an element in a drawn run that differs is exit 1, named; one outside every run passes (what a slice cannot see);
  a tensor replaced whole is caught at every seed; a planned tensor missing from the folder is exit 1;
  ram_stats.json's counts: totals that are not the sums of the per-tensor counts are exit 1, a tensor's count its
  slice contradicts is exit 1 naming it;
* bad input: `--sample 0|-0.1|1.5|abc`, `--sample-seed` without `--sample` or not an integer: exit 2, one line; a
  published tensor in another shape or dtype than planned: exit 1 naming it; a tensor whose bytes lie outside its
  file: exit 3 naming the file; an index naming a tensor twice: exit 1 or 3 naming it, never 0;
* `--sample 1` is a full verify; the `mergekit-pytorch` door (a pickled input: its tensors checked whole, and
  said) and `mergekit-multi` stages sample too.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
from pathlib import Path

import pytest
import test_verification as tv
from helpers import config_text

from mergekit_ram.verify import sample

# ---------------------------------------------------------------- the draw, on plain data


def llama_3b() -> dict[str, tuple[int, int]]:
    """The tensors of Llama-3.2-3B (28 layers, tied embeddings): name -> (elements, elements per row)."""
    hidden, inter, kv, vocab = 3072, 8192, 1024, 128256
    sizes = {"model.embed_tokens.weight": (vocab * hidden, hidden), "model.norm.weight": (hidden, 1)}
    for i in range(28):
        at = f"model.layers.{i}."
        sizes |= {
            at + "self_attn.q_proj.weight": (hidden * hidden, hidden),
            at + "self_attn.k_proj.weight": (kv * hidden, hidden),
            at + "self_attn.v_proj.weight": (kv * hidden, hidden),
            at + "self_attn.o_proj.weight": (hidden * hidden, hidden),
            at + "mlp.gate_proj.weight": (inter * hidden, hidden),
            at + "mlp.up_proj.weight": (inter * hidden, hidden),
            at + "mlp.down_proj.weight": (hidden * inter, inter),
            at + "input_layernorm.weight": (hidden, 1),
            at + "post_attention_layernorm.weight": (hidden, 1),
        }
    return sizes


@pytest.mark.quick
def test_the_draw_is_repeatable_and_holds_the_share_of_every_tensor():
    sizes = llama_3b()
    first = sample.draw(sizes, 0.02, 7)
    assert sample.draw(sizes, 0.02, 7) == first and sample.draw(sizes, 0.02, 8) != first
    assert first.names == tuple(sorted(sizes))  # every tensor
    for seed in (1, 2, 3):
        for cut in sample.draw(sizes, 0.02, seed).slices:
            numel, row = sizes[cut.name]
            assert cut.elements >= min(numel, max(0.02 * numel, row)), cut.name
            assert cut.whole is None and len(cut.runs) <= sample.RUNS + 1 and len(set(cut.runs)) == len(cut.runs)
            assert all(0 <= r < cut.count for r in cut.runs)
    drawn = sample.draw(sizes, 0.02, 1)
    assert 0.02 <= drawn.elements / drawn.total < 0.03  # P of the weights, not a tensor's whole 12 %
    small = sample.draw({"tiny": (100, 10), "big": (10_000, 100)}, 0.02, 1, {"big": "a reason"})
    assert [(s.name, s.runs, s.elements, s.whole) for s in small.slices] == [
        ("big", (0,), 10_000, "a reason"), ("tiny", (0,), 100, None)]  # fmt: skip
    assert small.pass_bound(0.01) == 0
    # a larger sample draws more runs, so it is a stronger check (the verdict's advice), not only a longer one
    assert sample.runs_for(0.01) == sample.runs_for(0.02) == sample.RUNS < sample.runs_for(0.05) < sample.runs_for(0.1)
    bounds = [sample.draw(sizes, share, 1).pass_bound(0.1) for share in (0.02, 0.05, 0.1)]
    assert bounds[0] > bounds[1] > bounds[2] and bounds[2] < 0.001, bounds


def _upper(n: int, p: float) -> int:
    """The upper end of the central 95 % interval of Binomial(n, p)."""
    cumulative = 0.0
    for k in range(n + 1):
        cumulative += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if cumulative >= 0.975:
            return k
    return n


def _hit(cut: sample.Slice, changed: list[tuple[int, int]]) -> bool:
    return any(a < stop and start < b for a, b in cut.spans() for start, stop in changed)


@pytest.mark.quick
def test_the_stated_bound_holds_over_200_seeds():
    """At `--sample 0.02` over 200 seeds: a tensor changed in 10 % of its elements, in one block (the place a slice
    misses most), passes inside the 95 % binomial interval of the stated bound or below it; one spread over the
    tensor is caught at every seed, and so is one whole tensor of 50 changed."""
    sizes = llama_3b()
    name = "model.layers.3.mlp.down_proj.weight"
    numel = sizes[name][0]
    rng = random.Random(60)
    start = rng.randrange(numel - numel // 10)
    block = [(start, start + numel // 10)]
    spread = [(i, i + 1) for i in rng.sample(range(numel), numel // 10)]
    bound = sample.draw(sizes, 0.02, 0).tensor_bound(0.1)  # a tensor's: this one holds 0.8 % of the weights
    block_passes = spread_passes = whole_passes = 0
    names = sorted(sizes)
    for seed in range(200):
        drawn = {s.name: s for s in sample.draw(sizes, 0.02, seed).slices}
        block_passes += not _hit(drawn[name], block)
        spread_passes += not _hit(drawn[name], spread[:2000])  # 2,000 of them already catch it
        other = names[seed % len(names)]
        whole_passes += not _hit(drawn[other], [(0, sizes[other][0])])
        assert drawn[name].pass_bound(0.1) <= bound
    assert block_passes <= _upper(200, bound), (block_passes, bound)
    assert block_passes > 0  # the test can fail both ways: some seeds miss a block
    assert spread_passes == 0 and whole_passes == 0


def llama_3b_narrow() -> dict[str, tuple[int, int]]:
    """Llama-3.2-3B's tensors at 1/16 of its width (benchmarks' R3w: hidden 192, MLP 512, 3 heads of 64, its
    vocabulary): the embeddings hold 66 % of the weights, each of the 196 matrices at most 0.3 %."""
    hidden, inter, vocab = 192, 512, 128256
    sizes = {"model.embed_tokens.weight": (vocab * hidden, hidden), "model.norm.weight": (hidden, 1)}
    for i in range(28):
        at = f"model.layers.{i}."
        sizes |= {at + f"self_attn.{p}_proj.weight": (hidden * hidden, hidden) for p in "qkvo"}
        sizes |= {at + f"mlp.{p}_proj.weight": (inter * hidden, hidden) for p in ("gate", "up")}
        sizes |= {at + "mlp.down_proj.weight": (hidden * inter, inter)}
        sizes |= {at + f"{n}_layernorm.weight": (hidden, 1) for n in ("input", "post_attention")}
    return sizes


@pytest.mark.quick
def test_the_merges_bound_holds_over_200_seeds_where_it_is_weakest():
    """The verdict's bound is the merge's (`sample.merge_bound`): a merge whose differences hold 10 % of its
    weights, placed where the draw is thinnest (one block of the tensor with the fewest runs per element: the
    embeddings), passes inside the 95 % binomial interval of the stated bound or below it over 200 seeds at
    `--sample 0.02`; small tensors draw fewer runs than large ones (`sample.allotted`), never fewer than
    `least_runs`, and the stated bound is no weaker than 16 runs in every tensor gave."""
    sizes = llama_3b_narrow()
    first = sample.draw(sizes, 0.02, 0)
    runs = {s.name: len(s.runs) for s in first.slices if s.sliced}
    assert min(runs.values()) >= sample.least_runs(0.02) == 8 and max(runs.values()) <= sample.runs_for(0.02) + 1
    assert runs["model.embed_tokens.weight"] > runs["model.layers.0.mlp.up_proj.weight"]
    bound = first.pass_bound(0.1)
    assert bound <= (1 - 0.1) ** sample.runs_for(0.02)  # what 16 runs in every tensor stated
    assert first.tensor_bound(0.5) <= 0.5 ** sample.least_runs(0.02)
    name, total = "model.embed_tokens.weight", sum(numel for numel, _ in sizes.values())
    rng = random.Random(71)
    start = rng.randrange(sizes[name][0] - total // 10)
    block = [(start, start + total // 10)]  # 10 % of the merge's weights, all in the embeddings
    passes, bounds = 0, []
    for seed in range(200):
        drawn = sample.draw(sizes, 0.02, seed)
        passes += not _hit(next(s for s in drawn.slices if s.name == name), block)
        bounds.append(drawn.pass_bound(0.1))  # a seed that draws a short last run draws one run more
    assert passes <= _upper(200, max(bounds)), (passes, max(bounds))
    assert passes > 0  # the test can fail both ways
    tiny = [sample.Slice("a", 100, 10, (0,)), sample.Slice("b", 1000, 10, tuple(range(5)))]
    assert sample.merge_bound(tiny, 0.1) == pytest.approx(math.exp(-5 / 1000 * 110))  # all in b, the thinner
    wider = [sample.Slice("a", 1000, 1000, (0,), "a reason"), sample.Slice("b", 100, 10, tuple(range(5)))]
    assert sample.merge_bound(wider, 0.5) == 0  # 550 differences cannot all lie in b: some in a, checked whole
    assert sample.miss_chance(10, 2, 3) == pytest.approx(math.comb(8, 3) / math.comb(10, 3))


# ---------------------------------------------------------------- a folder


def run(out: Path, capsys, *flags: str) -> tuple[int, dict, str]:
    code, text, err = tv.verify(out, capsys, "--json", *flags)
    return code, json.loads(text), err


@pytest.fixture
def folder(qwen_bf16, merged, tmp_path) -> Path:
    """A private copy of a bfloat16 merge of three agents (safe to damage)."""
    return tv.copy_of(merged(config_text(qwen_bf16, list("ABC"))).out, tmp_path)


def _slices(out: Path, capsys, seed: int, share: str = "0.2") -> dict:
    code, verdict, _ = run(out, capsys, "--sample", share, "--sample-seed", str(seed))
    assert code == 0, verdict["problems"]
    return verdict["sample"]["slices"]


def _inside(slices: dict, name: str) -> set[int]:
    """The elements of `name` a draw checks."""
    found = slices[name]
    return {i for r in found["runs"] for i in range(r * found["run"], (r + 1) * found["run"])}


@pytest.mark.quick
def test_a_sample_of_a_folder_says_what_it_checked(qwen_bf16, folder, capsys, tensor_reads):
    code, text, err = tv.verify(folder, capsys, "--sample", "0.2", "--sample-seed", "7")
    assert code == 0, text + err
    headline, odds, cost, *summary_lines = text.strip().splitlines()
    summary = "\n".join(summary_lines)  # checked: and not checked:, one item a line
    assert summary_lines[0] == "checked:" and "not checked:" in summary_lines
    assert cost.startswith("  read ") and " MB of weight files (a full verify reads " in cost  # local: no requests
    assert headline.startswith(f"{folder}: no difference in a slice of every tensor (27 tensors, ")
    assert headline.endswith(" of the weights, seed 7)") and "bit-identical" not in text
    assert odds.startswith("  a merge with 10 % of its weights changed would pass this check up to ")
    assert odds.endswith("use a larger --sample for a stronger check")
    assert "elements outside the slices" in summary
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "7")
    drawn = verdict["sample"]
    assert {"seed", "tensors_checked", "tensors_total", "elements_checked", "elements_total", "bytes_read",
            "tensors", "slices", "whole", "pass_bound"} <= set(drawn)  # fmt: skip
    assert drawn["seed"] == 7 and drawn["tensors_checked"] == drawn["tensors_total"] == 27 and drawn["whole"] == {}
    assert drawn["requests"] == 0 and drawn["bytes_read"] < drawn["full_verify_bytes"]
    assert drawn["full_verify_cheaper"] is False and "tensor_pass_bound" in drawn
    assert 0.2 * drawn["elements_total"] <= drawn["elements_checked"] < 0.5 * drawn["elements_total"]
    assert all(row["share"] >= 0.2 for row in drawn["slices"].values())
    assert verdict["tensors_compared"] == 27 and verdict["result"] == "no difference in sample"
    read = [folder, *(qwen_bf16.paths[who] for who in ("base", "A", "B", "C"))]  # what a full verify reads whole
    weights = sum(p.stat().st_size for where in read for p in Path(where).glob("*.safetensors"))
    assert drawn["bytes_read"] < weights
    assert not {where for where, _ in tensor_reads if where.startswith(str(folder.resolve()))}  # no whole tensor
    code, again, _ = run(folder, capsys, "--sample", "0.2")  # a seed from the operating system, recorded
    assert isinstance(again["sample"]["seed"], int) and f"seed {again['sample']['seed']})" in again["headline"]


def test_sample_one_is_a_full_verify(folder, capsys):
    code, whole, _ = run(folder, capsys)
    code_one, one, _ = run(folder, capsys, "--sample", "1", "--sample-seed", "3")
    assert code == code_one == 0 and "sample" not in one and one["headline"] == whole["headline"]
    assert "bit-identical" in one["headline"]


def test_an_element_in_the_slice_is_named_and_one_outside_is_not_seen(folder, capsys, tmp_path):
    name = "model.layers.1.mlp.gate_proj.weight"
    clean = tv.copy_of(folder, tmp_path, "clean")
    slices = _slices(folder, capsys, 3)
    inside = sorted(_inside(slices, name))
    outside = next(i for i in range(48 * 32) if i not in inside)
    tv.move_one_ulp(folder, {name: inside[len(inside) // 2]})
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]
    assert verdict["tensors"][0]["differing"] == 1 and verdict["tensors"][0]["elements"] == len(inside)
    code, text, _ = tv.verify(folder, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert f"differs: {name}: 1 of {len(inside)} elements" in text and "  sample: a slice of every tensor" in text
    tv.move_one_ulp(clean, {name: outside})
    code, verdict, _ = run(clean, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert code == 0 and "no difference in a slice" in verdict["headline"]  # what a slice cannot see


def test_a_tensor_replaced_whole_is_caught_at_every_seed(qwen_bf16, folder, capsys):
    from safetensors.torch import load_file

    name = "model.layers.0.self_attn.o_proj.weight"
    other = load_file(str(qwen_bf16.paths["A"] / "model.safetensors"))[name]  # an agent's, not the merge's
    tv.rewrite(folder, lambda tensors: tensors.update({name: other.to(tensors[name].dtype)}))
    for seed in range(5):
        code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", str(seed))
        assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]


def test_a_missing_tensor_is_named(folder, capsys):
    name = "model.layers.0.input_layernorm.weight"
    tv.rewrite(folder, lambda tensors: tensors.pop(name))
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "1")
    assert code == 1 and f"missing: {name}: planned by the merge, not in the folder" in verdict["problems"]


def _edit_counts(out: Path, edit) -> None:
    path = out / "ram_stats.json"
    stats = json.loads(path.read_text(encoding="utf-8"))
    edit({row["name"]: row for row in stats["tensors"]}, stats)
    path.write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


def test_counts_are_checked_through_their_sums_and_against_each_slice(folder, capsys, tmp_path):
    careless = tv.copy_of(folder, tmp_path, "careless")
    x, y = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def one(rows, _stats):  # the sums no longer hold
        rows[x]["counts"]["A"][0] += 1

    _edit_counts(careless, one)
    code, verdict, _ = run(careless, capsys, "--sample", "0.2", "--sample-seed", "1")
    assert code == 1 and any(line.startswith("ram_stats.json: agents[0].active") for line in verdict["files"]), verdict
    numel = 48 * 32

    def moved(rows, _stats):  # y's active entries moved to x: the totals, rho and lambda are the same
        taken = min(rows[y]["counts"]["A"][0], numel - rows[x]["counts"]["A"][0])
        rows[x]["counts"]["A"][0] += taken
        rows[y]["counts"]["A"][0] -= taken

    before = json.loads((folder / "ram_stats.json").read_text())
    _edit_counts(folder, moved)
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "1")
    assert before != json.loads((folder / "ram_stats.json").read_text())
    said = [line for line in verdict["files"] if "cannot be: its slice holds" in line]
    assert code == 1 and said and all(f"tensor {y}: A's active count" in line or f"tensor {x}: A's active" in line
                                       for line in said), verdict["problems"]  # fmt: skip


def test_an_agents_totals_far_from_its_slices_are_named(folder, capsys):
    """Per-tensor counts edited (and so the totals and lambda): the slices' estimate of each agent's totals is
    further from them than the stated room, which an honest record exceeds with a chance below 1e-6."""
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "2")
    said = verdict["sample"]["counts"]
    assert code == 0 and said.startswith("each agent's active and unique totals within "), said
    assert "a record moving an agent's lambda by more than " in said and "99.9999 %" in said
    room = float(said.split("within ")[1].split(" of")[0].replace(",", ""))

    def inflated(rows, _stats):
        for row in rows.values():
            row["counts"]["A"][0] = min(row["numel"], row["counts"]["A"][0] + row["numel"] // 2)

    _edit_counts(folder, inflated)
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "2")
    lines = [line for line in verdict["files"] if line.startswith("ram_stats.json: A's active entries total")]
    assert code == 1 and len(lines) == 1 and "its slices estimate" in lines[0], verdict["problems"]
    recorded, estimated = (float(x.split()[0].replace(",", "").rstrip(";")) for x in
                           (lines[0].split("total ")[1], lines[0].split("estimate ")[1]))  # fmt: skip
    assert abs(recorded - estimated) > room


@pytest.mark.parametrize("damage", ["shape", "dtype"])
def test_a_published_tensor_unlike_the_plan_is_named(folder, capsys, damage):
    import torch

    name = "model.layers.0.mlp.down_proj.weight"
    if damage == "shape":
        change = {name: lambda t: t.reshape(48, 32).contiguous()}
    else:
        change = {name: lambda t: t.to(torch.float16)}
    tv.rewrite(folder, lambda tensors: tensors.update({n: f(tensors[n]) for n, f in change.items()}))
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "1")
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]
    assert verdict["tensors"][0]["status"] == damage


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _write(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_a_tensor_outside_its_file_is_named(folder, capsys):
    (path,) = tv.weight_files(folder)
    header, body = _header(path)
    _write(path, header, body[:-64])  # the last tensor ends past the file
    code, verdict, _ = run(folder, capsys, "--sample", "0.2", "--sample-seed", "1")
    said = " ".join(verdict["problems"] + verdict["cannot_check"] + [verdict.get("error") or ""])
    assert code == 3 and str(path) in said, said  # mergekit's loader refuses the file first


def test_an_index_naming_a_tensor_twice_is_named(llama_sharded, run_yaml, capsys, tmp_path):
    made = run_yaml(config_text(llama_sharded, list("AB")), out_shard_size=4096)
    out = tv.copy_of(made.out, tmp_path)
    index = out / "model.safetensors.index.json"
    text = index.read_text(encoding="utf-8")
    data = json.loads(text)
    name, file = next(iter(data["weight_map"].items()))
    other = next(f for f in sorted(set(data["weight_map"].values())) if f != file)
    twice = text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1)
    index.write_text(twice, encoding="utf-8")
    code, verdict, _ = run(out, capsys, "--sample", "0.2", "--sample-seed", "1")
    said = " ".join(verdict["problems"] + verdict["cannot_check"] + [verdict.get("error") or ""])
    assert code in (1, 3) and name in said, said


@pytest.mark.parametrize("case", list(tv.CASES))
def test_a_sample_passes_every_honest_merge(request, run_yaml, capsys, case):
    """No false alarm: every merge test_verification checks whole (dtypes, out_dtype, r = 0, rho scopes, a given
    rho, epsilon by filter, tied embeddings, shards) passes a slice of every tensor, at three seeds."""
    fixture, agents, config, options = tv.CASES[case]
    made = run_yaml(config_text(request.getfixturevalue(fixture), list(agents), **config), **options)
    for seed in (1, 2, 3):
        code, verdict, _ = run(made.out, capsys, "--sample", "0.1", "--sample-seed", str(seed))
        assert code == 0 and "no difference in a slice of every tensor" in verdict["headline"], verdict["problems"]
        assert verdict["tensors_compared"] == len(made.tensors)
    whole = verdict["sample"]["whole"]
    assert not whole or case == "tied", whole  # a tied lm_head some input does not store: checked whole, said


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
    code, verdict, _ = run(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert code == 0 and "no difference in a slice of every tensor" in verdict["headline"], verdict["problems"]
    assert verdict["sample"]["whole"] == {}
    name = "model.layers.1.mlp.up_proj.weight"
    tv.move_one_ulp(out, {name: min(_inside(verdict["sample"]["slices"], name))})
    code, verdict, _ = run(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]


def test_a_pickled_input_is_checked_whole_and_said(qwen_bf16, tmp_path, capsys):
    from models import write_flat

    files = write_flat(tmp_path / "pickles", qwen_bf16.family, ("base", "A", "B"), fmt="pt")
    out = tv.flat_merge(files, tmp_path)
    code, verdict, _ = run(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert code == 0, verdict["problems"]
    whole = verdict["sample"]["whole"]
    assert len(whole) == 27 and set(whole.values()) == {"an input is a pickle, which has no byte ranges"}
    code, text, _ = tv.verify(out, capsys, "--sample", "0.3", "--sample-seed", "1")
    assert "  checked whole, not sliced (an input is a pickle, which has no byte ranges): lm_head.weight, " in text


def test_a_merge_without_counts_samples(qwen_bf16, merged, tmp_path, capsys):
    """r = 0: the merge needs no rho and records no counts; a sample checks the drawn tensors."""
    out = tv.copy_of(merged(config_text(qwen_bf16, list("AB"), parameters="r: 0")).out, tmp_path)
    code, verdict, _ = run(out, capsys, "--sample", "0.3", "--sample-seed", "2")
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
        code, verdict, _ = run(inter / stage, capsys, "--sample", "0.3", "--sample-seed", "5")
        assert code == 0 and "no difference in a slice of every tensor" in verdict["headline"], verdict["problems"]


def test_a_pickled_published_merge_is_read_whole_and_said(qwen_bf16, run_yaml, capsys, tmp_path):
    """A merge written with --no-safe-serialization (pytorch_model.bin) has no byte ranges: each tensor is checked
    whole (as docs/verify.md says a pickled weight file is read), never exit 3; a changed element is still named."""
    out = run_yaml(config_text(qwen_bf16, list("AB")), out=tmp_path / "o", safe_serialization=False).out
    assert list(out.glob("*.bin")) and not list(out.glob("*.safetensors"))
    code, verdict, _ = run(out, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert code == 0, (verdict["problems"], verdict.get("cannot_check"))
    whole = verdict["sample"]["whole"]
    assert len(whole) == verdict["sample"]["tensors_total"]
    assert set(whole.values()) == {"the published merge is a pickle, which has no byte ranges"}
    code, text, _ = tv.verify(out, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert "checked whole, not sliced (the published merge is a pickle, which has no byte ranges)" in text
    import torch

    weights = out / "pytorch_model.bin"
    tensors = torch.load(weights, weights_only=True)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name].view(-1)[-1] = tensors[name].view(-1)[-1] * 2 + 1  # outside most slices: whole, so seen
    torch.save(tensors, weights)
    code, verdict, _ = run(out, capsys, "--sample", "0.2", "--sample-seed", "3")
    assert code == 1 and [row["name"] for row in verdict["tensors"]] == [name], verdict["problems"]
