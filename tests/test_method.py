"""End to end through mergekit's own run_merge: `merge_method: ramplus` on tiny checkpoints.

Every merged tensor is compared with the float64 reference (tests/reference.py)
up to the single output rounding; statistics from the pre-pass are compared with
the reference and with the closed form of the planted index sets.
"""

from __future__ import annotations

import logging
import math

import models
import pytest
import reference as R
import torch
from helpers import (
    DTYPE_OF,
    check_against_reference,
    config_text,
    inputs_of,
    no_nan_written,
    no_weights_written,
    stat_of,
    stats_by_path,
)

BF16 = torch.bfloat16
@pytest.fixture(scope="module", autouse=True)
def input_snapshot(qwen_bf16, llama_tied, llama_sharded, qwen_fp32):
    """Every input folder's files (size, mtime) before this module runs."""
    folders = [p for w in (qwen_bf16, llama_tied, llama_sharded, qwen_fp32) for p in w.paths.values()]
    return folders, models.snapshot(folders)


# ---------------------------------------------------------------- set-up


@pytest.mark.quick
def test_ramplus_is_registered_and_prepass_installed():
    from mergekit.merge_methods import registered_methods
    from mergekit.plan import MergePlanner

    assert "ramplus" in {m.spec.name for m in registered_methods()}
    assert getattr(MergePlanner._plan, "__mergekit_ram_prepass__", False)


# ---------------------------------------------------------------- values and statistics

CASES = [
    ("qwen_bf16", "ABC"),  # untied, q/k/v biases, 3 agents, C has no unique entry
    ("qwen_bf16", "AB"),  # 2 agents, partial overlap
    ("qwen_bf16", "AD"),  # disjoint supports: everything unique, rho = 0, lambda = 1
    ("qwen_bf16", "AE"),  # identical supports: everything shared, both rho = inf
    ("qwen_bf16", "A"),  # a single agent
    ("llama_tied", "ABC"),  # tied embeddings: lm_head neither written nor counted
    ("llama_sharded", "AB"),  # two shards + index for base and A, B single-file
    ("qwen_fp32", "ABC"),  # float32 checkpoints, merged in float32
]


@pytest.mark.quick
@pytest.mark.parametrize("fixture, agents", CASES)
def test_merge_matches_reference(request, merged, fixture, agents):
    written = request.getfixturevalue(fixture)
    dtype = "float32" if written.family.dtype == torch.float32 else "bfloat16"
    run = merged(config_text(written, agents, dtype=dtype))
    base, agent_sds, _ = check_against_reference(run, written, agents, out_dtype=DTYPE_OF[dtype])
    if written.family.tied:
        assert "lm_head.weight" not in run.tensors
    # pre-pass statistics = reference = closed form from the planted index sets
    ref_stats = R.reference_stats(base, agent_sds, 1e-5, names=list(base))
    closed = written.family.expected_counts(list(agents))
    assert run.stats is not None and run.count_calls > 0
    got = stats_by_path(run.stats)
    for agent in agents:
        path = written.path(agent)
        rs = ref_stats[path]
        assert got[path] == (rs.active, rs.shared, rs.unique) == closed[agent], agent
        assert stat_of(run, path).rho == rs.rho
        assert stat_of(run, path).numel == sum(t.numel() for t in base.values())  # lm_head only if stored
    if agents == "AD":
        assert all(stat_of(run, written.path(a)).rho == 0 for a in agents)
    if agents == "AE":
        assert all(stat_of(run, written.path(a)).rho == math.inf for a in agents)
    assert dtype == run.config.get("dtype", run.config.get("torch_dtype"))


