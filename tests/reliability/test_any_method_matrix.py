"""Verify's verdict on merges by every one of mergekit's own methods (issue 70): a generated covering array.

The dimensions: each method variant of benchmarks/methods.py (mergekit 0.1.5's 20 registered methods and four
variants whose parameters change what an output element depends on), the dtype the merge computes in, the
out_dtype, where the inputs are (local folders; hub ids pinned to a commit in the config; hub ids at no revision,
the merge published on the Hub, so verify infers each input's commit from its history) and the tokenizer (the
base's, a union). Every method meets every value of every other dimension, through its kind (element-wise,
row-wise, whole-tensor, random), and every pair of values of the other dimensions meets (`covering_array`).

Each merge is made by mergekit with this plugin disabled (`MERGEKIT_RAM_DISABLE=1`, one process per test process,
`make`), the random methods with `--random-seed`; verify runs as a user's (`check`, another process, the plugin
on). For each: `verify` and `verify --sample 0.1` say exit 0 (a random method: exit 3 without the seed, naming
it, 0 with it); one output tensor changed (every element one step of its dtype): exit 1 naming it, full and
sampled (16 units in the last place: a change within the last bits a method moves between machines is exit 3,
tests/test_verify_any_method.py). No false verdict either way.

Hub ids: the stand-in (tests/hub_stub.py) serves each input with three commits when verify runs (an older one,
the one the merge read as the head of its branch, a newer one pushed after the merge was published) and the merge
made when the second was the head.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "benchmarks")]

import methods  # noqa: E402  (benchmarks/methods.py: a config per method variant)
from reliability.test_verdict_matrix import _groups, _tuples, covering_array  # noqa: E402,F401

DIMENSIONS: dict[str, list] = {
    "variant": list(methods.VARIANTS),
    "dtype": ["bfloat16", "float32"],
    "out": ["none", "other"],
    "inputs": ["folders", "hub-pinned", "hub-history"],
    "tokenizer": ["base", "union"],
}
SEED = 70
#: mergekit's --random-seed of every merge (the deterministic methods draw nothing)
RANDOM_SEED = 11
SAMPLE = ["--sample", "0.1", "--sample-seed", "5"]
TAMPERED = "model.layers.0.mlp.down_proj.weight"
#: how far every element of the changed tensor moves, in units in the last place: beyond the last bits a method moves
#: between machines (`_mergekit.methods.LAST_BITS`: at most 3), where the verdict is "last bits differ" (exit 3)
STEPS = 16
#: the methods whose results move beyond their last bits between machines (`_mergekit.methods.LAST_BITS`)
BEYOND_LAST_BITS = ("karcher", "arcee_fusion")
START = datetime(2026, 5, 1, tzinfo=timezone.utc)
DAY = timedelta(days=1)


def kind(variant: str) -> str:
    return "random" if variant in methods.RANDOM else methods.KIND[variant]


def rows() -> list[dict]:
    """Every variant at least once; each kind of method with every value of the others; every pair of the others."""
    others = {name: values for name, values in DIMENSIONS.items() if name != "variant"}
    kinds = sorted({kind(v) for v in methods.VARIANTS})
    found = covering_array({"kind": kinds, **others}, ok=lambda row: True, triples=[], seed=SEED)
    pool = {k: [v for v in methods.VARIANTS if kind(v) == k] for k in kinds}
    used: dict[str, int] = dict.fromkeys(kinds, 0)
    out = []
    for row in found:  # the kind's variants taken in turn
        k = row.pop("kind")
        out.append({"variant": pool[k][used[k] % len(pool[k])], **row})
        used[k] += 1
    seen = {row["variant"] for row in out}
    for i, variant in enumerate(v for v in methods.VARIANTS if v not in seen):  # the rest, on rows drawn in turn
        out.append({"variant": variant, **{k: v for k, v in found[i % len(found)].items() if k != "variant"}})
    return out


ROWS = rows()


def row_id(row: dict) -> str:
    return "-".join(str(v) for v in row.values())


# --------------------------------------------------------------------------- #
# The merges (`make`, plugin disabled) and the verdicts (`check`), each a process serving rows
# --------------------------------------------------------------------------- #
def _names(row: dict, models: dict[str, str], pins: dict[str, str]) -> tuple[str, list[str]]:
    """The base and the agents as the row's config names them."""
    agents = ["code", "tool-wide" if row["tokenizer"] == "union" else "tool", "memory"]

    def named(who: str) -> str:
        if row["inputs"] == "folders":
            return models[who]
        return f"org/{who}@{pins[who]}" if row["inputs"] == "hub-pinned" else f"org/{who}"

    return named("base"), [named(a) for a in agents]


