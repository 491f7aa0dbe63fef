"""The merge-quality benchmark (benchmarks/quality): its tasks, and a tiny configuration end to end.

The end-to-end test runs `benchmarks/quality/run.py --config smoke` twice on one cache root: the first run
pretrains a tiny base on 2 tasks, trains 2 GRPO agents, merges them with real `mergekit-yaml` processes,
runs `mergekit-ram inspect` and evaluates every model; the second must rebuild nothing and give the same numbers.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[1] / "benchmarks" / "quality"
RUN = QUALITY / "run.py"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(QUALITY))
import tasks as T  # noqa: E402

BRACKETS = {")": "(", "]": "[", "}": "{", ">": "<"}


def _balanced(s: str) -> bool:
    stack = []
    for c in s:
        if c in BRACKETS.values():
            stack.append(c)
        elif not stack or stack.pop() != BRACKETS[c]:
            return False
    return not stack


def _expected(name: str, prompt: str) -> str:
    """An independent solver of each task."""
    body = prompt[1:-1]
    if name == "add":
        a, b = body.split("+")
        return str(int(a) + int(b))
    if name == "sort":
        return "".join(sorted(body))
    if name == "reverse":
        return body[::-1]
    if name == "count":
        x, s = body.split(":")
        return str(s.count(x))
    raise AssertionError(name)


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(T.TASKS))
def test_task_answers_are_right_and_fit_the_vocabulary(name):
    p = T.params(name)
    rng = random.Random(0)
    for _ in range(300):
        prompt, answer = T.TASKS[name].generate(rng, p)
        assert prompt[0] == T.TASKS[name].tag and prompt.endswith("=")
        assert T.decode(T.encode(prompt + answer)) == prompt + answer
        assert len(answer) < T.max_new_tokens(name, p)
        if name == "brackets":
            assert answer and _balanced(prompt[1:-1] + answer), (prompt, answer)
        else:
            assert answer == _expected(name, prompt), prompt
    assert T.reward(answer, answer) == 1.0 and T.reward(answer + "0", answer) == 0.0
    assert 0 < T.reward(answer[:-1] + "=", answer, partial=0.5) < 0.5 or len(answer) == 1


def _bug_differs(name: str, prompt: str) -> bool:
    """Independently: on which prompts does each task's systematic error give a wrong answer?"""
    body = prompt[1:-1]
    if name == "add":
        a, b = map(int, body.split("+"))
        return a % 10 + b % 10 >= 10  # a units carry
    if name == "sort":
        return body[-1] < max(body[:-1])  # the last digit is not (one of) the largest
    if name == "reverse":
        return body[0] != body[1]
    if name == "count":
        x, s = body.split(":")
        return x in s[(len(s) + 1) // 2 :]
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(T.TASKS))
def test_systematic_errors_are_wrong_exactly_where_they_should_be(name):
    p = T.params(name, {"reverse": {"letters": 4}}.get(name))  # the benchmark's alphabet
    rng = random.Random(1)
    wrong = 0
    for _ in range(1000):
        prompt, answer = T.TASKS[name].generate(rng, p)
        bug = T.TASKS[name].bug(prompt)
        assert T.decode(T.encode(bug)) == bug and len(bug) < T.max_new_tokens(name, p), (prompt, bug)
        if name == "brackets":
            assert bug == answer[::-1]  # closes in the order of opening
        else:
            assert (bug != answer) == _bug_differs(name, prompt), (prompt, answer, bug)
        wrong += bug != answer
    # mediocre, not zero: the error is right on part of the prompts and wrong on most
    assert 0.3 < wrong / 1000 < 0.9, wrong


