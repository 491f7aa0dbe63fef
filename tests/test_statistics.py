"""Statistics and diagnostics: `kernel.diagnose` against the float64 definitions, the reductions of
`statistics` (of the kernel's diagnostics as the statistics pass hands them over), and fixtures whose regime is known (a shared update vs rounding-level noise)."""

from __future__ import annotations

import math

import pytest
import reference as R
import torch

from mergekit_ram._mergekit import counting
from mergekit_ram.core import kernel, native, statistics

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _steps(base: torch.Tensor, where: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """base moved by `steps` representable numbers (signed) where `where` holds."""
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[base.dtype]
    bits = base.view(view).to(torch.int64)
    magnitude = (1 << (8 * base.element_size() - 1)) - 1
    key = torch.where(bits < 0, -(bits & magnitude), bits) + torch.where(where, steps, torch.zeros_like(steps))
    sign = (1 << (8 * base.element_size() - 1))
    out = torch.where(key < 0, (-key) | sign, key)
    out = torch.where(out >= (1 << (8 * base.element_size() - 1)), out - (1 << (8 * base.element_size())), out)
    return out.to(view).view(base.dtype)


def _case(dtype, n_agents, numel=50_000, seed=0, common=0.0, density=0.3):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 0.02).to(dtype)
    shared = torch.rand(numel, generator=g) < common
    shared_steps = torch.randint(1, 4, (numel,), generator=g)
    agents = []
    for _ in range(n_agents):
        own = (torch.rand(numel, generator=g) < density) & ~shared
        sign = torch.where(torch.rand(numel, generator=g) < 0.5, -1, 1)
        steps = torch.where(shared, shared_steps, sign * torch.randint(1, 4, (numel,), generator=g))
        agents.append(_steps(base, shared | own, steps))
    return base, agents


