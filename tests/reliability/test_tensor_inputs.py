"""Bad and odd tensors: NaN/Inf, shapes, dtypes, missing or extra tensors, integer and empty
tensors, degenerate agent sets (identical agents, no unique entries, 1 and 20 agents).

Decided behaviour: NaN/Inf anywhere, a shape mismatch, an integer (quantized) tensor
where the base holds floats, and a missing tensor are errors naming tensor and model,
raised before a weight file is written; everything else merges and equals the float64
reference. Older cases counted here: tests/test_method.py (1 agent, an agent without
unique entries, an agent identical to the base, NaN in an agent), tests/test_kernel.py
(zero-element tensors, 300 agents), tests/test_api.py (integer buffers).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import config_yaml, inputs, no_weights

MLP = "model.layers.1.mlp.down_proj.weight"
EMBED = "model.embed_tokens.weight"


def _with(sd, name, fn):
    out = {k: v.clone() for k, v in sd.items()}
    out[name] = fn(out[name])
    return out


def _poke(value, index=7):
    def fn(t):
        t.view(-1)[index] = value
        return t

    return fn


# ---------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize(
    "who, value, r",
    [("base", math.nan, 0.1), ("agent", math.inf, 0.1), ("agent", -math.inf, 0.0), ("base", math.inf, 0.0)],
    ids=["nan-in-base", "inf-in-agent", "-inf-in-agent-r0", "inf-in-base-r0"],
)
def test_non_finite_value_names_tensor_and_model(rel, qwen_bf16, make_model, run_yaml, tmp_path, who, value, r):
    from mergekit_ram.core.kernel import NonFiniteInputError

    fam = qwen_bf16.family
    source = fam.base if who == "base" else fam.agents["A"]
    bad = make_model(f"{who}-{value}", _with(source, MLP, _poke(value)))
    base = bad if who == "base" else qwen_bf16.path("base")
    agents = [qwen_bf16.path("B"), bad] if who == "agent" else [qwen_bf16.path("A"), qwen_bf16.path("B")]
    rel.watch(bad, *qwen_bf16.paths.values())
    with pytest.raises(NonFiniteInputError) as info:
        run_yaml(config_yaml(base, agents, parameters={"r": r}), out=tmp_path / "out")
    rel.names(info, MLP, bad, "NaN or Inf")
    assert qwen_bf16.path("B") not in str(info.value)
    no_weights(tmp_path / "out")


def test_nan_in_a_tied_embedding_names_it(rel, llama_tied, make_model, run_yaml, tmp_path):
    from mergekit_ram.core.kernel import NonFiniteInputError

    fam = llama_tied.family
    bad = make_model("tied-nan", _with(fam.agents["A"], EMBED, _poke(math.nan, 3)), arch="llama", tied=True)
    rel.watch(bad, *llama_tied.paths.values())
    with pytest.raises(NonFiniteInputError) as info:
        run_yaml(config_yaml(llama_tied.path("base"), [bad, llama_tied.path("B")]), out=tmp_path / "out")
    rel.names(info, EMBED, bad)
    no_weights(tmp_path / "out")


# ---------------------------------------------------------------- a result no dtype holds (issue 39, case 4)


def _overflowing(fam, make_model, dtype=torch.float16, value=64992.0):
    """base, A, B (folders, in `dtype`) where A alone changes one MLP entry, to 64,992: A's lambda (> 1 with r = 1)
    makes it more than float16's largest value, 65,504; every input finite."""
    entry = fam.base[MLP].view(-1)[7]
    a = _with(fam.agents["A"], MLP, _poke(value))
    b = _with(fam.agents["B"], MLP, _poke(float(entry)))
    cast = lambda sd: {k: v.to(dtype) for k, v in sd.items()}  # noqa: E731
    tag = f"{str(dtype).removeprefix('torch.')}-{value:g}"  # make_model writes a name once per session
    return (make_model(f"inf-base-{tag}", cast(fam.base), dtype=dtype), make_model(f"inf-A-{tag}", cast(a), dtype=dtype),
            make_model(f"inf-B-{tag}", cast(b), dtype=dtype))  # fmt: skip


def _names_overflow(rel, info, agent, dtype="float16") -> None:
    rel.names(info, MLP, f"only {agent} changed it", "lambda = ", f"not finite in {dtype}", f"`out_dtype: float32`",
              "a smaller `r`")  # fmt: skip


