"""What a `ramplus` merge publishes, and the options that shape it.

* `ram_stats.json`: validated against the schema documented in mergekit_ram/reporting/report.py
  and against the closed-form counts of the planted index sets (tests/models.py);
* the model card: mergekit's own content kept, plus a "RAM+ statistics" section;
* the output folder may not be an input folder;
* `rho_scope: layer | tensor` and `lambda_rule: soft` through real merges against the
  float64 reference (tests/reference.py);
* misspelled or misplaced parameter names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
import reference as R
import torch
import yaml
from helpers import (
    closed_form,
    config_text,
    inputs_of,
    model_of,
    no_weights_written,
    number,
    read_stats,
    rows_by_model,
    stats_by_path,
    strict_json,
    validate_schema,
)

LOGGER = "mergekit_ram"
@pytest.mark.quick
def test_ram_stats_json_schema_and_closed_form(merged, qwen_bf16):
    run = merged(config_text(qwen_bf16, "ABC"))
    text = (run.out / "ram_stats.json").read_text(encoding="utf-8")
    report = strict_json(text)
    assert "Infinity" not in text and "NaN" not in text
    validate_schema(report)
    assert report["statistics"] == "computed"
    assert report["parameters"] == {"epsilon": 1e-5, "r": 0.1, "alpha": 2.0, "rho_scope": "model", "lambda_rule": "clip"}
    assert report["per_tensor_parameters"] == {}
    assert report["base_model"] == "base" and model_of(report, "base") == qwen_bf16.path("base")

    per_tensor, totals = closed_form(qwen_bf16.family, "ABC")
    rows = rows_by_model(report)
    assert set(rows) == {qwen_bf16.path(a) for a in "ABC"}
    for agent, want in totals.items():
        row = rows[qwen_bf16.path(agent)]
        for key in ("active", "shared", "unique", "shared_with_1", "shared_with_2plus", "numel"):
            assert row[key] == want[key], (agent, key)
        assert row["density"] == pytest.approx(want["density"], rel=1e-12)
        assert (row["unique_share"], row["shared_with_1_share"], row["shared_with_2plus_share"]) == pytest.approx(
            (want["unique"] / want["active"], want["shared_with_1"] / want["active"], want["shared_with_2plus"] / want["active"])
        )
        assert number(row["rho"]) == pytest.approx(want["rho"]) and row["rho"] == row["rho_counted"]
        assert row["rho_source"] == "counted"
        assert row["lambda"] == pytest.approx(1 + 0.1 * min(want["rho"], 2.0))
    assert rows[qwen_bf16.path("C")]["rho"] == "inf" and rows[qwen_bf16.path("C")]["lambda"] == pytest.approx(1.2)
    # the same numbers the pre-pass handed to the merge
    assert {m: (r["active"], r["shared"], r["unique"]) for m, r in rows_by_model(report).items()} == stats_by_path(
        run.stats
    )
    assert [row["label"] for row in report["agents"]] == list("ABC")  # each input by its folder's name

    # per tensor: every stored tensor once, the closed form, summing to the totals
    names = [t["name"] for t in report["tensors"]]
    assert sorted(names) == sorted(qwen_bf16.family.base) and len(set(names)) == len(names)
    for t in report["tensors"]:
        assert t["numel"] == qwen_bf16.family.base[t["name"]].numel()
        assert t["epsilon"] == 1e-5
        assert t["counts"] == {a: per_tensor[t["name"]][a] for a in "ABC"}, t["name"]
    for agent, want in totals.items():
        assert sum(t["counts"][agent][0] for t in report["tensors"]) == want["active"]
        assert sum(t["counts"][agent][1] for t in report["tensors"]) == want["unique"]
        assert sum(t["counts"][agent][2] for t in report["tensors"]) == want["shared_with_1"]
    assert sum(t["numel"] for t in report["tensors"]) == totals["A"]["numel"]


def test_diagnostics_equal_the_float64_definitions_over_the_stored_tensors(merged, qwen_bf16):
    """ram_stats.json's diagnostics (per tensor, per agent, per pair) and the card's tables, against
    `reference.reference_diagnostics` on the stored tensors."""
    agents = "ABC"
    run = merged(config_text(qwen_bf16, agents))
    report = strict_json((run.out / "ram_stats.json").read_text(encoding="utf-8"))
    base, sds = inputs_of(qwen_bf16, agents)
    paths = list(agents)  # the labels: the folders' names
    sds = {a: sds[qwen_bf16.path(a)] for a in agents}
    single = dict.fromkeys(paths, 0)
    magnitude = {p: [0.0, 0.0] for p in paths}
    pairs = {}
    for t in report["tensors"]:
        want = R.reference_diagnostics(base[t["name"]], [sds[p][t["name"]] for p in paths], 1e-5)
        got = t["diagnostics"]
        assert got["single"] == dict(zip(paths, want["single"])), t["name"]
        for p, (u, sh) in zip(paths, want["magnitude"]):
            assert got["magnitude"][p] == pytest.approx([u, sh], rel=1e-12, abs=1e-300), t["name"]
            single[p] += want["single"][paths.index(p)]
            magnitude[p][0] += u
            magnitude[p][1] += sh
        for a, b, *values in got["pairs"]:
            ref = want["pairs"][(paths.index(a), paths.index(b))]
            assert values[:2] == list(ref[:2]) and values[2:] == pytest.approx(list(ref[2:]), rel=1e-12, abs=1e-300)
            total = pairs.setdefault((a, b), [0, 0, 0.0, 0.0, 0.0])
            for k, v in enumerate(ref):
                total[k] += v
    rows = {row["label"]: row for row in report["agents"]}
    for p in paths:
        assert rows[p]["single_step"] == single[p]
        assert rows[p]["single_step_share"] == pytest.approx(single[p] / rows[p]["active"], rel=1e-12)
        assert rows[p]["magnitude_unique_share"] == pytest.approx(magnitude[p][0] / sum(magnitude[p]), rel=1e-12)
    assert len(report["pairs"]) == 3
    for pair in report["pairs"]:
        common, same, dot, sa, sb = pairs[tuple(pair["agents"])]
        assert (pair["common"], pair["same_sign"]) == (common, same)
        assert pair["same_sign_share"] == pytest.approx(same / common, rel=1e-12)
        assert pair["cosine"] == pytest.approx(dot / math.sqrt(sa * sb), rel=1e-9)
    card = (run.out / "README.md").read_text(encoding="utf-8")
    assert "Diagnostics (which regime the agents are in):" in card
    for pair in report["pairs"]:
        assert f"| {' / '.join(pair['agents'])} | {pair['common']:,} |" in card


def test_content_ids_tell_inputs_apart_and_ignore_where_they_live(merged, qwen_bf16, tmp_path):
    from mergekit_ram.core import cache
    from mergekit_ram.reporting import report

    stats = read_stats(merged(config_text(qwen_bf16, "ABC")).out)
    ids = [row["identity"]["content_id"] for row in stats["inputs"].values()]
    assert len(set(ids)) == 4
    # a copy elsewhere (other path, mtimes, inodes) has the same content id
    copy = tmp_path / "copy-of-A"
    shutil.copytree(qwen_bf16.paths["A"], copy)
    os.utime(copy / "model.safetensors", (1_000_000_000, 1_000_000_000))
    same = report.public_identity(cache.folder_identity(str(copy)))
    assert same == stats["inputs"]["A"]["identity"] and stats["inputs"]["A"]["model"] == qwen_bf16.path("A")
    # a Hugging Face hub snapshot folder also names its revision
    snapshot = tmp_path / "models--org--agent-a" / "snapshots" / "0123abcd"
    shutil.copytree(qwen_bf16.paths["A"], snapshot)
    hub = report.public_identity(cache.folder_identity(str(snapshot)))
    assert hub == {"content_id": same["content_id"], "revision": "0123abcd"}


def test_given_rho_is_reported_as_given(run_yaml, qwen_bf16):
    run = run_yaml(config_text(qwen_bf16, "AB", model_parameters={"A": "rho: 0.5"}))
    report = read_stats(run.out)
    validate_schema(report)
    _, totals = closed_form(qwen_bf16.family, "AB")
    rows = rows_by_model(report)
    a, b = rows[qwen_bf16.path("A")], rows[qwen_bf16.path("B")]
    assert a["rho"] == 0.5 and a["rho_source"] == "given" and a["lambda"] == pytest.approx(1.05)
    assert a["rho_counted"] == pytest.approx(totals["A"]["rho"])
    assert b["rho_source"] == "counted" and b["rho"] == pytest.approx(totals["B"]["rho"])


# ---------------------------------------------------------------- model card


def split_card(text: str):
    assert text.startswith("---\n"), text[:80]
    end = text.index("\n---\n", 4)
    return yaml.safe_load(text[4:end]), text[end + 5 :]


def card_table(body: str, header: str):
    """Rows (lists of cells) of the markdown table that starts with `header`."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.quick
