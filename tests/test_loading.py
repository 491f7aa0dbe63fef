"""Mixture-of-experts checkpoints: per-expert tensors on disk, fused by mergekit on load.

Tiny Qwen3-MoE and Mixtral families are written the way hub checkpoints store them
(one gate/up/down matrix per expert; Mixtral's `block_sparse_moe` names), and merged
with plain `run_merge`. The reference fuses the experts itself (stack per expert, gate
rows before up rows) and runs the float64 equations on the fused tensors, so counts,
rho and merged weights are checked against what mergekit writes. The linear-time
loading that `ramplus` switches on (mergekit_ram/_mergekit/loading.py) must give exactly
mergekit's own tensors, and never divert any other method's loading.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Dict

import pytest
import torch

import models
import reference as R

ARCHS = {
    # arch -> (MoE block name on disk, gate / up / down names of one expert)
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
EXPERTS, LAYERS = 4, 2


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe(request, tmp_path_factory):
    from mergekit_ram.example_models import build_workload

    arch = request.param
    wl = build_workload(
        tmp_path_factory.mktemp(arch), arch=arch, hidden_size=64, num_layers=LAYERS, vocab_size=64,
        intermediate_size=16, num_heads=4, num_kv_heads=1, num_experts=EXPERTS,
        densities=(0.03, 0.46, 0.54), tokenizer=False,
    )
    return arch, wl


def fused(arch: str, stored: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers 5's model layout, built by hand: experts stacked, gate rows then up rows."""
    block, (gate, up, down) = ARCHS[arch]
    out = {k: v for k, v in stored.items() if ".experts." not in k}
    if block != "mlp":
        out = {k.replace(f".{block}.", ".mlp."): v for k, v in out.items()}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.{block}.experts"
        q = f"model.layers.{layer}.mlp.experts"
        out[f"{q}.gate_up_proj"] = torch.stack(
            [torch.cat([stored[f"{p}.{e}.{gate}.weight"], stored[f"{p}.{e}.{up}.weight"]]) for e in range(EXPERTS)]
        )
        out[f"{q}.down_proj"] = torch.stack([stored[f"{p}.{e}.{down}.weight"] for e in range(EXPERTS)])
    return out


def config_text(wl, parameters: str = "epsilon: 1.0e-5\n  r: 0.1\n  alpha: 2.0", method: str = "ramplus") -> str:
    lines = [f"merge_method: {method}", f"base_model: {wl.base}", "models:"]
    for path in wl.agents.values():
        lines.append(f"  - model: {path}")
        if method == "task_arithmetic":
            lines.append("    parameters: {weight: 1.0}")
    lines += ["dtype: bfloat16", "parameters:", f"  {parameters}"]
    return "\n".join(lines) + "\n"


def inputs(arch, wl):
    base = fused(arch, models.load_checkpoint(wl.base))
    agents = {str(p): fused(arch, models.load_checkpoint(p)) for p in wl.agents.values()}
    return base, agents


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_moe_merge_equals_float64_reference(moe, run_yaml, scope):
    arch, wl = moe
    run = run_yaml(config_text(wl, f"epsilon: 1.0e-5\n  r: 0.1\n  alpha: 2.0\n  rho_scope: {scope}"))
    base, agents = inputs(arch, wl)
    # mergekit writes the fused layout: exactly the model's own parameter names
    assert set(run.tensors) == set(base)
    assert any(name.endswith("experts.gate_up_proj") for name in run.tensors)
    ref = R.reference_merge(base, agents, 1e-5, 0.1, 2.0, names=list(base), rho_scope=scope)
    R.assert_state_dict_matches(run.tensors, ref, R.reference_magnitudes(base, agents, list(base)))
    want = R.reference_stats(base, agents, 1e-5, list(base))
    got = {str(k): s for k, s in run.stats.items()}
    for path, s in want.items():
        assert (got[path].active, got[path].shared, got[path].unique) == (s.active, s.shared, s.unique), path
        assert got[path].rho == pytest.approx(s.rho, rel=1e-12)
    assert all(s.unique > 0 and s.shared > 0 for s in want.values())  # a non-trivial rho for every agent

    report = json.loads((run.out / "ram_stats.json").read_text(encoding="utf-8"))
    assert {t["name"] for t in report["tensors"]} == {n for n, t in base.items() if t.is_floating_point()}
    if scope == "layer":  # experts are grouped with their block, not standing alone
        groups = R.reference_group_rhos(base, agents, 1e-5, list(base), "layer")
        assert set(report["rho_by_group"]) == set(groups)
        assert {f"model.layers.{i}" for i in range(LAYERS)} <= set(groups)
        labels = {row["model"]: label for label, row in report["inputs"].items()}  # format 4 names agents by label
        for group, rhos in groups.items():
            for path, rho in rhos.items():
                got_rho = report["rho_by_group"][group][labels[path]]
                assert (got_rho == "inf") if rho == float("inf") else got_rho == pytest.approx(rho, rel=1e-12)


