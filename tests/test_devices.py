"""What a GPU machine does differently, tested on the CPU: the device flags as a machine with a GPU takes them,
the devices mergekit's executor is given, and the kernel's path on a device other than the CPU (no C loops, the
torch kernel in chunks of `CHUNK_ACCELERATOR` elements), which must give the CPU's results bit for bit.

The tests that need CUDA itself (`test_kernel.py::test_cuda_matches_cpu`, `test_method.py::test_cuda_merge_equals_cpu`)
skip on a CPU machine; these run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from mergekit.options import MergeOptions

from mergekit_ram._mergekit import counting
from mergekit_ram.checks import config_checks
from mergekit_ram.core import kernel, native

EPS = 1e-5


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch sees n CUDA devices (as on a GPU machine when n > 0), whatever this machine has."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: n)  # what mergekit's multi-GPU executor asks

    return see


# mergekit-yaml's flags as MergeOptions fields (its validators turn --cuda and --gpu-rich into a device)
GPU_FLAGS = {
    "--cuda": {"cuda": True},
    "--gpu-rich": {"gpu_rich": True},
    "--multi-gpu": {"multi_gpu": True},
    "--device cuda:0": {"device": "cuda:0"},
    "--device cuda --low-cpu-memory --read-to-gpu": {"device": "cuda", "low_cpu_memory": True, "read_to_gpu": True},
}


@pytest.mark.parametrize("flags", list(GPU_FLAGS))
def test_gpu_flags_pass_the_device_check_where_torch_sees_a_gpu(gpus, flags):
    options = MergeOptions(**GPU_FLAGS[flags])
    gpus(1)
    config_checks.check_devices(options)  # a GPU machine merges with these flags: no refusal
    gpus(0)
    with pytest.raises(ValueError, match="--multi-gpu|--cuda") as refused:
        config_checks.check_devices(options)
    assert "torch sees no" in str(refused.value)


@pytest.mark.quick
def test_cpu_and_auto_pass_the_device_check_with_or_without_a_gpu(gpus):
    for n in (0, 1):
        gpus(n)
        for options in (MergeOptions(), MergeOptions(device="cpu"), MergeOptions(device="auto")):
            config_checks.check_devices(options)
    gpus(1)
    assert MergeOptions(device="auto").device == "cuda"  # mergekit resolves auto when the options are built


@pytest.mark.quick
@pytest.mark.parametrize("low_cpu_memory", [False, True])
def test_the_statistics_pass_runs_on_the_devices_of_the_merge(gpus, low_cpu_memory):
    """The statistics pass's executor gets the merge's devices: math on the GPU, storage on the CPU unless
    --low-cpu-memory keeps intermediate values on the GPU (as mergekit's run_merge builds its executor)."""
    gpus(1)
    options = MergeOptions(cuda=True, low_cpu_memory=low_cpu_memory)
    executor = counting._executor([], options)
    assert executor.math_device == torch.device("cuda")
    assert executor.storage_device == torch.device("cuda" if low_cpu_memory else "cpu")


def _case(numel: int, n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g).bfloat16()
    agents = []
    for _ in range(n):
        mask = torch.rand(numel, generator=g) < 0.3
        agents.append((base.double() + 0.05 * mask * torch.randn(numel, generator=g).sign()).bfloat16())
    return base, agents


def test_off_the_cpu_the_kernel_takes_the_torch_path_in_accelerator_chunks():
    base, agents = _case(16)
    meta = base.to("meta"), [a.to("meta") for a in agents]
    assert not native.supports(*meta)  # the C loops are for CPU tensors only
    assert kernel._chunk(meta[0], None) == kernel.CHUNK_ACCELERATOR
    assert kernel._chunk(base, None) == kernel.CHUNK_CPU < kernel.CHUNK_ACCELERATOR
    assert kernel._chunk(meta[0], 7) == 7


def test_the_gpu_path_gives_the_cpu_results(monkeypatch):
    """On a tensor of three CPU chunks: the CPU's own path (C loops where built, else torch in CPU chunks) against
    the one a GPU runs (the torch kernel, the whole tensor as one accelerator chunk), on the CPU. Counts, merge and
    the diagnostics' integer parts are equal; the diagnostics' float sums agree to rounding (summed in other
    orders)."""
    numel = 2 * kernel.CHUNK_CPU + 1000
    base, agents = _case(numel)
    lambdas = [1.1, 0.9, 1.3]
    cpu = (kernel.count(base, agents, EPS), kernel.merge(base, agents, lambdas, EPS),
           kernel.diagnose(base, agents, EPS))
    monkeypatch.setattr(native, "supports", lambda *_a, **_k: False)  # what a CUDA tensor gets
    monkeypatch.setattr(kernel, "CHUNK_CPU", kernel.CHUNK_ACCELERATOR)
    assert kernel._chunk(base, None) == kernel.CHUNK_ACCELERATOR >= numel
    gpu = (kernel.count(base, agents, EPS), kernel.merge(base, agents, lambdas, EPS),
           kernel.diagnose(base, agents, EPS))
    assert torch.equal(cpu[0], gpu[0])
    assert torch.equal(cpu[1], gpu[1]) and cpu[1].dtype == gpu[1].dtype == torch.bfloat16
    for field in ("counts", "single", "pair_counts"):
        assert torch.equal(getattr(cpu[2], field), getattr(gpu[2], field)), field
    for field in ("magnitude", "pair_sums"):
        torch.testing.assert_close(getattr(cpu[2], field), getattr(gpu[2], field), rtol=1e-12, atol=0)
