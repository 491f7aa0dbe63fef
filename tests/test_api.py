"""In-memory API (mergekit_ram.merge_state_dicts / agent_statistics) and mergekit's
per-tensor API with `ramplus`, against the float64 reference."""

from __future__ import annotations

import math

import models
import pytest
import reference as R
import torch
from torch import nn

import mergekit_ram
from mergekit_ram.core import kernel

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def fam():
    return models.Family("qwen2", tied=False, dtype=BF16, seed=11)


def agents_of(fam, who="ABC"):
    return {a: fam.agents[a] for a in who}


def forbid_count(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("statistics were recounted")

    monkeypatch.setattr(kernel, "count", refuse)


# ---------------------------------------------------------------- state dicts


@pytest.mark.quick
def test_merge_state_dicts_matches_reference(fam):
    agents = agents_of(fam)
    out = mergekit_ram.merge_state_dicts(fam.base, agents)
    ref = R.reference_merge(fam.base, agents)
    R.assert_state_dict_matches(out, ref, R.reference_magnitudes(fam.base, agents))
    assert all(t.dtype == BF16 for t in out.values())
    assert list(out) == list(fam.base)  # key order kept


@pytest.mark.quick
def test_agent_statistics_match_reference_and_closed_form(fam):
    agents = agents_of(fam)
    stats = mergekit_ram.agent_statistics(fam.base, agents)
    ref = R.reference_stats(fam.base, agents)
    closed = fam.expected_counts("ABC")
    numel = sum(t.numel() for t in fam.base.values())
    assert list(stats) == ["A", "B", "C"]
    for a in "ABC":
        s = stats[a]
        assert (s.active, s.shared, s.unique) == (ref[a].active, ref[a].shared, ref[a].unique) == closed[a]
        assert s.rho == ref[a].rho and s.numel == numel
        assert s.density == pytest.approx(s.active / numel)
    assert stats["C"].rho == math.inf and stats["C"].lambda_(0.1, 2.0) == pytest.approx(1.2)


def test_agents_as_list_or_dict(fam):
    as_dict = agents_of(fam, "AB")
    as_list = [fam.agents["A"], fam.agents["B"]]
    d = mergekit_ram.merge_state_dicts(fam.base, as_dict)
    l = mergekit_ram.merge_state_dicts(fam.base, as_list)  # noqa: E741
    assert all(torch.equal(d[k], l[k]) for k in d)
    sl = mergekit_ram.agent_statistics(fam.base, as_list)
    sd = mergekit_ram.agent_statistics(fam.base, as_dict)
    assert list(sl) == [0, 1]
    assert [(s.active, s.unique) for s in sl.values()] == [(s.active, s.unique) for s in sd.values()]


@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
def test_epsilon_is_applied(fam, epsilon):
    agents = agents_of(fam)
    stats = mergekit_ram.agent_statistics(fam.base, agents, epsilon=epsilon)
    ref = R.reference_stats(fam.base, agents, epsilon)
    assert {a: (s.active, s.unique) for a, s in stats.items()} == {a: (s.active, s.unique) for a, s in ref.items()}
    out = mergekit_ram.merge_state_dicts(fam.base, agents, epsilon=epsilon, r=0.2, alpha=1.0)
    R.assert_state_dict_matches(
        out, R.reference_merge(fam.base, agents, epsilon, 0.2, 1.0), R.reference_magnitudes(fam.base, agents)
    )


def test_out_dtype(fam):
    agents = agents_of(fam)
    out = mergekit_ram.merge_state_dicts(fam.base, agents, out_dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in out.values())
    R.assert_state_dict_matches(out, R.reference_merge(fam.base, agents), R.reference_magnitudes(fam.base, agents))


def test_identical_agent_is_harmless(fam):
    agents = agents_of(fam, "ABZ")
    stats = mergekit_ram.agent_statistics(fam.base, agents)
    assert (stats["Z"].active, stats["Z"].unique) == (0, 0) and stats["Z"].rho == math.inf
    out = mergekit_ram.merge_state_dicts(fam.base, agents)
    R.assert_state_dict_matches(out, R.reference_merge(fam.base, agents), R.reference_magnitudes(fam.base, agents))


def test_inputs_are_not_modified(fam):
    agents = agents_of(fam)
    before = {k: v.clone() for k, v in fam.base.items()}
    out = mergekit_ram.merge_state_dicts(fam.base, agents)
    assert all(torch.equal(fam.base[k], before[k]) for k in before)
    assert all(out[k].data_ptr() != fam.base[k].data_ptr() for k in out)


# ---------------------------------------------------------------- rho sweep


def test_rho_sweep_counts_once(fam, monkeypatch):
    agents = agents_of(fam)
    fresh = {r: mergekit_ram.merge_state_dicts(fam.base, agents, r=r) for r in (0.0, 0.05, 0.1, 0.2)}
    stats = mergekit_ram.agent_statistics(fam.base, agents)
    rho = {a: s.rho for a, s in stats.items()}
    forbid_count(monkeypatch)
    for r, expected in fresh.items():
        swept = mergekit_ram.merge_state_dicts(fam.base, agents, r=r, rho=rho)
        assert all(torch.equal(swept[k], expected[k]) for k in expected), r
    as_list = mergekit_ram.merge_state_dicts(fam.base, agents, r=0.1, rho=[rho["A"], rho["B"], rho["C"]])
    assert all(torch.equal(as_list[k], fresh[0.1][k]) for k in as_list)


def test_user_rho_wins_and_missing_ones_are_computed(fam):
    agents = agents_of(fam)
    out = mergekit_ram.merge_state_dicts(fam.base, agents, rho={"A": 0.3})
    ref = R.reference_merge(fam.base, agents, rho={"A": 0.3})
    R.assert_state_dict_matches(out, ref, R.reference_magnitudes(fam.base, agents))
    plain = mergekit_ram.merge_state_dicts(fam.base, agents)
    assert any(not torch.equal(out[k], plain[k]) for k in out)


def test_r_zero_needs_no_statistics(fam, monkeypatch):
    agents = agents_of(fam)
    forbid_count(monkeypatch)
    out = mergekit_ram.merge_state_dicts(fam.base, agents, r=0)
    R.assert_state_dict_matches(out, R.reference_merge(fam.base, agents, r=0.0), R.reference_magnitudes(fam.base, agents))


# ---------------------------------------------------------------- modules, tied weights, buffers


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("step", torch.tensor([7], dtype=torch.int64))


def tiny(seed):
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.empty_like(p).uniform_(0.1, 0.4) * torch.sign(torch.randn_like(p)))
    return m