def config_of(row: dict, models: dict[str, str], pins: dict[str, str]) -> dict:
    base, agents = _names(row, models, pins)
    out = None if row["out"] == "none" else ("float32" if row["dtype"] == "bfloat16" else "bfloat16")
    config = methods.configs(base, agents, row["dtype"], out)[row["variant"]]
    if row["tokenizer"] == "union":
        config["tokenizer"] = {"source": "union"}
    return config


def make(request: dict) -> dict:
    """One row merged by mergekit alone (this process has the plugin disabled), and a copy with one tensor changed."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from safetensors.torch import load_file, save_file

    work = Path(request["work"])
    work.mkdir(parents=True)
    config = config_of(request["row"], request["models"], request["pins"])
    text = yaml.safe_dump(config, sort_keys=False)
    out = work / "merged"
    options = MergeOptions(random_seed=RANDOM_SEED, quiet=True, copy_tokenizer=True, write_model_card=True)
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), str(out), options=options, config_source=text)
    tampered = Path(shutil.copytree(out, work / "tampered"))
    path = next(tampered.glob("*.safetensors"))
    tensors = load_file(str(path))
    width = {1: "int8", 2: "int16", 4: "int32"}[tensors[TAMPERED].element_size()]
    import torch

    bits = tensors[TAMPERED].view(getattr(torch, width))  # more than any method moves between machines
    tensors[TAMPERED] = (bits + STEPS).view(tensors[TAMPERED].dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {"merged": str(out), "tampered": str(tampered)}


def check(request: dict) -> dict:
    """The verdicts on one row's merge (`targets`: what verify is given, a folder or a hub id at `endpoint`)."""
    from mergekit_ram import cli

    found = {}
    for key, argv in request["verifies"].items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(["verify", *argv, "-q", "--json"])
        said = json.loads(out.getvalue()) if out.getvalue().strip() else {}
        found[key] = {"code": code, **{k: said.get(k) for k in ("result", "problems", "tensors", "inputs", "error")}}
    return found


