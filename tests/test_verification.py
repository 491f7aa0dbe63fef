"""`mergekit-ram verify OUT_DIR`: a finished ramplus merge recomputed from its folder and compared bit for bit.

* no false alarm: folders merged by `run_merge` (not by verify) across the dtypes and options the suite
  covers verify as bit-identical, with the count of tensors the folder holds, and a summary line of what
  was checked (identities, tensors, ram_stats.json's statistics, config.json, the card);
* every change is found and named: one element of one tensor moved by one ulp (count 1, its |difference|),
  one element of every tensor at once, a tensor deleted or added, an agent's weights swapped for another's
  (a changed identity: exit 3, cannot check, nothing recomputed), an edited parameter in mergekit_config.yml (nothing recomputed);
* a `mergekit-multi` stage whose config names the earlier stage's folder verifies, and names that folder
  once it is gone;
* rho is counted again although the statistics cache holds the counts (the cache is never evidence);
* `--json` follows the schema of mergekit_ram/verify/verdict.py; the card's reproduce line names verify.

The bit comparison on plain tensors: tests/test_bitwise.py; the checks of the record on plain data:
tests/test_record_checks.py; the outcome as text and JSON: tests/test_verdict.py. Hub ids pinned to
their recorded revision: tests/test_hub.py. Bad input to verify and "writes nothing":
tests/reliability/test_verify_cases.py; a stranger's folder (code, pickles, special files, links, the
files beside the weights, --input): tests/reliability/test_untrusted_folders.py.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import models
import pytest
import torch
import yaml
from helpers import config_text, read_stats
from safetensors.torch import load_file, save_file

INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------- helpers


def verify(out: Path, capsys, *flags: str) -> tuple[int, str, str]:
    from mergekit_ram import cli

    capsys.readouterr()
    code = cli.main(["verify", str(out), "-q", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def copy_of(out: Path, tmp_path: Path, name: str = "copy") -> Path:
    """A private copy of a merged folder (safe to damage); verify reads the inputs by their absolute paths."""
    return Path(shutil.copytree(out, tmp_path / name))


def weight_files(out: Path) -> list[Path]:
    return sorted(out.glob("*.safetensors"))


def move_one_ulp(out: Path, changes: dict[str, int]) -> dict[str, float]:
    """Move element `index` of each named tensor by one step of its dtype (its bits + 1), in the folder's files;
    returns name -> |new - old|."""
    moved = {}
    for path in weight_files(out):
        tensors = load_file(str(path))
        hit = [name for name in changes if name in tensors]
        if not hit:
            continue
        for name in hit:
            tensor = tensors[name].clone()
            flat = tensor.view(-1)
            old = float(flat[changes[name]])
            flat.view(INTS[tensor.element_size()])[changes[name]] += 1
            moved[name] = abs(float(flat[changes[name]]) - old)
            tensors[name] = tensor
        save_file(tensors, str(path), metadata={"format": "pt"})
    assert set(moved) == set(changes), set(changes) - set(moved)
    return moved


def rewrite(out: Path, edit) -> None:
    """Apply `edit(dict of tensors)` to the folder's single weight file."""
    (path,) = weight_files(out)
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------- no false alarm