def test_a_merge_float16_cannot_hold_stops_before_writing(rel, qwen_bf16, make_model, run_yaml, tmp_path):
    """mergekit-yaml / run_merge: before, inf was written, exit 0, and verify called the folder identical."""
    from mergekit_ram.errors import NonFiniteResultError

    base, a, b = _overflowing(qwen_bf16.family, make_model)
    rel.watch(base, a, b)
    with pytest.raises(NonFiniteResultError) as info:
        run_yaml(config_yaml(base, [a, b], parameters={"r": 1.0}, dtype="float16"), out=tmp_path / "o")
    _names_overflow(rel, info, a)
    no_weights(tmp_path / "o")


def test_a_merge_written_narrower_than_its_inputs_stops_at_out_dtype(rel, qwen_bf16, make_model, run_yaml, tmp_path):
    """float32 inputs, out_dtype float16, r = 0: the agent's own value, rounded once to what is written."""
    from mergekit_ram.errors import NonFiniteResultError

    base, a, b = _overflowing(qwen_bf16.family, make_model, torch.float32, 70000.0)
    rel.watch(base, a, b)
    text = config_yaml(base, [a, b], parameters={"r": 0.0}, dtype="float32") + "out_dtype: float16\n"
    with pytest.raises(NonFiniteResultError) as info:
        run_yaml(text, out=tmp_path / "o")
    _names_overflow(rel, info, a)
    assert "lambda = 1 makes" in str(info.value)
    no_weights(tmp_path / "o")


def test_mergekit_pytorch_stops_before_writing(rel, tmp_path):
    """The issue's repro: dtype float16, r = 0.1; a: w[5] = 64000, w[10:40] = 0.01; b: w[10:40] = 0.02, w[50] = 0.5."""
    from helpers import run_flat
    from safetensors.torch import save_file

    from mergekit_ram.errors import NonFiniteResultError

    w = torch.zeros(64)
    a, b = w.clone(), w.clone()
    a[5], a[10:40], b[10:40], b[50] = 64000, 0.01, 0.02, 0.5
    folder = tmp_path / "inputs"
    folder.mkdir()
    for name, tensor in (("base", w), ("a", a), ("b", b)):
        save_file({"w": tensor}, str(folder / f"{name}.safetensors"))
    rel.watch(folder)
    text = (f"merge_method: ramplus\nbase_model: {folder}/base.safetensors\nmodels:\n  - model: {folder}/a.safetensors"
            f"\n  - model: {folder}/b.safetensors\nparameters:\n  r: 0.1\ndtype: float16\n")  # fmt: skip
    with pytest.raises(NonFiniteResultError) as info:
        run_flat(text, tmp_path / "o")
    rel.names(info, "tensor w", f"only {folder}/a.safetensors changed it", "lambda = 1.2", "float16")
    no_weights(tmp_path / "o")


def test_mergekit_multi_stops_before_writing(rel, qwen_bf16, make_model, tmp_path):
    """A ramplus stage of mergekit-multi: one line, exit 1, no stage folder with weights."""
    import subprocess

    from helpers import console_script

    base, a, b = _overflowing(qwen_bf16.family, make_model)
    rel.watch(base, a, b)
    config = tmp_path / "recipe.yml"
    config.write_text("name: ram\n" + config_yaml(base, [a, b], parameters={"r": 1.0}, dtype="float16"))
    env = {**__import__("os").environ, "MERGEKIT_RAM_CACHE": "off"}
    done = subprocess.run([console_script("mergekit-multi"), str(config), "--intermediate-dir", str(tmp_path / "i"),
                           "--no-copy-tokenizer", "--quiet"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(tmp_path))  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    _names_overflow(rel, done.stderr.strip().splitlines()[-1], a)
    no_weights(tmp_path / "i" / "ram")


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("dtype, value", [(torch.float16, 64000.0), (torch.bfloat16, 3.0e38), (torch.float32, 3.0e38)],
                         ids=["float16", "bfloat16", "float32"])  # fmt: skip
def test_merge_state_dicts_stops(rel, monkeypatch, native, dtype, value):
    """The in-memory door, both kernels, near each dtype's largest value."""
    import mergekit_ram

    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", native)
    w = torch.zeros(64, dtype=dtype)
    a, b = w.clone(), w.clone()
    a[5], a[10:40], b[10:40], b[50] = value, 0.01, 0.02, 0.5
    with pytest.raises(mergekit_ram.RamError) as info:
        mergekit_ram.merge_state_dicts({"w": w}, {"a": {"w": a}, "b": {"w": b}}, r=0.1)
    name = str(dtype).removeprefix("torch.")
    rel.names(info, "tensor w", "only a changed it", "lambda = 1.2", f"not finite in {name}")


# ---------------------------------------------------------------- shapes, dtypes, names


@pytest.mark.quick
@pytest.mark.parametrize("r", [0.1, 0.0], ids=["prepass", "r0"])
def test_shape_mismatch_names_tensor_and_model(rel, qwen_bf16, make_model, run_yaml, tmp_path, r, monkeypatch):
    name = "model.layers.0.self_attn.q_proj.bias"
    bad = make_model("shape", _with(qwen_bf16.family.agents["A"], name, lambda t: t[:16].clone()))
    rel.watch(bad, *qwen_bf16.paths.values())
    with pytest.raises(ValueError) as info:
        run_yaml(
            config_yaml(qwen_bf16.path("base"), [bad, qwen_bf16.path("B")], parameters={"r": r}), out=tmp_path / "o"
        )
    rel.names(info, name, bad, "(16,)", "(32,)")
    no_weights(tmp_path / "o")


@pytest.mark.parametrize("dtype", ["bfloat16", None], ids=["dtype-bf16", "no-dtype"])
def test_integer_tensor_in_an_agent_is_refused(rel, qwen_bf16, make_model, run_yaml, tmp_path, dtype):
    """A quantized (int8) weight would be cast to `dtype:` and merged as numbers: refused."""
    bad = make_model("int8", _with(qwen_bf16.family.agents["A"], MLP, lambda t: (t * 100).to(torch.int8)))
    rel.watch(bad, *qwen_bf16.paths.values())
    with pytest.raises(ValueError) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [bad, qwen_bf16.path("B")], dtype=dtype), out=tmp_path / "o")
    rel.names(info, MLP, bad, "I8")
    no_weights(tmp_path / "o")


