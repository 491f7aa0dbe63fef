"""What the start-up hook costs every Python process: mergekit_ram's import at start-up.

Usage: python benchmarks/startup.py [--samples N] [--target-ms MS] [--out FILE.json]

`mergekit_ram.pth` imports the torch-free package at every interpreter start. This runs
`python -X importtime -c pass` N times in an empty folder (so that mergekit_ram comes from the
installation) and reads mergekit_ram's cumulative import time from each, then prints the median,
the samples and whether the median is under the target (20 ms by default; about a millisecond on
a quiet machine). A measurement, not a test: on a busy machine the figure grows with the load,
which is why it left the test suite (`tests/test_finder.py` keeps what does not depend on the
clock: the start-up imports no torch, no mergekit and nothing but the hook). Exit status 0 even
when the target is missed; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def import_time_us(cwd: str) -> int:
    """mergekit_ram's cumulative import time (microseconds) in one fresh interpreter's start-up."""
    env = {k: v for k, v in os.environ.items() if k not in ("MERGEKIT_RAM_DISABLE", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"python -X importtime failed:\n{proc.stderr[-2000:]}")
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):
            _, _self, cumulative, name = (p.strip() for p in line.replace(":", "|", 1).split("|"))
            if name == "mergekit_ram":
                return int(cumulative)
    raise RuntimeError("mergekit_ram was not imported at start-up (is it installed, and its .pth?):\n"
                       + proc.stderr[-2000:])


def measure(samples: int) -> list[int]:
    with tempfile.TemporaryDirectory() as cwd:
        return [import_time_us(cwd) for _ in range(samples)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--target-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    samples = measure(args.samples)
    median = statistics.median(samples) / 1000
    result = {
        "median_ms": median,
        "samples_ms": [s / 1000 for s in samples],
        "target_ms": args.target_ms,
        "met": median < args.target_ms,
        "python": sys.version.split()[0],
        "load_average": list(os.getloadavg()),
    }
    print(f"mergekit_ram start-up import (cumulative, -X importtime): median {median:.2f} ms over "
          f"{len(samples)} runs, samples {[round(s, 2) for s in result['samples_ms']]} ms; target < "
          f"{args.target_ms:g} ms: {'met' if result['met'] else 'NOT met'} (load average "
          f"{result['load_average'][0]:.2f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
