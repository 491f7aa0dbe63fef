"""`mergekit-ram verify` of a merge by one of mergekit's own methods (no ram_stats.json): planned from its
`mergekit_config.yml`, every tensor recomputed by the method's own mergekit task and compared bit for bit.

* a right merge verifies (exit 0), full and sampled; a tensor changed is named (exit 1), full and sampled;
* a method that draws random numbers (dare_ties) cannot be checked without mergekit's `--random-seed` (exit 3,
  naming the method), verifies with the merge's seed and differs with another (exit 1, the seed said);
* the card: its YAML block is `mergekit_config.yml`, its front matter names the inputs on the Hub;
* bad input: no config (exit 3, saying what would let verify check it), a method this mergekit lacks, a ramplus
  folder without its record, an input gone (each exit 3, named), a local copy given with `--input`.

Every method of mergekit, the generated matrix: tests/reliability/test_any_method_matrix.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def config(method: str, qwen, agents=("A", "B"), *, base: str | None = "base", parameters: str = "") -> str:
    lines = [f"merge_method: {method}"]
    if base is not None:
        lines.append(f"base_model: {qwen.path(base)}")
    lines.append("models:")
    for agent in agents:
        lines.append(f"- model: {qwen.path(agent)}")
        if parameters:
            lines.append(f"  parameters: {parameters}")
    lines.append("dtype: bfloat16")
    return "\n".join(lines) + "\n"


def slerp(qwen) -> str:
    return (
        f"merge_method: slerp\nbase_model: {qwen.path('base')}\nmodels:\n- model: {qwen.path('base')}\n"
        f"- model: {qwen.path('A')}\nparameters:\n  t: 0.3\ndtype: bfloat16\n"
    )


def verify(out: Path, capsys, *flags: str) -> tuple[int, dict]:
    from mergekit_ram import cli

    capsys.readouterr()
    code = cli.main(["verify", str(out), "-q", "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def change_one_tensor(out: Path, name: str, steps: int = 1) -> None:
    """Every element of tensor `name` moved by `steps` steps of its dtype (its bits + steps)."""
    path = next(out.glob("*.safetensors"))
    tensors = load_file(path)
    bits = tensors[name].view(torch.int16)
    tensors[name] = (bits + steps).view(tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen_bf16):
    """The merges these tests verify, made once by mergekit (outside verify): method -> folder."""
    from conftest import _run

    root = tmp_path_factory.mktemp("any_method")
    made = {
        "task_arithmetic": config("task_arithmetic", qwen_bf16, parameters="{weight: 0.6}"),
        "linear": config("linear", qwen_bf16, base=None, parameters="{weight: 0.4}"),
        "ties": config("ties", qwen_bf16, parameters="{weight: 0.5, density: 0.7}"),
        "slerp": slerp(qwen_bf16),
        "dare_ties": config("dare_ties", qwen_bf16, parameters="{weight: 0.5, density: 0.6}"),
        "dare_norms": config(
            "dare_ties", qwen_bf16, parameters="{weight: 0.5, density: [{filter: norm, value: 1.0}, {value: 0.6}]}"
        ),
    }
    out = {}
    for method, text in made.items():
        out[method] = root / method
        _run(text, out[method], {"random_seed": 7} if method.startswith("dare") else None)
    return out


def copy_of(folders, method: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folders[method], tmp_path / method))


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "slerp"])
def test_a_right_merge_verifies_full_and_sampled(folders, capsys, method):
    code, said = verify(folders[method], capsys)
    assert (code, said["result"], said["method"]) == (0, "identical", method), said["problems"]
    assert said["tensors_compared"] == said["tensors_identical"] > 0
    assert said["statistics"] is None and said["parameters"] == []
    assert {row["status"] for row in said["inputs"]} == {"not recorded"}
    assert all("local folder" in row["detail"] for row in said["inputs"])
    assert set(said["environment"]) == {"device", "threads", "cpu_capability", "torch", "mergekit"}
    code, said = verify(folders[method], capsys, "--sample", "0.3", "--sample-seed", "5")
    assert (code, said["result"]) == (0, "no difference in sample"), said["problems"]
    whole = said["sample"]["whole"]
    if method == "task_arithmetic":  # element-wise: sliced
        assert not whole
    else:  # whole-tensor methods: every tensor recomputed whole, and said why
        assert len(whole) == said["sample"]["tensors_checked"] and method in next(iter(whole.values()))
    assert not any("ram_stats.json" in line for line in said["not_checked"])


@pytest.mark.parametrize("method", ["task_arithmetic", "slerp"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_changed_tensor_is_named(folders, tmp_path, capsys, method, sampled):
    out = copy_of(folders, method, tmp_path)
    change_one_tensor(out, "model.layers.1.mlp.up_proj.weight")
    code, said = verify(out, capsys, *(["--sample", "0.2", "--sample-seed", "3"] if sampled else []))
    assert (code, said["result"]) == (1, "differs")
    assert [t["name"] for t in said["tensors"]] == ["model.layers.1.mlp.up_proj.weight"]


def test_a_random_method_needs_the_seed(folders, tmp_path, capsys):
    code, said = verify(folders["dare_ties"], capsys)
    assert (code, said["result"]) == (3, "cannot check")
    assert "dare_ties" in said["cannot_check"][0] and "--random-seed" in said["cannot_check"][0]
    assert said["merged"]
    code, said = verify(folders["dare_ties"], capsys, "--random-seed", "7")
    assert (code, said["result"]) == (0, "identical"), said["problems"]
    code, said = verify(folders["dare_ties"], capsys, "--random-seed", "7", "--sample", "0.2", "--sample-seed", "1")
    assert (code, said["result"]) == (0, "no difference in sample"), said["problems"]
    code, said = verify(folders["dare_ties"], capsys, "--random-seed", "8")
    assert (code, said["result"]) == (1, "differs")
    assert any("--random-seed 8" in line for line in said["checked"])


def test_a_random_method_without_the_seed_checks_what_it_does_not_draw_for(folders, capsys):
    """The norms merged at density 1: dare draws nothing for them, so they are checked without the seed."""
    code, said = verify(folders["dare_norms"], capsys)
    norms = [name for name in load_file(next(folders["dare_norms"].glob("*.safetensors"))) if "norm" in name]
    assert code == 3 and said["merged"] and len(norms) > 2
    assert said["tensors_compared"] == said["tensors_identical"] == len(norms)
    planned = len(load_file(next(folders["dare_norms"].glob("*.safetensors"))))
    assert said["cannot_check"][0].startswith(f"{planned - len(norms):,} tensors made by dare_ties")


def test_the_card_yaml_and_base_models_are_checked(folders, tmp_path, capsys):
    out = copy_of(folders, "task_arithmetic", tmp_path)
    card = (out / "README.md").read_text()
    (out / "README.md").write_text(card.replace("weight: 0.6", "weight: 0.9"))
    code, said = verify(out, capsys)
    assert (code, said["result"]) == (1, "differs")
    assert said["files"] and said["files"][0].startswith("README.md: its YAML configuration")
    (out / "README.md").write_text(card.replace("base_model: []", "base_model:\n- org/other"))
    code, said = verify(out, capsys)
    assert code == 1 and "base_model" in said["files"][0] and "org/other" in said["files"][0]
    (out / "README.md").write_text("# my merge\n\nA publisher's own card.\n")
    code, said = verify(out, capsys)
    assert code == 0 and any("quotes no YAML block" in line for line in said["not_checked"])


def test_a_folder_without_a_config_says_what_would_let_it_be_checked(folders, tmp_path, capsys):
    out = copy_of(folders, "task_arithmetic", tmp_path)
    (out / "mergekit_config.yml").unlink()
    code, said = verify(out, capsys)
    assert code == 3
    assert "neither ram_stats.json nor mergekit_config.yml" in said["error"]
    assert "--no-write-model-card" in said["error"]


def test_a_method_this_mergekit_lacks_is_named(folders, tmp_path, capsys):
    out = copy_of(folders, "task_arithmetic", tmp_path)
    path = out / "mergekit_config.yml"
    path.write_text(path.read_text().replace("task_arithmetic", "someone_elses_method"))
    code, said = verify(out, capsys)
    assert code == 3 and "'someone_elses_method'" in said["error"] and "does not have" in said["error"]


def test_a_ramplus_folder_without_its_record_cannot_be_checked(folders, tmp_path, capsys):
    out = copy_of(folders, "task_arithmetic", tmp_path)
    path = out / "mergekit_config.yml"
    path.write_text(path.read_text().replace("task_arithmetic", "ramplus"))
    code, said = verify(out, capsys)
    assert code == 3 and "holds no ram_stats.json" in said["error"]


def test_an_input_gone_is_named_and_a_copy_can_stand_for_it(folders, qwen_bf16, tmp_path, capsys):
    out = copy_of(folders, "task_arithmetic", tmp_path)
    copy = Path(shutil.copytree(qwen_bf16.paths["B"], tmp_path / "B-copy"))
    path = out / "mergekit_config.yml"
    path.write_text(path.read_text().replace(qwen_bf16.path("B"), str(tmp_path / "gone")))
    card = out / "README.md"
    card.write_text(card.read_text().replace(qwen_bf16.path("B"), str(tmp_path / "gone")))
    code, said = verify(out, capsys)
    assert code == 3
    assert [row["status"] for row in said["inputs"]] == ["not recorded", "not recorded", "missing"]
    assert str(tmp_path / "gone") in said["cannot_check"][0]
    code, said = verify(out, capsys, "--input", f"{tmp_path / 'gone'}={copy}")
    assert code == 0, said["problems"]
    assert said["inputs"][2]["detail"] == f"read from {copy}, given (--input)"


@pytest.mark.parametrize("steps, code, result", [(1, 3, "last bits differ"), (3, 3, "last bits differ"), (4, 1, "differs")])
def test_a_difference_in_the_last_bits_a_method_moves_between_machines_is_no_forgery(
    folders, tmp_path, capsys, steps, code, result
):
    """linear's last bits move with the CPU's vector instructions (up to 3 units in the last place, measured): a
    tensor that differs only that much gets its own result, exit 3, or 0 with --accept-last-bits; more is exit 1."""
    out = copy_of(folders, "linear", tmp_path)
    change_one_tensor(out, "model.layers.1.mlp.up_proj.weight", steps)
    found, said = verify(out, capsys)
    assert (found, said["result"]) == (code, result)
    assert said["tensors"][0]["max_ulp"] == steps
    if code == 3:
        assert said["rounding"].startswith(f"at most {steps} units in the last place: linear moves up to 3")
        assert said["environment"]["cpu_capability"] in said["rounding"]
        found, said = verify(out, capsys, "--accept-last-bits")
        assert (found, said["result"]) == (0, "identical but for the last bits")
    else:
        assert said["rounding"] is None
        assert verify(out, capsys, "--accept-last-bits")[0] == 1


@pytest.mark.quick
def test_the_cards_yaml_block_and_base_models_on_plain_text():
    from mergekit_ram.verify import any_method

    card = (
        "---\nbase_model:\n- org/a\nlibrary_name: transformers\n---\n# x\n\n"
        f"{any_method.YAML_INTRO}\n\n```yaml\nmerge_method: ties\n\n```\n"
    )
    assert any_method.yaml_block(card) == "merge_method: ties\n"
    assert any_method.yaml_block("# a card a publisher wrote\n") is None
    assert any_method.base_model_problem(card, {"org/a"}, set()) is None
    assert any_method.base_model_problem(card, set(), {"org/a"}) is None  # a folder here too: mergekit asked the Hub
    assert "org/b" in any_method.base_model_problem(card, {"org/b"}, set())
    assert any_method.base_model_problem("# no front matter\n", {"org/a"}, set()) is None


@pytest.mark.quick
def test_a_union_without_a_base_starts_from_the_tokenizer_the_published_ids_allow():
    """Without a base_model mergekit starts a union from the first of a set of models (its process's hash order): a
    wide agent first keeps its own ids for the tokens it adds, another first numbers them as added. verify starts
    from the largest tokenizer whose every id is the published one (found by the matrix, one verify in four)."""
    from mergekit_ram._mergekit import tokenizer_order

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    base = {f"t{i}": i for i in range(4)}
    narrow, wide = Tok(base), Tok({**base, "x": 4, "y": 5})
    tokenizers = {"a": narrow, "wide": wide}
    added_other_way = {**base, "y": 4, "x": 5}  # the merge started from a narrow one: x and y added as it listed them
    assert tokenizer_order.published_base(wide, tokenizers, added_other_way) is narrow
    assert tokenizer_order.published_base(narrow, tokenizers, added_other_way) is narrow
    same_ids = {**base, "x": 4, "y": 5}  # either start gives these ids: the largest, as a merge that started from it
    assert tokenizer_order.published_base(narrow, tokenizers, same_ids) is wide
    assert tokenizer_order.published_base(wide, tokenizers, same_ids) is wide
