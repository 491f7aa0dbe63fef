"""What a `ramplus` merge leaves in its output folder: no earlier merge's weights beside the new
ones, one rounding to `out_dtype`, `ram_stats.json` readable like mergekit's own files, a tied
pair counted once and said so on the card.

Decided behaviour: when a `ramplus` merge finishes, the weight files and index of an earlier
merge that it did not write again are removed from the output folder, each named in a warning
(nothing outside the folder; a symlink is removed, never followed); a `ram_stats.json` of an
earlier `ramplus` merge is removed before any other method merges into the folder. `out_dtype`
is written by the kernel directly (float32 arithmetic rounded once). `ram_stats.json` is
created 0666 less the umask. With `tie_word_embeddings`, a stored `lm_head` copy is merged and
written as mergekit writes it, but counted once with the embeddings it is tied to.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import models
import pytest
import reference as R
import torch
import yaml
from helpers import config_yaml, finished, inputs, rows_by_model, tree

WEIGHTS = (".safetensors", ".bin", ".index.json")


def _weights(out):
    return sorted(p.name for p in out.iterdir() if p.name.endswith(WEIGHTS))


def _removed(caplog):
    return [r.getMessage() for r in caplog.records if "left by an earlier merge" in r.getMessage()]


SHARDS = 4096  # out_shard_size in bytes: the tiny models' merge is written in several shards


@pytest.mark.quick
@pytest.mark.parametrize("order", ["sharded-then-single", "single-then-sharded"])
def test_reused_output_folder_keeps_only_the_new_merge(rel, qwen_bf16, run_yaml, tmp_path, caplog, order):
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = tmp_path / "o"
    rel.watch(*qwen_bf16.paths.values())
    first, second = (
        ({"out_shard_size": SHARDS}, {}) if order == "sharded-then-single" else ({}, {"out_shard_size": SHARDS})
    )
    run_yaml(config_yaml(qwen_bf16.path("base"), agents, parameters={"r": 0.5}), out=out, **first)
    old = set(_weights(out))
    (out / "notes.txt").write_text("mine")
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=out, **second)
    now = _weights(out)
    if order == "sharded-then-single":
        assert now == ["model.safetensors"], now
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(now) == {"model.safetensors.index.json", *index["weight_map"].values()}, now
        assert "model.safetensors" not in now
    stale = old - set(now)
    assert stale, "the two merges wrote the same files: nothing to test"
    messages = _removed(caplog)
    for name in stale:
        rel.names(next(m for m in messages if name in m), out / name)
    assert (out / "notes.txt").read_text() == "mine"
    if "model.safetensors" in now:
        finished(out)
    assert json.loads((out / "ram_stats.json").read_text())["parameters"]["r"] == 0.1
    rel.matches_reference(models.load_checkpoint(out), *inputs(qwen_bf16.path("base"), agents))
    assert run.tensors.keys() == models.load_checkpoint(out).keys()


def test_reused_output_folder_symlink_is_removed_not_followed(rel, qwen_bf16, run_yaml, tmp_path, caplog):
    """A stale weight-file name that is a symlink: the link goes, what it points to (outside) stays."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = tmp_path / "o"
    out.mkdir()
    outside = tmp_path / "keep" / "model-00001-of-00002.safetensors"
    outside.parent.mkdir()
    outside.write_bytes(b"not mine to delete")
    (out / "model-00001-of-00002.safetensors").symlink_to(outside)
    rel.watch(*qwen_bf16.paths.values(), outside.parent)
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=out)
    assert _weights(out) == ["model.safetensors"]
    rel.names(_removed(caplog)[0], out / "model-00001-of-00002.safetensors")
    finished(out)
    rel.matches_reference(models.load_checkpoint(out), *inputs(qwen_bf16.path("base"), agents))


def _task_arithmetic(qwen, agents):
    data = yaml.safe_load(config_yaml(qwen.path("base"), agents, method="task_arithmetic"))
    for entry in data["models"]:
        entry["parameters"] = {"weight": 0.5}
    return yaml.safe_dump(data)