CASES = {
    # id: (fixture, agents, config options, run options)
    "bf16": ("qwen_bf16", "ABC", {}, {}),
    "float32": ("qwen_fp32", "ABC", {"dtype": "float32"}, {}),
    "out_dtype": ("qwen_bf16", "AB", {"out_dtype": "float32"}, {}),
    "r0": ("qwen_bf16", "AB", {"parameters": "r: 0"}, {}),
    "rho_layer": ("qwen_bf16", "ABC", {"parameters": "rho_scope: layer"}, {}),
    "rho_tensor": ("qwen_bf16", "AB", {"parameters": "rho_scope: tensor\nr: 0.5"}, {}),
    "given_rho": ("qwen_bf16", "AB", {"model_parameters": {"A": "rho: 0.7", "B": "rho: 2.5"}}, {}),
    "epsilon_filter": (
        "qwen_bf16",
        "AB",
        {"parameters": "epsilon:\n  - filter: mlp\n    value: 0.001\n  - value: 0.00001"},
        {},
    ),
    "tied": ("llama_tied", "ABC", {}, {}),
    "sharded": ("llama_sharded", "AB", {}, {"out_shard_size": 4096}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_passes_on_merges_it_did_not_make(request, run_yaml, capsys, case):
    fixture, agents, config, options = CASES[case]
    written = request.getfixturevalue(fixture)
    run = run_yaml(config_text(written, list(agents), **config), **options)
    if case == "sharded":
        assert len(weight_files(run.out)) > 1 and (run.out / "model.safetensors.index.json").exists()
    code, out, err = verify(run.out, capsys)
    assert code == 0, out + err
    counted = "" if case in ("r0", "given_rho") else " (rho counted again)"  # r = 0 or rho given: none needed
    headline, summary = out.strip().split("\n", 1)  # then what was checked, one item a line
    assert headline == f"{run.out}: bit-identical, {len(run.tensors)} tensors{counted}", out
    assert summary.startswith("checked:\n  the identities of ") and " tensors bit for bit " in summary, summary
    assert all(line.startswith("  ") for line in summary.splitlines()[1:]), summary
    assert "ram_stats.json's statistics" in summary and "config.json" in summary, summary
    assert read_stats(run.out)["merge"]["entry_point"] == "run_merge"


def test_verify_without_the_compiled_kernel_passes_a_float32_merge(run_yaml, capsys, qwen_fp32, monkeypatch):
    """A stranger's verify builds no kernel and counts with the torch one, whose float64 sums add in another order
    than the compiled loops that counted the merge: the diagnostics' last bits differ (checked below), and verify
    takes them to their rounding (`published_checks.SUM_TOLERANCE`) instead of calling an honest merge different."""
    from mergekit_ram.core import kernel, native

    if native.library() is None:
        pytest.skip("no C compiler: the merge would count with the torch kernel too")
    run = run_yaml(config_text(qwen_fp32, ["A", "B", "C"], dtype="float32"))
    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "0")
    code, out, err = verify(run.out, capsys)
    assert code == 0, out + err
    assert "\n  ram_stats.json's statistics" in out, out
    base, agents = qwen_fp32.family.base, [qwen_fp32.family.agents[a] for a in "ABC"]

    def sums(name: str) -> torch.Tensor:
        found = kernel.diagnose(base[name], [a[name] for a in agents], 1e-5)
        return torch.cat([found.pair_sums.reshape(-1), found.magnitude.reshape(-1)])

    torch_sums = {name: sums(name) for name in base}
    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "1")
    # the torch path's sums are per chunk since issue 53: in some tensors they are the native bits, not in all
    differ = [name for name in base if not torch.equal(torch_sums[name], sums(name))]
    assert differ, "the case does not tell the two kernels' sums apart"


def test_verify_with_mergekit_ram_from_elsewhere_notes_it(merged, qwen_bf16, capsys, monkeypatch):
    """Where mergekit-ram came from is the installation's, like its version: a stranger's wheel verifying a merge made
    from a checkout is a note, not a difference (it was `ram_stats.json: mergekit_ram_source.commit ...`, exit 1)."""
    from mergekit_ram.reporting import report

    run = merged(config_text(qwen_bf16, ["A", "B"]))
    elsewhere = {"installed_from": "index"}
    assert read_stats(run.out)["mergekit_ram_source"] != elsewhere
    monkeypatch.setattr(report, "installed_from", lambda: dict(elsewhere))
    code, out, err = verify(run.out, capsys, "--json")
    assert code == 0, out + err
    notes = json.loads(out)["notes"]
    assert any(n.startswith('this mergekit-ram came from {"installed_from": "index"}') for n in notes), notes


def test_merge_record_names_the_options_that_change_the_merge(merged, qwen_bf16):
    from mergekit_ram.reporting import report

    record = read_stats(merged(config_text(qwen_bf16, ["A", "B"])).out)["merge"]
    assert record == {
        "entry_point": "run_merge",
        "options": {name: (None if name == "lora_merge_dtype" else False) for name in report.RECORDED_OPTIONS},
    }


@pytest.mark.quick
def test_card_names_verify(merged, qwen_bf16):
    card = (merged(config_text(qwen_bf16, ["A", "B"])).out / "README.md").read_text(encoding="utf-8")
    assert "`mergekit-ram verify ORG/NAME`, with this repository's id on the Hub" in card
    assert "`mergekit-ram verify FOLDER` for a copy of this folder" in card


# ---------------------------------------------------------------- every change found