@pytest.mark.quick
def test_region_semantics_in_closed_form(merged, qwen_bf16):
    """Spot checks without the reference: unchanged entries keep the base bits,
    sub-threshold deltas are dropped, opposite deltas cancel, unique entries get
    lambda = 1 + r * clip(rho, 0, alpha) with the whole-model rho."""
    fam = qwen_bf16.family
    run = merged(config_text(qwen_bf16, "ABC"))
    counts = fam.expected_counts("ABC")
    lam = {}
    for agent, (active, shared, unique) in counts.items():
        rho = shared / unique if unique else math.inf
        lam[agent] = 1 + 0.1 * min(rho, 2.0)
    assert counts["C"][2] == 0 and lam["C"] == pytest.approx(1.2)
    assert 1.0 < lam["A"] < 1.2 and lam["B"] == pytest.approx(1.2)  # B is clipped, A is not
    exact = total = 0
    for name, regions in fam.regions.items():
        out = run.tensors[name].reshape(-1)
        base = fam.base[name].reshape(-1)
        touched = torch.zeros(base.numel(), dtype=torch.bool)
        for idx in regions.values():
            touched[idx] = True
        assert torch.equal(out[~touched], base[~touched]), name
        for region in ("SUB_A", "OPP"):
            idx = regions[region]
            assert torch.equal(out[idx], base[idx]), (name, region)
        for region, agent in (("A", "A"), ("MID_A", "A"), ("B", "B"), ("SUB_A_B", "B")):
            idx = regions[region]
            tau = fam.agents[agent][name].reshape(-1)[idx].double() - base[idx].double()
            expect = (base[idx].double() + lam[agent] * tau).to(BF16)
            diff = (out[idx].double() - expect.double()).abs()
            assert bool((diff <= R.ulp(expect, BF16)).all()), (name, region)
            exact += int((out[idx] == expect).sum())
            total += idx.numel()
    assert exact >= 0.99 * total


def test_base_listed_among_models_changes_nothing(merged, run_yaml, qwen_bf16):
    plain = merged(config_text(qwen_bf16, "AB"))
    listed = run_yaml(config_text(qwen_bf16, "AB", base_in_models=True))
    assert set(listed.tensors) == set(plain.tensors)
    for name in plain.tensors:
        assert torch.equal(listed.tensors[name], plain.tensors[name]), name
    assert stats_by_path(listed.stats) == stats_by_path(plain.stats)
    assert qwen_bf16.path("base") not in stats_by_path(listed.stats)


def test_slices_with_one_base_equal_models_syntax(merged, run_yaml, llama_sharded):
    w = llama_sharded
    slices = "\n".join(
        [
            "merge_method: ramplus",
            f"base_model: {w.path('base')}",
            "dtype: bfloat16",
            "slices:",
        ]
        + [
            line
            for lo, hi in ((0, 1), (1, 2))
            for line in (
                "  - sources:",
                *(f"      - model: {w.path(m)}\n        layer_range: [{lo}, {hi}]" for m in ("base", "A", "B")),
                f"    base_model: {w.path('base')}",
            )
        ]
    )
    by_slices = run_yaml(slices + "\n")
    by_models = merged(config_text(w, "AB"))
    assert stats_by_path(by_slices.stats) == stats_by_path(by_models.stats)
    assert set(by_slices.tensors) == set(by_models.tensors)
    for name in by_models.tensors:
        assert torch.equal(by_slices.tensors[name], by_models.tensors[name]), name


def test_identical_agent_warns_and_adds_nothing(run_yaml, qwen_bf16, caplog):
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(config_text(qwen_bf16, "ABZ"))
    z = qwen_bf16.path("Z")
    warnings = [r.getMessage() for r in caplog.records if r.name == "mergekit_ram" and r.levelno == logging.WARNING]
    assert any(m.startswith(f"ramplus: Z ({z}) changes no weight") and "identical" in m for m in warnings), warnings
    assert not any(qwen_bf16.path("A") in m and "identical" in m for m in warnings)
    assert stats_by_path(run.stats)[z] == (0, 0, 0)
    check_against_reference(run, qwen_bf16, "ABZ")


def test_epsilon_zero_counts_every_change(run_yaml, qwen_bf16):
    """epsilon 0: every bit change is active; an agent identical to the base gives
    0/0 counts and still no NaN (mergekit's ramplus_tl writes NaN there)."""
    run = run_yaml(config_text(qwen_bf16, "ABCZ", parameters="epsilon: 0"))
    base, agents, _ = check_against_reference(run, qwen_bf16, "ABCZ", eps=0.0)
    assert stats_by_path(run.stats)[qwen_bf16.path("Z")] == (0, 0, 0)
    closed = qwen_bf16.family.expected_counts("ABCZ", epsilon=0.0)
    assert stats_by_path(run.stats)[qwen_bf16.path("A")] == closed["A"]
    assert closed["A"] != qwen_bf16.family.expected_counts("ABCZ")["A"]  # the sub-threshold entries now count


# ---------------------------------------------------------------- r = 0 and user rho


def _forbid_count(monkeypatch):
    from mergekit_ram.core import kernel

    def refuse(*_a, **_k):
        raise AssertionError("the statistics pre-pass ran")

    monkeypatch.setattr(kernel, "count", refuse)
    monkeypatch.setattr(kernel, "diagnose", refuse)