def test_float32_agent_with_bf16_base_merges_as_bf16(rel, qwen_bf16, make_model, run_yaml, caplog):
    """Another float dtype is only a warning: with `dtype: bfloat16` the (exact) fp32
    copy of A merges exactly like A itself."""
    a32 = make_model("A-fp32", {k: v.float() for k, v in qwen_bf16.family.agents["A"].items()}, dtype=torch.float32)
    rel.watch(a32, *qwen_bf16.paths.values())
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [a32, qwen_bf16.path("B")]))
    assert any("different dtype" in r.getMessage() for r in caplog.records)
    base, agents = inputs(qwen_bf16.path("base"), [a32, qwen_bf16.path("B")], cast=torch.bfloat16)
    rel.matches_reference(run.tensors, base, agents)


@pytest.mark.quick
@pytest.mark.parametrize("r", [0.1, 0.0], ids=["prepass", "r0"])
def test_agent_missing_a_tensor_names_tensor_and_model(rel, qwen_bf16, make_model, run_yaml, tmp_path, r):
    sd = {k: v for k, v in qwen_bf16.family.agents["A"].items() if k != MLP}
    bad = make_model("missing", sd)
    rel.watch(bad, *qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(
            config_yaml(qwen_bf16.path("base"), [bad, qwen_bf16.path("B")], parameters={"r": r}), out=tmp_path / "o"
        )
    rel.names(info, MLP, bad)
    no_weights(tmp_path / "o")


def test_agent_missing_its_lm_head_names_it(rel, qwen_bf16, make_model, run_yaml, tmp_path):
    sd = {k: v for k, v in qwen_bf16.family.agents["A"].items() if k != "lm_head.weight"}
    bad = make_model("no-lm-head", sd)
    rel.watch(bad, *qwen_bf16.paths.values())
    with pytest.raises(Exception) as info:
        run_yaml(config_yaml(qwen_bf16.path("base"), [bad, qwen_bf16.path("B")]), out=tmp_path / "o")
    rel.names(info, "lm_head.weight", bad)
    no_weights(tmp_path / "o")


def test_extra_tensors_in_an_agent_are_ignored(rel, qwen_bf16, make_model, run_yaml):
    """mergekit merges the base architecture's tensors; a stray tensor in an agent is not one."""
    sd = dict(qwen_bf16.family.agents["A"])
    sd["model.extra_head.weight"] = torch.ones(4, 32, dtype=torch.bfloat16)
    sd["model.layers.0.extra.step"] = torch.tensor([3], dtype=torch.int64)
    extra = make_model("extra", sd)
    rel.watch(extra, *qwen_bf16.paths.values())
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [extra, qwen_bf16.path("B")]))
    base, agents = inputs(qwen_bf16.path("base"), [extra, qwen_bf16.path("B")])
    rel.matches_reference(run.tensors, base, agents)


# ---------------------------------------------------------------- degenerate agent sets


