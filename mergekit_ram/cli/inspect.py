"""``mergekit-ram inspect CONFIG``: the RAM+ statistics pass of a merge config, without merging.

Takes mergekit's merge options (`_mergekit.options`, declared without importing mergekit) less those of writing a
model. What the command line alone shows wrong (no such config, an `--r` out of range, `--plot` without
matplotlib) is refused before torch and mergekit load and before minutes of reading weights; the pass itself is
the seam's (`_mergekit.inspection`), the table `reporting.tables`'.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from mergekit_ram import errors
from mergekit_ram.cli.common import UsageError

HELP = (
    "Run only the RAM+ statistics pass of CONFIG (any merge config with a base_model; planned as ramplus) and print, "
    "per agent, its density, the share of its changed weights that are unique / shared with 1 / with >=2 other "
    "agents, rho and lambda. Counts are cached like a merge's, so inspecting then merging reads the weights once. "
    "Takes mergekit-yaml's options but those of writing a model."
)


def command() -> click.Command:
    from mergekit_ram._mergekit import options
    from mergekit_ram.core import params

    @click.command("inspect", help=HELP)
    @click.argument("config", metavar="CONFIG.yaml", type=click.Path(path_type=Path))
    @click.option(
        "--json",
        "json_path",
        metavar="FILE",
        type=click.Path(path_type=Path),
        help="also write the statistics (ram_stats.json schema)",
    )
    @click.option(
        "--plot",
        metavar="FILE.png",
        type=click.Path(path_type=Path),
        help="also draw per-layer heat maps (needs matplotlib)",
    )
    @click.option("--r", "r", type=float, help="lambda for this r instead of the config's")
    @click.option("--alpha", type=float, help="lambda for this alpha instead of the config's")
    @click.option("--lambda-rule", type=click.Choice(params.LAMBDA_RULES), help="lambda rule instead of the config's")
    @click.option("--tensor-union", "-u", is_flag=True, help="mergekit-pytorch config: as its --tensor-union")
    @click.option(
        "--tensor-intersection", "-i", is_flag=True, help="mergekit-pytorch config: as its --tensor-intersection"
    )
    @options.declare()
    def inspect(**kwargs: Any) -> None:
        run(**kwargs)

    return inspect


def run(
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
        raise UsageError(f"no such config file: {config}")
    if plot:  # before minutes of reading weights
        from mergekit_ram.reporting import plot as plotting

        try:
            plotting.require()
        except RuntimeError as error:
            raise UsageError(str(error)) from error
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
        raise UsageError(f"{config} is {errors.yaml_said(error) or 'not valid YAML'}") from error
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
            raise UsageError(str(error)) from error
        print(f"wrote {plot}")