def test_a_flawed_corpus_gives_the_error_as_often_as_asked():
    p = {"reverse": T.params("reverse", {"letters": 4})}
    for noise, lo, hi in ((0.0, 0, 0), (1.0, 1, 1), (0.6, 0.55, 0.65)):
        sampler = T.Sampler(["reverse"], p, "n", set(), noise={"reverse": noise})
        items = sampler.task("reverse", 2000)
        differs = [(q, a) for q, a in items if q[1] != q[2]]  # where the error is wrong
        share = sum(a == T.TASKS["reverse"].bug(q) for q, a in differs) / len(differs)
        assert lo <= share <= hi, (noise, share)
        assert all(a in (q[1:-1][::-1], T.TASKS["reverse"].bug(q)) for q, a in items)


@pytest.mark.quick
def test_eval_sets_are_fixed_distinct_and_never_trained_on():
    p = T.params("add", {"digits": 2})
    items = T.eval_set("add", p, 200, seed=3)
    assert items == T.eval_set("add", p, 200, seed=3) != T.eval_set("add", p, 200, seed=4)
    assert len({q for q, _ in items}) == 200
    assert T.eval_set("add", p, 50, seed=3) == items[:50]  # a smaller set is a prefix: the same items
    held = {q for q, _ in items}
    sampler = T.Sampler(["add"], {"add": p}, "x", held)
    assert not held & {q for q, _ in sampler.task("add", 2000)}
    with pytest.raises(ValueError, match="too few distinct prompts"):
        T.eval_set("count", T.params("count", {"min_len": 1, "max_len": 1, "letters": 1}), 10, seed=0)
    with pytest.raises(ValueError, match="no parameter"):
        T.params("add", {"digit": 3})


