"""A valid mergekit config for each of mergekit 0.1.5's registered merge methods, for a base and agents (paths).

`configs(base, agents, dtype)` gives {variant: config dict}: one variant per method with parameters that exercise
it (densities below 1, so the sparsifying methods sort or draw), plus variants where a parameter changes what an
output element depends on (ties/breadcrumbs at density 1: element-wise; nuslerp without flattening and
model_stock filter_wise: row-wise). Each variant names its method (`METHOD[variant]`), what an output element
depends on (`KIND`: "element", "row" or "whole"; from the kernels' source, measured by benchmarks/determinism.py)
and whether it draws random numbers (`RANDOM`). benchmarks/determinism.py measures them; the lead's verify matrix
generates merges from them. Methods taking exactly two models get the base and the first agent.
"""

from __future__ import annotations

from collections.abc import Sequence

#: mergekit 0.1.5's registered methods (mergekit.merge_methods.registered_methods(), this plugin disabled)
METHODS = (
    "linear",
    "task_arithmetic",
    "ties",
    "dare_ties",
    "dare_linear",
    "breadcrumbs",
    "breadcrumbs_ties",
    "della",
    "della_linear",
    "slerp",
    "nuslerp",
    "multislerp",
    "karcher",
    "model_stock",
    "sce",
    "passthrough",
    "nearswap",
    "arcee_fusion",
    "ram",
    "ramplus_tl",
)

#: variant -> the registered method it runs
METHOD = {m: m for m in METHODS} | {
    "ties_d1": "ties",
    "breadcrumbs_d1": "breadcrumbs",
    "nuslerp_rows": "nuslerp",
    "model_stock_filter": "model_stock",
}

#: variant -> what one output element depends on: the same elements of the inputs, whole rows, or the whole tensor
#: (a sort, a quantile, a norm or a count over it). Per the kernels' source (../shared/reference/mergekit-methods.md).
KIND = {
    "linear": "element",
    "task_arithmetic": "element",
    "passthrough": "element",
    "nearswap": "element",
    "ram": "element",
    "ties_d1": "element",
    "breadcrumbs_d1": "element",
    "nuslerp_rows": "row",
    "model_stock_filter": "row",
    # della ranks within rows, but its rescale divides by norms over the whole tensor
    "ties": "whole",
    "breadcrumbs": "whole",
    "breadcrumbs_ties": "whole",
    "dare_ties": "whole",
    "dare_linear": "whole",
    "della": "whole",
    "della_linear": "whole",
    "slerp": "whole",
    "nuslerp": "whole",
    "multislerp": "whole",
    "karcher": "whole",
    "model_stock": "whole",
    "sce": "whole",
    "arcee_fusion": "whole",
    "ramplus_tl": "whole",
}

#: variants drawing from torch's global generator (seeded only by mergekit's --random-seed); arcee_fusion only for
#: tensors over 2**20 elements (its quantile sample)
RANDOM = frozenset({"dare_ties", "dare_linear", "della", "della_linear", "arcee_fusion"})

VARIANTS = tuple(METHOD)


def _weights(n: int) -> list[float]:
    # distinct, not summing to 1, so normalisation does real arithmetic
    return [round(0.6 - 0.15 * i, 2) for i in range(n)]