def test_all_agents_identical(rel, qwen_bf16, make_model, run_yaml):
    """Every change shared: rho = inf for all, lambda multiplies nothing, result = base + tau_A."""
    twin = make_model("A-twin", qwen_bf16.family.agents["A"])
    rel.watch(twin, *qwen_bf16.paths.values())
    agents = [qwen_bf16.path("A"), twin]
    run = run_yaml(config_yaml(qwen_bf16.path("base"), agents))
    assert all(s.rho == math.inf for s in run.stats.values())
    base, sds = inputs(qwen_bf16.path("base"), agents)
    rel.matches_reference(run.tensors, base, sds)


def test_agent_identical_to_base_alone(rel, qwen_bf16, run_yaml, caplog):
    """The only agent changes nothing: the merge is the base, with a warning naming it."""
    caplog.set_level(logging.WARNING, logger="mergekit_ram")
    rel.watch(*qwen_bf16.paths.values())
    run = run_yaml(config_yaml(qwen_bf16.path("base"), [qwen_bf16.path("Z")]))
    # named by its label, as the table names it, then its path (the console is the merger's own)
    said = f"ramplus: Z ({qwen_bf16.path('Z')}) changes no weight"
    assert any(r.getMessage().startswith(said) and "identical" in r.getMessage() for r in caplog.records)
    base, sds = inputs(qwen_bf16.path("base"), [qwen_bf16.path("Z")])
    rel.matches_reference(run.tensors, base, sds)
    for name, t in run.tensors.items():
        assert torch.equal(t, base[name]), name


@pytest.fixture(scope="module")
def twenty(qwen_bf16, make_model):
    """20 agents of one base, each changing its own random 4% plus a shared 1% region."""
    fam = qwen_bf16.family
    gen = torch.Generator().manual_seed(20)
    paths = []
    for i in range(20):
        sd = {}
        for name, b in fam.base.items():
            n = b.numel()
            mask = torch.rand(n, generator=gen) < 0.04
            mask[: max(1, n // 100)] = True
            delta = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.04 + 0.02) * torch.where(
                torch.rand(n, generator=gen) < 0.5, -1.0, 1.0
            ).double()
            a = b.double().reshape(-1) + delta * mask
            sd[name] = a.to(b.dtype).reshape(b.shape)
        paths.append(make_model(f"agent{i:02d}", sd))
    return paths


def test_twenty_agents(rel, qwen_bf16, twenty, run_yaml):
    rel.watch(qwen_bf16.path("base"), *twenty)
    run = run_yaml(config_yaml(qwen_bf16.path("base"), twenty, parameters={"r": 0.2}))
    assert len(run.stats) == 20
    base, sds = inputs(qwen_bf16.path("base"), twenty)
    rel.matches_reference(run.tensors, base, sds, r=0.2)


@pytest.mark.quick
def test_zero_element_tensors_merge(rel):
    """mergekit plans no empty tensor for these architectures: the in-memory API (same kernel)."""
    import mergekit_ram

    gen = torch.Generator().manual_seed(0)
    base = {"empty": torch.zeros(0, 8), "w": torch.randn(6, 8, generator=gen)}
    agents = {
        "a": {"empty": torch.zeros(0, 8), "w": base["w"] + 0.05 * (torch.rand(6, 8, generator=gen) < 0.3)},
        "b": {"empty": torch.zeros(0, 8), "w": base["w"] - 0.05 * (torch.rand(6, 8, generator=gen) < 0.3)},
    }
    merged = mergekit_ram.merge_state_dicts(base, agents)
    assert merged["empty"].shape == (0, 8)
    rel.matches_reference(merged, base, agents, names=list(base), eps=1e-5, r=0.1, alpha=2.0)


def test_integer_buffer_equal_everywhere_is_copied(rel):
    import mergekit_ram

    base = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "step": torch.tensor([7, 8])}
    agent = {"w": base["w"] + torch.tensor([0.1] + [0.0] * 11).reshape(3, 4), "step": torch.tensor([7, 8])}
    merged = mergekit_ram.merge_state_dicts(base, [agent])
    assert torch.equal(merged["step"], base["step"]) and merged["step"].dtype == torch.int64
    rel.matches_reference({"w": merged["w"]}, base, [agent], names=["w"])


def test_api_non_float_tensor_names_the_agent_that_differs(rel):
    """A float tensor in the base and a non-float one in the second agent (the first agent's float
    differs from the base, as any update does): the message names the second agent only."""
    import mergekit_ram

    base = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "scale": torch.ones(4)}
    first = {"w": base["w"] + 0.1, "scale": torch.full((4,), 1.5)}
    second = {"w": base["w"] - 0.1, "scale": torch.ones(4, dtype=torch.int8)}
    with pytest.raises(ValueError) as info:
        mergekit_ram.merge_state_dicts(base, {"first": first, "second": second})
    message = rel.names(info, "scale", "'second'", "torch.int8")
    assert "'first'" not in message, message