def test_r_zero_is_mergekit_ram_in_float32(run_yaml, merged, qwen_bf16, monkeypatch):
    ram = merged(config_text(qwen_bf16, "ABC", method="ram", dtype="float32", out_dtype="bfloat16"))
    _forbid_count(monkeypatch)
    ours = run_yaml(config_text(qwen_bf16, "ABC", parameters="r: 0"))
    assert ours.stats is None and ours.count_calls == 0
    check_against_reference(ours, qwen_bf16, "ABC", r=0.0)
    total = differ = beyond_one_ulp = 0
    for name, theirs in ram.tensors.items():
        assert theirs.dtype == BF16
        mine = ours.tensors[name]
        total += mine.numel()
        ne = mine != theirs
        differ += int(ne.sum())
        gap = (mine.double() - theirs.double()).abs()
        beyond_one_ulp += int((gap > R.ulp(theirs, BF16)).sum())
    print(f"r=0 vs mergekit ram (float32 -> bf16): {differ} of {total} entries differ, {beyond_one_ulp} by more than 1 ULP")
    assert beyond_one_ulp == 0
    assert differ <= 0.001 * total


def test_rho_for_every_agent_skips_prepass(run_yaml, qwen_bf16, monkeypatch):
    _forbid_count(monkeypatch)
    rho = {"A": "0.5", "B": "5", "C": "1e-1"}
    run = run_yaml(config_text(qwen_bf16, "ABC", model_parameters={k: f"rho: {v}" for k, v in rho.items()}))
    assert run.stats is None and run.count_calls == 0
    given = {qwen_bf16.path(k): float(v) for k, v in rho.items()}
    check_against_reference(run, qwen_bf16, "ABC", rho=given)
    # and they matter: the computed rho of A (1.44) gives another result
    computed = R.reference_merge(*inputs_of(qwen_bf16, "ABC"))
    assert any(
        not torch.equal(run.tensors[n], computed[n].to(BF16)) for n in run.tensors
    )


def test_rho_for_some_agents_wins_over_prepass(run_yaml, qwen_bf16):
    run = run_yaml(config_text(qwen_bf16, "ABC", model_parameters={"A": "rho: 0.25"}))
    assert run.stats is not None and run.count_calls > 0
    base, agents = inputs_of(qwen_bf16, "ABC")
    ref_stats = R.reference_stats(base, agents)
    assert stats_by_path(run.stats)[qwen_bf16.path("B")][2] == ref_stats[qwen_bf16.path("B")].unique
    check_against_reference(run, qwen_bf16, "ABC", rho={qwen_bf16.path("A"): 0.25})


def test_per_tensor_epsilon_and_r_from_filters(run_yaml, qwen_bf16):
    params = "\n".join(
        [
            "epsilon:",
            "  - filter: mlp",
            "    value: 1e-3",
            "  - value: 1e-5",
            "r:",
            "  - filter: self_attn",
            "    value: 0.3",
            "  - value: 0.1",
        ]
    )
    run = run_yaml(config_text(qwen_bf16, "ABC", parameters=params))

    def eps(name):
        return 1e-3 if "mlp" in name else 1e-5

    def r(name):
        return 0.3 if "self_attn" in name else 0.1

    base, agents = inputs_of(qwen_bf16, "ABC")
    ref_stats = R.reference_stats(base, agents, eps)
    flat_stats = R.reference_stats(base, agents, 1e-5)
    assert {p: (s.active, s.shared, s.unique) for p, s in ref_stats.items()} == stats_by_path(run.stats)
    assert ref_stats[qwen_bf16.path("A")] != flat_stats[qwen_bf16.path("A")]  # the filter matters
    check_against_reference(run, qwen_bf16, "ABC", eps=eps, r=r)


# ---------------------------------------------------------------- output dtype


