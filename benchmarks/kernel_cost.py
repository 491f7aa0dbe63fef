"""What the statistics pass costs per tensor against the merge itself: the compiled kernel's count, diagnose
(counts and the report's diagnostics: the statistics pass) and merge loops on one tensor in memory.

    python benchmarks/kernel_cost.py [--numel 11534336] [--densities 0.03 0.46 0.54] [--repeats 7]

A cold `ramplus` merge runs diagnose once per tensor, then merge; `r = 0` runs merge only. With the inputs in
the page cache, reading them costs far less than either loop (`phases.py`'s `read s`), so this ratio, not
the read, is what a cold pass adds on a CPU. Medians over --repeats, torch's thread count as the merge uses it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mergekit_ram.core import native


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=2048 * 5632, help="entries (default: one G1 MLP matrix)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.03, 0.46, 0.54])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if not native.enabled() or native.library() is None:
        raise SystemExit("the compiled kernel is not available here (no C compiler, or MERGEKIT_RAM_NATIVE=0)")
    torch.manual_seed(0)
    base = torch.randn(args.numel).to(torch.bfloat16)
    agents = []
    for density in args.densities:
        agent = base.clone()
        changed = torch.rand(args.numel) < density
        agent[changed] = (agent[changed].float() + 0.01 * torch.randn(int(changed.sum()))).to(torch.bfloat16)
        agents.append(agent)
    out = torch.empty_like(base)
    lambdas = [1.1] * len(agents)
    count = timed(lambda: native.count(base, agents, 1e-5), args.repeats)
    diagnose = timed(lambda: native.diagnose(base, agents, 1e-5), args.repeats)
    merge = timed(lambda: native.merge(base, agents, lambdas, 1e-5, out), args.repeats)
    print(f"bf16, {args.numel:,} entries, {len(agents)} agents (densities {args.densities}), "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}: count {count:.4f} s, diagnose "
          f"{diagnose:.4f} s, merge {merge:.4f} s; diagnose / merge {diagnose / merge:.2f}, "
          f"count / merge {count / merge:.2f}")


if __name__ == "__main__":
    main()
