"""`mergekit-pytorch` with `merge_method: ramplus`: single-file policy networks that are no transformers.

An MLP actor-critic (bfloat16) and a small CNN (float32, 4-D conv weights, batch norm with an int64
buffer), base + agents A, B, C with the known sparse regions of `tests/models.py`, each saved as
`.safetensors` and as a weights-only `.pt`. mergekit-pytorch's `main` runs in this process (one run
goes through its console script): its planner `plan_flat_merge` is wrapped by the seam, so the merge
gets the same statistics pass, rho, table, cache and `ram_stats.json` as `mergekit-yaml`.
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
from helpers import (
    closed_form,
    differing,
    flat_config_text,
    number,
    read_stats,
    rows_by_model,
    run_flat,
    validate_schema,
)
from mergekit.options import MergeOptions

from mergekit_ram.reporting import report

AGENTS = ("A", "B", "C")


def _floats(sd):
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def _inputs(flat, fmt, agents=AGENTS, cast=None, drop=None):
    """The reference's inputs: base and agents keyed by file path; `drop`: agent -> tensors it lacks (read
    as the base's: an agent that lacks a tensor left it unchanged)."""
    base = _floats(flat.stored("base", fmt))
    sds = {}
    for a in agents:
        sd = _floats(flat.stored(a, fmt))
        for name in (drop or {}).get(a, ()):
            sd[name] = base[name]
        sds[flat.path(a, fmt)] = sd
    if cast is not None:
        base = {k: v.to(cast) for k, v in base.items()}
        sds = {p: {k: v.to(cast) for k, v in sd.items()} for p, sd in sds.items()}
    return base, sds


def _counts_match(report, flat, fmt, agents=AGENTS, names=None):
    """ram_stats.json's per-agent totals and per-tensor counts equal the closed form of the regions."""
    per_tensor, totals = closed_form(flat.family, agents)
    names = set(flat.family.shapes if names is None else names)
    rows = rows_by_model(report)
    label = {row["model"]: name for name, row in report["inputs"].items()}
    numel = sum(flat.family.base[n].numel() for n in names)
    for a in agents:
        row, want = rows[flat.path(a, fmt)], totals[a]
        got = {k: row[k] for k in ("active", "unique", "shared", "shared_with_1")}
        want_here = {
            "active": sum(per_tensor[n][a][0] for n in names),
            "unique": sum(per_tensor[n][a][1] for n in names),
            "shared_with_1": sum(per_tensor[n][a][2] for n in names),
        }
        want_here["shared"] = want_here["active"] - want_here["unique"]
        assert got == want_here, (a, got, want_here)
        assert row["numel"] == numel
        if names == set(flat.family.shapes):
            assert row["active"] == want["active"] and row["unique"] == want["unique"]
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == names
    for name in names:
        assert tensors[name]["counts"] == {label[flat.path(a, fmt)]: per_tensor[name][a] for a in agents}, name


def _record(flat, fmt, text_dtype, union=False, intersection=False, agents=AGENTS):
    return {
        "entry_point": "mergekit-pytorch",
        # mergekit's defaults of the options that change a merge (report.RECORDED_OPTIONS)
        "options": {name: MergeOptions.model_fields[name].default for name in report.RECORDED_OPTIONS},
        "config": {
            "merge_method": "ramplus",
            "models": [{"model": flat.path(a, fmt), "parameters": None} for a in agents],
            "parameters": None,
            "dtype": text_dtype,
            "base_model": flat.path("base", fmt),
            "out_dtype": None,
        },
        "tensor_union": union,
        "tensor_intersection": intersection,
    }


# ---------------------------------------------------------------- merges equal the float64 reference