@pytest.mark.parametrize(
    "fixture, dtype, out_dtype, expected",
    [
        ("qwen_bf16", "bfloat16", None, "bfloat16"),
        ("qwen_fp32", "float32", "bfloat16", "bfloat16"),
        ("qwen_fp32", None, "bfloat16", "bfloat16"),
        ("qwen_bf16", "float32", None, "float32"),
        ("qwen_bf16", "bfloat16", "float32", "float32"),
        ("qwen_fp32", None, None, "float32"),
    ],
)
def test_output_dtype(request, merged, fixture, dtype, out_dtype, expected):
    written = request.getfixturevalue(fixture)
    run = merged(config_text(written, "ABC", dtype=dtype, out_dtype=out_dtype))
    cast = DTYPE_OF[dtype] if dtype else None
    check_against_reference(run, written, "ABC", cast=cast, out_dtype=DTYPE_OF[expected])
    if cast is not None and cast.itemsize < DTYPE_OF[expected].itemsize:  # not rounded to `dtype` first
        merged = torch.cat([t.reshape(-1) for t in run.tensors.values()])
        assert not torch.equal(merged.to(cast).to(merged.dtype), merged)
    assert run.config.get("dtype", run.config.get("torch_dtype")) == expected
    if "torch_dtype" in run.config and "dtype" in run.config:
        assert run.config["torch_dtype"] == run.config["dtype"]


def test_downcasting_fp32_checkpoints_warns(run_yaml, qwen_fp32, caplog):
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(config_text(qwen_fp32, "AB", dtype="bfloat16"))
    messages = [r.getMessage() for r in caplog.records if r.name == "mergekit_ram"]
    assert any("bfloat16" in m and "rounds the stored weights" in m and qwen_fp32.path("A") in m for m in messages), messages
    # masks and merge both see the bf16-rounded tensors
    check_against_reference(run, qwen_fp32, "AB", cast=BF16)
    base, agents = inputs_of(qwen_fp32, "AB", cast=BF16)
    ref_stats = R.reference_stats(base, agents)
    assert stats_by_path(run.stats) == {p: (s.active, s.shared, s.unique) for p, s in ref_stats.items()}


def test_no_downcast_warning_in_float32(run_yaml, qwen_fp32, caplog):
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run_yaml(config_text(qwen_fp32, "AB", dtype="float32"))
    assert not [r for r in caplog.records if r.name == "mergekit_ram" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name, parameters, model_parameters",
    [
        ("epsilon", "epsilon: -1e-5", None),
        ("epsilon", "epsilon: .nan", None),
        ("r", "r: -0.1", None),
        ("r", "r: .inf", None),
        ("alpha", "alpha: -2", None),
        ("rho", "", {"B": "rho: -1"}),
    ],
)
@pytest.mark.quick
def test_invalid_parameters_fail_at_plan_time(
    run_yaml, qwen_bf16, monkeypatch, tmp_path, name, parameters, model_parameters
):
    _forbid_count(monkeypatch)
    text = config_text(qwen_bf16, "AB", parameters=parameters, model_parameters=model_parameters)
    with pytest.raises(Exception) as info:
        run_yaml(text, out=tmp_path)
    assert f"parameter '{name}'" in str(info.value), str(info.value)
    assert "the statistics pre-pass ran" not in str(info.value)
    no_weights_written(tmp_path)


@pytest.mark.quick
def test_missing_base_model_is_an_error(qwen_bf16, run_yaml, tmp_path):
    text = "\n".join(
        ["merge_method: ramplus", "dtype: bfloat16", "models:"]
        + [f"  - model: {qwen_bf16.path(a)}" for a in ("base", "A", "B")]
    )
    with pytest.raises(Exception) as info:
        run_yaml(text + "\n", out=tmp_path)
    assert "base_model" in str(info.value)
    no_weights_written(tmp_path)


def test_two_slice_base_models_are_an_error(llama_sharded, run_yaml, tmp_path):
    w = llama_sharded
    text = "\n".join(
        [
            "merge_method: ramplus",
            "dtype: bfloat16",
            "slices:",
            "  - sources:",
            f"      - model: {w.path('base')}",
            "        layer_range: [0, 1]",
            f"      - model: {w.path('A')}",
            "        layer_range: [0, 1]",
            f"    base_model: {w.path('base')}",
            "  - sources:",
            f"      - model: {w.path('A')}",
            "        layer_range: [1, 2]",
            f"      - model: {w.path('B')}",
            "        layer_range: [1, 2]",
            f"    base_model: {w.path('A')}",
        ]
    )
    with pytest.raises(Exception) as info:
        run_yaml(text + "\n", out=tmp_path)
    message = str(info.value)
    assert "one base model" in message and w.path("base") in message and w.path("A") in message
    no_weights_written(tmp_path)


@pytest.mark.quick
@pytest.mark.parametrize("r", ["0.1", "0"], ids=["prepass", "merge"])
def test_nan_in_agent_names_tensor_and_model(qwen_bf16, run_yaml, tmp_path, r):
    from mergekit_ram.core.kernel import NonFiniteInputError

    text = config_text(qwen_bf16, ["B", "NAN"], parameters=f"r: {r}")
    with pytest.raises(NonFiniteInputError) as info:
        run_yaml(text, out=tmp_path)
    message = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in message and qwen_bf16.path("NAN") in message
    assert qwen_bf16.path("B") not in message
    no_nan_written(tmp_path)


