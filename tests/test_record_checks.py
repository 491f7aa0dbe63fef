"""`record_checks.py`: what a ramplus folder records, read and checked on plain data for `mergekit-ram verify`.

The folder's `ram_stats.json` read (usage errors and data errors told apart), its merge record, damaged
weight files and tensors the index does not name, the plan and the recomputed rho against the record,
an input's identity against the recorded one, installed versions against the recorded ones; the recorded
options taken as evidence (none that runs code without the user's flag), local copies of inputs,
`folder_checks` (a stranger's files: special files, links, size and depth), `loader_files` (which weight files
each loader reads) and `published_checks` (the published statistics against the recomputed ones). Through
`mergekit-ram verify` on real folders: tests/test_verification.py, tests/reliability/test_verify_cases.py.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from mergekit_ram.verify import record_checks
from mergekit_ram.verify.input_copies import local_copies
from mergekit_ram.verify.record_checks import NotVerifiable, Unreadable

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)

HASH = "ab" * 32


def recorded_report(**changes) -> dict:
    """A ram_stats.json as plain data (format 4): base + A (rho counted) + B (rho given), recorded under /m."""
    out = {
        "format": "mergekit-ram/ram_stats",
        "format_version": 4,
        "method": "ramplus",
        "parameters": {"epsilon": 1e-5, "r": 0.1, "alpha": 0.2, "rho_scope": "tensor"},
        "per_tensor_parameters": {},
        "inputs": {
            "base": {"role": "base", "model": "/m/base", "identity": {"content_id": HASH}},
            "A": {"role": "agent", "model": "/m/A", "identity": {"content_id": HASH, "revision": "r1"}},
            "B": {"role": "agent", "model": "/m/B", "identity": {}},
        },
        "base_model": "base",
        "agents": [
            {"label": "A", "rho": 0.25, "rho_source": "counted"},
            {"label": "B", "rho": 0.5, "rho_source": "given"},
        ],
        "rho_by_group": {"g0": {"A": 0.25, "B": 0.5}},
        "tied_counted_once": {},
        "versions": {"mergekit": "0.1.5", "torch": "2.13.0"},
        "merge": {"entry_point": "run_merge", "options": {"lazy_unpickle": True}},
    }
    out.update(changes)
    return out


def old_report(format_version: int = 3) -> dict:
    """The same merge as mergekit-ram wrote it in formats 1 to 3: every input named by its path, everywhere."""
    out = {key: value for key, value in recorded_report(format_version=format_version).items() if key != "inputs"}
    out["base_model"] = {"model": "/m/base", "identity": {"content_id": HASH}}
    out["agents"] = [
        {"model": "/m/A", "rho": 0.25, "rho_source": "counted", "identity": {"content_id": HASH, "revision": "r1"}},
        {"model": "/m/B", "rho": 0.5, "rho_source": "given", "identity": {}},
    ]
    out["rho_by_group"] = {"g0": {"/m/A": 0.25, "/m/B": 0.5}}
    out["pairs"] = [{"agents": ["/m/A", "/m/B"], "common": 1}]
    out["tensors"] = [{"name": "w", "counts": {"/m/A": [1, 0, 1], "/m/B": [1, 0, 1]}}]
    return out


def planned_report() -> dict:
    """What `report.build` gives for the same plan before anything is counted."""
    planned = copy.deepcopy(recorded_report())
    planned["agents"][0].update(rho=None, rho_source=None)
    return planned


def write_report(folder, report) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "ram_stats.json").write_text(report if isinstance(report, str) else json.dumps(report))


# ---------------------------------------------------------------- ram_stats.json


def test_read_report_gives_a_ramplus_report(tmp_path):
    write_report(tmp_path / "o", recorded_report())
    assert record_checks.read_report(str(tmp_path / "o")) == recorded_report()
    assert record_checks.READABLE == (1, 2, 3, 4)
    for version in record_checks.READABLE:
        write_report(tmp_path / "o", old_report(version) if version < 4 else recorded_report())
        assert record_checks.read_report(str(tmp_path / "o"))["format_version"] == version


def test_a_report_written_before_labels_is_read_in_the_labelled_shape(tmp_path):
    """Formats 1 to 3 (mergekit-ram 0.1.0 up to 4a22594) named each input by its path in every table; read, they
    have an inputs table and labels (as a merge labels the same inputs now), their numbers and identities unchanged."""
    write_report(tmp_path / "o", old_report(3))
    found = record_checks.read_report(str(tmp_path / "o"))
    want = recorded_report(format_version=3, pairs=[{"agents": ["A", "B"], "common": 1}],
                           tensors=[{"name": "w", "counts": {"A": [1, 0, 1], "B": [1, 0, 1]}}])  # fmt: skip
    assert found == want
    assert [tuple(row) for row in record_checks.recorded_inputs(found)] == [
        ("base", "/m/base", "base", {"content_id": HASH}),
        ("A", "/m/A", "agent", {"content_id": HASH, "revision": "r1"}),
        ("B", "/m/B", "agent", {}),
    ]


def test_read_report_usage_errors(tmp_path):
    with pytest.raises(NotVerifiable, match="no such folder"):
        record_checks.read_report(str(tmp_path / "nowhere"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotVerifiable, match="not a folder"):
        record_checks.read_report(str(tmp_path / "f"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotVerifiable, match=r"holds no ram_stats\.json: not the output of a finished ramplus merge"):
        record_checks.read_report(str(tmp_path / "empty"))
    for report, named in [
        ({"format": "something/else"}, "was not written by mergekit-ram"),
        ([1, 2], "was not written by mergekit-ram"),
        (recorded_report(method="ties"), "describes a 'ties' merge; verify checks ramplus merges"),
        (recorded_report(format_version=99), "has format_version 99; this mergekit-ram reads 1, 2, 3, 4"),
    ]:
        write_report(tmp_path / "o", report)
        with pytest.raises(NotVerifiable, match=named):
            record_checks.read_report(str(tmp_path / "o"))


@pytest.mark.parametrize(
    "content, named",
    [
        ('{"format": ', "is not valid JSON"),
        (recorded_report(agents=None), "has no 'agents'"),
        (recorded_report(parameters=[]), "has no 'parameters'"),
        (recorded_report(inputs=None), "has no 'inputs'"),
        (recorded_report(base_model="other"), "its inputs table does not name the base and the agents"),
        (recorded_report(agents=[{"label": "A"}]), "its inputs table does not name the base and the agents"),
    ],
)
def test_read_report_data_errors(tmp_path, content, named):
    write_report(tmp_path / "o", content)
    with pytest.raises(Unreadable, match=named):
        record_checks.read_report(str(tmp_path / "o"))
    assert not issubclass(Unreadable, NotVerifiable) and not issubclass(NotVerifiable, Unreadable)


def test_read_merge_record_of_each_format_version():
    report = recorded_report()
    found = record_checks.read_merge_record(report)
    assert found == report["merge"] and found is not report["merge"]  # a copy
    older = recorded_report(format_version=2)
    del older["merge"]
    assert record_checks.read_merge_record(older) == {"entry_point": "run_merge"}


# ---------------------------------------------------------------- the folder's weight files


def test_damaged_weight_file_names_the_first_one(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    assert record_checks.damaged_weight_file(str(tmp_path)) is None
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    (tmp_path / "notes.txt").write_text("not weights")
    found = record_checks.damaged_weight_file(str(tmp_path))
    assert found is not None and found.startswith(str(tmp_path / "model-00002-of-00002.safetensors") + ": ")
    assert "\n" not in found


def test_stray_tensors_are_those_the_index_maps_elsewhere(tmp_path):
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.ones(2), "c": torch.zeros(2)}, str(tmp_path / "two.safetensors"))
    indexed = {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors", "d": "model.bin"}
    assert record_checks.stray_tensors(str(tmp_path), indexed) == {
        "b": "in one.safetensors, which the index does not name for it"
    }
    assert record_checks.stray_tensors(str(tmp_path), {"a": "gone.safetensors"}) == {}  # reading names it


# ---------------------------------------------------------------- the plan against the record


def test_a_plan_of_the_recorded_merge_has_no_mismatch():
    assert record_checks.plan_mismatches(recorded_report(), planned_report()) == []
    # numbers by value, inf as ram_stats.json writes it, lists in any order
    recorded = recorded_report(parameters={"r": 1, "epsilon": "inf"}, per_tensor_parameters={"r": [0.5, 1]})
    planned = planned_report()
    planned.update(parameters={"r": 1.0, "epsilon": math.inf}, per_tensor_parameters={"r": [1.0, 0.5]})
    assert record_checks.plan_mismatches(recorded, planned) == []


def test_each_edit_of_the_plan_is_one_line():
    planned = planned_report()
    planned["parameters"]["r"] = 0.3
    planned["per_tensor_parameters"] = {"alpha": [0.1, 0.2]}
    planned["agents"][1]["rho_source"] = None
    planned["tied_counted_once"] = {"lm_head.weight": "model.embed_tokens.weight"}
    assert record_checks.plan_mismatches(recorded_report(), planned) == [
        "r: mergekit_config.yml plans 0.3, ram_stats.json records 0.1",
        "alpha per tensor: mergekit_config.yml plans [0.1, 0.2], ram_stats.json records one value",
        "rho of B: mergekit_config.yml gives none (counted), ram_stats.json records 0.5 given",
        "tied tensors counted once: mergekit_config.yml plans {'lm_head.weight': 'model.embed_tokens.weight'}, "
        "ram_stats.json records none",
    ]
    planned = planned_report()
    planned["agents"][0].update(rho=0.7, rho_source="given")
    assert record_checks.plan_mismatches(recorded_report(), planned, source="the recorded config") == [
        "rho of A: the recorded config gives 0.7, ram_stats.json records it counted"
    ]


def test_other_inputs_are_named_once():
    planned = planned_report()
    planned["inputs"]["base"]["model"] = "/other/base"  # the same label, another input: still a mismatch
    planned["agents"].reverse()
    assert record_checks.plan_mismatches(recorded_report(), planned) == [
        "base model: mergekit_config.yml plans /other/base, ram_stats.json records /m/base",
        "agents: mergekit_config.yml plans /m/B, /m/A; ram_stats.json records /m/A, /m/B",
    ]


def test_rho_recomputed_against_the_record():
    recorded = recorded_report()
    assert record_checks.rho_mismatches(recorded, recorded_report()) == []
    recomputed = recorded_report(rho_by_group={"g0": {"A": 0.3, "B": 0.5}, "g1": {"A": 0.1, "B": 0.5}})
    recomputed["agents"][0]["rho"] = 0.3
    assert record_checks.rho_mismatches(recorded, recomputed) == [
        "rho of A: recomputed 0.3, ram_stats.json records 0.25",
        "rho by group differs from ram_stats.json's for 2 group(s), first g0",
    ]
    del recomputed["rho_by_group"]  # a scope without groups: nothing to compare
    assert len(record_checks.rho_mismatches(recorded, recomputed)) == 1


# ---------------------------------------------------------------- inputs and versions


def test_identity_found_against_the_recorded_one():
    recorded = {"content_id": HASH, "revision": "r1"}
    check = record_checks.check_identity("A", "agent", recorded, dict(recorded))
    assert (check.status, check.detail, check.line()) == ("same", None, "input A (agent): same")
    labelled = record_checks.check_identity("/m/A", "agent", recorded, dict(recorded), label="A")
    assert labelled.line() == "input A (/m/A, agent): same" and labelled.as_json()["label"] == "A"
    check = record_checks.check_identity("A", "agent", recorded, {"content_id": "cd" * 32, "revision": "r1"})
    assert check.status == "changed"
    assert check.line() == f"input A (agent) changed: content_id {'cd' * 8}… now, {'ab' * 8}… recorded"
    check = record_checks.check_identity("A", "agent", recorded, {"content_id": HASH})
    assert check.detail == "revision none now, r1 recorded"
    check = record_checks.check_identity("B", "agent", {}, {"content_id": HASH})
    assert check.status == "not recorded" and check.as_json() == {
        "label": "B",
        "model": "B",
        "role": "agent",
        "status": "not recorded",
        "recorded": {},
        "found": {"content_id": HASH},
        "detail": None,
    }
    gone = record_checks.InputCheck("A", "base", "missing", recorded, None, "no such folder: /x")
    assert gone.line() == "input A (base) cannot be read: no such folder: /x" and gone.as_json()["found"] is None


def test_recorded_inputs_are_the_base_then_the_agents():
    assert record_checks.recorded_inputs(recorded_report()) == [
        ("base", "/m/base", "base", {"content_id": HASH}),
        ("A", "/m/A", "agent", {"content_id": HASH, "revision": "r1"}),
        ("B", "/m/B", "agent", {}),
    ]
    assert record_checks.recorded_labels(recorded_report(), {"/copy/of/A": "/m/A"}) == {
        "/m/base": "base", "/m/A": "A", "/m/B": "B", "/copy/of/A": "A",
    }


def test_versions_other_than_the_recorded_ones_are_noted():
    installed = {"mergekit": "0.1.5", "torch": "2.14.0", "mergekit-ram": "9.9"}
    assert record_checks.version_notes(recorded_report(), installed) == [
        "torch 2.14.0 is installed; the merge was made with 2.13.0 (a difference may come from that)"
    ]
    assert record_checks.version_notes(recorded_report(versions=None), installed) == []


# ---------------------------------------------------------------- the record as evidence (issue 29)


def test_recorded_options_apply_no_code_option_without_the_users_flag():
    from mergekit.options import MergeOptions

    from mergekit_ram.reporting import report

    record = {"options": {"trust_remote_code": True, "lazy_unpickle": True, "allow_crimes": True}}
    options, notes, refused = record_checks.recorded_options(record, MergeOptions(), False, report.RECORDED_OPTIONS)
    assert options is None and "records trust_remote_code: true" in refused and "--trust-remote-code" in refused
    options, notes, refused = record_checks.recorded_options(record, MergeOptions(), True, report.RECORDED_OPTIONS)
    assert refused is None and options.trust_remote_code and options.allow_crimes and not options.lazy_unpickle
    assert notes == ["ram_stats.json records lazy_unpickle: true; verify reads pickles weights-only instead (the same tensors)"]
    # the user's flag alone asks for nothing the record does not
    options, _, _ = record_checks.recorded_options({"options": {}}, MergeOptions(), True, report.RECORDED_OPTIONS)
    assert not options.trust_remote_code
    with pytest.raises(Unreadable, match="the merge record's options are not mergekit's \\(lora_merge_dtype\\)"):
        record_checks.recorded_options({"options": {"lora_merge_dtype": {"x": 1}}}, MergeOptions(), False,
                                       report.RECORDED_OPTIONS)  # fmt: skip


def test_local_copies_name_recorded_inputs_only(tmp_path):
    report = recorded_report()
    assert local_copies(report, {"/m/A": str(tmp_path)}) == {"/m/A": str(tmp_path)}
    assert local_copies(report, {"A": str(tmp_path)}) == {"/m/A": str(tmp_path)}  # by label
    with pytest.raises(NotVerifiable, match="records no input Q \\(it records base \\(/m/base\\), A \\(/m/A\\)"):
        local_copies(report, {"Q": str(tmp_path)})


def test_input_pairs_split_after_a_recorded_name_holding_an_equals_sign(tmp_path):
    """A sweep's folder (Hydra: `runs/lr=1e-5,seed=1/agent`) is a recorded name with `=` in it (issue 39, case 6)."""
    sweep = "runs/lr=1e-5,seed=1/agent"
    report = recorded_report()
    report["inputs"]["A"]["model"] = sweep
    copy_ = tmp_path / "a=copy"
    assert local_copies(report, [f"{sweep}={copy_}"]) == {sweep: str(copy_)}
    assert local_copies(report, [f"B={copy_}"]) == {"/m/B": str(copy_)}  # split at the first = otherwise
    with pytest.raises(NotVerifiable, match="records no input runs/lr"):
        local_copies(report, [f"runs/lr=1e-5,seed=2/agent={copy_}"])
    with pytest.raises(NotVerifiable, match="expected RECORDED=LOCAL"):
        local_copies(report, ["no-equals-sign"])


