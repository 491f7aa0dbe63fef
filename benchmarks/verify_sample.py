"""What `mergekit-ram verify --sample P` reads and costs beside a full verify, from a stand-in Hub and a folder.

    python benchmarks/verify_sample.py --workload W1 --share 0.01,0.02 [--seeds 1,2,3 | --seeds 1-10] [--folder]
        [--link 40/50 --link 10/500] [--no-full] [--root DIR] [--scratch DIR] [--out F]

On one workload (workloads.py), every input is published on the suite's stand-in Hub (tests/hub_stub.py, on
127.0.0.1, serving ranges as the Hub does, each weight file by a redirect to another origin as the Hub does) and
merged by `mergekit-yaml` as hub ids (`org/base`, `org/agent-N`);
the merge is published there as `org/merged`. Then, each a whole process timed by measure.py's launcher, each with
a fresh Hub cache and the statistics cache off:

- `verify org/merged` (full: it downloads the merge and its inputs whole, and recomputes every tensor);
- per share P and seed S, `verify org/merged --sample P --sample-seed S` (ranges only), and with `--folder`
  `verify FOLDER --sample P` of the merged folder on disk, its inputs the Hub's (what it reads: `bytes_read`).

Bytes are what the stand-in sent (bodies of GETs, every file) and, for weight files, what `--json`'s `bytes_read`
says; requests are every request the stand-in answered during the run (both origins), connections those it
accepted.

`--link MS/MBPS` (issue 71; repeatable) puts the stand-in behind a link of that latency (milliseconds per request,
one more per new connection) and bandwidth (MB/s, shared by every answer): the verifies run once per link, each
link its own stand-in (the merge itself runs without one). A `--scratch` folder that already holds the merge
(`merged/ram_stats.json`, from the same workload) is reused: another run measures the same merge. Prints one line per run and writes them as JSON (`--out`). The machine's load is printed beside each run:
on a shared machine the times are upper bounds. Not part of the benchmark suite (run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import measure
import workloads
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hub_stub import HubStub, hub_env  # noqa: E402  (the suite's stand-in Hub)

MERGEKIT_RAM = str(measure.BIN / "mergekit-ram")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--share", default="0.02", help="the shares P, comma-separated")
    parser.add_argument("--seeds", default="1,2,3", help="the sample's seeds, one run each (1,2,3 or 1-10)")
    parser.add_argument("--folder", action="store_true", help="also verify the merged folder on disk by a sample")
    parser.add_argument("--root", help="workload folder (workloads.py)")
    parser.add_argument("--scratch", help="where the merge and the Hub caches go (default: a temporary folder)")
    parser.add_argument("--link", action="append", default=[], help="MS/MBPS: verify through this link (repeatable)")
    parser.add_argument("--no-full", action="store_true", help="no full verify (its time is measured elsewhere)")
    parser.add_argument("--out", help="write the runs here as JSON")
    args = parser.parse_args(argv)
    wl, marker = workloads.get(args.workload, args.root)
    if args.scratch and args.link:  # a fixed folder: its merge reused by the next run
        scratch = Path(args.scratch) / f"{args.workload}-links"
        scratch.mkdir(parents=True, exist_ok=True)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="verify-sample-", dir=args.scratch))
    inputs = {"org/base": wl.base, **{f"org/agent-{i}": path for i, path in enumerate(wl.agents.values())}}
    config = measure.config(wl, "ramplus", measure.RAMPLUS)
    config["base_model"] = "org/base"
    config["models"] = [{**row, "model": f"org/agent-{i}"} for i, row in enumerate(config["models"])]
    (scratch / "ramplus.yaml").write_text(yaml.safe_dump(config))
    out = scratch / "merged"
    cwd = scratch / "cwd"  # nothing there is named like a hub id
    cwd.mkdir(exist_ok=True)
    rows = []
    seeds = _seeds(args.seeds)
    if args.link:
        _through_links(args, inputs, scratch, out, cwd, seeds, rows)
    else:
        _on_loopback(args, inputs, scratch, out, cwd, seeds, rows)
    weights = sum(p.stat().st_size for folder in [*inputs.values(), out] for p in Path(folder).glob("*.safetensors"))
    print(f"{args.workload}: {marker['num_parameters'] / 1e6:.1f}M params per model, {len(wl.agents)} agents, "
          f"{weights / 1e9:.2f} GB of weight files (merge and inputs); share {args.share}, seeds {args.seeds}")
    fulls = {row.get("link"): row for row in rows if row["what"].startswith("verify org/merged") and
             "--sample" not in row["what"]}  # fmt: skip
    for row in rows:
        ratio = ""
        full = fulls.get(row.get("link"))
        if row["what"].startswith("verify") and full is not None:
            ratio = (f"  {row['sent_weights'] / max(1, full['sent_weights']):6.2%} of the full verify's weight bytes, "
                     f"{row['wall_s'] / full['wall_s']:6.2%} of its time")
        read = f", bytes_read {row['bytes_read'] / 1e6:,.1f} MB" if row.get("bytes_read") is not None else ""
        link = f"[{row['link']}] " if row.get("link") else ""
        print(f"{link}{row['what']:<36} exit {row['returncode']}  {row['wall_s']:8.1f} s  {row['requests']:7,} "
              f"requests  sent {row['sent'] / 1e6:10,.1f} MB (weights {row['sent_weights'] / 1e6:,.1f} MB{read}), "
              f"load {row['loadavg_1m']:.1f}, cpu {row['verify_cpu_s']:.1f} s + stand-in {row['stand_in_cpu_s']:.1f} s"
              f"{ratio}")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "share": args.share, "seeds": args.seeds,
                                              "links": args.link, "weights_bytes": weights, "runs": rows},
                                             indent=2) + "\n")  # fmt: skip


def _link(text: str) -> tuple[float, float]:
    """`40/50` as (0.040 s, 50e6 bytes per second)."""
    latency, rate = text.split("/")
    return float(latency) / 1000, float(rate) * 1e6


def _merged(inputs: dict, scratch: Path, out: Path, cwd: Path, rows: list) -> None:
    """The merge of hub ids through the stand-in (without a link), unless `out` holds it already."""
    if (out / "ram_stats.json").is_file():
        return
    with HubStub({repo: [folder] for repo, folder in inputs.items()}, lifetime=24 * 3600, redirect=True) as stub:
        merge = [measure.MERGEKIT_YAML, str(scratch / "ramplus.yaml"), str(out), "--no-copy-tokenizer", "--quiet"]
        rows.append(_run("merge (hub ids)", merge, stub, scratch / "hf-merge", cwd))


def _through_links(args, inputs: dict, scratch: Path, out: Path, cwd: Path, seeds: list[str], rows: list) -> None:
    """Each link: its own stand-in in front of the inputs and the merge, a full verify, then each share and seed."""
    _merged(inputs, scratch, out, cwd, rows)
    served = {**{repo: [folder] for repo, folder in inputs.items()}, "org/merged": [out]}
    quiet = ["--json", "-q"]
    for text in args.link:
        latency, rate = _link(text)
        with HubStub(served, lifetime=24 * 3600, redirect=True, latency=latency, bandwidth=rate) as stub:
            if not args.no_full:
                home = scratch / "hf-full"
                rows.append(_run("verify org/merged", [MERGEKIT_RAM, "verify", "org/merged", *quiet], stub, home,
                                 cwd, text))  # fmt: skip
                shutil.rmtree(home, ignore_errors=True)
            for share in args.share.split(","):
                for seed in seeds:
                    home = scratch / f"hf-s{share}-{seed}"
                    sample = ["--sample", share, "--sample-seed", seed]
                    rows.append(_run(f"verify org/merged --sample {share} ({seed})", [MERGEKIT_RAM, "verify",
                                     "org/merged", *sample, *quiet], stub, home, cwd, text))  # fmt: skip
                    shutil.rmtree(home, ignore_errors=True)


def _on_loopback(args, inputs: dict, scratch: Path, out: Path, cwd: Path, seeds: list[str], rows: list) -> None:
    """Issue 60's runs: the merge, a full verify and the samples through the stand-in without a link."""
    with HubStub({repo: [folder] for repo, folder in inputs.items()}, lifetime=24 * 3600, redirect=True) as stub:
        merge = [measure.MERGEKIT_YAML, str(scratch / "ramplus.yaml"), str(out), "--no-copy-tokenizer", "--quiet"]
        rows.append(_run("merge (hub ids)", merge, stub, scratch / "hf-merge", cwd))
    served = {**{repo: [folder] for repo, folder in inputs.items()}, "org/merged": [out]}
    with HubStub(served, lifetime=24 * 3600, redirect=True) as stub:
        quiet = ["--json", "-q"]
        rows.append(_run("verify org/merged", [MERGEKIT_RAM, "verify", "org/merged", *quiet], stub,
                         scratch / "hf-full", cwd))  # fmt: skip
        for share in args.share.split(","):
            for seed in seeds:
                sample = ["--sample", share, "--sample-seed", seed]
                rows.append(_run(f"verify org/merged --sample {share} ({seed})", [MERGEKIT_RAM, "verify",
                                 "org/merged", *sample, *quiet], stub, scratch / f"hf-s{share}-{seed}", cwd))  # fmt: skip
                if args.folder:
                    rows.append(_run(f"verify FOLDER --sample {share} ({seed})", [MERGEKIT_RAM, "verify", str(out),
                                     *sample, *quiet], stub, scratch / f"hf-f{share}-{seed}", cwd))  # fmt: skip
                shutil.rmtree(scratch / f"hf-s{share}-{seed}", ignore_errors=True)


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def _seeds(text: str) -> list[str]:
    """`1,2,3` or `1-10` as the list of seeds."""
    if "-" in text:
        first, last = (int(part) for part in text.split("-"))
        return [str(seed) for seed in range(first, last + 1)]
    return text.split(",")