def perturbed(base: Tiny, changes) -> Tiny:
    m = Tiny()
    m.load_state_dict(base.state_dict())
    with torch.no_grad():
        for name, entries in changes.items():
            flat = dict(m.named_parameters())[name].view(-1)
            for i, d in entries.items():
                flat[i] += d
    return m


def test_modules_with_tied_weights_and_buffers():
    base = tiny(0)
    a = perturbed(base, {"embed.weight": {0: 0.05, 1: 0.05, 2: -0.03}, "proj.weight": {5: 0.02}})
    b = perturbed(base, {"embed.weight": {1: -0.04, 9: 0.03}, "proj.bias": {0: 0.02, 1: 0.02}})
    # embed/head are one tensor: counted once (A: 4 active, 3 unique; B: 4 active, 3 unique)
    stats = mergekit_ram.agent_statistics(base, {"a": a, "b": b})
    assert (stats["a"].active, stats["a"].unique) == (4, 3)
    assert (stats["b"].active, stats["b"].unique) == (4, 3)
    assert stats["a"].numel == 16 * 8 + 8 * 8 + 8
    sds = [m.state_dict() for m in (base, a, b)]
    names = [k for k in sds[0] if k not in ("head.weight", "step")]
    ref_stats = R.reference_stats(sds[0], {"a": sds[1], "b": sds[2]}, names=names)
    assert {k: (s.active, s.unique) for k, s in ref_stats.items()} == {k: (s.active, s.unique) for k, s in stats.items()}
    out = mergekit_ram.merge_state_dicts(base, {"a": a, "b": b})
    assert set(out) == set(sds[0])
    ref = R.reference_merge(sds[0], {"a": sds[1], "b": sds[2]}, names=names)
    R.assert_state_dict_matches({k: out[k] for k in names}, ref, acc_ulps=4.0)
    assert torch.equal(out["head.weight"], out["embed.weight"])
    assert out["step"].dtype == torch.int64 and torch.equal(out["step"], torch.tensor([7]))
    assert not out["embed.weight"].requires_grad


def test_differing_non_float_buffer_is_an_error():
    base = tiny(0)
    a = perturbed(base, {"proj.weight": {0: 0.05}})
    a.step.fill_(8)
    with pytest.raises(ValueError, match="step.*'odd'|'odd'.*step"):
        mergekit_ram.merge_state_dicts(base, {"odd": a})


# ---------------------------------------------------------------- errors


