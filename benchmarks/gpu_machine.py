"""Everything one lent GPU machine should measure, in one call whose results come back whatever step fails.

A lent GPU machine (benchmarks/README.md, "On a lent GPU machine") is held for minutes: 15 a session with its
start, 10 a command, at most 8 files back. It starts bare, reaches no network and has no mergekit; a command cut
off at its limit returns only what it wrote under $OUT. So the work is prepared and tried here, and there each
step runs under the time the budget leaves it, in a process group killed whole when that runs out, with its
output written as it goes and the results packed into $OUT again after every step.

Here, where the package registries answer, once before the machine starts:

    python benchmarks/gpu_machine.py wheels     # .whl/ (git-ignored): mergekit, pydantic, test tools, for 3.12

There (the device's `run`, carry [".whl"], timeout_s 600; the machine's python3 holds torch with CUDA):

    python3 benchmarks/gpu_machine.py run --budget 540              # the measuring steps, in their order
    python3 benchmarks/gpu_machine.py run --budget 400 install suite   # the whole suite with -rfE, kept whole

Here, to try the script on the tiny workload (no GPU, no dropped cache; the environment as it is):

    python benchmarks/gpu_machine.py run --local --out /tmp/gpu-try      # every default step but install

What comes back ($OUT, or --out): `log.txt` (each step: command, exit status, seconds; skipped steps and why),
`facts.txt` (GPU, cores, memory, versions), `steps.txt` (every step's output), `suite.txt` (pytest's, a line per
test: a run cut off still names what failed), and `results.tgz` (the results.json and results.md of run.py,
phases.py and `verify`, a folder per step).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WHEELS = REPO / ".whl"
#: what the GPU machine's python lacks: mergekit, and the pure-Python packages it needs that the image leaves out
MERGEKIT = ("mergekit", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "immutables")
#: the suite's tools at the versions this checkout tests with, and what builds the editable install there, offline
TOOLS = ("pytest", "pluggy", "iniconfig", "pytest-xdist", "execnet", "coverage", "typing-extensions", "packaging")
BUILD = ("hatchling", "editables", "pathspec", "trove-classifiers")
CARRIED = MERGEKIT + TOOLS + BUILD
#: the machine's python (KINDS.md: Python 3.12.3, x86-64)
PYTHON_VERSION = "3.12"
PLATFORMS = "manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"
#: seconds kept back from the budget for the last packing
RESERVE = 5.0


class Step(NamedTuple):
    """One command with the most time it may take (`cap`) and the least worth starting it with (`least`)."""

    name: str
    argv: tuple[str, ...]
    cap: float
    least: float
    log: str = "steps.txt"


def steps(local: bool, root: Path, work: Path, jobs: int) -> list[Step]:
    """The steps in the order they run by default: G1's GPU rows first (the issue's targets), then its CPU row,
    then R3 (built only then: it takes longest) from a dropped page cache. `local` keeps the commands but runs
    them on the tiny workload, without --cuda and without dropping the page cache (which needs root), so that
    the script itself can be tried."""
    py = sys.executable
    g1, r3 = ("tiny", "tiny") if local else ("G1", "R3")
    cuda = () if local else ("--cuda",)
    drop = () if local else ("--drop-cache",)
    bench = ("--root", str(root), "--no-chart")
    trio = ("--methods", "help", "task_arithmetic", "ramplus_cold")
    pair = ("--methods", "task_arithmetic", "ramplus_cold")

    def run(workload: str, name: str, *extra: str) -> tuple[str, ...]:
        return (py, str(HERE / "run.py"), "--workload", workload, *bench, "--out", str(work / name), *extra)

    build = (py, str(HERE / "workloads.py"), "--root", str(root), "--jobs", str(jobs))
    phases = (py, str(HERE / "phases.py"), "--workload", g1, "--root", str(root), *cuda)
    return [
        Step("install", (py, str(HERE / "gpu_machine.py"), "install"), 180, 20),
        Step("facts", (py, str(HERE / "gpu_machine.py"), "facts"), 60, 5, log="facts.txt"),
        Step("g1-build", (*build, g1), 200, 30),
        Step("g1-cuda", run(g1, "G1-cuda", *cuda, *trio, "--repeats", "2", "--timeout", "90"), 300, 90),
        Step("phases-cuda", (*phases, "--repeats", "2", "--out", str(work / "phases"), "--name", "G1-cuda"), 200, 60),
        Step("g1-threads", run(g1, "G1-threads", *trio, "--repeats", "1", "--timeout", "90"), 200, 60),
        Step(
            "verify-cuda",
            (
                py,
                str(HERE / "gpu_machine.py"),
                "verify",
                g1,
                "--root",
                str(root),
                "--out",
                str(work / "verify-cuda"),
                *cuda,
            ),
            240,
            60,
        ),
        Step("r3-build", (*build, r3), 400, 60),
        Step("r3-cuda", run(r3, "R3-cuda", *cuda, *drop, *pair, "--repeats", "1", "--timeout", "240"), 400, 90),
        Step("r3-threads", run(r3, "R3-threads", *drop, *pair, "--repeats", "1", "--timeout", "240"), 400, 90),
        Step(
            "suite",
            (py, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-n", str(jobs)),
            600,
            120,
            log="suite.txt",
        ),
    ]


#: what `run` runs when no step is named: everything but the suite, which needs a call of its own
DEFAULT = ("install", "facts", "g1-build", "g1-cuda", "phases-cuda", "g1-threads", "r3-build", "r3-cuda", "r3-threads")
#: a correctness check beside them, for a call with time to spare (`run ... verify-cuda`)


def _wheels() -> list[str]:
    return sorted(str(p) for p in WHEELS.glob("*.whl"))


def wheels() -> int:
    """Download CARRIED as wheels for the GPU machine's Python into .whl/, at the versions installed here (the
    newest where one is not), and keep .whl/ out of git: it travels as a carried path, not in the tree."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:  # a build tool pip fetches into an isolated build here (editables)
            pins.append(name)
    platforms = [arg for p in PLATFORMS.split() for arg in ("--platform", p)]
    where = ["--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms]
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command = [*download, *where, "-d", str(WHEELS), *pins]
    print(shlex.join(command))
    done = subprocess.run(command)
    if done.returncode:
        return done.returncode
    exclude = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--git-path", "info/exclude"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(exclude) if Path(exclude).is_absolute() else REPO / exclude
    lines = path.read_text().splitlines() if path.exists() else []
    if "/.whl/" not in lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{line}\n" for line in [*lines, "/.whl/"]))
    total = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
    print(f"{len(_wheels())} wheels, {total / 2**20:.1f} MiB in {WHEELS} (the device carries 64 MiB at most)")
    return 0


def install() -> int:
    """Install the carried wheels into this python, then this checkout editable, as CI's set-up does (the build
    needs hatchling, which is among the wheels: so in two steps, offline)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    found = _wheels()
    if not found:
        print(f"no wheels in {WHEELS}: run `python benchmarks/gpu_machine.py wheels` where pip reaches an index")
        return 2
    for command in ([*pip, *found], [*pip, "--no-build-isolation", "-e", str(REPO)]):
        print(shlex.join(command), flush=True)
        done = subprocess.run(command)
        if done.returncode:
            return done.returncode
    return 0


def facts() -> int:
    """What the figures were measured on, printed: the GPU, cores, memory, disk, Python and its packages."""
    for command in (
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv"],
        ["nproc"],
        ["free", "-g"],
        ["df", "-h", "/tmp"],
        ["uname", "-r"],
    ):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=20)
            print(f"$ {shlex.join(command)}\n{done.stdout}{done.stderr}", end="")
        except (OSError, subprocess.TimeoutExpired) as error:
            print(f"$ {shlex.join(command)}\n{error}")
    from importlib.metadata import PackageNotFoundError, version

    print(f"python {sys.version.split()[0]} ({sys.executable})")
    for name in ("torch", "transformers", "safetensors", "mergekit", "mergekit-ram", "pytest", "pytest-xdist"):
        try:
            print(f"{name} {version(name)}")
        except PackageNotFoundError:
            print(f"{name} not installed")
    import torch

    print(f"torch sees CUDA: {torch.cuda.is_available()}, threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        print(f"device 0: {torch.cuda.get_device_name(0)}")
    return 0


def verify(workload: str, root: Path, out: Path, cuda: bool) -> int:
    """A ramplus merge of `workload` (with --cuda), then `mergekit-ram verify` of it three ways: recomputed with
    --cuda, on the CPU (the GPU's merge must be the CPU's bits) and with --sample 0.05 and --cuda, each expected to
    exit 0. out/results.json holds each command, its exit status, seconds and verdict (--json)."""
    import json

    sys.path.insert(0, str(HERE))
    import measure
    import workloads
    import yaml

    wl, _marker = workloads.get(workload, str(root))
    out.mkdir(parents=True, exist_ok=True)
    config = out / "ramplus.yaml"
    config.write_text(yaml.safe_dump(measure.config(wl, "ramplus", measure.RAMPLUS)))
    merged = out / "merged"
    device = ["--cuda"] if cuda else []
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off"}  # every run counts: a cold merge, as verify always is
    verify = [str(measure.BIN / "mergekit-ram"), "verify", str(merged), "--json", "-q"]
    commands = {
        "merge": [measure.MERGEKIT_YAML, str(config), str(merged), *device],
        "verify": [*verify, *device],
        "verify on the CPU": verify,
        "verify --sample": [*verify, "--sample", "0.05", "--sample-seed", "1", *device],
    }
    rows, failed = {}, 0
    for name, command in commands.items():
        t0 = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        row = {"command": shlex.join(command), "exit": done.returncode, "seconds": round(time.monotonic() - t0, 2)}
        if name != "merge":
            try:
                row["verdict"] = json.loads(done.stdout)
            except ValueError:
                row["stdout"] = done.stdout[-2000:]
        row["stderr"] = done.stderr[-2000:]
        rows[name] = row
        print(f"{name}: exit {done.returncode} after {row['seconds']} s", flush=True)
        failed += done.returncode != 0
        if name == "merge" and done.returncode:
            break
    (out / "results.json").write_text(json.dumps({"workload": workload, "cuda": cuda, "runs": rows}, indent=1))
    shutil.rmtree(merged, ignore_errors=True)  # G1's is 1.7 GB, and its .json files are not results
    return 1 if failed else 0


def _run_step(step: Step, seconds: float, out: Path) -> tuple[int | None, float]:
    """(exit status, or None when killed at `seconds`; wall seconds). Output appended to `out / step.log`; the step
    runs in a process group of its own, killed whole at its time (run.py's merges are grandchildren)."""
    t0 = time.monotonic()
    with open(out / step.log, "a") as log:
        log.write(f"\n==== {step.name}: {shlex.join(step.argv)} (at most {seconds:.0f} s)\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        child = subprocess.Popen(
            step.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            code: int | None = child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
                try:
                    os.killpg(child.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    child.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return code, time.monotonic() - t0


def _pack(work: Path, out: Path) -> None:
    """results.tgz: every results.json and .md under `work` (small; rewritten whole after each step)."""
    partial = out / "results.tgz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in (".json", ".md"):
                tar.add(path, arcname=str(path.relative_to(work)))
    partial.replace(out / "results.tgz")


def run(names: list[str], budget: float, out: Path, local: bool, root: Path, jobs: int) -> int:
    """Run the named steps in order within `budget` seconds; 0 when every one ran and exited 0."""
    deadline = time.monotonic() + budget
    out.mkdir(parents=True, exist_ok=True)
    work = out.parent / f"{out.name}-work" if local else Path("/tmp/gpu-machine-work")
    work.mkdir(parents=True, exist_ok=True)
    plan = {step.name: step for step in steps(local, root, work, jobs)}
    unknown = [name for name in names if name not in plan]
    if unknown:
        print(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(plan)}", file=sys.stderr)
        return 2
    failed = 0
    with open(out / "log.txt", "a") as summary:
        summary.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(names)} within {budget:.0f} s\n")
        for name in names:
            step = plan[name]
            left = deadline - time.monotonic() - RESERVE
            if left < step.least:
                summary.write(f"{name}: skipped ({left:.0f} s left of the budget, it needs {step.least:.0f})\n")
                failed += 1
                continue
            code, took = _run_step(step, min(step.cap, left), out)
            said = f"exit {code}" if code is not None else "killed at its time"
            summary.write(f"{name}: {said} after {took:.1f} s: {shlex.join(step.argv)}\n")
            summary.flush()
            failed += code != 0
            _pack(work, out)
    print((out / "log.txt").read_text())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("wheels", help="here: the wheels the GPU machine needs, into .whl/")
    verbs.add_parser("install", help="there: the carried wheels, then this checkout editable")
    verbs.add_parser("facts", help="print the machine's GPU, cores, memory and versions")
    check = verbs.add_parser("verify", help="a ramplus merge of WORKLOAD verified with --cuda, on the CPU, sampled")
    check.add_argument("workload")
    check.add_argument("--root", type=Path, required=True)
    check.add_argument("--out", type=Path, required=True)
    check.add_argument("--cuda", action="store_true")
    go = verbs.add_parser("run", help="there: the steps, within the budget, results into $OUT")
    go.add_argument("names", nargs="*", metavar="STEP", help=f"steps to run, in order (default: {' '.join(DEFAULT)})")
    go.add_argument("--budget", type=float, default=540, help="seconds for all the steps (default 540)")
    go.add_argument("--out", type=Path, default=None, help="where the results go (default $OUT)")
    go.add_argument("--local", action="store_true", help="try the script: the tiny workload, no GPU, no cache drop")
    go.add_argument("--root", type=Path, default=None, help="workload folder (default /tmp/gpu-machine-bench)")
    go.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build threads and test processes")
    args = parser.parse_args(argv)
    if args.verb == "wheels":
        return wheels()
    if args.verb == "install":
        return install()
    if args.verb == "facts":
        return facts()
    if args.verb == "verify":
        return verify(args.workload, args.root, args.out, args.cuda)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        parser.error("run needs --out or $OUT")
    root = args.root or Path("/tmp/gpu-machine-bench")
    names = args.names or [name for name in DEFAULT if not (args.local and name == "install")]
    return run(names, args.budget, out, args.local, root, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
