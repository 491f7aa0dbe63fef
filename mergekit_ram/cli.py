"""The ``mergekit-ram`` command line: ``example``, ``inspect`` and ``verify``.

On click, like mergekit's own commands; ``inspect`` and ``verify`` take mergekit's merge
options, declared without importing mergekit (`_mergekit.options`, checked against mergekit's
own), less those of writing a model. Commands are built when they run, and import torch and
mergekit only once they start working, so help, ``--version`` and usage errors answer at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from mergekit_ram import errors
from mergekit_ram.reporting import versions

PROG = "mergekit-ram"
#: verify's exit code when it cannot check (`verdict.EXIT["cannot check"]`, named here without importing torch)
CANNOT_CHECK = 3


class _UsageError(Exception):
    """An error worth one line on stderr and exit code 2, not a traceback."""


class _NotIdentical(Exception):
    """`verify` found the folder not identical (exit code 1) or could not check it (3) and said so."""

    def __init__(self, code: int = 1):
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------- #
# example
# --------------------------------------------------------------------------- #
def _example_command() -> click.Command:
    @click.command(
        "example",
        help=(
            "Write a tiny bf16 Qwen2 base model, three sparse RL-like agents (code, tool, memory; it prints the "
            "share of each one's weights changed, as a merge's statistics table counts it) and the configs "
            "ramplus.yaml and ram.yaml (absolute paths) into OUT_DIR."
        ),
    )
    @click.argument("out_dir", metavar="OUT_DIR", type=click.Path(path_type=Path))
    @click.option("--force", is_flag=True, help="write into OUT_DIR even if it is not empty")
    def example(out_dir: Path, force: bool) -> None:
        out_dir = out_dir.expanduser().resolve()
        if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
            raise _UsageError(f"{out_dir} is not empty; pick an empty folder or pass --force")

        from mergekit_ram.example_models import EXAMPLE_DENSITIES, write_example, written_densities

        ramplus = write_example(out_dir, overwrite=force)
        out = ramplus.parent
        densities = written_densities(out, EXAMPLE_DENSITIES)  # as the statistics table counts them
        print(f"Wrote an RL-like example workload to {out}:")
        print(f"  base model      {out / 'base'}")
        for name, density in densities.items():
            print(f"  agent {name:<9} {out / 'agents' / name}  ({100 * density:.2f}% of weights changed)")
        print(f"  RAM+ config     {ramplus}")
        print(f"  RAM config      {out / 'ram.yaml'}")
        print()
        print("Next, merge with:")
        print(f"  mergekit-yaml {ramplus} {out / 'merged'}")

    return example


# --------------------------------------------------------------------------- #
# inspect
# --------------------------------------------------------------------------- #
def _inspect_command() -> click.Command:
    from mergekit_ram._mergekit import options
    from mergekit_ram.core import params

    @click.command(
        "inspect",
        help=(
            "Run only the RAM+ statistics pass of CONFIG (any merge config with a base_model; planned as ramplus) "
            "and print, per agent, its density, the share of its changed weights that are unique / shared with 1 / "
            "with >=2 other agents, rho and lambda. Counts are cached like a merge's, so inspecting then merging "
            "reads the weights once. Takes mergekit-yaml's options but those of writing a model."
        ),
    )
    @click.argument("config", metavar="CONFIG.yaml", type=click.Path(path_type=Path))
    @click.option("--json", "json_path", metavar="FILE", type=click.Path(path_type=Path),
                  help="also write the statistics (ram_stats.json schema)")  # fmt: skip
    @click.option("--plot", metavar="FILE.png", type=click.Path(path_type=Path),
                  help="also draw per-layer heat maps (needs matplotlib)")  # fmt: skip
    @click.option("--r", "r", type=float, help="lambda for this r instead of the config's")
    @click.option("--alpha", type=float, help="lambda for this alpha instead of the config's")
    @click.option("--lambda-rule", type=click.Choice(params.LAMBDA_RULES), help="lambda rule instead of the config's")
    @click.option("--tensor-union", "-u", is_flag=True, help="mergekit-pytorch config: as its --tensor-union")
    @click.option("--tensor-intersection", "-i", is_flag=True,
                  help="mergekit-pytorch config: as its --tensor-intersection")  # fmt: skip
    @options.declare()
    def inspect(**kwargs: Any) -> None:
        _inspect(**kwargs)

    return inspect


def _inspect(
    config: Path,
    json_path: Path | None,
    plot: Path | None,
    r: float | None,
    alpha: float | None,
    lambda_rule: str | None,
    tensor_union: bool = False,
    tensor_intersection: bool = False,
    **merge: Any,
) -> None:
    """`merge`: mergekit's merge options, made a `MergeOptions` (torch, mergekit) after the usage checks."""
    import logging

    import yaml

    from mergekit_ram.core import params

    config = config.expanduser()  # `~` as in every option of ours that takes a path
    json_path, plot = (None if p is None else p.expanduser() for p in (json_path, plot))
    levels = {0: logging.WARNING, 1: logging.INFO}
    logging.basicConfig(level=levels.get(merge.get("verbosity", 0), logging.DEBUG), format="%(levelname)s: %(message)s")
    if not config.is_file():
        raise _UsageError(f"no such config file: {config}")
    if plot:  # before minutes of reading weights
        from mergekit_ram.reporting import plot as plotting

        try:
            plotting.require()
        except RuntimeError as error:
            raise _UsageError(str(error)) from error
    for name, value in (("r", r), ("alpha", alpha)):  # before minutes of reading weights
        if value is not None:
            params.check(name, value, label=f"--{name}")
    from mergekit_ram._mergekit import inspection
    from mergekit_ram._mergekit import options as merge_options
    from mergekit_ram.reporting import report, tables

    options = merge_options.merge_options(merge)
    options.apply_global_options()
    try:
        text = yaml.safe_load(config.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise _UsageError(f"{config} is {errors.yaml_said(error) or 'not valid YAML'}") from error
    merge_config = inspection.config_of(text)  # or mergekit-pytorch's
    done = inspection.inspect(merge_config, options, tensor_union=tensor_union, tensor_intersection=tensor_intersection)
    assert done.report is not None and done.stats is not None
    found = report.with_lambda_for(done.report, r=r, alpha=alpha, lambda_rule=lambda_rule)  # lambda for the flags'
    stats, labels = done.stats, report.labels_of(found)
    text, warnings = tables.inspect_summary(found, stats, labels, str(config))
    print(text)
    for line in warnings:
        print(line, file=sys.stderr)
    if json_path:
        json_path.write_text(report.dumps(found), encoding="utf-8")
        print(f"wrote {json_path}")
    if plot:
        from mergekit_ram.reporting.plot import heatmap

        try:
            heatmap(stats, plot, labels)
        except RuntimeError as error:
            raise _UsageError(str(error)) from error
        print(f"wrote {plot}")


# --------------------------------------------------------------------------- #
# verify
# --------------------------------------------------------------------------- #
#: verify's options in --help by what they change (`--lora-merge-cache`, where merged LoRAs are written: unlisted)
VERIFY_HELP = {
    "What it checks": ("share", "seed", "trust"),
    "Where the inputs are": ("inputs", "inputs_from", "input_dir", "transformers_cache"),
    "How it recomputes": ("cuda", "device", "low_cpu_memory", "read_to_gpu", "multi_gpu", "num_threads", "gpu_rich"),
    "What it prints": ("as_json", "quiet", "verbosity", "help"),
}


def _verify_command() -> click.Command:
    from mergekit_ram._mergekit import options
    from mergekit_ram.reporting.report import RECORDED_OPTIONS

    @click.command(
        "verify",
        cls=options.grouped(VERIFY_HELP),
        help=(
            "Check that TARGET, a merge's output folder or ORG/NAME[@REVISION] on the Hugging Face Hub (only the files "
            "verify reads are fetched, never code), holds what its ramplus merge makes of its inputs: each input's "
            "recorded identity, the plan, every tensor recomputed (rho counted again) and compared bit for bit, then "
            "the statistics, the card and the other files a loader reads; writing nothing, running no code of them. "
            "Exit 0: bit-identical; 1: not what it records (each difference named); 2: a usage error; 3: cannot "
            "check (an input missing or changed, a file or option refused, the Hub unreachable or contradicting)."
        ),
    )
    @click.argument("target", metavar="OUT_DIR|ORG/NAME[@REVISION]")
    @click.option(
        "--json", "as_json", is_flag=True, help="print the result as JSON (schema: mergekit_ram/verify/verdict.py)"
    )
    @click.option("--input", "inputs", multiple=True, metavar="RECORDED=LOCAL",
                  help="read the recorded input RECORDED (its recorded name or label) from the local copy LOCAL "
                  "(its identity is checked); repeatable")  # fmt: skip
    @click.option("--inputs-from", "inputs_from", multiple=True, metavar="RECORDED_PARENT=LOCAL_PARENT",
                  help="read every input recorded under the folder RECORDED_PARENT from the same place under "
                  "LOCAL_PARENT; repeatable")  # fmt: skip
    @click.option("--input-dir", metavar="DIR", type=click.Path(path_type=Path),
                  help="read each input with a copy in DIR named by its label (DIR/LABEL) from there")  # fmt: skip
    @click.option("--trust-remote-code", "trust", is_flag=True,
                  help="let the inputs' own code run where the merge's record says it ran")  # fmt: skip
    @click.option("--sample", "share", metavar="P",
                  help="check a slice of every output tensor holding at least P (in (0, 1]) of it, reading only "
                  "its bytes; exit 0 then means no difference in the sample (docs/verify.md)")  # fmt: skip
    @click.option("--sample-seed", "seed", metavar="N", help="--sample's seed (default: the system's; printed)")
    @options.declare(left_out=RECORDED_OPTIONS, hidden=("lora_merge_cache",), helps=options.READING_HELP)
    def verify(
        target: str,
        as_json: bool,
        inputs: tuple[str, ...],
        inputs_from: tuple[str, ...],
        input_dir: Path | None,
        trust: bool,
        share: str | None,
        seed: str | None,
        **merge: Any,
    ) -> None:
        from mergekit_ram.verify import sample  # a bad value: ValueError, its one line (exit 2)

        _verify(target, as_json, merge, trust=trust, inputs=inputs, inputs_from=inputs_from, input_dir=input_dir,
                sample=sample.options(share, seed))  # fmt: skip

    return verify


def _verify(
    target: str | Path,
    as_json: bool,
    merge: dict[str, Any],
    *,
    inputs: Sequence[str] = (),
    inputs_from: Sequence[str] = (),
    input_dir: Path | None = None,
    trust: bool = False,
    sample: tuple[float, int] | None = None,
) -> None:
    """`merge`: mergekit's merge options, a `MergeOptions` after the usage checks, which come before the heavy
    imports: an `--input` or `--inputs-from` without `=`, an `--input-dir` that is no folder (each value is split
    where the record says, `input_copies`). A TARGET that is no local path and reads as `org/name` is a merge on
    the Hub (`hub.parse`), fetched first."""
    from mergekit_ram.checks import paths
    from mergekit_ram.verify import hub

    for option, values, form in (("--input", inputs, "RECORDED=LOCAL"),
                                 ("--inputs-from", inputs_from, "RECORDED_PARENT=LOCAL_PARENT")):  # fmt: skip
        for pair in values:
            if "=" not in pair.strip("="):
                raise _UsageError(f"{option} {pair}: expected {form}")
    input_dir = None if input_dir is None else input_dir.expanduser()  # `--input-dir=~/x`: no shell expands it
    if input_dir is not None and not input_dir.is_dir():
        raise _UsageError(f"--input-dir {input_dir}: no such folder{paths.where(str(input_dir))}")
    on_hub = hub.parse(str(target))
    published = None
    restore = hub.quiet_bars(as_json or bool(merge.get("quiet")))  # -q, --json: huggingface_hub's bars too
    try:
        if on_hub is not None:  # before torch and mergekit load: a repository the Hub lacks is one line at once
            cache = merge.get("transformers_cache")
            try:  # with --sample, the weights are read by ranges (`ranged`), not fetched
                published = hub.fetch(*on_hub, cache_dir=cache, quiet=bool(merge.get("quiet")), weights=sample is None)
            except errors.Unreadable as error:  # neither a folder here nor a merge the Hub gives: say both
                raise errors.Unreadable(paths.neither(str(target), errors.said(error))) from error
        from mergekit_ram._mergekit import options as merge_options
        from mergekit_ram._mergekit import recompute
        from mergekit_ram.verify import driver

        options = merge_options.merge_options(merge)
        options.apply_global_options()
        with hub.guarded():  # the inputs a hub id names: their answers checked and bounded too
            outcome = driver.verify(
                published.folder if published is not None else str(target),
                options,
                recompute.MERGEKIT,
                trust_remote_code=trust,
                inputs=inputs,
                inputs_from=inputs_from,
                input_dir=None if input_dir is None else str(input_dir),
                published=published,
                sample=sample,
            )
    except errors.NotVerifiable as error:
        raise _UsageError(str(error)) from error
    except errors.CANNOT_CHECK as error:
        message = errors.said(error)
        if as_json:  # the verdict's JSON (verdict imports torch: not for the one line alone)
            from mergekit_ram.verify import verdict

            where = {"repository": on_hub[0], "requested": on_hub[1], "revision": None} if on_hub else None
            outcome = verdict.Outcome(folder=str(Path(target).expanduser().absolute()), hub=where, error=message)
            if published is not None:
                outcome.folder, outcome.hub = published.folder, published.as_json()
            print(verdict.dumps(outcome), end="")
        print(f"{PROG} verify: cannot check: {message}", file=sys.stderr)
        raise _NotIdentical(CANNOT_CHECK) from error
    finally:
        restore()
    if as_json:
        from mergekit_ram.verify import verdict

        print(verdict.dumps(outcome), end="")
    else:
        for note in outcome.notes:
            print(f"note: {note}", file=sys.stderr)
        print(outcome.text())
    if outcome.exit_code:
        raise _NotIdentical(outcome.exit_code)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #
#: name -> (one-line help, a function that builds the command): built only when run.
COMMANDS: dict[str, tuple[str, Callable[[], click.Command]]] = {
    "example": ("write a tiny RL-like base model, three agents and ready RAM/RAM+ configs", _example_command),
    "inspect": ("count (or reuse cached) RAM+ statistics of a config without merging", _inspect_command),
    "verify": ("recompute a ramplus merge from its folder or the Hub and compare it bit for bit", _verify_command),
}


class _Commands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        return entry[1]() if entry else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (text, _) in COMMANDS.items()])


