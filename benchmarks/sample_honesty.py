"""Does `verify --sample P` catch what its verdict says it catches? Empirical rates over many seeds, on one workload.

    python benchmarks/sample_honesty.py --workload D50 --share 0.02 --seeds 200 [--root DIR] [--scratch DIR] [--out F]

The workload (workloads.py) is merged by `mergekit-yaml` (ramplus, bf16) into a scratch folder, then:

- `whole`: a copy with one tensor (of the ~50 the model holds) replaced by the base's: `verify --sample P` at each
  seed (in one process, `cli.main`): the share of seeds that exit 1 naming it (the verdict: a tensor changed in
  half its elements or more passes with a chance of at most `pass_bound[0.5]`);
- `spread`: a copy with 10 % of one tensor's elements, at random places, moved by one step of bfloat16: the share
  of seeds caught, beside the stated bound for q = 0.1 (`pass_bound[0.1]`: the most it may pass with);
- `counts`: the counts check alone (`verify.ramplus.totals`, the code verify runs) on the honest record and on records
  whose per-tensor unique counts of one agent are scaled so that its lambda moves by 0.01 (up, and down), with
  the slices counted from the inputs as verify counts them: the share of seeds at which each is caught, and of
  seeds at which the honest one is (a false alarm), beside the shift the verdict says is caught.

Prints one line per check and writes them as JSON (`--out`), with the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import measure
import torch
import workloads
import yaml
from safetensors.torch import load_file, save_file


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="D50")
    parser.add_argument("--share", default="0.02")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--root", help="workload folder (workloads.py)")
    parser.add_argument("--scratch", help="where the merge and its damaged copies go (default: a temporary folder)")
    parser.add_argument("--out", help="write the rates here as JSON")
    args = parser.parse_args(argv)
    wl, _marker = workloads.get(args.workload, args.root)
    scratch = Path(tempfile.mkdtemp(prefix="sample-honesty-", dir=args.scratch))
    (scratch / "ramplus.yaml").write_text(yaml.safe_dump(measure.config(wl, "ramplus", measure.RAMPLUS)))
    merged = scratch / "merged"
    subprocess.run([measure.MERGEKIT_YAML, str(scratch / "ramplus.yaml"), str(merged), "--no-copy-tokenizer",
                    "--quiet"], check=True)  # fmt: skip
    (weights,) = sorted(merged.glob("*.safetensors"))
    tensors = load_file(str(weights))
    base = {}
    for path in sorted(Path(wl.base).glob("*.safetensors")):
        base |= load_file(str(path))
    names = sorted(n for n in tensors if tensors[n].numel() > 4096)
    rng = random.Random(60)
    rows = []
    target = rng.choice([n for n in names if not torch.equal(tensors[n], base[n])])
    whole = _copy(merged, scratch / "whole", {target: base[target]})
    differ = float((base[target] != tensors[target]).float().mean())
    rows.append(_rate("whole", whole, target, args, extra={"tensor": target, "share_differing": differ}))
    target = rng.choice(names)
    moved = tensors[target].clone()
    flat = moved.view(-1).view(torch.int16)
    picked = torch.tensor(rng.sample(range(flat.numel()), flat.numel() // 10))
    flat[picked] += 1
    spread = _copy(merged, scratch / "spread", {target: moved})
    rows.append(_rate("spread", spread, target, args, extra={"tensor": target, "share_differing": 0.1}))
    rows.append(_counts(wl, merged, float(args.share), args.seeds))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "share": args.share, "seeds": args.seeds,
                                              "checks": rows}, indent=2) + "\n")  # fmt: skip
    shutil.rmtree(scratch, ignore_errors=True)


def _copy(merged: Path, where: Path, changed: dict) -> Path:
    shutil.copytree(merged, where)
    (path,) = sorted(where.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors.update(changed)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return where


def _rate(what: str, folder: Path, target: str, args, extra: dict) -> dict:
    """The seeds at which `verify --sample` exits 1 naming `target`, and the bound its verdict states."""
    from mergekit_ram import cli

    caught, bounds, start, load = 0, [], time.perf_counter(), os.getloadavg()[0]
    for seed in range(args.seeds):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(["verify", str(folder), "--sample", args.share, "--sample-seed", str(seed), "--json", "-q"])
        verdict = json.loads(out.getvalue())
        caught += code == 1 and [row["name"] for row in verdict["tensors"]] == [target]
        bounds.append(verdict["sample"]["pass_bound"])
    q = "0.5" if what == "whole" else "0.1"
    return {"check": what, "seeds": args.seeds, "caught": caught, "stated_pass_bound": max(b[q] for b in bounds),
            "q": float(q), "wall_s": round(time.perf_counter() - start, 1), "loadavg_1m": load, **extra}  # fmt: skip


def _counts(wl, merged: Path, share: float, seeds: int) -> dict:
    """The counts check (`ramplus.totals`) at each seed, on the honest record and on records moving lambda."""
    from mergekit_ram._mergekit import comparing
    from mergekit_ram.core import kernel, statistics
    from mergekit_ram.files import Headers
    from mergekit_ram.verify import ramplus, sample

    record = json.loads((merged / "ram_stats.json").read_text())
    labels = [row["label"] for row in record["agents"]]
    folders = {"base": Path(wl.base), **dict(zip(labels, wl.agents.values(), strict=True))}
    files = {}
    for who, folder in folders.items():
        for path in sorted(folder.glob("*.safetensors")):
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            files.update({(who, name): str(path) for name in header if name != "__metadata__"})
    honest = statistics.Statistics.from_json(labels, record["tensors"])
    parameters = {**measure.RAMPLUS, "rho_scope": "model", "lambda_rule": "clip"}
    agent = labels[0]
    forged = {sign: _forged(honest, agent, sign * 0.01, parameters) for sign in (1, -1)}
    caught = {"honest": 0, "up": 0, "down": 0}
    said, start, load = "", time.perf_counter(), os.getloadavg()[0]
    for seed in range(seeds):
        drawn = sample.draw({t.name: (t.numel, _row(files, t.name)) for t in honest.tensors}, share, seed)
        headers = Headers()
        counted = {}
        for cut in drawn.slices:
            spans = cut.spans()
            b = comparing.read(files[("base", cut.name)], cut.name, spans, headers)
            agents = [comparing.read(files[(a, cut.name)], cut.name, spans, headers) for a in labels]
            found = kernel.count(b, agents, measure.RAMPLUS["epsilon"])
            counts = {a: tuple(int(x) for x in found[i]) for i, a in enumerate(labels)}
            counted[cut.name] = statistics.TensorCounts(cut.name, cut.elements, counts)
        lines, said = ramplus.totals(honest, counted, drawn, parameters, {})
        caught["honest"] += bool(lines)
        for key, sign in (("up", 1), ("down", -1)):
            caught[key] += bool(ramplus.totals(forged[sign], counted, drawn, parameters, {})[0])
    return {"check": "counts", "seeds": seeds, "caught": caught, "said": said, "agent": agent,
            "lambda_moved": 0.01, "wall_s": round(time.perf_counter() - start, 1), "loadavg_1m": load}  # fmt: skip


def _row(files: dict, name: str) -> int:
    with open(files[("base", name)], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    shape = header[name]["shape"]
    return int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1


def _forged(stats, agent: str, moved: float, parameters: dict):
    """`stats` with `agent`'s unique counts scaled in every tensor so that its lambda (rho_scope model) moves by
    `moved` (r * rho below alpha: rho moves by moved / r), each count kept within [0, active]."""
    from mergekit_ram.core import statistics

    active = sum(t.counts[agent][0] for t in stats.tensors)
    unique = sum(t.counts[agent][1] for t in stats.tensors)
    rho = (active - unique) / unique
    wanted = active / (rho + moved / parameters["r"] + 1)  # rho = (active - unique) / unique
    scale = wanted / unique
    tensors = []
    for t in stats.tensors:
        counts = dict(t.counts)
        a, u, p = counts[agent]
        counts[agent] = (a, min(a, round(u * scale)), p)
        tensors.append(statistics.TensorCounts(t.name, t.numel, counts, t.epsilon))
    return statistics.Statistics(list(stats.agents), tensors)


if __name__ == "__main__":
    main(sys.argv[1:])