def _run(what: str, cmd: list[str], stub: HubStub, home: Path, cwd: Path, link: str | None = None) -> dict:
    """One process against the stand-in: its wall time, what the stand-in sent and answered meanwhile, and
    verify's verdict."""
    env = {**hub_env(stub.url, home), "MERGEKIT_RAM_CACHE": "off"}
    before, asked, load = len(stub.sent), len(stub.requests), os.getloadavg()[0]
    connections = stub.link.connections if stub.link else 0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True)
    wall = time.perf_counter() - start
    own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    sent = stub.sent[before:]
    requests = stub.requests[asked:]
    row = {"what": what, "link": link, "wall_s": round(wall, 2), "returncode": done.returncode, "loadavg_1m": load,
           "loadavg_1m_after": os.getloadavg()[0], "requests": len(requests),
           "weight_requests": sum(1 for _, path, _ in requests if ".safetensors" in path or ".bin" in path),
           "connections": (stub.link.connections - connections) if stub.link else None,
           # CPU seconds of the process verified (its children's) and of the stand-in (this process's threads):
           # on the Hub the stand-in's share is not the user's machine's
           "verify_cpu_s": round(_cpu(children_after) - _cpu(children), 2),
           "stand_in_cpu_s": round(_cpu(own_after) - _cpu(own), 2),
           "sent": sum(size for *_, size in sent),
           "sent_weights": sum(size for path, _, size in sent if path.endswith((".safetensors", ".bin")))}
    try:
        found = json.loads(done.stdout)
        row["headline"] = found.get("headline")
        row["bytes_read"] = (found.get("sample") or {}).get("bytes_read")
        row["sample"] = {k: v for k, v in (found.get("sample") or {}).items() if k != "tensors"} or None
    except ValueError:
        row["log_tail"] = (done.stdout + done.stderr)[-3000:]
    return row


if __name__ == "__main__":
    main()