@pytest.mark.quick
def test_other_method_into_a_ramplus_folder_drops_its_ram_stats(rel, qwen_bf16, run_yaml, tmp_path, caplog):
    """`task_arithmetic` into a folder holding a `ramplus` merge: the old ram_stats.json (ρ, λ)
    would describe weights it no longer sits beside. Everything else is mergekit's own."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = tmp_path / "o"
    rel.watch(*qwen_bf16.paths.values())
    run_yaml(config_yaml(qwen_bf16.path("base"), agents), out=out)
    assert (out / "ram_stats.json").exists()
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(_task_arithmetic(qwen_bf16, agents), out=out)
    assert "ram_stats.json" not in run.files
    rel.names(
        next(m for m in (r.getMessage() for r in caplog.records) if "ram_stats.json" in m), out / "ram_stats.json",
        "r=0.1, alpha=2.0", f"agents {agents[0]}, {agents[1]}",  # what the merge replaces (issue 43)
    )
    fresh = run_yaml(_task_arithmetic(qwen_bf16, agents), out=tmp_path / "fresh")
    try:
        assert fresh.tensors.keys() == run.tensors.keys()
        assert all(torch.equal(fresh.tensors[k], run.tensors[k]) for k in fresh.tensors)
        assert fresh.files == run.files
    except AssertionError:
        rel.case.wrong_merges += 1
        raise
    rel.case.merges_compared += 1


def test_user_file_named_ram_stats_is_left_to_other_methods(rel, qwen_bf16, run_yaml, tmp_path):
    """Only a ram_stats.json that mergekit-ram wrote is removed by another method's merge."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    out = tmp_path / "o"
    out.mkdir()
    (out / "ram_stats.json").write_text('{"mine": true}')
    rel.watch(*qwen_bf16.paths.values())
    run_yaml(_task_arithmetic(qwen_bf16, agents), out=out)
    assert json.loads((out / "ram_stats.json").read_text()) == {"mine": True}


def test_out_dtype_float32_from_bfloat16_rounds_once(rel, qwen_bf16, run_yaml):
    """`dtype: bfloat16`, `out_dtype: float32`: float32 arithmetic on the bf16 inputs, rounded once to
    float32, not rounded to bf16 first and widened."""
    agents = [qwen_bf16.path("A"), qwen_bf16.path("B"), qwen_bf16.path("C")]
    data = yaml.safe_load(config_yaml(qwen_bf16.path("base"), agents))
    data["out_dtype"] = "float32"
    rel.watch(*qwen_bf16.paths.values())
    run = run_yaml(yaml.safe_dump(data))
    assert {t.dtype for t in run.tensors.values()} == {torch.float32}
    base, sds = inputs(qwen_bf16.path("base"), agents)
    rel.matches_reference(run.tensors, base, sds)
    # and the merged values are not all bf16 numbers (a bf16 rounding would make them so)
    merged = torch.cat([t.reshape(-1) for t in run.tensors.values()])
    assert not torch.equal(merged, merged.to(torch.bfloat16).to(torch.float32))


def test_ram_stats_json_is_readable_like_mergekits_files(rel, qwen_bf16, run_yaml):
    old = os.umask(0o022)
    try:
        rel.watch(*qwen_bf16.paths.values())
        run = run_yaml(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("A"), qwen_bf16.path("B")]))
    finally:
        os.umask(old)
    modes = {
        name: stat.S_IMODE((run.out / name).stat().st_mode) for name in ("ram_stats.json", "config.json", "README.md")
    }
    assert modes["ram_stats.json"] == modes["config.json"] == 0o644, {k: oct(v) for k, v in modes.items()}


def test_tied_embeddings_with_a_stored_lm_head_copy_are_counted_once(rel, llama_tied, make_model, run_yaml):
    """Some exporters store `lm_head.weight` beside tied embeddings. The pair is one set of parameters
    in the model transformers loads: counted once (ρ and λ as without the copy), merged and written
    as mergekit writes it, and the card says so."""
    fam = llama_tied.family
    head = "lm_head.weight"
    paths = {}
    for who in ("base", "A", "B"):
        sd = dict(fam.state_dict(who))
        sd[head] = sd["model.embed_tokens.weight"].clone()
        paths[who] = make_model(f"tied-with-copy-{who}", sd, arch="llama", tied=True)
    agents = [paths["A"], paths["B"]]
    rel.watch(*paths.values(), *llama_tied.paths.values())
    run = run_yaml(config_yaml(paths["base"], agents))
    without = run_yaml(config_yaml(llama_tied.path("base"), [llama_tied.path("A"), llama_tied.path("B")]))
    stats = json.loads((run.out / "ram_stats.json").read_text())
    plain = json.loads((without.out / "ram_stats.json").read_text())
    base, sds = inputs(paths["base"], agents)
    counted = [n for n in base if n != head]
    ref = R.reference_stats(base, sds, names=counted)
    for (model, row), other in zip(rows_by_model(stats).items(), plain["agents"], strict=True):
        assert row["numel"] == sum(base[n].numel() for n in counted) == other["numel"]
        assert row["rho"] == pytest.approx(ref[model].rho, rel=1e-12)
        assert row["rho"] == other["rho"] and row["lambda"] == other["lambda"]
    assert stats["tied_counted_once"] == {head: "model.embed_tokens.weight"}
    assert head in run.tensors
    card = (run.out / "README.md").read_text()
    rel.names(card, "counted once", f"`{head}` (tied to `model.embed_tokens.weight`)")
    rel.matches_reference(run.tensors, base, sds, rho={k: s.rho for k, s in ref.items()})