@pytest.mark.quick
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_mlp_bf16_merge_is_the_reference_and_counts_the_known_sets(flat_mlp, fmt, tmp_path):
    out = tmp_path / "out"
    tensors = run_flat(flat_config_text(flat_mlp, AGENTS, fmt=fmt, dtype="bfloat16"), out)
    base, sds = _inputs(flat_mlp, fmt)
    ref = R.reference_merge(base, sds, 1e-5, 0.1, 2.0)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert differing(tensors, ref) == {}  # bit-identical to the float64 reference rounded once
    report = read_stats(out)
    validate_schema(report)
    _counts_match(report, flat_mlp, fmt)
    stats = R.reference_stats(base, sds, 1e-5)
    for model, row in rows_by_model(report).items():
        assert number(row["rho_counted"]) == stats[model].rho and row["rho_source"] == "counted"
    assert report["merge"] == _record(flat_mlp, fmt, "bfloat16")
    ids = [row["identity"]["content_id"] for row in report["inputs"].values()]
    assert len(set(ids)) == 4  # one identity per file, not per folder
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "ram_stats.json"]
    text = (out / "ram_stats.json").read_text(encoding="utf-8")  # each path twice: the record's config, the inputs
    assert {who: text.count(json.dumps(flat_mlp.path(who, fmt))) for who in ("base", *AGENTS)} == dict.fromkeys(
        ("base", *AGENTS), 2
    )  # issue 40: 33 times per agent before (every per-tensor count and pair named it)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_cnn_float32_merge_is_the_reference_and_copies_its_int_buffer(flat_cnn, fmt, tmp_path):
    """float32 in and out: the kernel's float32 arithmetic rounds more than once, so the merge is the reference
    up to that (`assert_state_dict_matches`) and bit for bit the in-memory API's; computed in float64
    (`dtype: float64`, `out_dtype: float32`) it is the reference rounded once, exactly."""
    from mergekit_ram import merge_state_dicts

    out = tmp_path / "out"
    tensors = run_flat(flat_config_text(flat_cnn, AGENTS, fmt=fmt, dtype="float32"), out)
    assert torch.equal(tensors.pop("bn.num_batches_tracked"), flat_cnn.extra["bn.num_batches_tracked"])
    base, sds = _inputs(flat_cnn, fmt)
    ref = R.reference_merge(base, sds, 1e-5, 0.1, 2.0)
    assert tensors["conv2.weight"].dim() == 4
    R.assert_state_dict_matches(tensors, ref, R.reference_magnitudes(base, sds))
    api = merge_state_dicts(base, list(sds.values()), epsilon=1e-5, r=0.1, alpha=2.0)
    assert all(torch.equal(tensors[k], api[k]) for k in api) and set(api) == set(tensors)
    wide = run_flat(flat_config_text(flat_cnn, AGENTS, fmt=fmt, dtype="float64", out_dtype="float32"), tmp_path / "w")
    wide.pop("bn.num_batches_tracked")
    assert all(t.dtype == torch.float32 for t in wide.values())
    assert differing(wide, ref) == {}
    report = read_stats(out)
    validate_schema(report)
    _counts_match(report, flat_cnn, fmt)  # the int64 buffer is copied, never counted
    assert report["merge"] == _record(flat_cnn, fmt, "float32")


def test_bf16_in_float32_out_rounds_once(flat_mlp, tmp_path):
    out = tmp_path / "out"
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", out_dtype="float32", parameters="r: 0.3")
    tensors = run_flat(text, out)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    base, sds = _inputs(flat_mlp, "safetensors")
    ref = R.reference_merge(base, sds, 1e-5, 0.3, 2.0)
    R.assert_state_dict_matches(tensors, ref, R.reference_magnitudes(base, sds))


# ---------------------------------------------------------------- the console script, the table, order, cache