def _check(found: kernel.Diagnosis, ref: dict, counts: torch.Tensor) -> None:
    assert torch.equal(found.counts, counts)
    assert found.single.tolist() == ref["single"]
    for got, want in zip(found.magnitude.tolist(), ref["magnitude"], strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)
    for k, (i, j) in enumerate(kernel.pairs(len(ref["single"]))):
        common, same, dot, sx, sy = ref["pairs"][(i, j)]
        assert found.pair_counts[k].tolist() == [common, same]
        assert found.pair_sums[k].tolist() == pytest.approx([dot, sx, sy], rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_agents", [1, 2, 4])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_diagnose_equals_the_float64_definitions(dtype, n_agents, path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "0")
    elif native.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    base, agents = _case(dtype, n_agents, seed=n_agents, common=0.05)
    found = kernel.diagnose(base, agents, 1e-5)
    _check(found, R.reference_diagnostics(base, agents, 1e-5), kernel.count(base, agents, 1e-5))


def test_diagnose_chunked_torch_path_agrees_with_native():
    base, agents = _case(torch.bfloat16, 3, numel=70_001, seed=7, common=0.1)
    whole, chunked = kernel.diagnose(base, agents, 1e-5), kernel.diagnose(base, agents, 1e-5, chunk=4096)
    for field in ("counts", "single", "pair_counts"):
        assert torch.equal(getattr(whole, field), getattr(chunked, field)), field
    assert torch.allclose(whole.magnitude, chunked.magnitude, rtol=1e-12)
    assert torch.allclose(whole.pair_sums, chunked.pair_sums, rtol=1e-12)


def test_diagnose_at_epsilon_zero_and_large_values():
    base, agents = _case(torch.float32, 3, numel=10_000, seed=3, common=0.02)
    agents = [a * 1000 for a in agents]
    base = base * 1000
    _check(kernel.diagnose(base, agents, 0.0), R.reference_diagnostics(base, agents, 0.0), kernel.count(base, agents, 0.0))


def _lanes(values: list[float], lanes: int) -> list[float]:
    """_native.c's partial sums of one block: value i into lane i % lanes, the tail past the last full group of
    `lanes` into lane 0."""
    acc = [0.0] * lanes
    full = len(values) - len(values) % lanes
    for i in range(full):
        acc[i % lanes] += values[i]
    for x in values[full:]:
        acc[0] += x
    return acc


def _in_native_order(base: torch.Tensor, agents: list[torch.Tensor], eps: float, lanes: int = 8, block: int = 2048):
    """The native loops' double sums, added in the order `_native.c` documents (one thread): per block of 2048
    entries, LANES partial sums; a magnitude adds its lanes into a block total, then into the sum; a pair
    sum adds its lanes into the sum one by one."""
    n = len(agents)
    magnitude = [[0.0, 0.0] for _ in range(n)]
    pair = {(i, j): [0.0, 0.0, 0.0] for i, j in kernel.pairs(n)}
    for s in range(0, base.numel(), block):
        b = base[s : s + block].float()
        d = [(a[s : s + block].float() - b) for a in agents]
        on = [x.abs() > eps for x in d]
        hits = torch.stack(on).sum(dim=0)
        for t in range(n):
            for col, where in enumerate((on[t] & (hits == 1), on[t] & (hits >= 2))):
                picked = torch.where(where, d[t].abs(), torch.zeros_like(d[t])).tolist()
                total = 0.0
                for lane in _lanes(picked, lanes):
                    total += lane
                magnitude[t][col] += total
        for i, j in kernel.pairs(n):
            both = on[i] & on[j]
            u = torch.where(both, d[i], torch.zeros_like(d[i])).tolist()
            v = torch.where(both, d[j], torch.zeros_like(d[j])).tolist()
            products = ([x * y for x, y in zip(u, v, strict=True)], [x * x for x in u], [y * y for y in v])
            parts = [_lanes(p, lanes) for p in products]
            for col, partial in enumerate(parts):
                for lane in partial:
                    pair[(i, j)][col] += lane
    return magnitude, pair


@pytest.mark.quick
def test_native_sums_keep_their_documented_order():
    """`verify` compares ram_stats.json's diagnostics with a recount bit for bit: the native loops must add in
    the one order `_native.c` documents (float32 inputs, where another order gives other bits; a tail in
    each place: a partial block, and a partial lane group)."""
    if native.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    g = torch.Generator().manual_seed(5)
    numel = 2 * 2048 + 1000 + 5
    base = torch.randn(numel, generator=g)
    scale = torch.exp2(torch.randint(-30, 30, (numel,), generator=g).float())  # float32 sums inexact in double
    agents = [base + torch.where(torch.rand(numel, generator=g) < p, torch.randn(numel, generator=g) * scale, 0.0)
              for p in (0.3, 0.6, 0.9)]
    found = kernel.diagnose(base, agents, 1e-5)
    magnitude, pair = _in_native_order(base, agents, 1e-5)
    assert found.magnitude.tolist() == magnitude
    assert found.pair_sums.tolist() == [pair[p] for p in kernel.pairs(3)]
    other, other_pairs = _in_native_order(base, agents, 1e-5, lanes=1)  # each block summed in entry order
    assert other != magnitude and other_pairs != pair, "the case cannot tell one order from another"


def test_native_sums_are_the_same_bits_for_any_thread_count():
    """ram_stats.json's diagnostics are recounted by `verify`, maybe on a machine with another number of cores:
    a tensor of several spans gives the same float64 sums on 1, 2 and 3 threads (float32 deltas of varied size,
    whose sums in double depend on the order; the spans' split was once the thread count's)."""
    if native.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    g = torch.Generator().manual_seed(9)
    numel = max(native._MIN_SPLIT, 2 * native.SPAN) + 3 * 2048 + 7  # several spans, split between threads
    base = torch.randn(numel, generator=g) * 0.02
    agents = [base + torch.where(torch.rand(numel, generator=g) < p, torch.randn(numel, generator=g) * 1e-3, 0.0)
              for p in (0.2, 0.5, 0.8)]
    before = torch.get_num_threads()
    found = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            found.append(kernel.diagnose(base, agents, 1e-5))
    finally:
        torch.set_num_threads(before)
    for other in found[1:]:
        assert torch.equal(other.counts, found[0].counts) and torch.equal(other.pair_counts, found[0].pair_counts)
        assert torch.equal(other.magnitude.view(torch.int64), found[0].magnitude.view(torch.int64))
        assert torch.equal(other.pair_sums.view(torch.int64), found[0].pair_sums.view(torch.int64))


@pytest.mark.quick
def test_non_finite_input_is_named():
    base, agents = _case(torch.bfloat16, 2, numel=1000)
    agents[1][5] = float("nan")
    with pytest.raises(kernel.NonFiniteInputError, match="bad"):
        kernel.diagnose(base, agents, 1e-5, names=["ok", "bad"], tensor_name="w")


def _stats(base, agents, eps=1e-5) -> statistics.Statistics:
    labels = [f"agent{i}" for i in range(len(agents))]
    halves = [(base[: base.numel() // 2], [a[: base.numel() // 2] for a in agents]),
              (base[base.numel() // 2 :], [a[base.numel() // 2 :] for a in agents])]
    tensors = []
    for k, (b, sub) in enumerate(halves):
        found = kernel.diagnose(b, sub, eps)
        tensors.append(
            statistics.TensorCounts(
                f"t{k}", b.numel(), dict(zip(labels, map(tuple, found.counts.tolist()))), eps,
                counting.diagnostics(labels, found),
            )
        )
    return statistics.Statistics(labels, tensors)


def test_a_shared_update_in_one_direction_reads_as_one():
    """Every agent makes the same change on a common set and its own disjoint changes elsewhere:
    the pairs agree in sign everywhere they overlap, and their cosine there is 1."""
    base, agents = _case(torch.bfloat16, 3, seed=11, common=0.2, density=0.0)
    stats = _stats(base, agents)
    for p in stats.pair_totals():
        assert p.common == int((R.task_vector(base, agents[0]).abs() > 1e-5).sum())
        assert p.same_sign_share == 1.0
        assert p.cosine == pytest.approx(1.0, abs=1e-12)
    for s in stats.totals().values():
        assert s.magnitude_unique_share == 0.0  # everything it changed, the others changed too


def test_rounding_noise_reads_as_noise():
    """Independent one-step changes of random sign: every change is a single step, and half of the
    common entries agree in sign (within 4 standard deviations)."""
    g = torch.Generator().manual_seed(5)
    base = (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16)
    agents = []
    for _ in range(3):
        where = torch.rand(base.numel(), generator=g) < 0.5
        sign = torch.where(torch.rand(base.numel(), generator=g) < 0.5, -1, 1)
        agents.append(_steps(base, where, sign))
    stats = _stats(base, agents)
    for s in stats.totals().values():
        assert s.single == s.active and s.single_step_share == 1.0
    for p in stats.pair_totals():
        sd = math.sqrt(0.25 / p.common)
        assert abs(p.same_sign_share - 0.5) < 4 * sd
        assert abs(p.cosine) < 0.05


@pytest.mark.quick
def test_totals_and_pairs_sum_over_tensors_and_round_trip_json():
    base, agents = _case(torch.float16, 3, seed=2, common=0.05)
    stats = _stats(base, agents)
    whole = kernel.diagnose(base, agents, 1e-5)
    totals = stats.totals()
    for i, a in enumerate(stats.agents):
        assert totals[a].single == int(whole.single[i])
        assert totals[a].magnitude_unique == pytest.approx(float(whole.magnitude[i, 0]), rel=1e-12)
    for k, p in enumerate(stats.pair_totals()):
        assert [p.common, p.same_sign] == whole.pair_counts[k].tolist()
    again = statistics.Statistics.from_json(stats.agents, stats.to_json())
    assert again.totals() == totals and again.pair_totals() == stats.pair_totals()


@pytest.mark.quick
def test_counts_without_diagnostics_report_none():
    stats = statistics.Statistics(["a", "b"], [statistics.TensorCounts("t", 10, {"a": (2, 1, 1), "b": (1, 0, 1)})])
    assert stats.totals()["a"].single is None and stats.totals()["a"].magnitude_unique_share is None
    assert stats.pair_totals() == [] and not stats.has_diagnostics


def test_the_torch_paths_statistics_scratch_bounds_its_chunk(monkeypatch):
    """On a CPU the statistics pass's chunk is cut to what `_SCRATCH` bytes a thread hold (more agents, smaller
    chunks): many chunks of 9 agents give the float64 definitions' counts, pair counts and sums all the same."""
    from mergekit_ram.core import torch_loops

    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "0")
    monkeypatch.setattr(torch_loops, "_SCRATCH", 5_000 * 8 * 40)  # at most 2**12 entries per chunk for 9 agents
    base, agents = _case(torch.bfloat16, 9, numel=30_001, seed=11, common=0.05, density=0.2)
    chunks = []
    real = torch_loops._shared_out
    monkeypatch.setattr(torch_loops, "_shared_out", lambda numel, step, *a: chunks.append(step) or real(numel, step, *a))
    found = kernel.diagnose(base, agents, 1e-5)
    assert chunks == [1 << 12]
    _check(found, R.reference_diagnostics(base, agents, 1e-5), kernel.count(base, agents, 1e-5, chunk=1 << 20))
