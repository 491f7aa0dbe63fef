"""What `-march=native` buys over a portable build of `_native.c`, and what the torch loops cost without any build
(issue 53's wheel decision: a wheel must be built for a baseline CPU, not for the user's).

    python benchmarks/march.py [--numel 11534336] [--rounds 5] [--repeats 5]

Builds the kernel with each set of flags into a temporary folder (the flags `native` uses, less `-march=native`,
plus each target's), then times the three loops of each build on one thread, on one bf16 tensor and 3 agents (as
`kernel_cost.py`), the builds alternated round by round so a busy machine slows them alike; prints each loop's
median over rounds (each round's figure the median of --repeats calls) and checks that every build gives the first
build's counts, diagnostics and merged bits. `--torch` adds the kernel's portable path (what runs without a
compiler), on one thread too.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from kernel_cost import timed

from mergekit_ram.core import build, kernel, native

COMMON = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC", "-std=gnu11"]
TARGETS = {
    "native (today)": ["-march=native", "-mprefer-vector-width=512"],
    "x86-64-v4": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "x86-64-v3": ["-march=x86-64-v3"],
    "x86-64-v2": ["-march=x86-64-v2"],
    "x86-64": ["-march=x86-64"],
}


def case(numel: int):
    torch.manual_seed(0)
    base = torch.randn(numel).to(torch.bfloat16)
    agents = []
    for density in (0.03, 0.46, 0.54):
        agent = base.clone()
        changed = torch.rand(numel) < density
        agent[changed] = (agent[changed].float() + 0.01 * torch.randn(int(changed.sum()))).to(torch.bfloat16)
        agents.append(agent)
    return base, agents


def loops(lib, base, agents, lambdas):
    """The three loops of one build on one thread, as `native` calls them: (count, diagnose, merge) callables."""
    n, numel = len(agents), base.numel()
    ptrs = (ctypes.c_void_p * n)(*[a.data_ptr() for a in agents])
    lams = (ctypes.c_float * n)(*lambdas)
    counts = torch.zeros(n, 3, dtype=torch.int64)
    ints = torch.zeros(4 * n + n * (n - 1), dtype=torch.int64)
    rows = torch.zeros(-(-numel // native.SPAN), 2 * n + 3 * (n * (n - 1) // 2), dtype=torch.float64)
    out = torch.empty_like(base)
    eps = ctypes.c_float(1e-5)

    def count():
        counts.zero_()
        lib.count_bf16(base.data_ptr(), ptrs, n, eps, numel, counts.data_ptr())
        return counts.clone()

    def diagnose():
        ints.zero_()
        rows.zero_()
        lib.diagnose_bf16(base.data_ptr(), ptrs, n, eps, numel, native.SPAN, ints.data_ptr(), rows.data_ptr())
        return torch.cat([ints.double(), rows.sum(dim=0)])

    def merge():
        lib.merge_bf16_bf16(base.data_ptr(), ptrs, n, lams, eps, numel, out.data_ptr())
        return out.clone()

    return count, diagnose, merge


def portable_loops(base, agents, lambdas):
    """The torch path's loops (what runs without a compiler), through `kernel` with an explicit chunk."""
    chunk = kernel.CHUNK_CPU
    return (lambda: kernel.count(base, agents, 1e-5, chunk=chunk), lambda: kernel.diagnose(base, agents, 1e-5, chunk=chunk),
            lambda: kernel.merge(base, agents, lambdas, 1e-5, chunk=chunk))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=2048 * 5632, help="entries (default: one G1 MLP matrix)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch", action="store_true", help="also time the torch loops (no build)")
    args = p.parse_args(argv)
    compiler = build.find_compiler()
    if not compiler:
        raise SystemExit("no C compiler")
    torch.set_num_threads(1)  # one thread for every build and for torch: the loops' own speed
    base, agents = case(args.numel)
    lambdas = [1.1, 0.9, 1.2]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in TARGETS.items():
            out = Path(tmp) / f"{len(runs)}.so"
            done = subprocess.run([compiler, *COMMON, *flags, "-o", str(out), str(build.SOURCE), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode:
                print(f"{name}: does not build ({done.stderr.strip().splitlines()[-1]})")
                continue
            runs[name] = loops(native._declare(ctypes.CDLL(str(out))), base, agents, lambdas)
        if args.torch:
            runs["torch (no build)"] = portable_loops(base, agents, lambdas)
        first = next(iter(runs))
        reference = [fn() for fn in runs[first]]
        for name, fns in runs.items():
            if name in TARGETS:  # the same bits from every build (the torch path: the suite compares it)
                assert all(torch.equal(fn(), ref) for fn, ref in zip(fns, reference, strict=True)), name
        times = {name: {"count": [], "diagnose": [], "merge": []} for name in runs}
        for _ in range(args.rounds):
            for name, (count, diagnose, merge) in runs.items():
                times[name]["count"].append(timed(count, args.repeats))
                times[name]["diagnose"].append(timed(diagnose, args.repeats))
                times[name]["merge"].append(timed(merge, args.repeats))
    print(f"bf16, {args.numel:,} entries, 3 agents, one thread, {compiler}; medians over {args.rounds} rounds of "
          f"{args.repeats} calls; every build gave the same bits")
    print("| build | count s | diagnose s | merge s | x the native build (count, diagnose, merge) |")
    print("|---|---|---|---|---|")
    base_med = {loop: statistics.median(v) for loop, v in times[first].items()}
    for name, found in times.items():
        med = {loop: statistics.median(v) for loop, v in found.items()}
        ratios = ", ".join(f"{med[k] / base_med[k]:.2f}" for k in ("count", "diagnose", "merge"))
        print(f"| {name} | {med['count']:.4f} | {med['diagnose']:.4f} | {med['merge']:.4f} | {ratios} |")


if __name__ == "__main__":
    main()
