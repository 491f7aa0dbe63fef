"""Run commands in one process and say what each decided: exit code, `--json` result, first problem line.

Used as a script by the hash-seed tests (issue 73): a process's string hashing (`PYTHONHASHSEED`) is fixed when it
starts, so each seed needs a process of its own, and one process runs every command of a seed in turn (a start
costs seconds; a verify of the suite's tiny models a fraction of one). Reads a JSON list of argv lists on stdin,
writes one JSON list of outcomes on stdout after a `@@outcomes ` mark. An argv starts with the command a user
types: `mergekit-ram` (run through `mergekit_ram.cli.main`) or `mergekit-yaml` (mergekit's own `main`, a refusal
said as the command says it: `errors.one_line`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

#: the seeds each command runs under: three, so a verdict that follows string hashing shows (issue 73's repro
#: gave exit 3 at seeds 1 and 2 and exit 1 at seed 3)
SEEDS = ("1", "2", "3")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def run(argv: list[str]) -> dict:
    """One command in this process: {"exit", "result", "first"} (`result`: `--json`'s, None without it)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if argv[0] == "mergekit-ram":
            from mergekit_ram import cli

            code = cli.main(argv[1:])
        elif argv[0] == "mergekit-yaml":
            from mergekit.scripts import run_yaml

            from mergekit_ram import errors

            try:
                run_yaml.main.main(argv[1:], standalone_mode=False)
                code = 0
            except Exception as error:  # what the command prints of it: its one line (None: a traceback)
                code, line = 1, errors.one_line(error, "mergekit-yaml")
                print(line if line is not None else f"traceback: {type(error).__name__}: {error}", file=sys.stderr)
        else:
            raise ValueError(f"not a command these tests run: {argv[0]}")
    found = None
    if "--json" in argv and out.getvalue().strip():
        found = json.loads(out.getvalue())
    if found is not None:
        first = (found.get("problems") or [found.get("headline", "")])[0]
        return {"exit": code, "result": found.get("result"), "first": first}
    return {"exit": code, "result": None, "first": first_line(err.getvalue()) or first_line(out.getvalue())}


def by_seed(commands: list[list[str]], env: dict | None = None, cwd=None, seeds=SEEDS) -> dict[str, list[dict]]:
    """seed -> the outcomes of `commands` (`run`), each seed in a process of its own started with
    `PYTHONHASHSEED` set (all at once: they only read), `env` added to this process's environment."""
    started = {}
    for seed in seeds:
        environment = {**os.environ, **(env or {}), "PYTHONHASHSEED": seed}
        started[seed] = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=cwd,
        )
    found = {}
    for seed, process in started.items():
        out, err = process.communicate(json.dumps(commands), timeout=900)  # a bound against a hang
        mark = out.rfind("@@outcomes ")
        if process.returncode or mark < 0:
            raise AssertionError(f"PYTHONHASHSEED={seed}: exit {process.returncode}: {err[-4000:]}")
        found[seed] = json.loads(out[mark + len("@@outcomes ") :])
    return found


def differing(found: dict[str, list[dict]], commands: list[list[str]]) -> list[str]:
    """A line for each command whose outcome is not the same under every seed."""
    seeds = list(found)
    lines = []
    for i, argv in enumerate(commands):
        outcomes = {seed: found[seed][i] for seed in seeds}
        if len({json.dumps(o, sort_keys=True) for o in outcomes.values()}) > 1:
            lines.append(f"{' '.join(argv)}: " + "; ".join(f"seed {s}: {o}" for s, o in outcomes.items()))
    return lines


def main() -> None:
    import mergekit_ram  # noqa: F401  (the plugin's hooks, as the .pth installs them)
    from mergekit_ram._mergekit import loading

    loading.install()
    commands = json.loads(sys.stdin.read())
    outcomes = [run(argv) for argv in commands]
    sys.stdout.write("\n@@outcomes " + json.dumps(outcomes) + "\n")


if __name__ == "__main__":
    main()