# ---------------------------------------------------------------- outputs the merge must not write to


def test_an_output_inside_the_hub_cache_is_refused_naming_where_it_resolved(rel, qwen_bf16, tmp_path):
    """A hub id's snapshot (its files links into blobs every revision shares), a folder inside it, or any folder
    of the Hub cache: `mergekit-yaml` refuses it in one line naming where it resolved to, before writing."""
    import shutil
    import subprocess

    from helpers import console_script
    from hub_stub import HubStub, hub_env

    home = tmp_path / "home"
    config = tmp_path / "ramplus.yml"
    config.write_text(config_yaml(qwen_bf16.path("base"), ["org/agent", qwen_bf16.path("B")]), encoding="utf-8")
    rel.watch(*qwen_bf16.paths.values())
    with HubStub({"org/agent": [qwen_bf16.paths["A"]]}, lifetime=900) as stub:
        snapshot = home / "hub" / "models--org--agent" / "snapshots" / stub.shas["org/agent"][0]
        env = hub_env(stub.url, home)

        def merge(out):
            return subprocess.run(
                [console_script("mergekit-yaml"), str(config), str(out), "--no-copy-tokenizer", "--quiet"],
                capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path),
            )  # fmt: skip

        first = merge(tmp_path / "fine")  # fills the cache: the snapshot exists
        assert first.returncode == 0, first.stderr[-3000:]
        served = (qwen_bf16.paths["A"] / "model.safetensors").read_bytes()
        link = tmp_path / "link-to-snapshot"
        link.symlink_to(snapshot)
        for out, named in [
            (snapshot, f"(the snapshot of org/agent at {snapshot.name})"),
            (link / "sub", f"resolves to {snapshot / 'sub'}"),
            (home / "hub" / "mine", f"inside the Hugging Face Hub cache {home / 'hub'}"),
        ]:
            done = merge(out)
            assert done.returncode != 0, done.stderr[-3000:]
            assert "Traceback" not in done.stderr, done.stderr[-3000:]
            line = done.stderr.strip().splitlines()[-1]
            assert line.startswith("mergekit-yaml: error: output folder "), done.stderr[-3000:]
            rel.names(line, out, named, "Choose another output folder")
            assert not (snapshot / "ram_stats.json").exists() and not (snapshot / "sub").exists()
            assert (snapshot / "model.safetensors").read_bytes() == served
            assert not (home / "hub" / "mine").exists()
        shutil.rmtree(tmp_path / "fine")


@pytest.fixture
def read_only_folder(tmp_path):
    """A tmpfs mounted at a folder, to be remounted read-only (root, and a kernel that lets it, or the case skips)."""
    import subprocess

    folder = tmp_path / "mounted"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("mounting a file system needs root and a kernel that allows it")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_re_merge_on_a_read_only_file_system_is_one_line_before_the_merge(
    rel, qwen_bf16, run_yaml, read_only_folder, monkeypatch
):
    import subprocess

    from mergekit_ram._mergekit import pipeline

    agents = [qwen_bf16.path("A"), qwen_bf16.path("B")]
    text = config_yaml(qwen_bf16.path("base"), agents)
    out = read_only_folder / "o"
    run_yaml(text, out=out)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_folder)], check=True, capture_output=True)
    rel.watch(*qwen_bf16.paths.values())
    before = tree([out])
    counted = []
    monkeypatch.setattr(pipeline, "prepare", lambda *a, **k: counted.append(1))  # the merge must not start
    with pytest.raises(Exception) as error:
        run_yaml(text, out=out)
    rel.names(error, out, "read-only file system")
    assert not counted, "the merge started before the output folder was found read-only"
    assert tree([out]) == before