def test_moe_fast_loading_gives_mergekits_own_tensors(moe, run_yaml, monkeypatch):
    """The linear-time path and mergekit's own loading write identical bytes and counts."""
    from mergekit.architecture import conversion
    from mergekit.io import tasks

    from mergekit_ram import session
    from mergekit_ram._mergekit import loading

    arch, wl = moe
    # Install the fast path before the spy replaces convert_checkpoint_tensors: the guard hashes
    # that function's source, and the spy's would disable fast loading for the whole process.
    assert loading.install() == ""
    sizes = []
    real = conversion.convert_checkpoint_tensors

    def spy(model_type, source_tensors, target):
        sizes.append(len(source_tensors))
        return real(model_type, source_tensors, target)

    monkeypatch.setattr(conversion, "convert_checkpoint_tensors", spy)
    monkeypatch.setattr(tasks, "convert_checkpoint_tensors", spy)  # mergekit's own import of it
    fast = run_yaml(config_text(wl))
    fast_sizes, sizes[:] = list(sizes), []
    with monkeypatch.context() as m:
        m.setattr(loading, "_fast", lambda: False)
        slow = run_yaml(config_text(wl))
    total = len(models.load_checkpoint(wl.base))
    assert fast_sizes and max(fast_sizes) <= 2 * EXPERTS < total  # only the experts that form the target
    assert sizes and min(sizes) == total  # mergekit hands over every tensor of the model
    assert set(fast.tensors) == set(slow.tensors)
    for name in fast.tensors:
        assert torch.equal(fast.tensors[name], slow.tensors[name]), name
    assert {str(k): vars(s) for k, s in fast.stats.items()} == {str(k): vars(s) for k, s in slow.stats.items()}
    assert session.current() is None


@pytest.mark.quick
def test_other_methods_keep_mergekits_loading(moe, run_yaml, monkeypatch):
    from mergekit_ram import session
    from mergekit_ram._mergekit import loading

    arch, wl = moe
    diverted = []
    for name in ("_get_tensor", "_load_converted_tensor"):
        real = getattr(loading, name)
        monkeypatch.setattr(loading, name, lambda *a, _real=real, **k: diverted.append(1) or _real(*a, **k))
    run_yaml(config_text(wl))
    assert diverted, "ramplus should load through the linear-time path"
    diverted.clear()
    run = run_yaml(config_text(wl, parameters="normalize: false", method="task_arithmetic"))
    assert not diverted and run.tensors
    assert session.current() is None


@pytest.mark.quick
def test_reachable_names_each_experts_tensors(moe):
    from mergekit_ram._mergekit.loading import reachable

    arch, wl = moe
    block, (gate, up, down) = ARCHS[arch]
    names = list(models.load_checkpoint(wl.base))
    found = reachable(arch, names)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.{block}.experts"
        want = {f"{p}.{e}.{w}.weight" for e in range(EXPERTS) for w in (gate, up)}
        assert set(found[f"model.layers.{layer}.mlp.experts.gate_up_proj"]) == want
        assert set(found[f"model.layers.{layer}.mlp.experts.down_proj"]) == {
            f"{p}.{e}.{down}.weight" for e in range(EXPERTS)
        }
    if arch == "mixtral":  # the router is only renamed
        assert found["model.layers.1.mlp.gate.weight"] == ["model.layers.1.block_sparse_moe.gate.weight"]
    assert reachable("llama", ["model.embed_tokens.weight"]) == {}


def test_merged_moe_loads_in_transformers_and_generates(moe, run_yaml):
    from transformers import AutoModelForCausalLM

    arch, wl = moe
    run = run_yaml(config_text(wl))
    model, info = AutoModelForCausalLM.from_pretrained(str(run.out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    params = dict(model.named_parameters())
    for name, tensor in run.tensors.items():
        assert torch.equal(params[name].data.to(tensor.dtype), tensor), name
    out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.quick
def test_tensor_count_of_moe_layout(moe):
    arch, wl = moe
    stored = models.load_checkpoint(Path(wl.base))
    per_layer = 3 * EXPERTS + 1 + 4 + 2 + (2 if arch == "qwen3_moe" else 0)  # experts, router, attention, norms
    assert len(stored) == LAYERS * per_layer + 3