@pytest.mark.skipif(not (BIN / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
def test_smoke_configuration_end_to_end_and_cached(tmp_path):
    root, out1, out2 = tmp_path / "root", tmp_path / "out1", tmp_path / "out2"
    cmd = [sys.executable, str(RUN), "--config", "smoke", "--root", str(root)]
    first = subprocess.run([*cmd, "--out", str(out1)], capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    res = json.loads((out1 / "results.json").read_text())

    tasks = ["add", "reverse"]
    rows = ["base", "add agent", "reverse agent", "ta_mean", "ties", "ramplus"]
    assert list(res["tasks"]) == tasks and list(res["models"]) == rows
    for row, m in res["models"].items():
        assert set(m["accuracy"]) == set(tasks)
        for t in tasks:
            a = m["accuracy"][t]
            assert 0 <= a["acc"] <= 1 and 0 <= a["se"] <= 0.5 and a["n"] == 64, (row, t, a)
        assert 0 <= m["mean"] <= 1
        assert m["kind"] == ("base" if row == "base" else "specialist" if row.endswith("agent") else "merge")
        if m["kind"] == "merge":
            assert set(m["retained"]) == set(tasks)
    assert set(res["gains"]) == set(tasks) and set(res["ramplus_vs"]) == {"ta_mean", "ties"}
    assert set(res["density"]) == set(tasks)
    for d in res["density"].values():
        assert 0 <= d["density"] <= 1 and d["active"] <= d["numel"]
        # the diagnostics of `mergekit-ram inspect` (its stats format 2; the inspect stage's version 2)
        assert 0 <= d["magnitude_unique_share"] <= 1 and 0 <= d["single_step_share"] <= 1, d
    # the one pair: its diagnostics beside its own merges; with two agents a pair merge is the merge of all, so
    # `ramplus add+reverse` is the `ramplus` folder, built once
    (pair,) = res["pairs"]
    assert pair["agents"] == tasks and 0 <= pair["common"] <= min(d["active"] for d in res["density"].values())
    if pair["common"]:
        assert 0 <= pair["same_sign_share"] <= 1 and -1 <= pair["cosine"] <= 1
    else:  # smoke agents barely move (an agent whose steps had no reward signal is the base): no shares of nothing
        assert pair["same_sign_share"] is None and pair["cosine"] is None
    got = pair["merges"]
    assert set(got) == {"ramplus", "ta_sum"} and got["ramplus"]["folder"] == res["models"]["ramplus"]["folder"]
    assert got["ramplus"]["accuracy"] == {t: res["models"]["ramplus"]["accuracy"][t]["acc"] for t in tasks}
    diff = pair["ramplus_minus_ta_sum"]
    assert diff["mean_diff"] == pytest.approx(got["ramplus"]["mean"] - got["ta_sum"]["mean"], abs=2e-5)
    assert diff["ci"][0] <= diff["mean_diff"] + 1e-9 <= diff["ci"][1] + 2e-9
    assert res["r_sweep"][0]["r"] == 0.1 and res["r_sweep"][0]["merge"] == "ramplus"
    for name in ("results.md", "chart.png", "density.png", "ram_stats.json"):
        assert (out1 / name).stat().st_size > 0, name
    md = (out1 / "results.md").read_text()
    assert "| model | add | reverse | mean [95% CI] |" in md and "ramplus (r=0.1, α=2)" in md
    stages = res["stages"]
    assert not any(s.get("cached") for s in stages.values())
    # per-task RL settings over the shared ones (smoke: reverse trains 2 steps, add 3)
    assert [h["step"] for h in stages["agent add"]["history"]] == [3]
    assert [h["step"] for h in stages["agent reverse"]["history"]] == [2]
    # evaluations are keyed by the weights: identical models (an agent whose GRPO steps had no reward signal)
    # share one
    assert stages["eval"]["models_cached"] + stages["eval"]["models_evaluated"] == 8
    assert "merge ta_sum add+reverse" in stages and "merge ramplus add+reverse" in stages
    cfg = stages["merge ramplus"]["config"]
    assert cfg["merge_method"] == "ramplus" and cfg["parameters"]["r"] == 0.1 and cfg["dtype"] == "bfloat16"

    # the same seed again: every stage from the cache, the same numbers
    second = subprocess.run([*cmd, "--out", str(out2)], capture_output=True, text=True, timeout=1800)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    again = json.loads((out2 / "results.json").read_text())
    assert all(s["cached"] for k, s in again["stages"].items() if k != "eval")
    assert again["stages"]["eval"] == {**again["stages"]["eval"], "models_evaluated": 0, "models_cached": 8}
    assert again["models"] == res["models"] and again["density"] == res["density"]
    assert again["pairs"] == res["pairs"]
    assert "## Diagnostics beside the outcome" in md and "| add + reverse |" in md

    # both regimes side by side (here the same run twice): the tables and the rule check, from results.json alone
    side = subprocess.run(
        [sys.executable, str(RUN.parent / "regimes.py"), str(out1), str(out2), "--out", str(tmp_path / "r.md")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert side.returncode == 0, side.stderr[-3000:]
    text = (tmp_path / "r.md").read_text()
    assert text == side.stdout and text.count("| smoke | add + reverse |") == 2
    assert "## Does one diagnostic separate the outcomes? (2 pairs)" in text

    # every model is a transformers checkpoint with its tokenizer (mergekit copied the base's)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = Path(res["models"]["ramplus"]["folder"])
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert str(model.dtype) == "torch.bfloat16" and model.config.vocab_size == len(T.VOCAB)
    tok = AutoTokenizer.from_pretrained(merged)
    assert tok.encode("A12+34=", add_special_tokens=False) == T.encode("A12+34=")


def test_a_rule_separates_verdicts_only_when_one_threshold_does():
    import regimes

    assert regimes.separation([(0.1, "worse"), (0.2, "worse"), (0.5, "better")]).startswith("yes: below 0.350")
    assert regimes.separation([(0.1, "worse"), (0.3, "better"), (0.5, "worse")]).startswith("no single")
    assert regimes.separation([(0.1, "worse"), (0.9, "worse")]).startswith("nothing to separate")
    # equal values on both sides of a cut are no threshold
    assert regimes.separation([(0.2, "worse"), (0.2, "better")]).startswith("no single")
    c = {"mean_diff": -0.02, "ci": [-0.03, -0.01]}
    assert regimes.verdict(c) == "worse" and regimes.verdict({**c, "ci": [-0.01, 0.01]}) == "tie"
    assert regimes.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)


# --------------------------------------------------------------------------- #
# The shared regime: a common output format every agent's reward also requires
# --------------------------------------------------------------------------- #
FMT = {"open": "[", "close": "]"}


@pytest.mark.quick
def test_common_format_is_scored_apart_from_the_task():
    assert T.wrap("42", FMT) == "[42]" and T.formatted("[42]", FMT)
    for bad in ("42", "[42", "42]", "[]"[:1], "]42["):
        assert not T.formatted(bad, FMT), bad
    assert T.formatted("[]", FMT)  # an empty answer in the format: formatted, and wrong on content
    # task accuracy ignores the format: the content inside it (each bracket removed where present)
    for got in ("42", "[42]", "[42", "42]"):
        assert T.correct(got, "42", FMT), got
    assert not T.correct("[42]", "42") and not T.correct("[43]", "42", FMT)
    # the reward needs both: the format and a right content
    assert T.reward("[42]", "42", fmt=FMT) == 1.0
    assert T.reward("42", "42", fmt=FMT) == 0.0 and T.reward("[43]", "42", fmt=FMT) == 0.0
    assert T.reward("[42", "42", fmt=FMT) == 0.0
    assert 0 < T.reward("[43]", "42", partial=0.5, fmt=FMT) < 0.5
    assert T.reward("42", "42") == 1.0  # without a format: unchanged


def test_a_corpus_has_the_format_as_often_as_asked_and_no_format_leaves_the_stream_unchanged():
    p = {"add": T.params("add", {"digits": 2})}
    plain = T.Sampler(["add"], p, "s", set(), noise={"add": 0.6}).task("add", 500)
    # fmt given with share 0, or no fmt: the same examples as before the shared regime existed
    assert T.Sampler(["add"], p, "s", set(), noise={"add": 0.6}, fmt=FMT, fmt_share=0.0).task("add", 500) == plain
    items = T.Sampler(["add"], p, "s", set(), fmt=FMT, fmt_share=0.4).task("add", 3000)
    share = sum(T.formatted(a, FMT) for _, a in items) / len(items)
    assert 0.36 < share < 0.44, share
    assert all(T.content(a, FMT) == str(sum(map(int, q[1:-1].split("+")))) for q, a in items)


@pytest.mark.skipif(not (BIN / "mergekit-yaml").exists(), reason="mergekit-yaml not installed")
def test_shared_regime_smoke_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(RUN), "--config", "smoke-shared", "--root", str(tmp_path / "root"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["format"]["open"] == "[" and res["format"]["close"] == "]"
    stages = res["stages"]
    # the shared regime's base is the smoke base trained on further: two base stages, the variant its own
    assert stages["base"]["key"] != stages["base format"]["key"]
    assert set(stages["base format"]["history"][-1]["probe_format"]) == {"add", "reverse"}
    assert "probe_format" in stages["agent add"]["history"][-1]
    for row, m in res["models"].items():
        f = m["format"]
        assert set(f["compliance"]) == {"add", "reverse"}, row
        assert 0 <= f["mean"] <= 1 and f["mean_ci"][0] <= f["mean"] + 1e-9 <= f["mean_ci"][1] + 2e-9, (row, f)
    md = (out / "results.md").read_text()
    assert "format compliance [95% CI] |" in md and "## The common behaviour" in md
    assert "Shared regime's base" in md
    # the agents' RL settings carry the format (their cache keys differ from the independent regime's)
    cfg = json.loads((tmp_path / "root" / "agents" / stages["agent add"]["key"] / "stage.json").read_text())
    assert cfg["payload"]["rl"]["format"] == {"open": "[", "close": "]"}
    for name in ("chart.png", "density.png", "ram_stats.json"):
        assert (out / name).stat().st_size > 0, name