def test_unbounded_alpha_is_rejected(run_yaml, qwen_bf16):
    """alpha = inf with an agent without unique entries would give lambda = inf."""
    with pytest.raises(Exception, match="alpha"):
        run_yaml(config_text(qwen_bf16, "ABC", parameters="alpha: .inf"))


def test_agent_stored_in_another_dtype_warns(run_yaml, qwen_bf16, tmp_path, caplog):
    """An fp32 copy of a bf16 agent (exact upcast): warned about, same masks."""
    fam = qwen_bf16.family
    a32 = models.write_checkpoint(
        tmp_path / "A32",
        models.make_config("qwen2", False, torch.float32),
        {k: v.float() for k, v in fam.agents["A"].items()},
    ).resolve()
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    text = config_text(qwen_bf16, "B", dtype=None).replace(
        "models:\n", f"models:\n  - model: {a32}\n", 1
    )
    run = run_yaml(text)
    messages = [r.getMessage() for r in caplog.records if r.name == "mergekit_ram"]
    assert any(str(a32) in m and "different dtype" in m for m in messages), messages
    # exact upcast: the statistics are those of the all-bf16 merge
    expected = fam.expected_counts("AB")
    got = stats_by_path(run.stats)
    assert got[str(a32)] == expected["A"] and got[qwen_bf16.path("B")] == expected["B"]


# ---------------------------------------------------------------- misc


def test_mergekit_yaml_cli_in_a_fresh_process(merged, qwen_bf16, tmp_path):
    """The console script, in a new interpreter: `ramplus` comes from the .pth hook alone."""
    import shutil
    import subprocess

    exe = shutil.which("mergekit-yaml")
    if exe is None:
        pytest.skip("mergekit-yaml is not on PATH")
    text = config_text(qwen_bf16, "ABC")
    (tmp_path / "config.yml").write_text(text)
    out = tmp_path / "out"
    proc = subprocess.run(
        [exe, str(tmp_path / "config.yml"), str(out), "--no-copy-tokenizer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAM+ statistics" in proc.stderr
    cli = models.load_checkpoint(out)
    inproc = merged(text).tensors
    assert set(cli) == set(inproc)
    for name in inproc:
        assert torch.equal(cli[name], inproc[name]), name


@pytest.mark.quick
def test_model_card_and_files(merged, qwen_bf16):
    run = merged(config_text(qwen_bf16, "ABC"))
    assert {"config.json", "model.safetensors", "README.md", "mergekit_config.yml"} <= set(run.files)
    assert "ramplus" in (run.out / "mergekit_config.yml").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_merge_equals_cpu(run_yaml, merged, qwen_bf16):
    text = config_text(qwen_bf16, "ABC")
    cpu = merged(text)
    gpu = run_yaml(text, cuda=True)
    assert stats_by_path(gpu.stats) == stats_by_path(cpu.stats)
    for name in cpu.tensors:
        assert torch.equal(gpu.tensors[name], cpu.tensors[name]), name


def test_statistics_order_changes_nothing(run_yaml, llama_sharded, monkeypatch):
    """The statistics pass counts in the reverse of the merge's order; the counts and the merge are the same."""
    from mergekit_ram.core import kernel

    order: list = []
    real = kernel.diagnose

    def recording(*args, **kwargs):
        order.append(kwargs.get("tensor_name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "diagnose", recording)
    text = config_text(llama_sharded, "AB")
    default = run_yaml(text)
    reversed_order = list(order)

    order.clear()
    monkeypatch.setenv("MERGEKIT_RAM_STATS_ORDER", "forward")
    plain = run_yaml(text)
    assert sorted(order) == sorted(reversed_order) and len(order) > 2
    assert order == sorted(order) and reversed_order[0] == max(order)  # forward: name order; default: last first
    assert stats_by_path(default.stats) == stats_by_path(plain.stats)
    assert set(default.tensors) == set(plain.tensors)
    for name in plain.tensors:
        assert torch.equal(default.tensors[name], plain.tensors[name]), name


def test_zz_input_folders_untouched(input_snapshot):
    """Runs last in this module: no file was written into, or changed in, any input folder."""
    folders, before = input_snapshot
    assert models.snapshot(folders) == before

