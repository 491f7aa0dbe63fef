"""``mergekit-ram verify TARGET``: a finished ramplus merge (a folder, or ORG/NAME[@REVISION] on the Hub) recomputed
from its record and compared bit for bit.

This module is the command line only: its options, the checks the command line alone allows (before torch and
mergekit load), the Hub fetch, and how the verdict is printed and exits (`common.EXIT_*`). The work is `verify/`'s
(`verify.driver`), through the seam's recompute interface (`_mergekit.recompute`), which this module passes in;
docs/verify.md says what is checked and what exit 0 promises.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from mergekit_ram import errors
from mergekit_ram.cli.common import EXIT_CANNOT_CHECK, PROG, UsageError, VerdictExit
from mergekit_ram.cli.grouped_help import grouped

HELP = (
    "Check that TARGET, a merge's output folder or ORG/NAME[@REVISION] on the Hugging Face Hub (only the files "
    "verify reads are fetched, never code), holds what its merge makes of its inputs: a ramplus merge from its "
    "ram_stats.json (each input's recorded identity, the plan, rho counted again in memory: the statistics cache is "
    "never evidence, verify never reads it), a merge by any of mergekit's own methods from its mergekit_config.yml; "
    "every tensor recomputed and compared bit for bit, then the statistics, the card and the other files a "
    "loader reads; writing nothing, running no code of them. "
    "Exit 0: bit-identical; 1: not what it records (each difference named); 2: a usage error; 3: cannot check (an "
    "input missing or changed, a file or option refused, the Hub unreachable or contradicting, a random method "
    "without --random-seed, or differences only as large as the method's bits move between machines)."
)

#: verify's options in --help by what they change (`--lora-merge-cache`, where merged LoRAs are written: unlisted)
GROUPS = {
    "What it checks": ("share", "seed", "random_seed", "accept_last_bits", "trust"),
    "Where the inputs are": ("inputs", "inputs_from", "input_dir", "transformers_cache"),
    "How it recomputes": ("cuda", "device", "low_cpu_memory", "read_to_gpu", "multi_gpu", "num_threads", "gpu_rich"),
    "What it prints": ("as_json", "quiet", "verbosity", "help"),
}

TRUST_HELP = (
    "let the inputs' own code run where the merge's record says it ran; verify's own flag, not mergekit's: a "
    "trust_remote_code the folder records is evidence of how it was merged, never applied without this flag "
    "(without it such a merge cannot be checked)"
)
SAMPLE_HELP = (
    "check a slice of every output tensor holding at least P (in (0, 1]) of it, reading only its bytes; exit 0 then "
    "means no difference in the sample (docs/verify.md)"
)
LAST_BITS_HELP = (
    "accept differences confined to the last bits that the merge's method is measured to move between machines "
    "(linear, multislerp, model_stock, dare_*, della*: 1 to 7 units in the last place, measured; docs/verify.md): "
    "exit 0, result 'identical but for the last bits', instead of 3; a larger difference is exit 1 whatever this says"
)
RANDOM_SEED_HELP = (
    "mergekit's --random-seed, the seed the merge ran with: a method that draws random numbers (dare_ties, "
    "dare_linear, della, della_linear; arcee_fusion on large tensors) is checked only with it, since nothing records "
    "it; a wrong seed makes those tensors differ"
)
SEED_HELP = (
    "the seed of --sample's draw, an integer: the same seed draws the same slices on every machine, so a verdict can "
    "be checked again (default: drawn from the operating system; the verdict and --json always print it)"
)


def command() -> click.Command:
    from mergekit_ram._mergekit import options
    from mergekit_ram.reporting.report import RECORDED_OPTIONS

    @click.command("verify", cls=grouped(GROUPS), help=HELP)
    @click.argument("target", metavar="OUT_DIR|ORG/NAME[@REVISION]")
    @click.option(
        "--json", "as_json", is_flag=True, help="print the result as JSON (schema: mergekit_ram/verify/verdict.py)"
    )
    @click.option(
        "--input",
        "inputs",
        multiple=True,
        metavar="RECORDED=LOCAL",
        help="read the recorded input RECORDED (its recorded name or label) from the local copy LOCAL (its identity "
        "is checked); repeatable",
    )
    @click.option(
        "--inputs-from",
        "inputs_from",
        multiple=True,
        metavar="RECORDED_PARENT=LOCAL_PARENT",
        help="read every input recorded under the folder RECORDED_PARENT from the same place under LOCAL_PARENT; "
        "repeatable",
    )
    @click.option(
        "--input-dir",
        metavar="DIR",
        type=click.Path(path_type=Path),
        help="read each input with a copy in DIR named by its label (DIR/LABEL) from there",
    )
    @click.option("--trust-remote-code", "trust", is_flag=True, help=TRUST_HELP)
    @click.option("--sample", "share", metavar="P", help=SAMPLE_HELP)
    @click.option("--sample-seed", "seed", metavar="N", help=SEED_HELP)
    @click.option("--random-seed", "random_seed", metavar="N", type=int, help=RANDOM_SEED_HELP)
    @click.option("--accept-last-bits", "accept_last_bits", is_flag=True, help=LAST_BITS_HELP)
    # not the merge options the folder's record fixes (`report.RECORDED_OPTIONS`: mergekit's `--trust-remote-code`
    # among them, replaced by verify's own flag above, the user's consent), nor those of writing a folder
    # (`options.WRITES`)
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
        random_seed: int | None,
        accept_last_bits: bool,
        **merge: Any,
    ) -> None:
        from mergekit_ram.verify import sample  # a bad value: ValueError, its one line (exit 2)

        drawn = sample.options(share, seed)
        run(
            target,
            as_json,
            merge,
            trust=trust,
            inputs=inputs,
            inputs_from=inputs_from,
            input_dir=input_dir,
            sample=drawn,
            random_seed=random_seed,
            accept_last_bits=accept_last_bits,
        )

    return verify


def run(
    target: str | Path,
    as_json: bool,
    merge: dict[str, Any],
    *,
    inputs: Sequence[str] = (),
    inputs_from: Sequence[str] = (),
    input_dir: Path | None = None,
    trust: bool = False,
    sample: tuple[float, int] | None = None,
    random_seed: int | None = None,
    accept_last_bits: bool = False,
) -> None:
    """`merge`: mergekit's merge options, made a `MergeOptions` (torch, mergekit) after the usage checks. What the
    command line alone shows wrong is refused here, before the heavy imports: an `--input` or `--inputs-from`
    without `=`, an `--input-dir` that is no folder. Each value is split where the record says (`input_copies`: a
    recorded name may hold `=`). A TARGET that is no local path and reads as `org/name` is a merge on the Hub
    (`hub.parse`), fetched first."""
    from mergekit_ram.checks import paths
    from mergekit_ram.verify import hub

    forms = (("--input", inputs, "RECORDED=LOCAL"), ("--inputs-from", inputs_from, "RECORDED_PARENT=LOCAL_PARENT"))
    for option, values, form in forms:
        for pair in values:
            if "=" not in pair.strip("="):
                raise UsageError(f"{option} {pair}: expected {form}")
    input_dir = None if input_dir is None else input_dir.expanduser()  # `--input-dir=~/x`: no shell expands it
    if input_dir is not None and not input_dir.is_dir():
        raise UsageError(f"--input-dir {input_dir}: no such folder{paths.where(str(input_dir))}")
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
        if random_seed is not None:  # mergekit's own option, which verify takes apart from those of reading inputs
            options = options.model_copy(update={"random_seed": random_seed})
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
                accept_last_bits=accept_last_bits,
            )
    except errors.NotVerifiable as error:
        raise UsageError(str(error)) from error
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
        raise VerdictExit(EXIT_CANNOT_CHECK) from error
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
        raise VerdictExit(outcome.exit_code)