def test_input_pairs_refuse_one_input_mapped_twice(tmp_path):
    report = recorded_report()
    with pytest.raises(NotVerifiable, match=f"--input maps A twice \\({tmp_path}/x and {tmp_path}/y\\)"):
        local_copies(report, [f"A={tmp_path}/x", f"A={tmp_path}/y"])
    with pytest.raises(NotVerifiable, match=f"--input maps A twice \\({tmp_path}/x and {tmp_path}/y\\)"):
        local_copies(report, [f"/m/A={tmp_path}/x", f"A={tmp_path}/y"])  # its name, then its label
    report["inputs"]["B"]["model"] = "A=b"  # "A=b=c" could be either input
    with pytest.raises(NotVerifiable, match="begins with two recorded inputs, A and A=b"):
        local_copies(report, ["A=b=c"])


def test_inputs_from_maps_every_input_recorded_under_a_folder(tmp_path):
    """Issue 40, item 4: four inputs under /home/alice/private-runs took four long --input flags."""
    report = recorded_report()
    assert local_copies(report, parents=[f"/m={tmp_path}/copies"]) == {
        "/m/base": f"{tmp_path}/copies/base", "/m/A": f"{tmp_path}/copies/A", "/m/B": f"{tmp_path}/copies/B",
    }
    assert local_copies(report, parents=[f"/m/={tmp_path}/c/"]) == local_copies(report, parents=[f"/m={tmp_path}/c"])
    # combined with --input for the rest; a parent holding "=" (a sweep's folder) is split where the record says
    report["inputs"]["A"]["model"] = "/runs/lr=1e-5/A"
    found = local_copies(report, [f"base={tmp_path}/b"], parents=[f"/runs/lr=1e-5={tmp_path}/sweep"])
    assert found == {"/m/base": f"{tmp_path}/b", "/runs/lr=1e-5/A": f"{tmp_path}/sweep/A"}
    with pytest.raises(NotVerifiable, match="no recorded input lies under /elsewhere \\(they are: /m/base, "):
        local_copies(report, parents=[f"/elsewhere={tmp_path}"])
    with pytest.raises(NotVerifiable, match="expected RECORDED_PARENT=LOCAL_PARENT"):
        local_copies(report, parents=["/m"])
    with pytest.raises(NotVerifiable, match=f"--input base={tmp_path}/b and --inputs-from /m={tmp_path} both map /m/base"):
        local_copies(report, [f"base={tmp_path}/b"], parents=[f"/m={tmp_path}"])


