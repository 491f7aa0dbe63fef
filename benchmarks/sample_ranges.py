"""How many ranges, and how many bytes, `verify --sample P` asks of a merge's weight files and its inputs', under
other draws and other joins than the one verify uses: counted from the files' safetensors headers, nothing sent.

    python benchmarks/sample_ranges.py --merged DIR --inputs DIR [DIR ...] [--share 0.02] [--seeds 1,2]

For each seed: the ranges and bytes of the slices (a) as verify draws them (`sample.draw`) and joins them (4 KiB,
`ranged.GAP`), then with every gap up to 16 KiB, 64 KiB and 1 MiB joined; (b) with every gap joined in order of
size while the bytes added stay within a budget (0.25, 0.45, 1 and 2 × the slices' own bytes), and gaps up to 4 KiB
always; (c) with at least 4, 6, 8 (verify's), 10, 12 or 16 runs a tensor (`least_runs`), joined at 4 KiB, and the
bound a tensor half changed in one block passes with. Headers and identity windows are left out (the same in all).
Issue 71's choices, on R3w (workloads.py): docs/verify.md, "Measured: through a link".
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

from mergekit_ram.verify import ranged, sample


def header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        found = json.loads(f.read(size))
    found.pop("__metadata__", None)
    return 8 + size, found


def spans(drawn: sample.Sample, files: dict[Path, tuple[int, dict]]) -> dict[Path, list[tuple[int, int]]]:
    """Each file's byte spans of the drawn slices (a tensor the file does not hold: none)."""
    out: dict[Path, list[tuple[int, int]]] = {path: [] for path in files}
    for cut in drawn.slices:
        for path, (start, found) in files.items():
            entry = found.get(cut.name)
            if entry is not None:
                first = start + entry["data_offsets"][0]
                size = 2 if entry["dtype"] in ("BF16", "F16") else 4
                out[path] += [(first + a * size, first + b * size) for a, b in cut.spans()]
    return out


def joined(found: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(found):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def count(per: dict[Path, list[tuple[int, int]]], gap: int) -> tuple[int, int]:
    ranges = [joined(found, gap) for found in per.values()]
    return sum(map(len, ranges)), sum(b - a for found in ranges for a, b in found)


def budgeted(per: dict[Path, list[tuple[int, int]]], budget: float) -> tuple[int, int]:
    """Gaps up to `ranged.GAP` joined, then the others smallest first while the bytes added stay within `budget`
    × the slices' own bytes."""
    exact = {path: joined(found, 0) for path, found in per.items()}
    own = sum(b - a for found in exact.values() for a, b in found)
    gaps = sorted(found[i + 1][0] - found[i][1] for found in exact.values() for i in range(len(found) - 1))
    requests, added = sum(map(len, exact.values())), 0
    for gap in gaps:
        if gap > ranged.GAP and added + gap > budget * own:
            break
        added, requests = added + gap, requests - 1
    return requests, own + added


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merged", required=True, help="the merge's folder (one model.safetensors)")
    parser.add_argument("--inputs", nargs="+", required=True, help="the inputs' folders")
    parser.add_argument("--share", type=float, default=0.02)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args(argv)
    files = {Path(f) / "model.safetensors": header(Path(f) / "model.safetensors") for f in [args.merged, *args.inputs]}
    found = files[Path(args.merged) / "model.safetensors"][1]
    sizes = {n: (math.prod(e["shape"]), math.prod(e["shape"][1:])) for n, e in found.items()}
    for seed in (int(s) for s in args.seeds.split(",")):
        per = spans(sample.draw(sizes, args.share, seed), files)
        print(f"seed {seed}: slices' own bytes {count(per, 0)[1]:,} in {count(per, 0)[0]:,} spans")
        for gap in (ranged.GAP, 1 << 14, 1 << 16, 1 << 20):
            print(f"  joined up to {gap:>9,} bytes apart: {count(per, gap)[0]:7,} ranges, {count(per, gap)[1]:13,} bytes")
        for budget in (0.25, 0.45, 1.0, 2.0):
            print(f"  joined within {budget:4} x the slices' bytes: {budgeted(per, budget)[0]:7,} ranges, "
                  f"{budgeted(per, budget)[1]:13,} bytes")
        for least in (4, 6, 8, 10, 12, 16):
            runs = {n: max(k, least) if least > sample.least_runs(args.share) else k
                    for n, k in sample.allotted({n: s[0] for n, s in sizes.items()}, args.share).items()}
            if least < sample.least_runs(args.share):  # fewer than verify's least: the same allotment, floored lower
                numels = {n: s[0] for n, s in sizes.items()}
                most, total = sample.runs_for(args.share), sum(numels.values())
                density = -most * math.log1p(-sample.REFERENCE) / (sample.REFERENCE * total)
                runs = {n: min(most, max(least, math.ceil(1.1 * density * v))) for n, v in numels.items()}
            cuts = sample.Sample(seed, args.share, tuple(sample.cut(n, *sizes[n], args.share, seed, None, runs[n])
                                                         for n in sorted(sizes)))
            requests, size = count(spans(cuts, files), ranged.GAP)
            print(f"  at least {least:2} runs a tensor: {requests:7,} ranges, {size:13,} bytes; a tensor half changed "
                  f"passes at most {cuts.tensor_bound(0.5):.2%}")


if __name__ == "__main__":
    main()
