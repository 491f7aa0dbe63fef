"""Peak memory of one large-tensor merge: mergekit-ram's kernel vs mergekit's `ram`.

Each measurement runs in a fresh process: it builds a bf16 base and N sparse
bf16 agents of NUMEL elements, records its peak RSS, runs one kernel and
reports the growth of the peak (the kernel's scratch plus its output).

    python benchmarks/kernel_memory.py --numel 262144000 --agents 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
numel, n, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
base = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
agents = []
for t in range(n):
    a = base.clone()
    bits = a.view(torch.int16)
    bits[t::7] += 1          # ~14% of entries moved by one bf16 ULP, in place
    bits[t + 3::11] -= 2
    agents.append(a)
del g
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
start = time.perf_counter()
if which == "ramplus":
    from mergekit_ram.core import kernel
    counts = kernel.count(base, agents, 1e-5)
    out = kernel.merge(base, agents, [1.2] * n, 1e-5)
elif which == "ramplus-torch":
    from mergekit_ram.core import kernel
    counts = kernel.count(base, agents, 1e-5, chunk=kernel.CHUNK_CPU)
    out = kernel.merge(base, agents, [1.2] * n, 1e-5, chunk=kernel.CHUNK_CPU)
else:
    from mergekit.merge_methods.ram import ram_merge
    from mergekit.merge_methods import TensorGroup
    group = TensorGroup.from_tensors([base, *agents], base_index=0, name="w")
    (out,) = ram_merge((group,))
elapsed = time.perf_counter() - start
print(json.dumps({"kernel": which, "extra_peak_bytes": peak() - before, "seconds": elapsed,
                  "inputs_bytes": (n + 1) * numel * 2, "out_dtype": str(out.dtype)}))
"""


def measure(numel: int, agents: int, which: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(numel), str(agents), which], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"kernel": which, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=128 * 2**20)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=["ramplus", "ramplus-torch", "mergekit:ram"])
    args = parser.parse_args()
    gib = 2**30
    print(f"| kernel | extra peak RSS (GiB) | x inputs | seconds |  ({args.numel:,} elements, {args.agents} agents, bf16)")
    print("|---|---|---|---|")
    for which in args.kernels:
        row = measure(args.numel, args.agents, which)
        if "error" in row:
            print(f"| {which} | failed: {row['error']} | | |")
            continue
        print(
            f"| {which} | {row['extra_peak_bytes'] / gib:.2f} | "
            f"{row['extra_peak_bytes'] / row['inputs_bytes']:.2f} | {row['seconds']:.2f} |"
        )


if __name__ == "__main__":
    main()