def test_input_dir_reads_the_copies_named_by_label(tmp_path):
    report = recorded_report()
    (tmp_path / "copies" / "A").mkdir(parents=True)
    (tmp_path / "copies" / "base").mkdir()
    assert local_copies(report, folder=str(tmp_path / "copies")) == {
        "/m/base": str(tmp_path / "copies" / "base"), "/m/A": str(tmp_path / "copies" / "A"),
    }  # B has no copy there: read as recorded
    with pytest.raises(NotVerifiable, match="holds no copy named by an input's label \\(base, A, B\\)"):
        local_copies(report, folder=str(tmp_path))
    with pytest.raises(NotVerifiable, match="both map /m/A"):
        local_copies(report, [f"A={tmp_path}/x"], folder=str(tmp_path / "copies"))
    report["inputs"]["../../outside"] = report["inputs"].pop("B")  # a stranger's label may lead out
    report["agents"][1]["label"] = "../../outside"
    (tmp_path / "outside").mkdir()
    assert "/m/B" not in local_copies(report, folder=str(tmp_path / "copies"))


def test_a_copy_is_checked_by_its_content_not_where_it_came_from():
    recorded = {"content_id": HASH, "revision": "r1"}
    assert record_checks.check_identity("A", "agent", recorded, {"content_id": HASH}, copy="/local/A").status == "same"
    changed = record_checks.check_identity("A", "agent", recorded, {"content_id": "cd" * 32}, copy="/local/A")
    assert changed.status == "changed" and changed.detail.startswith("the copy /local/A: content_id ")
    assert record_checks.check_identity("A", "agent", recorded, {"content_id": HASH}).status == "changed"  # revision


