"""What `-march=native` buys over a portable build of `_native.c`, and what the torch loops cost without any build
(issue 53's wheel decision: a wheel must be built for a baseline CPU, not for the user's).

    python benchmarks/march.py [--numel 11534336] [--rounds 5] [--repeats 5]

Builds the kernel with each set of flags into a temporary folder (the flags `native` uses, less `-march=native`,
plus each target's), then times the three loops of each build on one bf16 tensor and 3 agents (as
`kernel_cost.py`), the builds alternated round by round so a busy machine slows them alike; prints each loop's
median over rounds (each round's figure the median of --repeats calls) and checks that every build gives the first
build's counts, diagnostics and merged bits. `torch` is the kernel's portable path (`MERGEKIT_RAM_NATIVE=0`).
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
    base, agents = case(args.numel)
    lambdas = [1.1, 0.9, 1.2]
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in TARGETS.items():
            out = Path(tmp) / f"{len(libs)}.so"
            done = subprocess.run([compiler, *COMMON, *flags, "-o", str(out), str(build.SOURCE), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode:
                print(f"{name}: does not build ({done.stderr.strip().splitlines()[-1]})")
                continue
            libs[name] = native._declare(ctypes.CDLL(str(out)))
    times: dict[str, dict[str, list[float]]] = {name: {"count": [], "diagnose": [], "merge": []} for name in libs}
    if args.torch:
        times["torch (no build)"] = {"count": [], "diagnose": [], "merge": []}
    reference = None
    for _ in range(args.rounds):
        for name in times:
            native._lib = libs.get(name)
            if name not in libs:
                native._failed = "timing the torch loops"
            found = (kernel.count(base, agents, 1e-5), kernel.diagnose(base, agents, 1e-5),
                     kernel.merge(base, agents, lambdas, 1e-5))
            bits = (found[0], found[1].counts, found[1].single, found[1].pair_counts, found[2])
            if name in libs:
                bits += (found[1].magnitude, found[1].pair_sums)
            if reference is None:
                reference = bits
            assert all(torch.equal(x, y) for x, y in zip(bits, reference, strict=False)), f"{name}: other bits"
            times[name]["count"].append(timed(lambda: kernel.count(base, agents, 1e-5), args.repeats))
            times[name]["diagnose"].append(timed(lambda: kernel.diagnose(base, agents, 1e-5), args.repeats))
            times[name]["merge"].append(timed(lambda: kernel.merge(base, agents, lambdas, 1e-5), args.repeats))
            native._failed = None
    print(f"bf16, {args.numel:,} entries, 3 agents, {torch.get_num_threads()} threads, {compiler}; medians over "
          f"{args.rounds} rounds of {args.repeats} calls; the same bits from every build")
    first = next(iter(times))
    print("| build | count s | diagnose s | merge s | merge x the native build |")
    print("|---|---|---|---|---|")
    for name, loops in times.items():
        med = {loop: statistics.median(v) for loop, v in loops.items()}
        ratio = med["merge"] / statistics.median(times[first]["merge"])
        print(f"| {name} | {med['count']:.4f} | {med['diagnose']:.4f} | {med['merge']:.4f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
