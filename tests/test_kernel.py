"""mergekit_ram.core.kernel against the float64 reference, on small random tensors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import reference as R
import torch

from mergekit_ram.core import kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
EPS = 1e-5
R_, ALPHA = 0.1, 2.0


@pytest.fixture(autouse=True, params=["native", "torch"])
def backend(request, monkeypatch):
    """Every kernel test runs on the fused C loops and on the portable torch path."""
    from mergekit_ram.core import native

    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "1" if request.param == "native" else "0")
    if request.param == "native" and native.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_case(n: int, dtype: torch.dtype, shape=(37, 53), seed: int = 0, densities=None):
    """base + n agents with known masks: active deltas of 0.02..0.06 (far above eps
    and above one ULP of every dtype here), and sub-threshold deltas (<= 3e-6,
    dropped, or rounded away in 16-bit dtypes) on ~5% of the inactive entries."""
    g = _gen(seed)
    numel = int(torch.Size(shape).numel())
    sign = lambda k: torch.randint(0, 2, (k,), generator=g, dtype=torch.float64) * 2 - 1  # noqa: E731
    base64 = sign(numel) * torch.exp2(torch.empty(numel, dtype=torch.float64).uniform_(-4, -1, generator=g))
    base = base64.to(dtype)
    b = base.to(torch.float64)
    masks, agents = [], []
    for t in range(n):
        density = densities[t] if densities is not None else 0.1 + 0.5 * torch.rand((), generator=g).item()
        m = torch.rand(numel, generator=g) < density
        a = b.clone()
        a[m] += sign(int(m.sum())) * torch.empty(int(m.sum()), dtype=torch.float64).uniform_(0.02, 0.06, generator=g)
        sub = (~m) & (torch.rand(numel, generator=g) < 0.05)
        a[sub] += sign(int(sub.sum())) * torch.empty(int(sub.sum()), dtype=torch.float64).uniform_(0, 3e-6, generator=g)
        masks.append(m.reshape(shape))
        agents.append(a.to(dtype).reshape(shape))
    return base.reshape(shape), agents, masks


def ref_of(base, agents, eps=EPS, r=R_, alpha=ALPHA, rho=None):
    sd = {"t": base}
    ag = [{"t": a} for a in agents]
    stats = R.reference_stats(sd, ag, eps)
    merged = R.reference_merge(sd, ag, eps, r, alpha, rho=rho)["t"]
    mag = R.reference_magnitudes(sd, ag)["t"]
    return stats, merged, mag


def lambdas_of(stats, r=R_, alpha=ALPHA):
    return [stats[i].lam(r, alpha) for i in range(len(stats))]


# ------------------------------------------------------------------ count


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_count_matches_reference(dtype, n):
    base, agents, masks = make_case(n, dtype, seed=10 * n + DTYPES.index(dtype))
    stats, _, _ = ref_of(base, agents)
    # the reference sees exactly the planned masks
    c = torch.stack(masks).sum(0)
    for t, m in enumerate(masks):
        assert stats[t].active == int(m.sum())
        assert stats[t].unique == int((m & (c == 1)).sum())
    got = kernel.count(base, agents, EPS)
    assert got.dtype == torch.int64 and tuple(got.shape) == (n, 3)
    for t in range(n):
        assert got[t].tolist() == [stats[t].active, stats[t].unique, stats[t].pair], t


@pytest.mark.parametrize("n", [1, 2, 3])
def test_full_blocks_count_exactly(n):
    """Every entry changed by every agent, over several of the compiled loops' 2,048-entry blocks and a ragged
    end: the per-block counters reach their largest values (a narrow counter would wrap)."""
    numel = 5 * 2048 + 7
    base = torch.zeros(numel, dtype=torch.bfloat16)
    agents = [torch.full((numel,), 0.5 * (t + 1), dtype=torch.bfloat16) for t in range(n)]
    got = kernel.count(base, agents, EPS)
    assert got.tolist() == [[numel, numel if n == 1 else 0, numel if n == 2 else 0]] * n
    found = kernel.diagnose(base, agents, EPS)
    assert found.counts.tolist() == got.tolist()
    assert found.pair_counts.tolist() == [[numel, numel]] * (n * (n - 1) // 2)


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_matches_reference(dtype, n):
    base, agents, _ = make_case(n, dtype, seed=100 + 10 * n + DTYPES.index(dtype))
    stats, ref, mag = ref_of(base, agents)
    out = kernel.merge(base, agents, lambdas_of(stats), EPS)
    assert out.dtype == dtype and out.shape == base.shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    R.assert_rounded_equal(out, ref, mag, label=f"{dtype} n={n}", acc_dtype=acc)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_three_regimes_exactly(dtype):
    """Unchanged entries are the base bit for bit; sub-threshold deltas are dropped;
    an entry only one agent changes gets lambda * tau; a shared one the mean."""
    base = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.5, -0.375], dtype=dtype)
    a = torch.tensor([0.25, 0.25 + 2**-6, 0.25 + 2**-5, 0.25 + 2**-4, 0.5, -0.375 + 2**-4], dtype=dtype)
    b = torch.tensor([0.25, 0.25, 0.25 - 2**-5, 0.25 + 2**-3, 0.5, -0.375 - 2**-4], dtype=dtype)
    if dtype in (torch.float32, torch.float64):
        a[4] = 0.5 + 2**-20  # sub-threshold (9.5e-7 <= eps): dropped
    out = kernel.merge(base, [a, b], [1.25, 1.5], EPS)
    expect = torch.tensor(
        [0.25, 0.25 + 1.25 * 2**-6, 0.25, 0.25 + 0.5 * (2**-4 + 2**-3), 0.5, -0.375], dtype=dtype
    )
    assert torch.equal(out, expect), (out, expect)
    counts = kernel.count(base, [a, b], EPS).tolist()
    assert counts == [[4, 1, 3], [3, 0, 3]]


@pytest.mark.quick
def test_active_is_strict_and_absolute():
    d = torch.tensor([1e-5, -1e-5, 1.0000001e-5, -2e-5, 0.0, 3.0], dtype=torch.float64)
    assert kernel.active(d, 1e-5).tolist() == [False, False, True, True, False, True]
    assert kernel.active(d, 0.0).tolist() == [True, True, True, True, False, True]


def test_threshold_is_strict_in_kernel():
    base = torch.zeros(4, dtype=torch.float64)
    a = torch.tensor([1e-5, -1e-5, 2e-5, 0.5e-5], dtype=torch.float64)
    assert kernel.count(base, [a], 1e-5).tolist() == [[1, 1, 0]]
    out = kernel.merge(base, [a], [1.0], 1e-5)
    assert out.tolist() == [0.0, 0.0, 2e-5, 0.0]


# ------------------------------------------------------------------ chunking


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunking_does_not_change_results(dtype, chunk):
    base, agents, _ = make_case(3, dtype, shape=(29, 31), seed=7)  # 899: not a multiple of 7 or 64
    lambdas = [1.05, 1.2, 1.0]
    whole_counts = kernel.count(base, agents, EPS)
    whole = kernel.merge(base, agents, lambdas, EPS)
    assert torch.equal(kernel.count(base, agents, EPS, chunk=chunk), whole_counts)
    assert torch.equal(kernel.merge(base, agents, lambdas, EPS, chunk=chunk), whole)
    stats, ref, mag = ref_of(base, agents)
    assert whole_counts.tolist() == [[stats[t].active, stats[t].unique, stats[t].pair] for t in range(3)]


def test_default_chunking_on_a_large_tensor():
    """More elements than one default CPU chunk (2**18): a full chunk plus a tail."""
    n = kernel.CHUNK_CPU + 12345
    base, agents, _ = make_case(2, torch.bfloat16, shape=(n,), seed=15)
    stats, ref, mag = ref_of(base, agents)
    counts = kernel.count(base, agents, EPS)
    assert counts.tolist() == [[stats[t].active, stats[t].unique, stats[t].pair] for t in range(2)]
    out = kernel.merge(base, agents, lambdas_of(stats), EPS)
    R.assert_rounded_equal(out, ref, mag)
    assert torch.equal(out, kernel.merge(base, agents, lambdas_of(stats), EPS, chunk=n))


def test_chunk_must_be_positive():
    base, agents, _ = make_case(1, torch.float32, shape=(4,))
    with pytest.raises(ValueError, match="chunk"):
        kernel.merge(base, agents, [1.0], EPS, chunk=0)


def test_non_contiguous_and_scalar_inputs():
    base, agents, _ = make_case(2, torch.float32, shape=(16, 12), seed=3)
    bt, at = base.t(), [a.t() for a in agents]
    stats, ref, mag = ref_of(bt, at)
    out = kernel.merge(bt, at, lambdas_of(stats), EPS, chunk=5)
    R.assert_rounded_equal(out, ref, mag)
    assert kernel.count(bt, at, EPS, chunk=5).tolist() == [[s.active, s.unique, s.pair] for s in stats.values()]
    s = torch.tensor(0.5)
    assert kernel.merge(s, [torch.tensor(0.75)], [1.5], EPS).item() == 0.875


def test_empty_and_agentless_inputs():
    empty = torch.empty(0, 3)
    assert kernel.count(empty, [empty.clone()], EPS).tolist() == [[0, 0, 0]]
    assert kernel.merge(empty, [empty.clone()], [1.0], EPS).shape == (0, 3)
    base = torch.randn(5)
    assert kernel.count(base, [], EPS).shape == (0, 3)
    assert torch.equal(kernel.merge(base, [], [], EPS), base)


# ------------------------------------------------------------------ epsilon = 0


def _bump(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Move the given flat entries by one ULP (one bit of the integer view)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone()
    view = out.view(-1).view(ints)
    view[index] += 1
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epsilon_zero_counts_every_bit_change(dtype):
    base, _, _ = make_case(1, dtype, shape=(40, 10), seed=5)
    g = _gen(9)
    picks = [torch.randperm(400, generator=g)[:k] for k in (50, 80, 0)]
    agents = [_bump(base, p) for p in picks]  # the third is identical to the base
    counts = kernel.count(base, agents, 0.0)
    stats, ref, mag = ref_of(base, agents, eps=0.0)
    assert counts.tolist() == [[stats[t].active, stats[t].unique, stats[t].pair] for t in range(3)]
    assert counts[:, 0].tolist() == [50, 80, 0]
    lambdas = [kernel.lambda_clip(kernel.rho(int(c[0] - c[1]), int(c[1])), R_, ALPHA) for c in counts]
    assert lambdas[2] == 1 + R_ * ALPHA  # no unique entry (nor any entry): rho = inf
    out = kernel.merge(base, agents, lambdas, 0.0)
    assert not torch.isnan(out).any()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    R.assert_rounded_equal(out, ref, mag, acc_dtype=acc)
    # one agent identical to the base, alone, epsilon 0: no NaN, the base back
    same = kernel.merge(base, [base.clone()], [1.2], 0.0)
    assert torch.equal(same, base)
    assert kernel.count(base, [base.clone()], 0.0).tolist() == [[0, 0, 0]]


# ------------------------------------------------------------------ zero unique


def test_agent_without_unique_entries():
    base, agents, masks = make_case(2, torch.bfloat16, seed=21, densities=[0.5, 0.3])
    # agent C changes only entries that A changes too: it has no unique entry
    b = base.to(torch.float64)
    only = masks[0] & (torch.rand(base.shape, generator=_gen(4)) < 0.5)
    c = b.clone()
    c[only] -= 0.03
    agents.append(c.to(torch.bfloat16))
    counts = kernel.count(base, agents, EPS)
    active, unique, _ = counts[2].tolist()
    assert active == int(only.sum()) > 0 and unique == 0
    rho = kernel.rho(active - unique, unique)
    assert rho == math.inf
    lam = kernel.lambda_clip(rho, R_, ALPHA)
    assert lam == pytest.approx(1 + R_ * ALPHA)
    stats, ref, mag = ref_of(base, agents)
    assert stats[2].rho == math.inf
    out = kernel.merge(base, agents, lambdas_of(stats), EPS)
    R.assert_rounded_equal(out, ref, mag)


# ------------------------------------------------------------------ rho / lambda


@pytest.mark.quick
def test_rho_values():
    assert kernel.rho(3, 2) == 1.5
    assert kernel.rho(0, 5) == 0.0
    assert kernel.rho(5, 0) == math.inf
    assert kernel.rho(0, 0) == math.inf


@pytest.mark.parametrize(
    "rho_t, r, alpha, expected",
    [
        (1.5, 0.1, 2.0, 1.15),
        (3.0, 0.1, 2.0, 1.2),
        (math.inf, 0.1, 2.0, 1.2),
        (math.inf, 0.2, 1.0, 1.2),
        (0.0, 0.1, 2.0, 1.0),
        (-1.0, 0.1, 2.0, 1.0),
        (0.0, 0.0, 2.0, 1.0),
        (1.5, 0.0, 2.0, 1.0),
        (math.inf, 0.0, 2.0, 1.0),
        (5.0, 0.1, math.inf, 1.5),
    ],
)
def test_lambda_clip(rho_t, r, alpha, expected):
    assert kernel.lambda_clip(rho_t, r, alpha) == pytest.approx(expected)


def test_lambda_clip_r_zero_unclipped_alpha():
    assert kernel.lambda_clip(math.inf, 0.0, math.inf) == 1.0


def test_infinite_lambda_is_rejected():
    """inf * a masked 0 is NaN: an infinite lambda must never reach the arithmetic."""
    base = torch.zeros(4)
    a = torch.tensor([1.0, 1.0, 0.0, 0.0])
    c = torch.tensor([0.0, 2.0, 0.0, 0.0])  # no unique entry: rho = inf
    lam = [kernel.lambda_clip(kernel.rho(1, 1), 0.1, math.inf), kernel.lambda_clip(math.inf, 0.1, math.inf)]
    with pytest.raises(ValueError, match="lambda"):
        kernel.merge(base, [a, c], lam, EPS)
    # with a finite alpha the agent without unique entries multiplies nothing
    lam = [kernel.lambda_clip(1.0, 0.1, 2.0), kernel.lambda_clip(math.inf, 0.1, 2.0)]
    assert torch.allclose(kernel.merge(base, [a, c], lam, EPS), torch.tensor([1.1, 1.5, 0.0, 0.0]))


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("fn", ["count", "merge"])
@pytest.mark.parametrize(
    "where, value",
    [("base", float("nan")), ("base", float("inf")), ("agent", float("nan")), ("agent", float("-inf"))],
)
def test_non_finite_inputs_are_rejected(fn, where, value):
    base, agents, _ = make_case(3, torch.bfloat16, shape=(10, 9), seed=2)
    target = base if where == "base" else agents[1]
    target.view(-1)[85] = value  # in the last chunk of 7
    names = ["alpha-agent", "beta-agent", "gamma-agent"]
    kwargs = dict(names=names, tensor_name="model.layers.0.mlp.up_proj.weight", chunk=7)
    with pytest.raises(kernel.NonFiniteInputError) as info:
        if fn == "count":
            kernel.count(base, agents, EPS, **kwargs)
        else:
            kernel.merge(base, agents, [1.0] * 3, EPS, **kwargs)
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight" in message
    if where == "base":
        assert "base" in message
    else:
        assert "beta-agent" in message and "alpha-agent" not in message


def test_non_finite_without_names_uses_agent_index():
    base, agents, _ = make_case(2, torch.float32, shape=(6,), seed=2)
    agents[1][3] = float("nan")
    with pytest.raises(kernel.NonFiniteInputError, match="#1"):
        kernel.merge(base, agents, [1.0, 1.0], EPS)


def test_overflowing_task_vector_is_rejected():
    base = torch.tensor([-3e38, 0.0])
    agent = torch.tensor([3e38, 0.0])
    with pytest.raises(kernel.NonFiniteInputError, match="overflow"):
        kernel.count(base, [agent], EPS, tensor_name="w")


OVERFLOWS = [  # (inputs, written in, agent value at the entry, lambda): finite inputs, a result its dtype cannot hold
    (torch.float16, torch.float16, 64000.0, 1.2),  # issue 39's mergekit-pytorch repro: 76,800
    (torch.bfloat16, torch.bfloat16, 3.0e38, 1.2),  # past float32 too: the kernel's own arithmetic overflows
    (torch.float32, torch.float32, 3.0e38, 1.2),
    (torch.float32, torch.float16, 60000.0, 1.2),  # out_dtype narrower than the inputs
    (torch.bfloat16, torch.float16, 70144.0, 1.0),  # r = 0: the agent's own value, rounded once to float16
]


@pytest.mark.parametrize("dtype, out_dtype, value, lam", OVERFLOWS, ids=lambda v: str(v).removeprefix("torch."))
def test_a_merge_its_dtype_cannot_hold_is_refused_naming_agent_lambda_and_dtype(dtype, out_dtype, value, lam):
    """Before: both kernels wrote inf from finite inputs, silently (issue 39, case 4)."""
    n = 5000  # more than two native blocks: the entry lies in the third
    base = torch.zeros(n, dtype=dtype)
    a, b = base.clone(), base.clone()
    a[4321], a[10:40], b[10:40], b[50] = value, 0.01, 0.02, 0.5
    assert torch.isfinite(a).all()
    with pytest.raises(kernel.NonFiniteResultError) as info:
        kernel.merge(base, [a, b], [lam, 1.05], EPS, out_dtype=out_dtype, names=["agent-a", "agent-b"],
                     tensor_name="w")  # fmt: skip
    written = str(out_dtype).removeprefix("torch.")
    message = str(info.value)
    assert message.startswith(f"tensor w: the merge of finite inputs is not finite in {written} at 1 entry; ")
    stored = float(a[4321].float())  # the value as the input dtype holds it
    assert f"at entry 4321, only agent-a changed it (by {stored:g}), and its lambda = {lam:g} makes" in message
    assert f"beyond {written}'s largest value" in message and "or with a smaller `r`" in message
    assert info.value.tensor == "w" and "agent-b" not in message


@pytest.mark.parametrize("out_dtype, halfway", [(torch.float16, 65520.0), (torch.bfloat16, float.fromhex("0x1.ffp127"))],
                         ids=["float16", "bfloat16"])  # fmt: skip
def test_the_check_is_the_one_rounding_exactly(out_dtype, halfway):
    """float32 results written narrower: the float32 just below the halfway point above the dtype's largest value
    rounds to it (kept); the halfway point rounds to an infinity (refused)."""
    base = torch.zeros(3000, dtype=torch.float32)
    agent = base.clone()
    agent[2999] = torch.nextafter(torch.tensor(halfway), torch.tensor(0.0))
    out = kernel.merge(base, [agent], [1.0], EPS, out_dtype=out_dtype)
    assert float(out[2999]) == torch.finfo(out_dtype).max
    agent[2999] = halfway
    with pytest.raises(kernel.NonFiniteResultError, match="at entry 2999, only agent #0 changed it"):
        kernel.merge(base, [agent], [1.0], EPS, out_dtype=out_dtype)


def test_a_mean_its_dtype_cannot_hold_names_the_agents():
    base = torch.zeros(8, dtype=torch.float32)
    a, b = base.clone(), base.clone()
    a[3], b[3] = 3.0e38, 3.0e38  # their float32 sum overflows
    with pytest.raises(kernel.NonFiniteResultError, match="at entry 3, A, B changed it; their mean update"):
        kernel.merge(base, [a, b], [1.2, 1.2], EPS, names=["A", "B"])


@pytest.mark.parametrize("fn, doing, scratch", [("count", "counting", 2048), ("diagnose", "diagnosing", 5 * 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_allocation_failure_is_named_and_an_overflow_keeps_its_message(
    backend, monkeypatch, fn, doing, scratch, dtype
):
    """The C loops return NO_MEMORY when malloc fails: a MemoryError naming the bytes and the tensor,
    not the overflow message (which a failed allocation used to get from `count`)."""
    from mergekit_ram.core import native

    if backend != "native":
        pytest.skip("the native loops' allocation")
    lib, name = native.library(), native._NAMES[str(dtype)]
    assert getattr(lib, f"{fn}_scratch")(3) == 3 * scratch  # per agent: a mask byte (and a float32 delta) per entry
    base, agents, _ = make_case(3, dtype, shape=(10, 9), seed=2)
    with monkeypatch.context() as m:
        m.setattr(lib, f"{fn}_{name}", lambda *args: native._NO_MEMORY)
        with pytest.raises(MemoryError) as info:
            getattr(kernel, fn)(base, agents, EPS, tensor_name="model.layers.0.mlp.up_proj.weight")
    message = str(info.value)
    assert f"could not allocate {3 * scratch} bytes" in message, message
    assert f"while {doing} tensor model.layers.0.mlp.up_proj.weight" in message, message
    assert "overflow" not in message
    with pytest.raises(MemoryError, match="while counting a tensor"), monkeypatch.context() as m:
        m.setattr(lib, f"count_{name}", lambda *args: native._NO_MEMORY)
        kernel.count(base, agents, EPS)
    # a real overflow (finite inputs, an Inf task vector) keeps its own message
    over = [torch.tensor([-3e38, 0.0]), torch.tensor([3e38, 0.0])] if dtype == torch.float32 else None
    if over is not None:
        with pytest.raises(kernel.NonFiniteInputError, match="tensor w: a task vector overflows to Inf"):
            getattr(kernel, fn)(over[0], [over[1]], EPS, tensor_name="w")
    assert getattr(kernel, fn)(base, agents, EPS) is not None  # the loops themselves are back


@pytest.mark.quick
def test_shape_mismatch_names_agent_and_tensor():
    base = torch.zeros(4, 3)
    with pytest.raises(ValueError) as info:
        kernel.merge(base, [torch.zeros(4, 3), torch.zeros(3, 4)], [1.0, 1.0], EPS, names=["ok", "odd-one"], tensor_name="w.q")
    assert "odd-one" in str(info.value) and "w.q" in str(info.value)
    with pytest.raises(ValueError, match="odd-one"):
        kernel.count(base, [torch.zeros(4, 3), torch.zeros(12)], EPS, names=["ok", "odd-one"])


def test_other_argument_errors():
    base = torch.zeros(3)
    with pytest.raises(ValueError, match="lambdas"):
        kernel.merge(base, [base.clone()], [1.0, 1.0], EPS)
    with pytest.raises(ValueError, match="names"):
        kernel.count(base, [base.clone()], EPS, names=["a", "b"])
    with pytest.raises(TypeError, match="int-agent"):
        kernel.count(base, [torch.zeros(3, dtype=torch.int64)], EPS, names=["int-agent"])


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize(
    "base_dtype, agent_dtype, expected",
    [
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16, torch.float16),
        (torch.float32, torch.float32, torch.float32),
        (torch.float64, torch.float64, torch.float64),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.bfloat16, torch.float16, torch.float32),
        (torch.float32, torch.float64, torch.float64),
    ],
    ids=str,
)
def test_default_output_dtype_is_promoted_input_dtype(base_dtype, agent_dtype, expected):
    base, agents, _ = make_case(2, base_dtype, shape=(12, 11), seed=8)
    agents = [agents[0], agents[1].to(agent_dtype)]
    out = kernel.merge(base, agents, [1.1, 1.2], EPS)
    assert out.dtype == expected
    stats, ref, mag = ref_of(base, agents)
    acc = torch.float64 if expected == torch.float64 else torch.float32
    out2 = kernel.merge(base, agents, lambdas_of(stats), EPS)
    R.assert_rounded_equal(out2, ref, mag, acc_dtype=acc)


@pytest.mark.parametrize(
    "in_dtype, out_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float64, torch.float16),
        (torch.float16, torch.bfloat16),
    ],
    ids=str,
)
def test_out_dtype_is_honoured_with_one_rounding(in_dtype, out_dtype):
    base, agents, _ = make_case(3, in_dtype, shape=(30, 20), seed=12)
    stats, ref, mag = ref_of(base, agents)
    out = kernel.merge(base, agents, lambdas_of(stats), EPS, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    acc = torch.float64 if in_dtype == torch.float64 else torch.float32
    R.assert_rounded_equal(out, ref, mag, acc_dtype=acc)


def test_inputs_are_not_modified():
    base, agents, _ = make_case(3, torch.bfloat16, seed=13)
    copies = [base.clone()] + [a.clone() for a in agents]
    kernel.count(base, agents, EPS, chunk=11)
    kernel.merge(base, agents, [1.1, 1.2, 1.0], EPS, chunk=11)
    assert all(torch.equal(x, y) for x, y in zip([base, *agents], copies))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    base, agents, _ = make_case(3, torch.bfloat16, shape=(64, 33), seed=14)
    lambdas = [1.1, 1.2, 1.0]
    cpu = kernel.merge(base, agents, lambdas, EPS)
    gpu = kernel.merge(base.cuda(), [a.cuda() for a in agents], lambdas, EPS)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(kernel.count(base.cuda(), [a.cuda() for a in agents], EPS).cpu(), kernel.count(base, agents, EPS))


# ------------------------------------------------------------------ memory

_MEMORY_SCRIPT = textwrap.dedent(
    r"""
    import resource, sys
    import torch
    torch.set_num_threads(1)
    N = 8 * 1024 * 1024
    which = sys.argv[1]

    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    base = torch.empty(N, dtype=torch.float32).uniform_(-0.5, 0.5)
    agents = []
    for t in range(3):
        a = base.clone()
        a[t::5].add_(0.01)      # in place on strided views: no temporaries
        a[t + 1::7].sub_(0.02)
        agents.append(a)
    k = 4096
    if which == "ours":
        from mergekit_ram.core import kernel
        kernel.count(base[:k], [a[:k] for a in agents], 1e-5)
        kernel.merge(base[:k], [a[:k] for a in agents], [1.1, 1.2, 1.0], 1e-5)
        p0 = peak_kib()
        counts = kernel.count(base, agents, 1e-5)
        p1 = peak_kib()
        out = kernel.merge(base, agents, [1.1, 1.2, 1.0], 1e-5)
        p2 = peak_kib()
        assert out.shape == base.shape
        print(p0, p1, p2)
    else:
        from mergekit.merge_methods.base import TensorGroup
        from mergekit.merge_methods.ram import ram_merge
        group = lambda n: TensorGroup.from_tensors([base[:n]] + [a[:n] for a in agents], base_index=0)
        ram_merge.implementation(group(k), epsilon=1e-5)
        p0 = peak_kib()
        out = ram_merge.implementation(group(N), epsilon=1e-5)
        p1 = peak_kib()
        assert out.numel() == N
        print(p0, p1, p1)
    """
)


def test_peak_memory_is_far_below_mergekit_ram(tmp_path):
    script = tmp_path / "peak.py"
    script.write_text(_MEMORY_SCRIPT)
    # a fixed mmap threshold makes glibc hand big blocks back at once, so the
    # resident-set peak measures live allocations rather than heap retention
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="65536",
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
    )
    procs = {
        which: subprocess.Popen(
            [sys.executable, str(script), which], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for which in ("ours", "mergekit")
    }
    results = {}
    for which, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        results[which] = [int(x) for x in out.split()[-3:]]
    p0, p1, p2 = results["ours"]
    m0, m1, _ = results["mergekit"]
    input_kib = 4 * 8 * 1024 * 1024 * 4 // 1024  # base + 3 agents, float32
    ours_count, ours_merge, theirs = p1 - p0, p2 - p0, m1 - m0
    report = f"extra peak KiB: count {ours_count}, merge {ours_merge} (output alone 32768), mergekit ram {theirs}"
    print(report)
    assert ours_count < input_kib / 4, report
    assert ours_merge < input_kib / 2, report  # the output itself is 1/4 of the input
    assert ours_merge <= theirs / 3, report


# ------------------------------------------------------------------ known bugs


def test_many_agents_do_not_overflow_the_hit_counter():
    n = 257
    base = torch.zeros(3)
    agents = [torch.tensor([1.0, 0.0, 0.0]) for _ in range(n)]
    counts = kernel.count(base, agents, EPS)
    assert counts[:, 1].sum().item() == 0  # every active entry is shared
    assert torch.equal(kernel.merge(base, agents, [1.5] * n, EPS), torch.tensor([1.0, 0.0, 0.0]))


def test_inputs_requiring_grad():
    base, agents, _ = make_case(2, torch.float32, shape=(6, 5), seed=30)
    base = nn_param(base)
    agents = [nn_param(a) for a in agents]
    stats, ref, mag = ref_of(base.detach(), [a.detach() for a in agents])
    assert kernel.count(base, agents, EPS).tolist() == [[s.active, s.unique, s.pair] for s in stats.values()]
    out = kernel.merge(base, agents, lambdas_of(stats), EPS)
    R.assert_rounded_equal(out.detach(), ref, mag)


def nn_param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.clone())


# ------------------------------------------------------------------ native vs torch


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32], ids=str)
def test_native_and_torch_paths_agree(backend, dtype, out_dtype, monkeypatch):
    """The fused loops are used when available and give the torch path's bits."""
    from mergekit_ram.core import native

    if backend != "native":
        pytest.skip("compares the native path with the torch path")
    base, agents, _ = make_case(4, dtype, shape=(300, 301), seed=44)
    lambdas = [1.2, 1.0, 1.15, 1.05]
    calls = []
    real = native.merge
    monkeypatch.setattr(native, "merge", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = kernel.merge(base, agents, lambdas, EPS, out_dtype=out_dtype)
    fast_counts = kernel.count(base, agents, EPS)
    assert calls, "the native kernel was not used"
    monkeypatch.setenv("MERGEKIT_RAM_NATIVE", "0")
    slow = kernel.merge(base, agents, lambdas, EPS, out_dtype=out_dtype)
    assert torch.equal(fast_counts, kernel.count(base, agents, EPS))
    assert fast.dtype == slow.dtype
    assert torch.equal(fast, slow), int((fast != slow).sum())


# ------------------------------------------------------------------ the torch path's threads (issue 53)


@pytest.mark.quick
def test_the_torch_path_leaves_torchs_thread_count_as_it_found_it(backend):
    """The torch loops run in the pool's threads with torch on one thread each (an op on torch's own threads waited
    for a descheduled thread on a busy machine); torch records that one as its default too, so the caller's count
    is put back: the caller and threads started later still get theirs."""
    import threading

    if backend != "torch":
        pytest.skip("the torch path's threads")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        base, agents, _ = make_case(3, torch.bfloat16, shape=(300, 1000), seed=5)  # 3 chunks of 2^17: both threads
        kernel.merge(base, agents, [1.1, 1.0, 0.9], EPS)
        kernel.diagnose(base, agents, EPS)
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert (torch.get_num_threads(), seen) == (2, [2])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_torch_path_gives_the_same_bits_for_any_thread_count(backend, dtype):
    """Counts, merged values and the diagnostics' float64 sums (per chunk, added in chunk order) do not depend on how
    many threads share the chunks."""
    if backend != "torch":
        pytest.skip("the torch path's threads")
    before = torch.get_num_threads()
    base, agents, _ = make_case(3, dtype, shape=(700, 1301), seed=9)  # 7 chunks: split unevenly between threads
    found = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            d = kernel.diagnose(base, agents, EPS)
            found.append([kernel.merge(base, agents, [1.2, 0.8, 1.05], EPS), *(getattr(d, f) for f in vars(d))])
    finally:
        torch.set_num_threads(before)
    for other in found[1:]:
        assert all(torch.equal(x, y) for x, y in zip(found[0], other, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lambda_times_delta_is_rounded_before_it_is_added(dtype):
    """_native.c adds lambda * tau, rounded, to +0; torch's `add_(alpha=)` fused the two (one rounding), which kept the
    sign of a product too small to hold: base -0, one agent, lambda * tau underflowing to -0 gave -0, not +0."""
    base = torch.tensor([-0.0, -0.0, 0.5], dtype=dtype)
    agent = torch.tensor([-1e-39, 1e-39, 0.75], dtype=dtype)
    out = kernel.merge(base, [agent], [1e-30], 0.0, out_dtype=torch.float32)
    assert out.tolist() == [0.0, 0.0, 0.5] and not torch.signbit(out).any(), (out, torch.signbit(out))


def _edge_values(numel: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values of every kind a checkpoint holds: +0, -0, denormal, small, large."""
    kind = torch.randint(0, 5, (numel,), generator=g)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * 0.05
    scale = torch.tensor([0.0, -0.0, 1e-38, 1.0, 1e3], dtype=torch.float64)[kind]
    return torch.where(kind < 2, scale, x * scale).to(dtype)


@pytest.mark.parametrize("seed", range(12))
def test_native_and_torch_paths_agree_on_edge_values(backend, seed, monkeypatch):
    """The two paths' bits (the sign of zero included) on +-0, denormals, epsilon 0, lambdas 0, -0 and 1e-30: where
    the torch path once fused lambda * tau into the add (issue 53's fuzz)."""
    from mergekit_ram.core import native

    if backend != "native":
        pytest.skip("compares the native path with the torch path")
    g = torch.Generator().manual_seed(seed)
    dtype = [torch.bfloat16, torch.float16, torch.float32][seed % 3]
    out_dtype = [None, torch.bfloat16, torch.float16, torch.float32][seed % 4]
    n, numel = 1 + seed % 4, [5_000, 20_000][seed % 2]
    base = _edge_values(numel, dtype, g)
    agents = []
    for _ in range(n):
        changed = torch.rand(numel, generator=g) < torch.rand((), generator=g)
        agents.append(torch.where(changed, _edge_values(numel, dtype, g), base))
    lambdas = [[0.0, -0.0, 1e-30, 1e-30, 1.2, -0.7, 3.0][int(i)] for i in torch.randint(0, 7, (n,), generator=g)]
    epsilon = [0.0, 0.0, 1e-5, 1e-3][seed % 4]
    found = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MERGEKIT_RAM_NATIVE", flag)
        assert native.supports(base, agents) == (flag == "1")
        merged = kernel.merge(base, agents, lambdas, epsilon, out_dtype=out_dtype)
        d = kernel.diagnose(base, agents, epsilon)
        found.append([merged, torch.signbit(merged), kernel.count(base, agents, epsilon), d.counts, d.single, d.pair_counts])
    assert all(torch.equal(x, y) for x, y in zip(*found, strict=True)), [torch.equal(x, y) for x, y in zip(*found)]
