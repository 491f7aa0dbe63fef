"""Named benchmark workloads, built with `mergekit_ram.example_models.build_workload` and cached on disk.

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

from mergekit_ram.example_models import Workload, build_workload

DEFAULT_ROOT = "/tmp/mergekit-ram-bench"
MARKER = "workload.json"
#: Agent densities, cycled: the paper's Code/Tool/Memory (3/46/54 %) first.
DENSITIES = (0.03, 0.46, 0.54, 0.25, 0.10, 0.35, 0.50, 0.05)


def spec(arch="qwen2", hidden=1024, layers=12, vocab=32000, agents=3, tied=False,
         experts=None, intermediate=None, heads=None, densities=DENSITIES, kv_heads=None,
         shard_size=None) -> dict:
    """`build_workload` keyword arguments for a bf16 workload with `agents` agents.

    `experts` makes a mixture of experts (arch qwen3_moe or mixtral) whose
    experts are `intermediate` wide, stored one tensor per expert; for a dense
    model `intermediate` is the MLP width (default: `build_workload`'s).
    `shard_size` (bytes) splits each model into shards with a
    `model.safetensors.index.json`, as Hugging Face's `save_pretrained` does.
    Keys are added only when set, so older workloads keep their markers.
    """
    heads = heads or max(1, hidden // 64)
    out = {
        "arch": arch,
        "hidden_size": hidden,
        "num_layers": layers,
        "vocab_size": vocab,
        "num_heads": heads,
        "num_kv_heads": kv_heads or max(1, heads // 4),  # default 4:1 grouped-query attention
        "tie_word_embeddings": tied,
        "densities": [densities[i % len(densities)] for i in range(agents)],
        "dtype": "bfloat16",
        "seed": 0,
    }
    if experts:
        out.update(num_experts=experts, intermediate_size=intermediate)
    elif intermediate:
        out["intermediate_size"] = intermediate
    if shard_size:
        out["shard_size"] = shard_size
    return out


WORKLOADS: dict[str, dict] = {
    "tiny": spec(hidden=64, layers=2, vocab=256, agents=2),
    "W1": spec(hidden=1024, layers=12, vocab=32000),  # ~200M params
    "D50": spec(hidden=768, layers=4, vocab=16000),  # ~50M params: issue 53's small dense workload
    "W2": spec(arch="llama", hidden=2048, layers=2, vocab=128256),  # ~615M, two 262M-element tensors
    "G1": spec(hidden=2048, layers=16, vocab=32000),  # ~0.85B, for GPU runs; not run by default
}
#: Real scale (not run by default; build with `python benchmarks/workloads.py R3 --root /big/disk`):
#: Llama-3.2-3B's layout (3.21B params, tied embeddings, 25.7 GB for base + 3 agents) and Llama-3.1-8B's
#: (8.03B params, untied, ~64 GB). Shards of at most 5 GB with an index, as `save_pretrained` writes them.
HF_SHARD = 5 * 10**9
WORKLOADS.update({
    "R3": spec("llama", hidden=3072, layers=28, vocab=128256, tied=True, intermediate=8192, heads=24, kv_heads=8,
               shard_size=HF_SHARD),
    "R8": spec("llama", hidden=4096, layers=32, vocab=128256, intermediate=14336, heads=32, kv_heads=8,
               shard_size=HF_SHARD),
})
#: Llama-3.2-3B's tensor layout (28 layers, tied embeddings, its vocabulary) at 1/16 of its width (hidden 192,
#: MLP 512, 3 heads of 64): 37.0M params, 296 MB for base + 3 agents in one file each. Issue 71's fixture for
#: `verify --sample` through a link with latency, where the cost is the number of tensors, not their size.
WORKLOADS["R3w"] = spec("llama", hidden=192, layers=28, vocab=128256, tied=True, intermediate=512, heads=3, kv_heads=3)
#: Mixture-of-experts workloads, stored one tensor per expert as hub checkpoints are; RL updates are very
#: sparse there (3 / 20 / 40 % dense agents).
MOE_DENSITIES = (0.03, 0.20, 0.40)
WORKLOADS.update({
    # Qwen3-MoE style: 16 layers x 64 experts, 3219 checkpoint tensors, ~108M params
    "M1": spec("qwen3_moe", hidden=256, layers=16, vocab=8000, experts=64, intermediate=128,
               densities=MOE_DENSITIES),
    # Mixtral style: 8 wide experts per layer, `block_sparse_moe` names renamed on load, 499 tensors, ~93M params
    "MX": spec("mixtral", hidden=256, layers=16, vocab=8000, experts=8, intermediate=896,
               densities=MOE_DENSITIES),
    # Qwen3-30B-A3B's tensor layout (48 layers x 128 experts, 18,867 tensors) at reduced width, ~41M params
    "Q30": spec("qwen3_moe", hidden=128, layers=48, vocab=8000, experts=128, intermediate=16, heads=4,
                densities=MOE_DENSITIES),
})
#: Scaling series: model size at fixed layers/vocab/N, N at fixed size, and the checkpoint's tensor count
#: at a fixed parameter count (8 layers; experts x width = 16384, so ~52M params for 267 to 24,651 tensors).
SCALING: dict[str, list[str]] = {"size": [], "agents": [], "tensors": []}
for _e in (8, 32, 128, 512, 1024):
    WORKLOADS[f"T{_e}"] = spec("qwen3_moe", hidden=128, layers=8, vocab=4000, experts=_e,
                               intermediate=16384 // _e, heads=4, densities=MOE_DENSITIES)
    SCALING["tensors"].append(f"T{_e}")
for _h in (256, 512, 1024, 1536, 2048):
    WORKLOADS[f"S{_h}"] = spec(hidden=_h, layers=6, vocab=16000)
    SCALING["size"].append(f"S{_h}")
for _n in (2, 3, 4, 6, 8):
    WORKLOADS[f"N{_n}"] = spec(hidden=2048, layers=6, vocab=16000, agents=_n)
    SCALING["agents"].append(f"N{_n}")


def root_dir(root: str | os.PathLike | None = None) -> Path:
    return Path(root or os.environ.get("MERGEKIT_RAM_BENCH_DIR") or DEFAULT_ROOT).resolve()


def get(
    name: str, root: str | os.PathLike | None = None, *, quiet: bool = False, jobs: int | None = None
) -> tuple[Workload, dict]:
    """The workload `name` (built if needed, on `jobs` threads: default one per core, the same bytes for any
    number) and its marker (parameters, paths, size)."""
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
    jobs = jobs or os.cpu_count() or 1
    wl = build_workload(folder, jobs=jobs, **params)
    found = {
        "name": name,
        "params": params,
        "base": str(wl.base),
        "agents": {k: str(v) for k, v in wl.agents.items()},
        "num_parameters": wl.num_parameters,
        "build_s": round(time.perf_counter() - start, 2),
        "build_jobs": jobs,
    }
    marker.write_text(json.dumps(found, indent=2) + "\n")  # written last: marks a complete build
    if not quiet:
        print(f"built {name}: {wl.num_parameters / 1e6:.1f}M params in {found['build_s']} s", file=sys.stderr)
    return wl, found


def tensor_count(marker: dict) -> int:
    """Tensors in the base model's checkpoint (safetensors headers only)."""
    from safetensors import safe_open

    return sum(len(safe_open(str(f), "pt").keys()) for f in sorted(Path(marker["base"]).glob("*.safetensors")))


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
    parser.add_argument("--jobs", type=int, help="threads that build (default: one per core; same bytes for any)")
    args = parser.parse_args(argv)
    for name in args.names:
        _, marker = get(name, args.root, jobs=args.jobs)
        print(f"{name}: {marker['num_parameters'] / 1e6:.1f}M params, base {marker['base']}")


if __name__ == "__main__":
    main()