def test_as_recorded_reaches_every_label():
    found = {"agents": [{"model": "now"}], "pairs": [{"agents": ["now", "B"]}], "tensors": [{"counts": {"now": [1]}}]}
    assert record_checks.as_recorded(found, {"now": "was"}) == {
        "agents": [{"model": "was"}], "pairs": [{"agents": ["was", "B"]}], "tensors": [{"counts": {"was": [1]}}]
    }  # fmt: skip


# ---------------------------------------------------------------- folder_checks, loader_files: a stranger's files


def test_folder_checks_refuse_special_files_links_out_and_depth(tmp_path):
    import os

    from mergekit_ram.verify import folder_checks, loader_files

    (tmp_path / "ok.json").write_text('{"a": [1, {"b": 2}]}', encoding="utf-8")
    assert folder_checks.read_json(str(tmp_path), "ok.json") == {"a": [1, {"b": 2}]}
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(Unreadable, match="fifo.json is a FIFO: not read"):
        folder_checks.read_json(str(tmp_path), "fifo.json")
    (tmp_path / "out.json").symlink_to("/etc/hostname")
    with pytest.raises(Unreadable, match="out.json is a link out of"):
        folder_checks.read_json(str(tmp_path), "out.json")
    (tmp_path / "in.json").symlink_to(tmp_path / "ok.json")
    assert folder_checks.read_json(str(tmp_path), "in.json")["a"][0] == 1
    (tmp_path / "deep.json").write_text("[" * 65 + "]" * 65, encoding="utf-8")
    with pytest.raises(Unreadable, match="nests deeper than 64 levels"):
        folder_checks.read_json(str(tmp_path), "deep.json")
    (tmp_path / "big.json").write_bytes(b" " * 2049)
    with pytest.raises(Unreadable, match="larger than"):
        folder_checks.read_bytes(str(tmp_path), "big.json", limit=2048)
    with pytest.raises(Unreadable, match="fifo.json is a FIFO"):
        loader_files.check_files(str(tmp_path), {})