def serve(role: str) -> None:
    """This file as a script: one JSON request a line on stdin, one `@@result` line of JSON on stdout."""
    work = make if role == "make" else check
    for line in sys.stdin:
        try:
            result = work(json.loads(line))
        except Exception as error:  # the test names it
            import traceback

            result = {"crash": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
        sys.stdout.write("\n@@result " + json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(sys.argv[1])


# --------------------------------------------------------------------------- #
# The tests
# --------------------------------------------------------------------------- #
import hub_stub  # noqa: E402
import pytest  # noqa: E402
from hub_stub import HubStub, hub_env  # noqa: E402

#: each hub input's commits, oldest first, when verify runs: (another model's weights, its own, a third's)
HISTORY = {"base": ("memory", "base", "code"), "code": ("tool", "code", "memory"), "tool": ("memory", "tool", "code"),
           "tool-wide": ("code", "tool-wide", "memory"), "memory": ("code", "memory", "tool")}  # fmt: skip


class Server:
    """One `serve` process: `ask(request)` -> its answer."""

    def __init__(self, role: str, env: dict, cwd: Path, log: Path):
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, __file__, role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(log, "w"), text=True, env=env, cwd=str(cwd),
        )  # fmt: skip

    def ask(self, request: dict) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("@@result "):
                return json.loads(line[len("@@result ") :])
        raise AssertionError(f"the {self.log.stem} process stopped: {self.log.read_text()[-4000:]}")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def publish(stub: HubStub, repo_id: str, folder: Path, when: datetime) -> None:
    """`folder` served by `stub` as `repo_id`'s one commit, dated `when` (a merge published after the stub started)."""
    sha = hub_stub.commit_sha(repo_id, 1)
    stub.repos[repo_id] = hub_stub.Repo(commits={sha: hub_stub.read_folder(folder)}, main=sha)
    stub.shas[repo_id] = [sha]
    stub.set_date(repo_id, 1, when)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """matrix(row) -> the verdicts on its merge: a `make` process (plugin disabled) whose hub ids are served with
    two commits each (the second the head), a `check` process (the plugin on) whose hub ids have a third, newer
    commit, and each merge verified by hub id published beside them between the second and the third."""
    from reliability.test_verdict_matrix import _models

    root = tmp_path_factory.mktemp("any-method-matrix")
    models = _models(root / "models")
    at_merge = {f"org/{who}": [Path(models[w]) for w in HISTORY[who][:2]] for who in HISTORY}
    later = {f"org/{who}": [Path(models[w]) for w in HISTORY[who]] for who in HISTORY}
    cwd = root / "cwd"  # nothing there is named like a hub id
    cwd.mkdir()
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    with HubStub(at_merge, lifetime=3600) as stub, HubStub(later, lifetime=3600) as now:
        for repo in later:  # the merge read the second commit; the third came after it was published (day 3)
            for number in (1, 2, 3):
                now.set_date(repo, number, START + DAY * {1: 1, 2: 2, 3: 5}[number])
        pins = {who: stub.shas[f"org/{who}"][1] for who in HISTORY}
        assert pins == {who: now.shas[f"org/{who}"][1] for who in HISTORY}
        maker = Server("make", {**hub_env(stub.url, root / "make_home"), "PYTHONPATH": path,
                                "MERGEKIT_RAM_DISABLE": "1"}, cwd, root / "make.log")  # fmt: skip
        checker = Server("check", {**hub_env(now.url, root / "check_home"), "PYTHONPATH": path}, cwd,
                         root / "check.log")  # fmt: skip

        def run(row: dict) -> dict:
            work = root / row_id(row)
            made = maker.ask({"row": row, "models": models, "pins": pins, "work": str(work)})
            if "crash" in made:
                return {"made": made}
            seed = ["--random-seed", str(RANDOM_SEED)] if row["variant"] in methods.RANDOM else []
            if row["inputs"] != "hub-history":
                return {"made": made, "verdicts": checker.ask(_verifies(made["merged"], made["tampered"], seed))}
            # published under names of this row's own (the Hub cache knows a snapshot by its commit alone)
            merged, tampered = f"org/merged-{ROWS.index(row)}", f"org/tampered-{ROWS.index(row)}"
            publish(now, merged, Path(made["merged"]), START + 3 * DAY)
            publish(now, tampered, Path(made["tampered"]), START + 3 * DAY)
            return {"made": made, "verdicts": checker.ask(_verifies(merged, tampered, seed))}

        try:
            yield run
        finally:
            maker.close()
            checker.close()


def _verifies(merged: str, tampered: str, seed: list[str]) -> dict:
    verifies = {"full": [merged, *seed], "sample": [merged, *seed, *SAMPLE], "tampered_full": [tampered, *seed],
                "tampered_sample": [tampered, *seed, *SAMPLE]}  # fmt: skip
    if seed:
        verifies["unseeded"] = [merged]
    return {"verifies": verifies}


@pytest.mark.quick
def test_the_rows_cover_every_variant_and_each_kind_with_every_value():
    assert {row["variant"] for row in ROWS} == set(methods.VARIANTS)
    for name, values in DIMENSIONS.items():
        if name == "variant":
            continue
        for k in {kind(v) for v in methods.VARIANTS}:
            assert {row[name] for row in ROWS if kind(row["variant"]) == k} == set(values), (k, name)
    assert len(ROWS) <= 40


@pytest.mark.stage_one  # minutes; no fork to compare, and mergekit's methods are stage 1's in the pinned stages
@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_any_method(matrix, row, rel):
    found = matrix(row)
    assert "crash" not in found["made"], found["made"]
    verdicts = found["verdicts"]
    assert "crash" not in verdicts, verdicts
    full, sample = verdicts["full"], verdicts["sample"]
    rel.verdict(full["code"] == 0 and full["result"] == "identical", "full", full)
    rel.verdict(sample["code"] == 0 and sample["result"] == "no difference in sample", "sample", sample)
    # karcher and arcee_fusion move beyond the last bits between machines: any numeric difference is exit 3
    changed = (3, "depends on the machine") if methods.METHOD[row["variant"]] in BEYOND_LAST_BITS else (1, "differs")
    for key in ("tampered_full", "tampered_sample"):
        said = verdicts[key]
        named = (said["code"], said["result"]) == changed and [t["name"] for t in said["tensors"] or []] == [TAMPERED]
        rel.verdict(named, key, said, tamper=True)
    if row["variant"] in methods.RANDOM:  # arcee_fusion draws only for tensors over 2**20 elements: none here
        unseeded, method = verdicts["unseeded"], methods.METHOD[row["variant"]]
        if method == "arcee_fusion":
            rel.verdict(unseeded["code"] == 0, "arcee_fusion without the seed", unseeded)
        else:
            said = " ".join(unseeded["problems"] or [])
            rel.verdict(unseeded["code"] == 3 and method in said, "without the seed", unseeded)
    if row["inputs"] == "hub-history":
        agent = next(i for i in verdicts["full"]["inputs"] if i["model"] == "org/code")
        assert "inferred from its history at 2026-05-04T00:00:00Z" in agent["detail"], agent
