"""Are mergekit 0.1.5's own merge methods bit-reproducible, and under which changes do their bits move?

For each method variant of benchmarks/methods.py and each dtype, merges are made with this plugin disabled
(MERGEKIT_RAM_DISABLE=1: mergekit's own methods) in one fresh process per environment, each merge through
mergekit's `run_merge` exactly as `mergekit-yaml CONFIG OUT --random-seed 1` calls it (one process per environment
rather than per merge: a mergekit-yaml process costs about 10 s to start here, 40 variants × 8 environments of it
would not fit in minutes). The environments, each against the reference process "A" (torch threads 2, the CPU's
own capability, torch of this venv):

  B          a second process, same environment (random methods: the same seed 1)
  threads1   OMP_NUM_THREADS=1
  cap-<c>    ATEN_CPU_CAPABILITY=<c> for each capability this CPU has below its own (default, avx2, ...)
  floor      another venv's torch (--floor-python; torch 2.6, pyproject's floor)
  seed2      --random-seed 2, random variants only (does the seed matter at all?)

Then, for the element-wise variants, a slice of each tensor's flat elements is merged alone through mergekit's
`merge_tensors` (the method's own kernel) and compared with the same elements of A's whole-tensor output.
Every difference is recorded per tensor: the share of elements differing and the largest difference in units in
the last place (ulp) of the output dtype.

    python benchmarks/determinism.py --models example wide --floor-python /tmp/wdet-floor-venv/bin/python \
        --out benchmarks/results/determinism-<machine>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import methods  # noqa: E402

DTYPES = ("bfloat16", "float32")
#: the wider model: a Llama whose MLP tensors (1024 × 2816, 2.9M elements) are above arcee_fusion's 2**20 sampling
#: limit and big enough for multithreaded reductions to split
WIDE = dict(
    arch="llama",
    hidden_size=1024,
    num_layers=1,
    vocab_size=2048,
    intermediate_size=2816,
    num_heads=16,
    num_kv_heads=4,
    densities=(0.1, 0.5),
    agent_names=("a", "b"),
    dtype="bfloat16",
    seed=0,
)
TINY = dict(
    arch="llama",
    hidden_size=64,
    num_layers=1,
    vocab_size=128,
    intermediate_size=176,
    num_heads=4,
    densities=(0.1, 0.5),
    agent_names=("a", "b"),
    dtype="bfloat16",
    seed=0,
)


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #
def build_models(root: Path, name: str) -> tuple[str, list[str]]:
    """(base, agents) of the named model set, written under root/name once."""
    from mergekit_ram.example_models import build_workload, write_example

    folder = root / name
    if name == "example":
        if not (folder / "base").is_dir():
            write_example(folder, overwrite=True)
        agents = sorted(str(p) for p in (folder / "agents").iterdir())
    else:
        if not (folder / "base").is_dir():
            build_workload(folder, **(WIDE if name == "wide" else TINY))
        agents = [str(folder / "agents" / a) for a in (WIDE if name == "wide" else TINY)["agent_names"]]
    return str(folder / "base"), agents


# --------------------------------------------------------------------------- #
# the worker: one process, every merge of one environment
# --------------------------------------------------------------------------- #
def worker(plan_file: Path) -> None:
    plan = json.loads(plan_file.read_text())
    os.environ["MERGEKIT_RAM_DISABLE"] = "1"
    import torch
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "seed": plan["seed"],
        "python": sys.executable,
    }
    times: dict = {}
    errors: dict = {}
    for job in plan["jobs"]:
        source = yaml.safe_dump(job["config"], sort_keys=False)
        options = MergeOptions(random_seed=plan["seed"], quiet=True)
        options.apply_global_options()
        started = time.perf_counter()
        try:
            run_merge(
                MergeConfiguration.model_validate(yaml.safe_load(source)),
                job["out"],
                options=options,
                config_source=source,
            )
        except Exception as e:
            errors[job["key"]] = f"{type(e).__name__}: {e}"
        times[job["key"]] = round(time.perf_counter() - started, 3)
    Path(plan["env_out"]).write_text(json.dumps({"env": env, "merge_s": times, "errors": errors}, indent=1))


# --------------------------------------------------------------------------- #
# comparing
# --------------------------------------------------------------------------- #
def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _bits(t):
    import torch

    return {
        torch.bfloat16: (torch.int16, 0x7FFF),
        torch.float16: (torch.int16, 0x7FFF),
        torch.float32: (torch.int32, 0x7FFFFFFF),
    }[t.dtype]


def ordered(t):
    """The tensor's bits as integers ordered like the values (+0 and -0 both 0), so a difference of n is n ulp."""
    import torch

    bits, mask = _bits(t)
    i = t.contiguous().view(bits).to(torch.int64)
    return torch.where(i >= 0, i, -(i & mask))