def test_console_script_prints_the_table_and_writes_stats_last(flat_cnn, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "cfg.yaml"
    config.write_text(flat_config_text(flat_cnn, AGENTS, fmt="pt", dtype="float32"), encoding="utf-8")
    script = Path(sys.executable).parent / "mergekit-pytorch"
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off"}
    done = subprocess.run([str(script), str(config), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stderr.split("RAM+ statistics (computed):", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in table.strip().splitlines()[2:5]] == ["A.pt", "B.pt", "C.pt"], table
    assert flat_cnn.path("A", "pt") not in table  # each agent by its label, as in ram_stats.json (issue 40)
    model, stats = out / "model.safetensors", out / "ram_stats.json"
    assert stats.stat().st_mtime_ns >= model.stat().st_mtime_ns  # the marker of a finished merge, last
    validate_schema(read_stats(out))


def test_a_rerun_takes_the_counts_from_the_cache(flat_mlp, tmp_path, monkeypatch):
    from mergekit_ram.core import kernel

    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16")
    first = run_flat(text, tmp_path / "one")
    assert read_stats(tmp_path / "one")["statistics"] == "computed"
    calls = []
    real = kernel.diagnose
    monkeypatch.setattr(kernel, "diagnose", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = run_flat(text, tmp_path / "two")
    report = read_stats(tmp_path / "two")
    assert report["statistics"] == "cache" and calls == []  # no tensor counted again
    assert all(torch.equal(first[k], again[k]) for k in first)
    one = read_stats(tmp_path / "one")
    assert [a["rho"] for a in report["agents"]] == [a["rho"] for a in one["agents"]]


def test_the_cache_key_follows_a_file_not_its_folder(flat_mlp, tmp_path):
    """Two agents side by side in one folder have different identities; rewriting one changes its identity."""
    from mergekit_ram.core import cache

    a, b = flat_mlp.path("A"), flat_mlp.path("B")
    assert os.path.dirname(a) == os.path.dirname(b)
    ia, ib = cache.file_identity(a), cache.file_identity(b)
    assert set(ia) == {"path", "files"} and list(ia["files"]) == ["A.safetensors"]
    assert ia["files"]["A.safetensors"]["sample_sha256"] != ib["files"]["B.safetensors"]["sample_sha256"]
    copy = tmp_path / "A.safetensors"
    copy.write_bytes(Path(a).read_bytes())
    before = cache.file_identity(str(copy))
    data = bytearray(copy.read_bytes())
    data[-3] ^= 1  # one changed bit in the last tensor: a sample window covers the file's end
    copy.write_bytes(bytes(data))
    assert cache.file_identity(str(copy))["files"] != before["files"]


# ---------------------------------------------------------------- tensors some models lack


@pytest.fixture(scope="module")
def ragged(flat_mlp, tmp_path_factory):
    """B lacks v.2.weight, C lacks pi.4.bias and v.2.weight, the agents lack log_std (only the base has it)."""
    root = tmp_path_factory.mktemp("ragged")
    lacks = {"A": {"log_std"}, "B": {"log_std", "v.2.weight"}, "C": {"log_std", "pi.4.bias", "v.2.weight"}}
    paths = {"base": flat_mlp.path("base")}
    for a, names in lacks.items():
        sd = {k: v for k, v in flat_mlp.stored(a).items() if k not in names}
        paths[a] = str(root / f"{a}.safetensors")
        from safetensors.torch import save_file

        save_file(sd, paths[a])
    return paths, lacks


def test_without_a_flag_mergekit_refuses_missing_tensors(flat_mlp, ragged, tmp_path):
    """mergekit's bare "Missing tensors" becomes one line of ours that names both flags."""
    from mergekit_ram.errors import RamError, one_line

    paths, _ = ragged
    with pytest.raises(RamError, match="--tensor-intersection .* --tensor-union") as info:
        run_flat(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths), tmp_path / "out")
    assert str(info.value.__cause__) == "Missing tensors" and one_line(info.value) is not None
    assert not (tmp_path / "out").exists()


def test_intersection_counts_and_merges_the_common_tensors_only(flat_mlp, ragged, tmp_path):
    paths, lacks = ragged
    out = tmp_path / "out"
    tensors = run_flat(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths), out, "--tensor-intersection")
    common = set(flat_mlp.family.shapes) - set().union(*lacks.values())
    assert set(tensors) == common
    base, sds = _inputs(flat_mlp, "safetensors")
    ref = R.reference_merge(base, sds, 1e-5, 0.1, 2.0, names=sorted(common))
    assert differing(tensors, ref) == {}
    report = read_stats(out)
    validate_schema(report)
    assert {t["name"] for t in report["tensors"]} == common
    assert report["merge"]["tensor_intersection"] and not report["merge"]["tensor_union"]
    rows = rows_by_model(report)
    per_tensor, _ = closed_form(flat_mlp.family, AGENTS)
    for a in AGENTS:
        assert rows[paths[a]]["active"] == sum(per_tensor[n][a][0] for n in common)


def test_union_counts_a_tensor_over_the_agents_that_store_it_and_keeps_a_base_only_one(
    flat_mlp, ragged, tmp_path, caplog
):
    paths, lacks = ragged
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths)
    tensors = run_flat(text, tmp_path / "unlisted", "--tensor-union")
    assert set(tensors) == set(flat_mlp.family.shapes) - {"log_std"}  # mergekit plans the models' tensors
    assert "log_std" in caplog.text and "List the base under `models:`" in caplog.text
    out = tmp_path / "out"
    listed = text.replace("models:\n", f"models:\n  - model: {paths['base']}\n")
    tensors = run_flat(listed, out, "--tensor-union")
    assert set(tensors) == set(flat_mlp.family.shapes)
    assert torch.equal(tensors["log_std"], flat_mlp.family.base["log_std"])  # only the base has it: copied
    base = _floats(flat_mlp.stored("base"))
    sds = {paths[a]: {**base, **_floats(flat_mlp.stored(a))} for a in AGENTS}  # every agent read whole...
    for a, names in lacks.items():
        for name in names:
            sds[paths[a]][name] = base[name]  # ...but what it lacks is the base's: left unchanged
    counted = sorted(set(flat_mlp.family.shapes) - {"log_std"})
    ref = R.reference_merge(base, sds, 1e-5, 0.1, 2.0, names=counted)
    assert differing({k: v for k, v in tensors.items() if k != "log_std"}, ref) == {}
    report = read_stats(out)
    validate_schema(report)
    assert report["merge"]["tensor_union"] and report["merge"]["config"]["models"][0]["model"] == paths["base"]
    stats = R.reference_stats(base, sds, 1e-5, counted)
    rows = rows_by_model(report)
    label = {row["model"]: name for name, row in report["inputs"].items()}
    for a in AGENTS:
        s = stats[paths[a]]
        assert (rows[paths[a]]["active"], rows[paths[a]]["unique"]) == (s.active, s.unique), a
        assert rows[paths[a]]["numel"] == sum(base[n].numel() for n in counted)
    tensor = next(t for t in report["tensors"] if t["name"] == "v.2.weight")
    assert tensor["counts"][label[paths["B"]]] == [0, 0, 0] and tensor["counts"][label[paths["C"]]] == [0, 0, 0]


@pytest.mark.quick
def test_union_refuses_a_tensor_the_base_lacks(flat_mlp, tmp_path):
    from safetensors.torch import save_file

    sd = dict(flat_mlp.stored("A"))
    sd["aux.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    extra = tmp_path / "A-aux.safetensors"
    save_file(sd, str(extra))
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths={"A": str(extra)})
    with pytest.raises(ValueError, match="tensor aux.weight is not in the base model") as info:
        run_flat(text, tmp_path / "out", "--tensor-union")
    assert str(extra) in str(info.value) and "--tensor-intersection" in str(info.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- inputs refused, named


def test_a_pickle_that_runs_code_is_refused_naming_the_file(flat_mlp, tmp_path):
    evil = tmp_path / "A.pt"
    torch.save({**flat_mlp.stored("A"), "hook": _Reduce()}, str(evil))
    text = flat_config_text(flat_mlp, AGENTS, fmt="pt", dtype="bfloat16", paths={"A": str(evil)})
    with pytest.raises(ValueError, match="pickle") as info:
        run_flat(text, tmp_path / "out")
    assert str(evil) in str(info.value) and "system" in str(info.value)
    assert not (tmp_path / "out").exists()


class _Reduce:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_nan_is_named_by_tensor_and_file(flat_mlp, tmp_path):
    sd = dict(flat_mlp.stored("B", "pt"))
    sd["pi.2.weight"] = sd["pi.2.weight"].clone()
    sd["pi.2.weight"].view(-1)[5] = float("nan")
    bad = tmp_path / "B.pt"
    torch.save(sd, str(bad))
    text = flat_config_text(flat_mlp, AGENTS, fmt="pt", dtype="bfloat16", paths={"B": str(bad)})
    with pytest.raises(ValueError, match="pi.2.weight") as info:
        run_flat(text, tmp_path / "out")
    assert str(bad) in str(info.value) and "NaN" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_shape_mismatch_is_named_by_tensor_and_file(flat_mlp, fmt, tmp_path):
    from safetensors.torch import save_file

    sd = dict(flat_mlp.stored("C", fmt))
    sd["v.0.weight"] = sd["v.0.weight"][:, :10].contiguous()
    bad = tmp_path / f"C.{fmt}"
    save_file(sd, str(bad)) if fmt == "safetensors" else torch.save(sd, str(bad))
    text = flat_config_text(flat_mlp, AGENTS, fmt=fmt, dtype="bfloat16", paths={"C": str(bad)})
    with pytest.raises(ValueError, match="tensor v.0.weight has shape") as info:
        run_flat(text, tmp_path / "out")
    assert str(bad) in str(info.value) and "(32, 10)" in str(info.value)


# ---------------------------------------------------------------- the output folder


def test_the_folder_of_an_input_file_is_refused_and_a_new_folder_inside_it_is_not(flat_mlp, tmp_path):
    folder = tmp_path / "policies"
    folder.mkdir()
    paths = {}
    for who in ("base", *AGENTS):
        paths[who] = str(folder / f"{who}.safetensors")
        Path(paths[who]).write_bytes(Path(flat_mlp.path(who)).read_bytes())
    text = flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths)
    before = sorted(folder.iterdir())
    with pytest.raises(ValueError, match="is the folder of the input file") as info:
        run_flat(text, folder)
    assert str(folder) in str(info.value)
    assert sorted(folder.iterdir()) == before  # nothing written beside the inputs (the config went elsewhere)
    with pytest.raises(ValueError, match="is the folder of the input file"):
        run_flat(text, folder / ".." / "policies")  # the same folder, spelt otherwise
    tensors = run_flat(text, folder / "merged")  # a new folder inside it: nothing is written beside an input
    assert set(tensors) == set(flat_mlp.family.shapes)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [p.name for p in before] + ["merged", "merged.yaml"]
    )