def test_hub_snapshot_links_into_blobs_are_read(tmp_path):
    from mergekit_ram.verify import folder_checks

    snapshot = tmp_path / "models--org--m" / "snapshots" / "abc123"
    blobs = tmp_path / "models--org--m" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_text('{"x": 1}', encoding="utf-8")
    (snapshot / "config.json").symlink_to("../../blobs/f00d")
    assert folder_checks.read_json(str(snapshot), "config.json") == {"x": 1}


@pytest.mark.parametrize(
    "present, mergekit, transformers, pickles",
    [
        (["model.safetensors"], "model.safetensors", "model.safetensors", None),
        (["model.safetensors.index.json"], "model.safetensors.index.json", "model.safetensors.index.json", None),
        (["model.safetensors", "model.safetensors.index.json"], "model.safetensors.index.json", "model.safetensors",
         None),
        (["pytorch_model.bin", "pytorch_model.bin.index.json"], "pytorch_model.bin.index.json", "pytorch_model.bin",
         "pytorch_model.bin"),
        (["pytorch_model.bin", "model.safetensors"], "model.safetensors", "model.safetensors", "pytorch_model.bin"),
        (["pytorch_model.bin.index.json", "model.safetensors"], "model.safetensors", "model.safetensors",
         "pytorch_model.bin.index.json"),
    ],
)  # fmt: skip
def test_which_weight_files_each_loader_reads(tmp_path, present, mergekit, transformers, pickles):
    """mergekit's from_disk, transformers' from_pretrained, and from_pretrained with use_safetensors=False."""
    from mergekit_ram.verify import loader_files

    for name in present:
        (tmp_path / name).write_text("{}", encoding="utf-8")
    expected = {"mergekit": mergekit, "transformers": transformers}
    if pickles:
        expected[loader_files.PICKLES] = pickles
    assert loader_files.loader_choices(str(tmp_path)) == expected


