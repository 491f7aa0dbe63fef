"""Named benchmark workloads, built with `mergekit_ram.synthetic.build_workload` and cached on disk.

Each workload lives in ROOT/<name> (ROOT: `--root`, `$MERGEKIT_RAM_BENCH_DIR`
or /tmp/mergekit-ram-bench) and is rebuilt only when its marker file
`workload.json` is missing or records different parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from mergekit_ram.synthetic import Workload, build_workload

DEFAULT_ROOT = "/tmp/mergekit-ram-bench"
MARKER = "workload.json"
#: Agent densities, cycled: the paper's Code/Tool/Memory (3/46/54 %) first.
DENSITIES = (0.03, 0.46, 0.54, 0.25, 0.10, 0.35, 0.50, 0.05)


def spec(arch="qwen2", hidden=1024, layers=12, vocab=32000, agents=3, tied=False) -> dict:
    """`build_workload` keyword arguments for a bf16 workload with `agents` agents."""
    return {
        "arch": arch,
        "hidden_size": hidden,
        "num_layers": layers,
        "vocab_size": vocab,
        "num_heads": max(1, hidden // 64),
        "num_kv_heads": max(1, hidden // 256),  # 4:1 grouped-query attention
        "tie_word_embeddings": tied,
        "densities": [DENSITIES[i % len(DENSITIES)] for i in range(agents)],
        "dtype": "bfloat16",
        "seed": 0,
    }


WORKLOADS: dict[str, dict] = {
    "tiny": spec(hidden=64, layers=2, vocab=256, agents=2),
    "W1": spec(hidden=1024, layers=12, vocab=32000),  # ~200M params
    "W2": spec(arch="llama", hidden=2048, layers=2, vocab=128256),  # ~615M, two 262M-element tensors
    "G1": spec(hidden=2048, layers=16, vocab=32000),  # ~0.85B, for GPU runs; not run by default
}
#: Scaling series: model size at fixed layers/vocab/N, and N at fixed size.
SCALING: dict[str, list[str]] = {"size": [], "agents": []}
for _h in (256, 512, 1024, 1536, 2048):
    WORKLOADS[f"S{_h}"] = spec(hidden=_h, layers=6, vocab=16000)
    SCALING["size"].append(f"S{_h}")
for _n in (2, 3, 4, 6, 8):
    WORKLOADS[f"N{_n}"] = spec(hidden=2048, layers=6, vocab=16000, agents=_n)
    SCALING["agents"].append(f"N{_n}")


def root_dir(root: str | os.PathLike | None = None) -> Path:
    return Path(root or os.environ.get("MERGEKIT_RAM_BENCH_DIR") or DEFAULT_ROOT).resolve()


def get(name: str, root: str | os.PathLike | None = None, *, quiet: bool = False) -> tuple[Workload, dict]:
    """The workload `name` (built if needed) and its marker (parameters, paths, size)."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    params = WORKLOADS[name]
    folder = root_dir(root) / name
    marker = folder / MARKER
    try:
        found = json.loads(marker.read_text())
        if found["params"] == params and Path(found["base"]).is_dir():
            return _workload(found), found
    except (OSError, ValueError, KeyError):
        pass
    if not quiet:
        print(f"building workload {name} in {folder} ...", file=sys.stderr, flush=True)
    if folder.exists():
        shutil.rmtree(folder)
    start = time.perf_counter()
    wl = build_workload(folder, **params)
    found = {
        "name": name,
        "params": params,
        "base": str(wl.base),
        "agents": {k: str(v) for k, v in wl.agents.items()},
        "num_parameters": wl.num_parameters,
        "build_s": round(time.perf_counter() - start, 2),
    }
    marker.write_text(json.dumps(found, indent=2) + "\n")  # written last: marks a complete build
    if not quiet:
        print(f"built {name}: {wl.num_parameters / 1e6:.1f}M params in {found['build_s']} s", file=sys.stderr)
    return wl, found


def _workload(marker: dict) -> Workload:
    return Workload(
        base=Path(marker["base"]),
        agents={k: Path(v) for k, v in marker["agents"].items()},
        num_parameters=marker["num_parameters"],
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build (or find) benchmark workloads.")
    parser.add_argument("names", nargs="*", default=["W1", "W2"], help=f"any of {', '.join(WORKLOADS)}")
    parser.add_argument("--root", help=f"workload folder (default ${{MERGEKIT_RAM_BENCH_DIR}} or {DEFAULT_ROOT})")
    args = parser.parse_args(argv)
    for name in args.names:
        _, marker = get(name, args.root)
        print(f"{name}: {marker['num_parameters'] / 1e6:.1f}M params, base {marker['base']}")


if __name__ == "__main__":
    main()