def diff(a, b) -> dict | None:
    """None when bit-identical, else the share of elements whose bits differ and the largest difference in ulp
    (+0 against -0: differing bits, 0 ulp)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"share": 1.0, "max_ulp": None, "why": f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"}
    bits, _ = _bits(a)
    differ = a.contiguous().view(bits) != b.contiguous().view(bits)
    n = int(differ.sum())
    if not n:
        return None
    return {"share": n / a.numel(), "elements": n, "max_ulp": int((ordered(a) - ordered(b)).abs().max())}


def compare(ref: Path, other: Path) -> dict:
    wa, wb = load_weights(ref), load_weights(other)
    tensors = {
        name: d
        for name in sorted(set(wa) | set(wb))
        if (d := (diff(wa[name], wb[name]) if name in wa and name in wb else {"why": "missing"}))
    }
    total = sum(t.numel() for t in wa.values())
    elements = sum(d.get("elements", 0) for d in tensors.values())
    ulps = [d["max_ulp"] for d in tensors.values() if d.get("max_ulp") is not None]
    return {
        "identical": not tensors,
        "tensors": len(wa),
        # what the reference wrote: arcee_fusion writes float32 whatever the config's dtype
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in wa.values()}),
        "tensors_differing": len(tensors),
        "share": elements / total if total else 0.0,
        "max_share": max((d["share"] for d in tensors.values()), default=0.0),
        "max_ulp": max(ulps, default=0),
        "per_tensor": tensors,
    }


def merge_inputs(cfg: dict):
    """(input paths, base index, parameters) of a config, as mergekit's merge_tensors takes them."""
    ids = [m["model"] for m in cfg["models"]]
    base = ids.index(cfg["base_model"]) if cfg.get("base_model") else None
    params: dict = dict(cfg.get("parameters", {}))
    for m in cfg["models"]:
        for k, v in m.get("parameters", {}).items():
            params.setdefault(k, {})[m["model"]] = v
    return ids, base, params