def test_mismatched_keys_name_the_agent(fam):
    bad = dict(fam.agents["B"])
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="'B'.*model.norm.weight"):
        mergekit_ram.merge_state_dicts(fam.base, {"A": fam.agents["A"], "B": bad})
    extra = dict(fam.agents["A"], **{"extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="'A'.*extra.weight"):
        mergekit_ram.agent_statistics(fam.base, {"A": extra})


def test_nan_names_tensor_and_agent(fam):
    bad = {k: v.clone() for k, v in fam.agents["B"].items()}
    bad["model.layers.0.self_attn.k_proj.bias"][3] = float("nan")
    with pytest.raises(kernel.NonFiniteInputError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*bad-agent"):
        mergekit_ram.merge_state_dicts(fam.base, {"A": fam.agents["A"], "bad-agent": bad})
    with pytest.raises(kernel.NonFiniteInputError, match="bad-agent"):
        mergekit_ram.merge_state_dicts(fam.base, {"A": fam.agents["A"], "bad-agent": bad}, r=0)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"epsilon": -1e-5}, "epsilon"),
        ({"epsilon": float("nan")}, "epsilon"),
        ({"r": -0.1}, "r must"),
        ({"r": float("inf")}, "r must"),
        ({"alpha": -1.0}, "alpha"),
        ({"rho": {"A": -1.0}}, "rho"),
        ({"rho": [1.0]}, "rho"),
    ],
)
@pytest.mark.quick
def test_invalid_arguments(fam, kwargs, word):
    with pytest.raises(ValueError, match=word):
        mergekit_ram.merge_state_dicts(fam.base, agents_of(fam, "AB"), **kwargs)


def test_no_agents_is_an_error(fam):
    with pytest.raises(ValueError, match="agent"):
        mergekit_ram.merge_state_dicts(fam.base, [])


def test_wrong_input_type(fam):
    with pytest.raises(TypeError, match="base"):
        mergekit_ram.merge_state_dicts([1, 2], [fam.agents["A"]])


def test_unbounded_alpha_is_rejected(fam):
    """alpha = inf with an agent without unique entries would give lambda = inf."""
    with pytest.raises(ValueError, match="alpha"):
        mergekit_ram.merge_state_dicts(fam.base, agents_of(fam), alpha=math.inf)


# ---------------------------------------------------------------- mergekit's per-tensor API


@pytest.mark.quick
def test_mergekit_merge_tensors_needs_rho_unless_r_zero(fam):
    from mergekit.merge_methods import merge_tensors

    name = "model.layers.0.mlp.up_proj.weight"
    tensors = [fam.base[name]] + [fam.agents[a][name] for a in "ABC"]
    with pytest.raises(RuntimeError) as info:
        merge_tensors(tensors, "ramplus", base_index=0)
    message = str(info.value)
    assert "rho" in message and "r: 0" in message
    out = merge_tensors(tensors, "ramplus", base_index=0, parameters={"r": 0})
    sd = {name: fam.base[name]}
    agents = [{name: fam.agents[a][name]} for a in "ABC"]
    R.assert_rounded_equal(out, R.reference_merge(sd, agents, r=0.0)[name], R.reference_magnitudes(sd, agents)[name])
    # rho given for every input: RAM+ with those values
    out = merge_tensors(tensors, "ramplus", base_index=0, parameters={"rho": [0.5, 4.0, math.inf]})
    ref = R.reference_merge(sd, agents, rho={0: 0.5, 1: 4.0, 2: math.inf})[name]
    R.assert_rounded_equal(out, ref, R.reference_magnitudes(sd, agents)[name])


def test_mergekit_merge_state_dicts_with_r_zero_is_whole_model_ram(fam):
    from mergekit.merge_methods import merge_state_dicts

    models_ = {"base": fam.base, **agents_of(fam)}
    with pytest.raises(RuntimeError, match="rho"):
        merge_state_dicts(models_, "ramplus", base="base")
    out = merge_state_dicts(models_, "ramplus", base="base", parameters={"r": 0})
    ours = mergekit_ram.merge_state_dicts(fam.base, agents_of(fam), r=0)
    assert all(torch.equal(out[k], ours[k]) for k in ours)


def test_mergekit_merge_state_dicts_with_modules():
    from mergekit.merge_methods import merge_state_dicts

    base = tiny(0)
    a = perturbed(base, {"proj.weight": {0: 0.05, 3: 0.02}})
    b = perturbed(base, {"proj.weight": {0: -0.01}, "proj.bias": {2: 0.03}})
    out = merge_state_dicts({"base": base, "a": a, "b": b}, "ramplus", base="base", parameters={"r": 0})
    with torch.no_grad():
        ours = mergekit_ram.merge_state_dicts(base, {"a": a, "b": b}, r=0)
    for k in ours:
        assert torch.equal(out[k].detach(), ours[k]), k


# ---------------------------------------------------------------- discoverable, named as the JSON (issue 31)