def test_model_card_keeps_mergekit_content_and_adds_statistics(merged, qwen_bf16):
    run = merged(config_text(qwen_bf16, "ABC"))
    meta, body = split_card((run.out / "README.md").read_text(encoding="utf-8"))
    # mergekit's own card: metadata, method, models, config block
    assert {"tags", "library_name"} <= set(meta)
    assert {"mergekit", "merge", "ramplus"} <= set(meta["tags"])  # the method as a tag (issue 31)
    assert "base_model" not in meta  # local inputs: no hub id known, no empty list
    assert "This is a merge of pre-trained language models created using [mergekit]" in body
    for agent in "ABC":
        assert f"* {qwen_bf16.path(agent)}" in body
    config_block = re.search(r"```yaml\n(.*?)```", body, re.S)
    assert config_block and yaml.safe_load(config_block.group(1))["merge_method"] == "ramplus"
    # then exactly one RAM+ section, after mergekit's configuration
    assert body.count("## RAM+ statistics") == 1
    assert body.index("## RAM+ statistics") > body.index("### Configuration") > 0
    assert body.index("## RAM+ statistics") > config_block.end()
    section = body[body.index("## RAM+ statistics") :]
    assert f"Merged with mergekit-ram {version('mergekit-ram')}" in section and "pypi.org" not in section
    assert f"mergekit {version('mergekit')}" in section and f"torch {version('torch')}" in section
    assert "ε = 1e-05, r = 0.1, α = 2, λ rule `clip`" in section
    assert "not computed" not in section

    _, totals = closed_form(qwen_bf16.family, "ABC")
    rows = card_table(section, "| agent |")
    assert [r[0] for r in rows] == [a["label"] for a in read_stats(run.out)["agents"]] == list("ABC")
    for row in rows:
        want = totals[row[0]]
        active = want["active"]
        assert row[1:] == [
            f"{100 * want['density']:.2f}%",
            f"{100 * want['unique'] / active:.2f}%",
            f"{100 * want['shared_with_1'] / active:.2f}%",
            f"{100 * want['shared_with_2plus'] / active:.2f}%",
            "inf" if math.isinf(want["rho"]) else f"{want['rho']:.4g}",
            f"{1 + 0.1 * min(want['rho'], 2.0):.4f}",
        ], row[0]
    inputs = card_table(section, "| label | role | input | identity |")
    report = read_stats(run.out)
    expected = [[label, row["role"], row["model"], f"content id `{row['identity']['content_id'][:16]}`"]
                for label, row in report["inputs"].items()]  # fmt: skip
    assert inputs == expected and [r[:3] for r in inputs] == [["base", "base", qwen_bf16.path("base")]] + [
        [a, "agent", qwen_bf16.path(a)] for a in "ABC"
    ]
    for name in ("base", *"ABC"):  # the plugin's section names each input's path once: in the inputs table
        assert section.count(qwen_bf16.path(name)) == 1, name
    assert "ram_stats.json" in section