def slice_check(cfg: dict, variant: str, whole: Path, elements: int = 4099) -> dict:
    """Each tensor's flat elements [n/3, n/3 + elements) merged alone through the method's mergekit kernel against
    the same elements of the whole merge: equal for a method whose output element depends on those elements only."""
    import torch
    from mergekit.merge_methods import merge_tensors

    ids, base, params = merge_inputs(cfg)
    inputs = [load_weights(Path(i)) for i in ids]
    out = load_weights(whole)
    dtype = getattr(torch, cfg["dtype"])
    out_dtype = getattr(torch, cfg["out_dtype"]) if cfg.get("out_dtype") else None
    found = {}
    rows = methods.KIND[variant] == "row"
    for name, full in out.items():
        if rows:
            # whole rows (dim 0; a 1-D tensor is one row): the row-wise kernels reduce over the last dimension
            n = full.shape[0] if full.dim() > 1 else 1
            lo = n // 3
            hi = min(n, lo + max(1, elements // max(1, full[0].numel() if full.dim() > 1 else 1)))
            parts = [w[name][lo:hi] if full.dim() > 1 else w[name] for w in inputs]
            full = full[lo:hi] if full.dim() > 1 else full
            lo, hi = 0, full.numel()
        else:
            n = full.numel()
            lo = n // 3
            hi = min(n, lo + elements)
            parts = [w[name].reshape(-1)[lo:hi] for w in inputs]
        got = merge_tensors(
            parts,
            methods.METHOD[variant],
            parameters=params,
            ids=ids,
            base_index=base,
            name=name,
            dtype=dtype,
            out_dtype=out_dtype,
        ).to(full.dtype)
        d = diff(got.reshape(-1), full.reshape(-1)[lo:hi])
        if d:
            found[name] = d
    ulps = [d["max_ulp"] for d in found.values() if d.get("max_ulp") is not None]
    return {
        "identical": not found,
        "tensors": len(out),
        "tensors_differing": len(found),
        "max_share": max((d["share"] for d in found.values()), default=0.0),
        "max_ulp": max(ulps, default=0),
        "per_tensor": found,
    }


# --------------------------------------------------------------------------- #
# the driver
# --------------------------------------------------------------------------- #
def capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this CPU runs, below its own (torch takes the lower of the variable and the
    CPU's); the CPU's own is what A runs."""
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    return order[: order.index(own)] if own in order else ["default"]


def environments(floor_python: str | None) -> dict:
    base = {"OMP_NUM_THREADS": "2", "MERGEKIT_RAM_DISABLE": "1", "PYTHONHASHSEED": "0"}
    envs = {
        "A": (sys.executable, base, 1),
        "B": (sys.executable, base, 1),
        "threads1": (sys.executable, {**base, "OMP_NUM_THREADS": "1"}, 1),
    }
    for cap in capabilities():
        envs[f"cap-{cap}"] = (sys.executable, {**base, "ATEN_CPU_CAPABILITY": cap}, 1)
    if floor_python:
        envs["floor"] = (floor_python, base, 1)
    envs["seed2"] = (sys.executable, base, 2)
    return envs


def run_env(python: str, env: dict, seed: int, jobs: list, work: Path, label: str) -> dict:
    plan = work / f"plan-{label}.json"
    env_out = work / f"env-{label}.json"
    plan.write_text(json.dumps({"seed": seed, "jobs": jobs, "env_out": str(env_out)}))
    full_env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    started = time.perf_counter()
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--worker", str(plan)],
        env={**full_env, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"{label}: {done.stderr[-3000:]}")
    out = json.loads(env_out.read_text())
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out


def measure(model: str, root: Path, floor_python: str | None, variants, dtypes, keep: bool, only=None) -> dict:
    base, agents = build_models(root, model)
    work = root / f"runs-{model}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    keys = [(v, d) for v in variants for d in dtypes]
    cfgs = {d: methods.configs(base, agents, d) for d in dtypes}
    result: dict = {"model": model, "base": base, "agents": agents, "environments": {}, "variants": {}}
    for label, (python, env, seed) in environments(floor_python).items():
        if only and label not in only and label != "A":
            continue
        chosen = [k for k in keys if label != "seed2" or k[0] in methods.RANDOM]
        if not chosen:
            continue
        jobs = [{"key": f"{v}/{d}", "config": cfgs[d][v], "out": str(work / label / f"{v}-{d}")} for v, d in chosen]
        info = run_env(python, env, seed, jobs, work, label)
        result["environments"][label] = info
        print(f"{model} {label}: {info['wall_s']} s {info['env']}", flush=True)
        for v, d in chosen:
            entry = result["variants"].setdefault(
                f"{v}/{d}",
                {
                    "variant": v,
                    "method": methods.METHOD[v],
                    "dtype": d,
                    "kind": methods.KIND[v],
                    "random": v in methods.RANDOM,
                },
            )
            failed = {
                lab: e["errors"][f"{v}/{d}"]
                for lab, e in result["environments"].items()
                if f"{v}/{d}" in e.get("errors", {})
            }
            if failed:
                entry["errors"] = failed
            elif label != "A":
                entry[label] = compare(work / "A" / f"{v}-{d}", work / label / f"{v}-{d}")
        if label != "A" and not keep:
            shutil.rmtree(work / label)
    for v, d in keys:
        if methods.KIND[v] in ("element", "row") and "errors" not in result["variants"][f"{v}/{d}"]:
            result["variants"][f"{v}/{d}"]["slice"] = slice_check(cfgs[d][v], v, work / "A" / f"{v}-{d}")
    if not keep:
        shutil.rmtree(work)
    return result


def machine() -> dict:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx512": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "load_before": os.getloadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def axes(res: dict) -> list[tuple[str, str]]:
    """(result key, column title) of the axes a model's results hold, one column per CPU capability."""
    caps = [k for k in res["environments"] if k.startswith("cap-")]
    cols = [("B", "two processes"), ("threads1", "threads 1 vs 2")]
    cols += [(c, f"{c[4:]} vs {res['environments']['A']['env']['capability'].lower()}") for c in caps]
    return cols + [("floor", "floor torch vs this"), ("seed2", "seed 2 vs 1"), ("slice", "slice vs whole")]


def cell(entry: dict, key: str) -> str:
    found = [entry[k] for k in entry if k == key or (key.endswith("*") and k.startswith(key[:-1]))]
    if "errors" in entry:
        return "error: " + "; ".join(sorted(set(entry["errors"].values())))[:80]
    if not found:
        return "–"
    if all(f["identical"] for f in found):
        return "="
    worst = max(found, key=lambda f: (f["max_ulp"] or 0, f["max_share"]))
    return f"≠ {worst['tensors_differing']}/{worst['tensors']} t, ≤{worst['max_share']:.2%}, {worst['max_ulp']} ulp"


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        envs = res["environments"]
        described = ", ".join(
            f"{k}: torch {v['env']['torch']}, {v['env']['threads']} threads, {v['env']['capability']}"
            for k, v in envs.items()
        )
        lines.append(f"\n**{res['model']}** ({described})\n")
        cols = axes(res)
        lines.append("| variant | dtype | kind | random | " + " | ".join(a for _, a in cols) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(cols))
        for entry in res["variants"].values():
            lines.append(
                f"| {entry['variant']} | {entry['dtype']} | {entry['kind']} | "
                f"{'yes' if entry['random'] else 'no'} | " + " | ".join(cell(entry, k) for k, _ in cols) + " |"
            )
    return (
        "\n".join(lines) + "\n\n= bit-identical; ≠ n/m t: tensors differing of those compared, the largest share "
        "of one tensor's elements differing, the largest difference in ulp of the output dtype"
        " (a tensor stored in another dtype than the config's is compared in its own); – not run.\n"
    )


def summary(results: list[dict]) -> str:
    """One row per variant over every model and dtype measured: "=" where every merge was bit-identical, else where
    it was not (model, dtype: the share of one tensor's elements differing at most, the largest difference in ulp)."""
    short = {"bfloat16": "bf16", "float32": "f32"}
    cols = [
        ("B", "two processes"),
        ("threads1", "threads 1 vs 2"),
        ("cap-", "CPU capability"),
        ("floor", "floor torch vs this"),
        ("seed2", "seed 2 vs 1"),
        ("slice", "slice vs whole"),
    ]
    rows: dict = {}
    for res in results:
        for entry in res["variants"].values():
            row = rows.setdefault(entry["variant"], {"entry": entry, "cells": {k: [] for k, _ in cols}})
            for key, _ in cols:
                for k, found in entry.items():
                    if not (k == key or (key == "cap-" and k.startswith("cap-"))):
                        continue
                    where = f"{res['model']} {short[entry['dtype']]}" + (f" {k[4:]}" if key == "cap-" else "")
                    row["cells"][key].append(
                        None if found["identical"] else f"{where}: {found['max_share']:.2%}, {found['max_ulp']} ulp"
                    )
    lines = [
        "| variant (method) | kind | random | " + " | ".join(t for _, t in cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for variant, row in rows.items():
        e = row["entry"]
        cells = []
        for key, _ in cols:
            got = row["cells"][key]
            cells.append("–" if not got else "=" if not any(got) else "≠ " + "; ".join(g for g in got if g))
        name = variant if variant == e["method"] else f"{variant} ({e['method']})"
        lines.append(f"| {name} | {e['kind']} | {'yes' if e['random'] else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=["example", "wide"], choices=["example", "wide", "tiny"])
    p.add_argument("--variants", nargs="+", default=list(methods.VARIANTS), choices=list(methods.VARIANTS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--floor-python", help="a python whose venv holds the floor's torch and this package")
    p.add_argument("--root", type=Path, default=Path("/tmp/mergekit-ram-determinism"), help="models and merges")
    p.add_argument("--out", type=Path, required=False, help="results folder (results.json, results.md)")
    p.add_argument("--environments", nargs="+", help="only these besides A (B, threads1, cap-avx2, floor, seed2...)")
    p.add_argument("--rerender", action="store_true", help="results.md again from --out's results.json")
    p.add_argument("--summarize", nargs="+", type=Path, help="one table over these results folders (to stdout)")
    p.add_argument("--keep", action="store_true", help="keep every environment's merges")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.summarize:
        print(summary([r for d in args.summarize for r in json.loads((d / "results.json").read_text())["results"]]))
        return
    if args.rerender:
        (args.out / "results.md").write_text(table(json.loads((args.out / "results.json").read_text())["results"]))
        return
    os.environ["MERGEKIT_RAM_DISABLE"] = "1"
    report = {"machine": machine(), "command": sys.argv, "results": []}
    for model in args.models:
        report["results"].append(
            measure(model, args.root, args.floor_python, args.variants, args.dtypes, args.keep, args.environments)
        )
    report["machine"]["load_after"] = os.getloadavg()
    md = table(report["results"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        (args.out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