def configs(base: str, agents: Sequence[str], dtype: str = "bfloat16", out_dtype: str | None = None) -> dict:
    """{variant: mergekit config dict} for `base` and `agents` (at least two agents: model_stock needs three models
    and nuslerp two besides the base)."""
    agents = [str(a) for a in agents]
    base = str(base)
    if len(agents) < 2:
        raise ValueError("needs at least two agents (model_stock takes three models, nuslerp two besides the base)")
    w = _weights(len(agents))
    w_all = _weights(len(agents) + 1)

    def tv(params: dict, method: str, shared: dict | None = None) -> dict:
        """base_model plus agents with per-agent parameters (the task-vector methods)."""
        cfg = {
            "merge_method": method,
            "base_model": base,
            "models": [{"model": base}]
            + [{"model": a, "parameters": {**params, "weight": w[i]}} for i, a in enumerate(agents)],
        }
        if shared:
            cfg["parameters"] = shared
        return cfg

    out = {
        "linear": {
            "merge_method": "linear",
            "models": [{"model": m, "parameters": {"weight": x}} for m, x in zip([base, *agents], w_all, strict=True)],
        },
        "task_arithmetic": tv({}, "task_arithmetic"),
        "ties": tv({"density": 0.5}, "ties"),
        "ties_d1": tv({"density": 1.0}, "ties"),
        "dare_ties": tv({"density": 0.5}, "dare_ties"),
        "dare_linear": tv({"density": 0.5}, "dare_linear"),
        "breadcrumbs": tv({"density": 0.9, "gamma": 0.01}, "breadcrumbs"),
        "breadcrumbs_d1": tv({"density": 1.0, "gamma": 0.01}, "breadcrumbs"),
        "breadcrumbs_ties": tv({"density": 0.9, "gamma": 0.01}, "breadcrumbs_ties"),
        "della": tv({"density": 0.5, "epsilon": 0.15}, "della"),
        "della_linear": tv({"density": 0.5, "epsilon": 0.15}, "della_linear"),
        "slerp": {
            "merge_method": "slerp",
            "base_model": base,
            "models": [{"model": base}, {"model": agents[0]}],
            "parameters": {"t": 0.3},
        },
        "nuslerp": {
            "merge_method": "nuslerp",
            "base_model": base,
            "models": [{"model": base}]
            + [{"model": a, "parameters": {"weight": x}} for a, x in zip(agents[:2], (0.7, 0.4), strict=True)],
        },
        "nuslerp_rows": {
            "merge_method": "nuslerp",
            "base_model": base,
            "models": [{"model": base}]
            + [{"model": a, "parameters": {"weight": x}} for a, x in zip(agents[:2], (0.7, 0.4), strict=True)],
            "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": False},
        },
        # without base_model: with it, multislerp works on task vectors and raises on a tensor no agent changed
        # (norms of sparse agents: "The weighted sum of the input tensors is zero")
        "multislerp": {
            "merge_method": "multislerp",
            "models": [{"model": m, "parameters": {"weight": x}} for m, x in zip([base, *agents], w_all, strict=True)],
        },
        "karcher": {
            "merge_method": "karcher",
            "models": [{"model": m} for m in [base, *agents]],
            "parameters": {"max_iter": 10, "tol": 1e-5},
        },
        "model_stock": {
            "merge_method": "model_stock",
            "base_model": base,
            "models": [{"model": m} for m in [base, *agents]],
        },
        "model_stock_filter": {
            "merge_method": "model_stock",
            "base_model": base,
            "models": [{"model": m} for m in [base, *agents]],
            "parameters": {"filter_wise": True},
        },
        "sce": {
            "merge_method": "sce",
            "base_model": base,
            "models": [{"model": m} for m in [base, *agents]],
            "parameters": {"select_topk": 0.5},
        },
        "passthrough": {"merge_method": "passthrough", "models": [{"model": agents[0], "parameters": {"scale": 0.7}}]},
        # t: differences below t take the agent's value, above it move towards the base (t / |a - b|)
        "nearswap": {
            "merge_method": "nearswap",
            "base_model": base,
            "models": [{"model": base}, {"model": agents[0]}],
            "parameters": {"t": 0.0001},
        },
        "arcee_fusion": {
            "merge_method": "arcee_fusion",
            "base_model": base,
            "models": [{"model": base}, {"model": agents[0]}],
        },
        "ram": {"merge_method": "ram", "base_model": base, "models": [{"model": m} for m in [base, *agents]]},
        "ramplus_tl": {
            "merge_method": "ramplus_tl",
            "base_model": base,
            "models": [{"model": m} for m in [base, *agents]],
            "parameters": {"r": 0.1, "alpha": 0.2},
        },
    }
    for cfg in out.values():
        cfg["dtype"] = dtype
        if out_dtype:
            cfg["out_dtype"] = out_dtype
    assert set(out) == set(METHOD), set(out) ^ set(METHOD)
    return out
