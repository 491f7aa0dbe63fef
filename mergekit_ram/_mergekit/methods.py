"""mergekit 0.1.5's own merge methods as `verify` sees them: which recompute an output element from the same
elements of the inputs (a sample may slice them), and which draw random numbers (reproducible only with the seed
the merge ran with, which nothing records).

Read from mergekit's source (`merge_methods/registry.py`, `sparsify.py`, `arcee_fusion.py`) and measured
(`benchmarks/determinism.py`, docs/verify.md's table of methods): a method missing here is treated as the safest
kind, whole-tensor and deterministic (its tensors recomputed whole, any difference named).
"""

from __future__ import annotations

from typing import Any

#: methods whose output element depends only on the same element of each input (and on parameters): a flat slice
#: of the inputs merges to the same slice of the output. The spherical ones, model_stock, sce, karcher and
#: arcee_fusion reduce over the tensor: not here.
ELEMENT_WISE = frozenset({"linear", "task_arithmetic", "passthrough", "nearswap", "ram"})
#: methods that are element-wise where they sparsify nothing: every input's density 1 (`sparsify` returns the delta
#: as it is, without a sort, a quantile or a draw over the tensor)
ELEMENT_WISE_DENSE = frozenset(
    {"ties", "breadcrumbs", "breadcrumbs_ties", "dare_ties", "dare_linear", "della", "della_linear"}
)

#: methods that draw from torch's global generator (mergekit's `--random-seed`), and the tensor parameter under
#: which they draw nothing (`sparsify`: a density of 1 keeps every element without drawing)
RANDOM_SPARSIFIERS = frozenset({"dare_ties", "dare_linear", "della", "della_linear"})
#: arcee_fusion samples a tensor's importance scores to estimate quantiles beyond this many elements
#: (`arcee_fusion._QUANTILE_SAMPLE_SIZE`)
FUSION_SAMPLED_ABOVE = 1_000_000


#: methods whose bits were measured to move between machines, the same inputs, config and seed given
#: (benchmarks/determinism.py; docs/verify.md's last table): method -> (the most units in the last place measured,
#: what moved them); None: more than the last bits (a threshold or an iteration count moved), any size. Every
#: method gave the same bits in two processes on one machine.
LAST_BITS: dict[str, tuple[int | None, str]] = {
    "linear": (3, "the CPU's vector instructions (ATEN_CPU_CAPABILITY default against AVX512)"),
    "multislerp": (4, "the torch version (2.6 against 2.13)"),
    "model_stock": (1, "the thread count (1 against 2)"),
    "dare_ties": (7, "the thread count (1 against 2)"),
    "dare_linear": (1, "the thread count (1 against 2)"),
    "della": (1, "the thread count (1 against 2)"),
    "della_linear": (1, "the thread count (1 against 2)"),
    "karcher": (None, "the thread count (its iteration count: up to 58,288 units in the last place) and torch"),
    "arcee_fusion": (None, "the CPU's vector instructions (its threshold: whole elements flip)"),
}


def method_of(task: Any) -> str | None:
    """The merge method that makes a planned tensor (None: a task that merges nothing, a copied buffer's)."""
    name = getattr(task, "method_name", None)
    return str(name) if name is not None else None


def _densities(task: Any) -> list[Any]:
    return [dict(p).get("density", 1.0) for p in dict(getattr(task, "input_parameters", {}) or {}).values()]


def sliceable(task: Any) -> bool:
    """Whether a flat slice of `task`'s inputs merges to the same slice of its output (a sample may slice it)."""
    method = method_of(task)
    if method in ELEMENT_WISE:
        return True
    densities = _densities(task)
    return method in ELEMENT_WISE_DENSE and bool(densities) and all(d is not None and float(d) >= 1 for d in densities)


def draws_random(task: Any, numel: int | None) -> bool:
    """Whether recomputing `task` draws random numbers (`numel`: the tensor's elements, None when unknown: assumed
    to)."""
    method = method_of(task)
    if method in RANDOM_SPARSIFIERS:
        densities = _densities(task)
        return any(density is None or float(density) < 1 for density in densities) or not densities
    if method == "arcee_fusion":
        return numel is None or numel > FUSION_SAMPLED_ABOVE
    return False