def test_report_differences_name_each_leaf_but_versions_and_identities():
    from mergekit_ram.verify import published_checks

    was = recorded_report()
    now = copy.deepcopy(was)
    now["agents"][0]["rho"] = 0.3
    now["versions"] = {"mergekit": "9"}
    now["agents"][0]["identity"] = {}
    assert published_checks.report_differences(was, now) == ["agents[0].rho: ram_stats.json records 0.25, recomputed 0.3"]


def test_report_differences_take_diagnostic_sums_to_their_rounding_and_all_else_exactly():
    """Another kernel, device or thread count adds a diagnostic's float64 sum in another order: its last bits may
    differ (verify on a machine without the compiled kernel did report an honest float32 merge as differing). Such
    a sum is the same within SUM_TOLERANCE of its scale; a larger change, and any count or rho, is a difference."""
    from mergekit_ram.verify import published_checks

    tol = published_checks.SUM_TOLERANCE
    was = {
        "agents": [{"magnitude_unique": 2.0, "magnitude_shared": 4.0, "magnitude_unique_share": 1 / 3, "rho": 0.25,
                    "active": 7}],
        "pairs": [{"agents": ["a", "b"], "cosine": 1e-4, "common": 3}],
        "tensors": [{"diagnostics": {"magnitude": {"a": [2.0, 4.0]}, "pairs": [["a", "b", 3, 2, 1e-6, 4.0, 9.0]]}}],
    }
    rounding = copy.deepcopy(was)
    rounding["agents"][0].update(magnitude_unique=2.0 * (1 + tol / 2), magnitude_shared=4.0 * (1 - tol / 2),
                                 magnitude_unique_share=1 / 3 + tol / 2)
    rounding["pairs"][0]["cosine"] = 1e-4 - tol / 2
    rounding["tensors"][0]["diagnostics"]["magnitude"]["a"] = [2.0 + tol, 4.0 - 2 * tol]
    rounding["tensors"][0]["diagnostics"]["pairs"][0][4:] = [1e-6 + 5 * tol, 4.0 + 2 * tol, 9.0 - 4 * tol]
    assert published_checks.report_differences(was, rounding) == []

    def changed(edit) -> list[str]:
        now = copy.deepcopy(was)
        edit(now)
        return published_checks.report_differences(was, now)

    pair = "tensors[0].diagnostics.pairs[0]"
    assert [line.split(":")[0] for line in changed(lambda r: r["tensors"][0]["diagnostics"]["pairs"][0].__setitem__(
        4, 1e-6 + 7 * tol))] == [f"{pair}[4]"]  # beyond sqrt(4 * 9) = 6 times the tolerance
    assert changed(lambda r: r["pairs"][0].__setitem__("cosine", 1e-4 + 2 * tol))
    assert changed(lambda r: r["agents"][0].__setitem__("magnitude_unique", 2.0 * (1 + 2 * tol)))
    assert changed(lambda r: r["agents"][0].__setitem__("rho", 0.25 * (1 + tol / 10)))  # not a sum: exact
    assert changed(lambda r: r["agents"][0].__setitem__("active", 8))
    assert changed(lambda r: r["pairs"][0].__setitem__("common", 4))
    assert changed(lambda r: r["tensors"][0]["diagnostics"]["pairs"][0].__setitem__(2, 4))
    assert changed(lambda r: r["agents"][0].__setitem__("magnitude_unique", "2.0"))  # a string is not a float