@pytest.mark.quick
def test_the_card_is_the_same_bytes_for_the_same_merge(qwen_bf16, tmp_path):
    """Issue 61: mergekit lists "Models Merged" from a set, whose order follows each process's string hashing, so two
    merges of the same inputs wrote two README.md files. Merged by mergekit-yaml four times into one folder, each
    process hashing strings its own way (PYTHONHASHSEED), the card is the same bytes, its models in the config's order
    (on mergekit's order the four agree once in 216)."""
    import subprocess

    from helpers import console_script

    agents = ("C", "A", "B")  # not the order of their folders' names either
    config = tmp_path / "three.yml"
    config.write_text(config_text(qwen_bf16, agents), encoding="utf-8")
    cards = []
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1", "MERGEKIT_RAM_CACHE": "off",
               "MERGEKIT_RAM_NATIVE": "0"}  # fmt: skip
        done = subprocess.run([console_script("mergekit-yaml"), str(config), str(tmp_path / "out"), "--quiet",
                               "--no-copy-tokenizer"], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        cards.append((tmp_path / "out" / "README.md").read_bytes())
    assert all(card == cards[0] for card in cards)
    listed = [line for line in cards[0].decode("utf-8").splitlines() if line.startswith("* ")]
    assert listed == [f"* {qwen_bf16.path(who)}" for who in agents]


def test_r_zero_card_says_not_computed_but_lists_inputs(run_yaml, qwen_bf16):
    run = run_yaml(config_text(qwen_bf16, "ABC", parameters="r: 0"))
    assert run.count_calls == 0
    report = read_stats(run.out)
    validate_schema(report, counted=False)
    assert report["statistics"] == "not computed"
    assert all(a["lambda"] == 1.0 and a["rho"] is None and a["rho_source"] is None for a in report["agents"])
    _, body = split_card((run.out / "README.md").read_text(encoding="utf-8"))
    section = body[body.index("## RAM+ statistics") :]
    assert "Statistics were not computed" in section
    rows = card_table(section, "| agent |")
    assert [r[0] for r in rows] == list("ABC")
    assert all(r[1] == "—" and r[-1] == "1.0000" for r in rows)
    inputs = card_table(section, "| label | role | input | identity |")
    assert [r[:3] for r in inputs] == [["base", "base", qwen_bf16.path("base")]] + [
        [a, "agent", qwen_bf16.path(a)] for a in "ABC"
    ]
    assert all(r[3].startswith("content id `") for r in inputs)


def test_no_model_card_still_writes_ram_stats(run_yaml, qwen_bf16):
    run = run_yaml(config_text(qwen_bf16, "AB"), write_model_card=False)
    assert "README.md" not in run.files and "ram_stats.json" in run.files
    validate_schema(read_stats(run.out))


# ---------------------------------------------------------------- output folder


def _tree(folder: Path):
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (
            st.st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None,
        )
    return out


@pytest.mark.parametrize("where", ["agent", "inside-agent", "base", "symlink-to-agent"])
def test_output_into_an_input_folder_is_refused_before_writing(run_yaml, qwen_bf16, tmp_path, where):
    root = tmp_path / "models"
    copies = {}
    for who in ("base", "A", "B"):
        shutil.copytree(qwen_bf16.paths[who], root / who, copy_function=shutil.copy2)
        copies[who] = (root / who).resolve()

    class W:
        family = qwen_bf16.family

        @staticmethod
        def path(who):
            return str(copies[who])

    out = {
        "agent": copies["A"],
        "inside-agent": copies["A"] / "merged",
        "base": copies["base"],
        "symlink-to-agent": tmp_path / "link",
    }[where]
    if where == "symlink-to-agent":
        out.symlink_to(copies["A"], target_is_directory=True)
    before = {who: _tree(p) for who, p in copies.items()}
    with pytest.raises(ValueError, match="inside the input model") as info:
        run_yaml(config_text(W, "AB"), out=out)
    assert "Choose another output folder" in str(info.value)
    assert {who: _tree(p) for who, p in copies.items()} == before
    assert not (copies["A"] / "merged").exists()


# ---------------------------------------------------------------- rho_scope and lambda_rule


def _reference_run(run, written, agents, *, eps=1e-5, r=0.1, alpha=2.0, rho_scope="model", lambda_rule="clip"):
    base, agent_sds = inputs_of(written, agents)
    names = list(base)
    ref = R.reference_merge(
        base, agent_sds, eps, r, alpha, names=names, rho_scope=rho_scope, lambda_rule=lambda_rule
    )
    assert set(run.tensors) == set(names)
    R.assert_state_dict_matches(run.tensors, ref, R.reference_magnitudes(base, agent_sds, names))
    return base, agent_sds, ref


@pytest.mark.parametrize(
    "rho_scope, lambda_rule, r",
    [("layer", "clip", 0.3), ("tensor", "clip", 0.3), ("model", "soft", 0.5), ("layer", "soft", 0.5)],
)
def test_rho_scope_and_lambda_rule_match_reference(merged, run_yaml, qwen_bf16, rho_scope, lambda_rule, r):
    agents = "ABC"
    params = f"r: {r}\nrho_scope: {rho_scope}\nlambda_rule: {lambda_rule}"
    run = run_yaml(config_text(qwen_bf16, agents, parameters=params))
    base, agent_sds, ref = _reference_run(run, qwen_bf16, agents, r=r, rho_scope=rho_scope, lambda_rule=lambda_rule)

    # the scope / rule matters: the plain RAM+ merge with this r differs
    plain = R.reference_merge(base, agent_sds, 1e-5, r, 2.0, names=list(base))
    assert any(not torch.equal(ref[n].to(torch.bfloat16), plain[n].to(torch.bfloat16)) for n in ref)

    report = read_stats(run.out)
    validate_schema(report)
    assert report["parameters"]["rho_scope"] == rho_scope and report["parameters"]["lambda_rule"] == lambda_rule
    _, totals = closed_form(qwen_bf16.family, agents)
    for row in report["agents"]:  # whole-model rho; lambda by the rule
        rho = totals[row["label"]]["rho"]
        assert number(row["rho"]) == pytest.approx(rho)
        want = 1 + r * (1.0 if math.isinf(rho) else rho / (1 + rho)) if lambda_rule == "soft" else 1 + r * min(rho, 2.0)
        assert row["lambda"] == pytest.approx(want)
    if rho_scope != "model":
        groups = R.reference_group_rhos(base, agent_sds, 1e-5, list(base), rho_scope)
        assert set(report["rho_by_group"]) == set(groups)
        for group, rhos in groups.items():
            got = {model_of(report, a): number(v) for a, v in report["rho_by_group"][group].items()}
            assert got == pytest.approx(rhos), group
    if rho_scope == "layer":
        # blocks are groups; embeddings, final norm and lm_head each stand alone
        assert set(report["rho_by_group"]) == {
            "model.layers.0", "model.layers.1", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
        }
    if lambda_rule == "soft":
        c = rows_by_model(report)[qwen_bf16.path("C")]
        assert c["rho"] == "inf" and c["lambda"] == pytest.approx(1 + r)


def test_rho_per_tensor_with_epsilon_zero_has_no_nan(run_yaml, qwen_bf16):
    """Z is identical to the base and many small tensors have agents with no
    unique (or no active) entry: 0/0 per tensor must not become NaN."""
    agents = "ABCZ"
    run = run_yaml(config_text(qwen_bf16, agents, parameters="epsilon: 0\nrho_scope: tensor"))
    for name, t in run.tensors.items():
        assert bool(torch.isfinite(t).all()), name
    _reference_run(run, qwen_bf16, agents, eps=0.0, rho_scope="tensor")
    report = read_stats(run.out)
    assert model_of(report, "Z") == qwen_bf16.path("Z")
    assert all(number(g["Z"]) == math.inf for g in report["rho_by_group"].values())
    # mergekit's tensor-local ramplus_tl turns exactly this into NaN
    theirs = run_yaml(config_text(qwen_bf16, agents, method="ramplus_tl", parameters="epsilon: 0"))
    assert any(bool(torch.isnan(t).any()) for t in theirs.tensors.values())


# ---------------------------------------------------------------- parameter names


def _check(text: str):
    from mergekit.config import MergeConfiguration

    from mergekit_ram.checks import config_checks as checks

    checks.check_config(MergeConfiguration.model_validate(yaml.safe_load(text)))


def test_misspelled_top_level_parameter_fails_before_reading(run_yaml, qwen_bf16, tmp_path, monkeypatch):
    from mergekit_ram.core import kernel

    monkeypatch.setattr(kernel, "count", lambda *a, **k: pytest.fail("the pre-pass ran"))
    monkeypatch.setattr(kernel, "diagnose", lambda *a, **k: pytest.fail("the pre-pass ran"))
    with pytest.raises(ValueError) as info:
        run_yaml(config_text(qwen_bf16, "AB", parameters="alhpa: 3"), out=tmp_path)
    message = str(info.value)
    assert "'alhpa'" in message and "did you mean 'alpha'" in message
    no_weights_written(tmp_path)


@pytest.mark.parametrize(
    "parameters, model_parameters, wanted",
    [
        ("epsilom: 1e-5", None, "did you mean 'epsilon'"),
        ("rho_scop: layer", None, "did you mean 'rho_scope'"),
        ("", {"A": "rhoo: 1"}, "did you mean 'rho'"),
        ("", {"B": "r: 0.5"}, "shared by all models"),
        ("", {"A": "alpha: 1"}, "shared by all models"),
    ],
)
@pytest.mark.quick
def test_misspelled_or_misplaced_parameters(qwen_bf16, parameters, model_parameters, wanted):
    with pytest.raises(ValueError, match=re.escape(wanted)) as info:
        _check(config_text(qwen_bf16, "AB", parameters=parameters, model_parameters=model_parameters))
    key = (parameters or next(iter(model_parameters.values()))).split(":")[0]
    assert f"'{key}'" in str(info.value)


def test_per_model_r_is_refused_by_a_real_merge(run_yaml, qwen_bf16, tmp_path):
    with pytest.raises(ValueError) as info:
        run_yaml(config_text(qwen_bf16, "AB", model_parameters={"B": "r: 0.5"}), out=tmp_path)
    message = str(info.value)
    assert "'r'" in message and "shared by all models" in message and "ignores it" in message
    assert qwen_bf16.path("B") in message
    no_weights_written(tmp_path)


def test_unrelated_parameter_warns_and_merges(merged, run_yaml, qwen_bf16, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    run = run_yaml(config_text(qwen_bf16, "ABC", parameters="normalize: true"))
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert any("'normalize'" in m and "not a ramplus parameter" in m for m in warnings), warnings
    reference = merged(config_text(qwen_bf16, "ABC"))
    for name in reference.tensors:
        assert torch.equal(run.tensors[name], reference.tensors[name]), name


def test_rho_per_model_is_accepted_silently(qwen_bf16, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _check(config_text(qwen_bf16, "AB", parameters="r: 0.2\nalpha: 1", model_parameters={"A": "rho: 2", "B": "rho: .inf"}))
    assert not [r for r in caplog.records if r.name == LOGGER], [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------- lambda for other parameters


def _report_with(rows, **parameters) -> dict:
    return {
        "parameters": {"epsilon": 1e-5, "r": 0.1, "alpha": 2.0, "rho_scope": "model", "lambda_rule": "clip", **parameters},
        "agents": rows,
        "tensors": [{"name": "t"}],
    }


@pytest.mark.quick
def test_with_lambda_for_returns_a_copy_with_lambda_for_other_parameters():
    from mergekit_ram.reporting import report

    rows = [
        {"model": "a", "rho_counted": 1.5, "rho": 1.5, "lambda": 1.15},
        {"model": "b", "rho_counted": "inf", "rho": "inf", "lambda": 1.2},
        {"model": "c", "rho_counted": 0.5, "rho": 3.0, "rho_source": "given", "lambda": 1.2},  # given: counted one shown
        {"model": "d", "rho": None, "lambda": None},  # not counted, none given
    ]
    original = _report_with(rows)
    frozen = yaml.safe_dump(original)
    found = report.with_lambda_for(original, r=0.2, alpha=1.0, lambda_rule=None)
    assert yaml.safe_dump(original) == frozen  # the published report is untouched
    assert found["parameters"] == {**original["parameters"], "r": 0.2, "alpha": 1.0}
    assert [row["lambda"] for row in found["agents"]] == [pytest.approx(1.2), pytest.approx(1.2), pytest.approx(1.1), None]
    assert [{k: v for k, v in row.items() if k != "lambda"} for row in found["agents"]] == [
        {k: v for k, v in row.items() if k != "lambda"} for row in rows
    ]
    assert found["tensors"] is original["tensors"]  # what no lambda changes is shared, not copied
    soft = report.with_lambda_for(original, r=0.3, lambda_rule="soft")
    assert soft["agents"][0]["lambda"] == pytest.approx(1 + 0.3 * 1.5 / 2.5) and soft["agents"][1]["lambda"] == 1.3
    plain = report.with_lambda_for(original, r=0.0)
    assert [row["lambda"] for row in plain["agents"]] == [1.0, 1.0, 1.0, 1.0]  # plain RAM, counted or not
    same = report.with_lambda_for(original)
    assert same["parameters"] == original["parameters"]
    assert [row["lambda"] for row in same["agents"]] == [pytest.approx(1.15), pytest.approx(1.2), pytest.approx(1.05), None]


def test_the_report_shows_lambda_by_one_rule():
    from mergekit_ram.core import statistics

    assert statistics.lambda_shown(None, 0.0, 2.0, "clip") == 1.0  # r = 0: plain RAM needs no rho
    assert statistics.lambda_shown(None, 0.1, 2.0, "clip") is None
    assert statistics.lambda_shown(math.inf, 0.1, 2.0, "clip") == pytest.approx(1.2)
    assert statistics.lambda_shown(1.0, 0.1, 2.0, "soft") == pytest.approx(1.05)
    for rho in (0.0, 0.7, 5.0, math.inf):
        for rule in ("clip", "soft"):
            assert statistics.lambda_shown(rho, 0.1, 2.0, rule) == statistics.lambda_for(rho, 0.1, 2.0, rule)
            stats = statistics.AgentStats("a", 10, 4, 20)
            assert stats.lambda_(0.1, 2.0, rule) == statistics.lambda_shown(stats.rho, 0.1, 2.0, rule)


# ---------------------------------------------------------------- the card for a hub reader (issue 31)


def test_card_for_a_hub_reader(merged, qwen_bf16):
    """The card sent readers to `pip install mergekit-ram==0.1.0` and a PyPI page (the package is not on PyPI),
    said "RAM+ with ρ per model", and had `base_model: []` and no tag for the method."""
    import subprocess

    from mergekit_ram.reporting import report

    root = Path(report.__file__).resolve().parent.parent
    # HEAD read beside the merge, not at the assertion: a commit made while the suite runs must not fail it
    head_commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    run = merged(config_text(qwen_bf16, "ABC"))
    card = (run.out / "README.md").read_text(encoding="utf-8")
    meta, body = split_card(card)
    head = card.split("\n---\n", 1)[0]
    assert re.search(r"^# license: .*for you to set", head, re.M) and "license" not in meta  # named, left to the user
    section = body[body.index("## RAM+ statistics") :]
    assert "one ρ per agent, counted over the whole model" in section and "ρ per model" not in section
    assert "pip install mergekit-ram" not in section and "not on PyPI" in section
    assert f"mergekit-ram {version('mergekit-ram')} is not on PyPI" in section
    assert f"`mergekit=={version('mergekit')}`" in section
    assert "`mergekit-ram verify ORG/NAME`" in section and "`mergekit-ram verify FOLDER`" in section
    stats = read_stats(run.out)
    source = stats["mergekit_ram_source"]
    text = (run.out / "ram_stats.json").read_text(encoding="utf-8")
    assert str(root) not in json.dumps(source) and str(root) not in section  # never a local path
    assert str(root) not in text
    if source["installed_from"] in ("checkout", "editable") and (root / ".git").exists():
        if head_commit.returncode == 0:
            assert source["commit"] == head_commit.stdout.strip()
            assert f"at commit `{source['commit']}`" in section or f"@{source['commit']}" in section


@pytest.mark.quick
def test_card_front_matter_names_hub_ids_and_the_method():
    from mergekit_ram.reporting import card as cards

    card = "---\nbase_model: []\nlibrary_name: transformers\ntags:\n- mergekit\n- merge\n---\n# body\n"
    snapshot = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-7B-Instruct/snapshots/0123abc"
    report = {"inputs": {
        "base": {"model": snapshot, "identity": {"content_id": "0" * 64, "revision": "0123abc"}},
        "mine": {"model": "/data/my-model", "identity": {"content_id": "1" * 64}},
        "coder": {"model": "org/coder@" + "f" * 40, "identity": {"content_id": "2" * 64, "revision": "f" * 40}},
    }}  # fmt: skip
    assert cards.lineage(report) == ["Qwen/Qwen2.5-7B-Instruct", "org/coder"]
    out = cards.card_front_matter(card, report)
    meta = yaml.safe_load(out.split("---\n")[1])
    assert meta["base_model"] == ["Qwen/Qwen2.5-7B-Instruct", "org/coder"] and meta["base_model_relation"] == "merge"
    assert meta["tags"] == ["mergekit", "merge", "ramplus"] and out.endswith("---\n# body\n")
    assert cards.card_front_matter(out, report) == out  # idempotent
    forged = card.replace("base_model: []", "base_model: [famous-org/coder-7b]")
    assert yaml.safe_load(cards.card_front_matter(forged, report).split("---\n")[1])["base_model"] == meta["base_model"]
    local = {"inputs": {"mine": report["inputs"]["mine"]}}
    empty = yaml.safe_load(cards.card_front_matter(card, local).split("---\n")[1])
    assert "base_model" not in empty and "base_model_relation" not in empty