@pytest.fixture(scope="module")
def abc(tmp_path_factory, qwen_bf16):
    """One merge of A, B, C (bf16) by run_merge, verified by copies."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    out = tmp_path_factory.mktemp("abc") / "merged"
    text = config_text(qwen_bf16, ["A", "B", "C"])
    run_merge(
        MergeConfiguration.model_validate(yaml.safe_load(text)),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True),
        config_source=text,
    )
    return out


@pytest.mark.quick
def test_one_ulp_in_one_tensor_is_named(abc, tmp_path, capsys):
    """Also after a verify of the same folder in the same process (mergekit's loaders are not reused stale)."""
    out = copy_of(abc, tmp_path)
    assert verify(out, capsys)[0] == 0
    name = "model.layers.1.self_attn.k_proj.bias"
    moved = move_one_ulp(out, {name: 5})
    code, text, err = verify(out, capsys)
    assert code == 1, text + err
    numel = load_file(str(out / "model.safetensors"))[name].numel()
    assert f"differs: {name}: 1 of {numel} elements, max |difference| {moved[name]:g}" in text, text
    assert text.count("differs:") == 1
    assert f"{len(load_file(str(out / 'model.safetensors'))) - 1} of" in text  # the others are identical
    found = json.loads(verify(out, capsys, "--json")[1])
    (row,) = found["tensors"]
    assert (row["name"], row["status"], row["differing"], row["elements"]) == (name, "differs", 1, numel)
    assert row["max_abs_difference"] == moved[name] and row["nan"] == 0


def test_one_ulp_in_every_tensor_is_named_for_each(abc, tmp_path, capsys):
    """A different element of every tensor moved by one ulp: every tensor is named, each with one element."""
    out = copy_of(abc, tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    changes = {name: (7 * i) % t.numel() for i, (name, t) in enumerate(sorted(tensors.items()))}
    move_one_ulp(out, changes)
    code, text, _ = verify(out, capsys, "--json")
    assert code == 1
    found = json.loads(text)
    assert {row["name"]: row["differing"] for row in found["tensors"]} == {name: 1 for name in tensors}
    assert found["tensors_compared"] == len(tensors) and found["tensors_identical"] == 0


def test_sign_of_a_zero_is_a_difference(abc, tmp_path, capsys):
    """-0.0 against 0.0: bits differ, |difference| 0."""
    out = copy_of(abc, tmp_path)
    name = "model.norm.weight"

    def edit(tensors):
        t = tensors[name].clone()
        t.view(-1)[3] = -0.0 if math.copysign(1, float(t.view(-1)[3])) > 0 and t.view(-1)[3] == 0 else 0.0
        tensors[name] = t

    rewrite(out, edit)
    code, text, _ = verify(out, capsys)
    assert code == 1 and f"differs: {name}: 1 of" in text, text


def test_deleted_and_added_tensors_are_named(abc, tmp_path, capsys):
    out = copy_of(abc, tmp_path)
    gone = "model.layers.0.mlp.up_proj.weight"

    def edit(tensors):
        del tensors[gone]
        tensors["model.extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)

    rewrite(out, edit)
    code, text, _ = verify(out, capsys)
    assert code == 1
    assert f"missing: {gone}: planned by the merge, not in the folder" in text, text
    assert "extra: model.extra.weight: in the folder (in model.safetensors), not planned by the merge" in text
    found = json.loads(verify(out, capsys, "--json")[1])
    assert {(row["name"], row["status"]) for row in found["tensors"]} == {
        (gone, "missing"),
        ("model.extra.weight", "extra"),
    }


def test_swapped_input_is_named_and_nothing_is_recomputed(qwen_bf16, run_yaml, tmp_path, capsys, monkeypatch):
    from mergekit_ram.core import kernel

    inputs = {who: Path(shutil.copytree(qwen_bf16.paths[who], tmp_path / who)) for who in ("base", "A", "B")}
    text = f"merge_method: ramplus\nbase_model: {inputs['base']}\nmodels:\n"
    text += "".join(f"  - model: {inputs[who]}\n" for who in "AB") + "dtype: bfloat16\n"
    run = run_yaml(text)
    shutil.copy2(inputs["B"] / "model.safetensors", inputs["A"] / "model.safetensors")  # A now holds B's weights

    def refuse(*_a, **_k):
        raise AssertionError("verify recomputed a merge of a changed input")

    for name in ("merge", "count", "diagnose"):
        monkeypatch.setattr(kernel, name, refuse)
    code, out, err = verify(run.out, capsys)
    assert code == 3, out + err  # not the recorded input: the folder cannot be checked, it is not shown to differ
    assert out.startswith(f"{run.out}: CANNOT CHECK (1 reason):"), out
    assert f"input A ({inputs['A']}, agent) changed: content_id " in out, out
    assert "(nothing recomputed: the merge was not run again)" in out
    found = json.loads(verify(run.out, capsys, "--json")[1])
    statuses = {row["model"]: row["status"] for row in found["inputs"]}
    assert statuses == {str(inputs["base"]): "same", str(inputs["A"]): "changed", str(inputs["B"]): "same"}
    assert found["merged"] is False and found["result"] == "cannot check" and found["exit_code"] == 3


@pytest.mark.parametrize(
    "edit, named",
    [
        (("r: 0.1", "r: 0.2"), "r: mergekit_config.yml plans 0.2, ram_stats.json records 0.1"),
        (("rho_scope: model", "rho_scope: layer"), "rho_scope: mergekit_config.yml plans layer, ram_stats.json records model"),
        (("dtype: bfloat16", "dtype: bfloat16\nparameters:\n  alpha: 3.0"), "alpha: mergekit_config.yml plans 3, "),
    ],
    ids=["r", "rho_scope", "alpha-added"],
)
@pytest.mark.quick
def test_edited_parameter_is_named_and_nothing_is_recomputed(qwen_bf16, run_yaml, tmp_path, capsys, monkeypatch, edit, named):
    from mergekit_ram.core import kernel

    parameters = "r: 0.1\nrho_scope: model" if edit[0] != "dtype: bfloat16" else ""
    run = run_yaml(config_text(qwen_bf16, ["A", "B"], parameters=parameters))
    config = run.out / "mergekit_config.yml"
    text = config.read_text(encoding="utf-8")
    assert edit[0] in text
    config.write_text(text.replace(edit[0], edit[1], 1), encoding="utf-8")
    monkeypatch.setattr(kernel, "diagnose", lambda *a, **k: pytest.fail("verify counted an edited config"))
    code, out, _ = verify(run.out, capsys)
    assert code == 1
    assert named in out, out


# ---------------------------------------------------------------- mergekit-multi, the cache


def multi_stages(qwen_bf16, tmp_path: Path) -> Path:
    """A `mergekit-multi` recipe run: stage `second` merges the folder of stage `first` with C; the stages' folder."""
    from mergekit.scripts.multimerge import main as multi

    recipe = tmp_path / "recipe.yml"
    recipe.write_text(
        f"name: first\n{config_text(qwen_bf16, ['A', 'B'])}---\nname: second\nmerge_method: ramplus\n"
        f"base_model: {qwen_bf16.path('base')}\nmodels:\n  - model: first\n  - model: {qwen_bf16.path('C')}\n"
        "dtype: bfloat16\n",
        encoding="utf-8",
    )
    inter = tmp_path / "stages"
    multi([str(recipe), "--intermediate-dir", str(inter), "--no-copy-tokenizer", "--quiet"], standalone_mode=False)
    return inter


def test_mergekit_multi_stages_verify(qwen_bf16, tmp_path, capsys):
    """Stage `second` merges the folder of stage `first` with C; both verify; without `first`, `second` names it."""
    inter = multi_stages(qwen_bf16, tmp_path)
    assert f"model: {inter / 'first'}" in (inter / "second" / "mergekit_config.yml").read_text(encoding="utf-8")
    for stage in ("first", "second"):
        code, out, err = verify(inter / stage, capsys)
        assert code == 0 and "bit-identical" in out, out + err
    shutil.rmtree(inter / "first")
    code, out, _ = verify(inter / "second", capsys)
    assert code == 3
    assert f"input first ({inter / 'first'}, agent) cannot be read: no such folder: {inter / 'first'}" in out, out


def test_verify_counts_again_although_the_cache_holds_the_counts(qwen_bf16, run_yaml, tmp_path, capsys, monkeypatch):
    """The cache is a hint for merges, never evidence: verify reads no entry, it counts again (an entry edited
    to agree with edited weights would otherwise vouch for them)."""
    from mergekit_ram.core import kernel

    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    run = run_yaml(config_text(qwen_bf16, ["A", "B", "C"]))
    assert run.count_calls > 0  # the merge counted and stored the counts
    counted = []
    real = kernel.diagnose
    monkeypatch.setattr(kernel, "diagnose", lambda *a, **k: counted.append(1) or real(*a, **k))
    code, out, err = verify(run.out, capsys)
    assert code == 0, out + err
    assert out.splitlines()[0].endswith("tensors (rho counted again)"), out
    assert counted
    assert json.loads(verify(run.out, capsys, "--json")[1])["statistics"] == "computed"


def test_a_merge_needing_no_rho_records_no_statistics_whatever_the_cache_held(
    qwen_bf16, run_yaml, tmp_path, capsys, monkeypatch
):
    """Issue 59: `ramplus` then `r: 0` (or rho given for every agent) on one warm cache. The second merge took the
    counts from the cache and recorded them; verify, which never reads the cache, recomputed none and called the
    right merge NOT identical (exit 1), while `--sample` said exit 0. Now such a merge records no statistics, the
    same bytes as with the cache off, and both verdicts are exit 0."""
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    run_yaml(config_text(qwen_bf16, ["A", "B", "C"]))  # fills the cache
    given = {a: f"rho: {rho}" for a, rho in zip("ABC", (2.0, 0.5, 1.0), strict=True)}
    for name, text in (("r0", config_text(qwen_bf16, ["A", "B", "C"], parameters="r: 0")),
                       ("given", config_text(qwen_bf16, ["A", "B", "C"], model_parameters=given))):  # fmt: skip
        warm = run_yaml(text, out=tmp_path / f"{name}-warm")
        monkeypatch.setenv("MERGEKIT_RAM_CACHE", "off")
        cold = run_yaml(text, out=tmp_path / f"{name}-cold")
        monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
        assert warm.count_calls == 0 and read_stats(warm.out)["statistics"] == "not computed"
        assert read_stats(warm.out)["tensors"] == [] == read_stats(cold.out)["tensors"]
        for flags in ((), ("--sample", "0.3")):
            code, out, err = verify(warm.out, capsys, *flags)
            assert code == 0, out + err


def test_a_record_with_counts_for_a_merge_needing_none_is_counted_and_checked(qwen_bf16, run_yaml, tmp_path, capsys):
    """A folder of an earlier mergekit-ram: an `r: 0` merge whose warm cache gave it counts, which it recorded. verify
    counts them again (they are checked, never believed): right ones are exit 0, an edited one exit 1, named."""
    from mergekit_ram.reporting import card

    run = run_yaml(config_text(qwen_bf16, ["A", "B"], parameters="r: 0"))
    counted = run_yaml(config_text(qwen_bf16, ["A", "B"]), out=tmp_path / "counted")
    report, counts = read_stats(run.out), read_stats(counted.out)
    for key in ("agents", "pairs", "tensors"):
        report[key] = counts[key]
    for row in report["agents"]:  # what r = 0 reports of each agent, with the counts beside it
        row["lambda"] = 1.0
    report["statistics"] = "cache"
    readme = (run.out / "README.md").read_text(encoding="utf-8")
    section = card.card_section(read_stats(run.out))
    assert readme.endswith(section)  # the card as that mergekit-ram wrote it, its table included
    (run.out / "README.md").write_text(readme[: -len(section)] + card.card_section(report), encoding="utf-8")
    (run.out / "ram_stats.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    code, out, err = verify(run.out, capsys)
    assert code == 0, out + err
    report["tensors"][0]["counts"][report["agents"][0]["label"]][0] += 1
    (run.out / "ram_stats.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    code, out, _ = verify(run.out, capsys)
    assert code == 1 and f"tensors[0].counts.{report['agents'][0]['label']}[0]" in out, out


@pytest.mark.quick
def test_an_r0_record_edited_to_claim_r_is_named(qwen_bf16, run_yaml, capsys):
    run = run_yaml(config_text(qwen_bf16, ["A", "B"], parameters="r: 0"))
    report = read_stats(run.out)
    report["parameters"]["r"] = 0.1
    (run.out / "ram_stats.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    for flags in ((), ("--sample", "0.3")):
        code, out, _ = verify(run.out, capsys, *flags)
        assert code == 1 and "r: mergekit_config.yml plans 0, ram_stats.json records 0.1" in out, out


# ---------------------------------------------------------------- --json


@pytest.mark.quick
def test_json_schema(abc, tmp_path, capsys):
    code, text, err = verify(abc, capsys, "--json")
    assert code == 0, err
    found = json.loads(text)
    tensors = len(load_file(str(abc / "model.safetensors")))
    assert found == {
        "format": "mergekit-ram/verify",
        "format_version": 4,
        "folder": str(abc),
        "hub": None,
        "entry_point": "run_merge",
        "method": "ramplus",
        "result": "identical",
        "exit_code": 0,
        "headline": f"{abc}: bit-identical, {tensors} tensors (rho counted again)",
        "merged": True,
        "statistics": "computed",
        "tensors_compared": tensors,
        "tensors_identical": tensors,
        "inputs": found["inputs"],
        "parameters": [],
        "files": [],
        "tensors": [],
        "cannot_check": [],
        "checked": found["checked"],
        "not_checked": [],
        "problems": [],
        "notes": [],
        "environment": found["environment"],
        "rounding": None,
    }
    assert set(found["environment"]) == {"device", "threads", "cpu_capability", "torch", "mergekit"}
    assert found["checked"][0] == "the identities of 4 input(s)", found["checked"]
    stats = read_stats(abc)
    recorded = [(label, row["model"], row["role"], row["identity"]) for label, row in stats["inputs"].items()]
    assert [(row["label"], row["model"], row["role"], row["recorded"]) for row in found["inputs"]] == recorded
    assert all(row["status"] == "same" and row["found"] == row["recorded"] and row["detail"] is None for row in found["inputs"])
    # a differing folder: the same keys, each problem a line
    out = copy_of(abc, tmp_path)
    move_one_ulp(out, {"lm_head.weight": 0})
    code, text, _ = verify(out, capsys, "--json")
    found = json.loads(text)
    assert code == 1 and found["result"] == "differs" and found["tensors_identical"] == tensors - 1
    (row,) = found["tensors"]
    assert set(row) == {
        "name", "status", "elements", "differing", "nan", "max_abs_difference", "published", "recomputed", "detail",
        "max_ulp",
    }
    assert row["max_ulp"] == 1
    assert row["published"] == row["recomputed"] == "bfloat16 [64, 32]"
    assert found["problems"] == [f"differs: lm_head.weight: 1 of 2,048 elements, max |difference| {row['max_abs_difference']:g}"]


# ---------------------------------------------------------------- the mergekit-pytorch door


def flat_merge(files: dict[str, Path], tmp_path: Path) -> Path:
    """`mergekit-pytorch` of A and B (`files`: base, A, B) into tmp_path/flat-out."""
    from mergekit.scripts.merge_raw_pytorch import main as flat

    config = tmp_path / "flat.yml"
    config.write_text(
        f"merge_method: ramplus\nbase_model: {files['base']}\nmodels:\n"
        f"  - model: {files['A']}\n  - model: {files['B']}\ndtype: bfloat16\n",
        encoding="utf-8",
    )
    out = tmp_path / "flat-out"
    flat([str(config), str(out), "--quiet"], standalone_mode=False)
    return out


def test_mergekit_pytorch_output_verifies(qwen_bf16, tmp_path, capsys):
    """A `mergekit-pytorch` merge of weight files records its config in ram_stats.json's `merge` record; verify
    plans it again with mergekit's `plan_flat_merge`, finds it identical, and names one moved element."""
    out = flat_merge({who: qwen_bf16.paths[who] / "model.safetensors" for who in ("base", "A", "B")}, tmp_path)
    record = read_stats(out)["merge"]
    assert record["entry_point"] == "mergekit-pytorch" and record["config"]["merge_method"] == "ramplus"
    code, text, err = verify(out, capsys)
    assert code == 0 and "bit-identical" in text, text + err
    move_one_ulp(out, {"model.norm.weight": 1})
    code, text, _ = verify(out, capsys)
    assert code == 1 and "differs: model.norm.weight: 1 of" in text, text


def test_mergekit_pytorch_input_missing_or_copied_under_another_name(qwen_bf16, tmp_path, capsys):
    """A `mergekit-pytorch` input is one file, whose own name the merge never reads: a copy under another name
    (`--input RECORDED=COPY`) stands for it. A missing one is named in the verdict's inputs, as for a folder."""
    import json
    import shutil

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    files = {who: inputs / f"{who}.safetensors" for who in ("base", "A", "B")}
    for who, path in files.items():
        shutil.copyfile(qwen_bf16.paths[who] / "model.safetensors", path)
    out = flat_merge(files, tmp_path)
    copy = tmp_path / "elsewhere" / "agent-a-renamed.safetensors"
    copy.parent.mkdir()
    files["A"].rename(copy)
    code, text, err = verify(out, capsys, "--json")
    found = json.loads(text)
    assert code == 3 and found["result"] == "cannot check", text + err
    missing = [row for row in found["inputs"] if row["status"] == "missing"]
    assert [row["model"] for row in missing] == [str(files["A"])] and "no such file" in missing[0]["detail"], found
    code, text, err = verify(out, capsys, "--input", f"{files['A']}={copy}")
    assert code == 0 and "bit-identical" in text, text + err