@pytest.mark.quick
def test_the_api_is_discoverable_without_importing_torch():
    """`dir(mergekit_ram)` was empty of the API (it is loaded lazily); now `dir` lists `__all__`, each name
    resolves, and neither listing it nor starting Python imports torch or mergekit."""
    import subprocess
    import sys

    code = (
        "import sys, mergekit_ram; names = dir(mergekit_ram); "
        "assert 'torch' not in sys.modules and 'mergekit' not in sys.modules, 'imported at start-up'; "
        "print(' '.join(n for n in names if not n.startswith('_')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    public = set(done.stdout.split())
    assert public == {n for n in mergekit_ram.__all__ if not n.startswith("_")}
    assert {"merge_state_dicts", "agent_statistics", "AgentStats", "RamError", "ramplus"} <= public
    for name in mergekit_ram.__all__:
        assert getattr(mergekit_ram, name) is not None


def test_agent_stats_names_are_ram_stats_json_names(merged, qwen_bf16):
    """`AgentStats` had `pair` and `single` where `ram_stats.json` says `shared_with_1` and `single_step`: each
    per-agent number of the file is an attribute of the same name and value (`rho_counted` is `rho`), and the
    old names still work."""
    from helpers import config_text, number, read_stats, rows_by_model

    from mergekit_ram.core import statistics
    from mergekit_ram.reporting import report

    run = merged(config_text(qwen_bf16, "ABC"))
    stats = mergekit_ram.agent_statistics(
        qwen_bf16.stored("base"), {qwen_bf16.path(a): qwen_bf16.stored(a) for a in "ABC"}, epsilon=1e-5
    )
    for model, row in rows_by_model(read_stats(run.out)).items():
        s = stats[model]
        numbers = {k: v for k, v in row.items() if k not in ("label", "rho_source", "lambda", "rho")}
        for key, value in numbers.items():
            attribute = "rho" if key == "rho_counted" else key
            if getattr(s, attribute) is None:  # the API counts without diagnostics: the name is there
                assert key in report.AGENT_DIAGNOSTICS, key
                continue
            assert number(value) == pytest.approx(getattr(s, attribute), rel=1e-12), key
        assert {"shared_with_1", "single_step", "unique_share"} <= set(numbers)
        assert s.pair == s.shared_with_1 and s.single == s.single_step and s.lambda_(0.1, 2.0) == row["lambda"]
    diagnosed = statistics.AgentStats("a", active=10, unique=4, numel=100, pair=3, single=2)
    assert (diagnosed.single_step, diagnosed.shared_with_2plus, diagnosed.unique_share) == (2, 3, 0.4)


# ---------------------------------------------------------------- rounding, measured (docs/method.md's statement)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_rounding_by_input_dtype(dtype):
    """float64 inputs: computed in float64, the float64 reference exactly. bfloat16: computed in float32 and
    rounded once, the reference rounded once (measured: every entry; double rounding could differ in general).
    float32: computed in float32, where each operation rounds: within the bound `assert_state_dict_matches`
    allows, and a measured share of the changed entries differs from the reference rounded once, most by one
    ulp of the result (docs/method.md gives the figures this prints: `-rP` shows them; `-q` shows no test's output)."""
    shares = []
    for seed in (4, 5, 6):
        fam = models.Family("qwen2", tied=False, dtype=dtype, seed=seed)
        agents = {k: fam.agents[k] for k in ("A", "B", "C")}
        out = mergekit_ram.merge_state_dicts(fam.base, agents)
        ref = R.reference_merge(fam.base, agents)
        changed = differ = one_ulp = 0
        for name, ref64 in ref.items():
            rounded = ref64.to(dtype)
            moved = torch.zeros(ref64.shape, dtype=torch.bool)
            for sd in agents.values():
                moved |= R.task_vector(fam.base[name], sd[name]).abs() > 1e-5
            wrong = out[name] != rounded
            assert not (wrong & ~moved).any(), name  # an unchanged entry is the base, exactly
            ulps = (out[name].double() - rounded.double()).abs() / R.ulp(rounded, dtype)
            changed, differ, one_ulp = changed + int(moved.sum()), differ + int(wrong.sum()), one_ulp + int((ulps == 1).sum())
        R.assert_state_dict_matches(out, ref, R.reference_magnitudes(fam.base, agents), min_exact=0.85)
        shares.append((differ / changed, one_ulp / max(differ, 1)))
    print(f"{dtype}: of the changed entries, differing from the reference rounded once: "
          + ", ".join(f"{100 * d:.1f}% ({100 * o:.0f}% of them by one ulp)" for d, o in shares))  # fmt: skip
    if dtype in (torch.float64, torch.bfloat16):
        assert all(d == 0 for d, _ in shares)
    else:
        assert all(0 < d < 0.15 and o >= 0.85 for d, o in shares), shares