def test_an_earlier_merges_weights_and_stats_are_replaced(flat_mlp, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (out / "ram_stats.json").write_text(json.dumps({"format": "mergekit-ram/ram_stats", "old": True}))
    (out / "notes.txt").write_text("kept")
    run_flat(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16"), out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt", "ram_stats.json"]
    assert "old" not in read_stats(out)


def test_another_method_runs_as_mergekit_and_drops_a_stale_ram_stats(flat_mlp, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "ram_stats.json").write_text(json.dumps({"format": "mergekit-ram/ram_stats"}))
    text = flat_config_text(flat_mlp, AGENTS, method="task_arithmetic", dtype="bfloat16", parameters="weight: 1.0")
    tensors = run_flat(text, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    base = flat_mlp.family.base
    want = base["pi.0.weight"].float() + sum(flat_mlp.family.agents[a]["pi.0.weight"].float() - base["pi.0.weight"].float() for a in AGENTS)
    assert torch.allclose(tensors["pi.0.weight"].float(), want, atol=0.02)


# ---------------------------------------------------------------- inspect, and the planner called directly


@pytest.mark.quick
def test_inspect_takes_a_mergekit_pytorch_config(flat_mlp, ragged, tmp_path, capsys):
    from mergekit_ram import cli

    config = tmp_path / "cfg.yaml"
    paths, _ = ragged
    config.write_text(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16", paths=paths), encoding="utf-8")
    assert cli.main(["inspect", str(config), "-q"]) == 1  # mergekit refuses, the message says what to pass
    assert "--tensor-intersection" in capsys.readouterr().err
    stats = tmp_path / "stats.json"
    assert cli.main(["inspect", str(config), "-q", "--tensor-union", "--json", str(stats)]) == 0
    printed = capsys.readouterr().out
    assert "RAM+ statistics of" in printed and "A.safetensors" in printed
    report = json.loads(stats.read_text())
    validate_schema(report)
    assert report["merge"]["entry_point"] == "mergekit-pytorch" and report["merge"]["tensor_union"]
    merged = tmp_path / "merged"
    run_flat(config.read_text(), merged, "--tensor-union")
    assert [a["rho"] for a in read_stats(merged)["agents"]] == [a["rho"] for a in report["agents"]]


def test_the_wrapped_planner_serves_a_caller_other_than_main(flat_cnn, tmp_path):
    """`verify` plans again from the record: plan_flat_merge called directly returns tasks with rho and
    the ram_stats.json task, which mergekit's executor runs."""
    import yaml
    from mergekit.graph import Executor
    from mergekit.options import MergeOptions
    from mergekit.scripts import merge_raw_pytorch

    from mergekit_ram._mergekit import surface

    assert surface.marked(merge_raw_pytorch.plan_flat_merge, surface.HOOKED)
    parameters = "r: 0.2\nepsilon:\n  - filter: conv\n    value: 0.0001\n  - value: 0.00001"
    config = merge_raw_pytorch.RawPyTorchMergeConfig.model_validate(
        yaml.safe_load(flat_config_text(flat_cnn, AGENTS, dtype="float32", parameters=parameters))
    )
    out = tmp_path / "out"
    planned = merge_raw_pytorch.plan_flat_merge(
        config, str(out), tensor_union=False, tensor_intersection=False, options=MergeOptions(quiet=True)
    )
    rhos = {
        str(m): dict(p.items()).get("rho")
        for t in planned
        if hasattr(t, "tensor_task") and t.tensor_name == "conv1.weight"
        for m, p in t.tensor_task.input_parameters.items()
    }
    assert all(rhos[flat_cnn.path(a)] is not None for a in AGENTS)
    Executor(planned, math_device="cpu", storage_device="cpu").execute()
    report = read_stats(out)
    record = report["merge"]
    assert {**record, "config": {**record["config"], "parameters": None}} == _record(flat_cnn, "safetensors", "float32")
    assert merge_raw_pytorch.RawPyTorchMergeConfig.model_validate(record["config"]) == config  # what verify rebuilds
    assert report["per_tensor_parameters"] == {"epsilon": [0.0001, 1e-05]} and report["parameters"]["r"] == 0.2
    assert models.load_checkpoint(out).keys() == {*flat_cnn.family.shapes, "bn.num_batches_tracked"}


def test_the_flat_door_is_wrapped_only_when_mergekit_pytorch_has_what_it_reads(monkeypatch, caplog):
    """`hooks.install_flat` checks the RAW_PYTORCH names (and the pre-pass's) first: a changed mergekit-pytorch leaves
    its planner unwrapped, with a warning; mergekit's own module is wrapped once."""
    import sys
    import types

    from mergekit.scripts import merge_raw_pytorch

    from mergekit_ram._mergekit import hooks, surface

    assert surface.problems(surface.RAW_PYTORCH) == []
    assert surface.marked(merge_raw_pytorch.plan_flat_merge, surface.HOOKED)
    original = surface.unwrapped(merge_raw_pytorch.plan_flat_merge)
    fake = types.ModuleType(merge_raw_pytorch.__name__)  # mergekit's module, its planner not yet wrapped
    fake.__dict__.update({k: v for k, v in vars(merge_raw_pytorch).items() if k != "__name__"})
    fake.plan_flat_merge = original
    monkeypatch.setitem(sys.modules, "mergekit.scripts.merge_raw_pytorch", fake)
    real_check = surface.check

    def check(needed_for):
        if needed_for == surface.RAW_PYTORCH:
            raise surface.IncompatibleMergekit("simulated: plan_flat_merge changed")
        real_check(needed_for)

    monkeypatch.setattr(surface, "check", check)
    hooks.install_flat()
    assert fake.plan_flat_merge is original and "simulated: plan_flat_merge changed" in caplog.text
    monkeypatch.setattr(surface, "check", real_check)
    hooks.install_flat()
    hooks.install_flat()  # idempotent
    assert surface.marked(fake.plan_flat_merge, surface.HOOKED) and surface.unwrapped(fake.plan_flat_merge) is original


# ---------------------------------------------------------------- console output (issue 31)


def test_quiet_merge_drops_the_planning_bars(flat_mlp, tmp_path, capsys):
    """`--quiet` reaches mergekit-pytorch's planning bars (drawn inside the wrapped planner); its executor's bar
    is drawn by mergekit's own `main`, after the planner returns, out of reach."""
    capsys.readouterr()
    run_flat(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16"), tmp_path / "out")  # run_flat passes --quiet
    err = capsys.readouterr().err
    assert "Preparing model loaders" not in err and "Planning operations" not in err, err


def test_stale_file_warning_starts_its_own_line(flat_mlp, tmp_path):
    """The removal of an earlier merge's weight file is named inside mergekit's "Executing graph" bar: as a
    terminal shows it (what follows the last carriage return of each line), the warning starts its line."""
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    config.write_text(flat_config_text(flat_mlp, AGENTS, dtype="bfloat16"), encoding="utf-8")
    out = tmp_path / "out"
    exe = str(Path(sys.executable).parent / "mergekit-pytorch")
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}
    subprocess.run([exe, str(config), str(out)], check=True, capture_output=True, env=env, timeout=300)
    (out / "model-00001-of-00002.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    done = subprocess.run([exe, str(config), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    shown = [line.rsplit("\r", 1)[-1] for line in done.stderr.split("\n")]
    warned = [line for line in shown if "removing" in line]
    assert len(warned) == 1 and warned[0].startswith("mergekit-ram: warning: ramplus: removing "), shown
    assert not (out / "model-00001-of-00002.safetensors").exists()


def test_batch_norm_buffers(flat_cnn, tmp_path):
    """What docs/doors.md says of BatchNorm: `running_mean` and `running_var` are floats, merged like weights (an
    entry one agent changed is base + lambda * tau); an integer `num_batches_tracked` that the inputs agree on
    is copied (the CNN test above), one they differ on is refused before any weight is read (mergekit refused it
    itself, mid-merge, with a traceback: `reliability/test_flat_inputs.py` has that case)."""
    from mergekit_ram import agent_statistics

    tensors = run_flat(flat_config_text(flat_cnn, AGENTS, fmt="pt", dtype="float32"), tmp_path / "out")
    base, sds = _inputs(flat_cnn, "pt")
    lam = {a: s.lambda_(0.1, 2.0) for a, s in agent_statistics(base, sds).items()}
    for name in ("bn.running_mean", "bn.running_var"):
        taus = {a: (sd[name] - base[name]).double() for a, sd in sds.items()}
        moved = {a: t.abs() > 1e-5 for a, t in taus.items()}
        count = sum(m.int() for m in moved.values())
        scaled = 0
        for a, t in taus.items():
            only = moved[a] & (count == 1)
            want = base[name].double()[only] + lam[a] * t[only]
            assert torch.allclose(tensors[name].double()[only], want, rtol=0, atol=1e-6), (name, a)
            scaled += int(only.sum())
        assert scaled > 0, name  # the fixture has entries only one agent changed


def test_agents_stored_in_other_dtypes_are_named_whatever_tensor_comes_first(flat_cnn, tmp_path, caplog):
    """Issue 59: the dtype warning looked at the first planned tensor only (an integer counter,
    `bn.num_batches_tracked`, or a tensor stored as the base stores it), and so said nothing of a bf16 and an fp16
    agent beside an fp32 base (whose rounding inflates their densities). Here the agents store only their last
    floating tensor in another dtype; every floating tensor of every input is looked at now."""
    import logging

    from safetensors.torch import save_file

    paths = {}
    for who, dtype in (("A", torch.bfloat16), ("B", torch.float16)):
        stored = flat_cnn.stored(who)
        last = sorted(k for k, v in stored.items() if v.is_floating_point())[-1]
        stored[last] = stored[last].to(dtype)
        paths[who] = str(tmp_path / f"{who}.safetensors")
        save_file(stored, paths[who])
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    text = flat_config_text(flat_cnn, ["A", "B"], paths=paths, parameters="r: 0.1")
    run_flat(text, tmp_path / "out")
    said = [r.getMessage() for r in caplog.records if "different dtype than the base" in r.getMessage()]
    assert said == [
        f"ramplus: {paths['A']} (BF16), {paths['B']} (F16) stored in a different dtype than the base (F32); "
        "rounding differences count as updates and inflate density"
    ], said