def _version(ctx: click.Context, _param: click.Parameter, wanted: bool) -> None:
    """The version, then the fused CPU kernel's state (`native.status`: nothing is built, torch is not imported)."""
    if not wanted or ctx.resilient_parsing:
        return
    from mergekit_ram.core import native

    click.echo(f"{PROG} {versions.installed('mergekit-ram')}\nfused CPU kernel: {native.status()}")
    ctx.exit()


@click.group(PROG, cls=_Commands, help="Helpers for RAM / RAM+ merging with mergekit (merge_method: ramplus).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version, and whether the fused CPU kernel is in use, and exit.")  # fmt: skip
def _group() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mergekit-ram``; returns the exit code: 0 ok, 1 an input model that cannot be read or counted (a damaged
    file, a NaN, a shape or dtype mismatch) or a folder ``verify`` finds not identical, 2 a usage error (an option,
    the config, a missing file named on the command line), 3 ``verify`` cannot check, 130 interrupted."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        click.echo(_group.get_help(click.Context(_group, info_name=PROG)), err=True)
        return 2
    command = args[0]
    errors.show_warnings_as_lines()
    errors.quiet_deprecated_dtype()
    try:
        _group.main(args, prog_name=PROG, standalone_mode=False)
        return 0
    except click.exceptions.Exit as done:  # --help, --version
        return int(done.exit_code or 0)
    except click.ClickException as error:  # usage errors
        error.show()
        return 2
    except _NotIdentical as verdict:
        return verdict.code
    except click.exceptions.Abort:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (_UsageError, OSError, ValueError) as error:
        if errors.wants_traceback():  # -v or MERGEKIT_RAM_TRACEBACK=1
            import traceback

            traceback.print_exc()
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {command}: error: {message}", file=sys.stderr)
        return 1 if isinstance(error, errors.InputError) else 2  # an input model that cannot be read or counted
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
