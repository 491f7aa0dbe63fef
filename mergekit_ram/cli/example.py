"""``mergekit-ram example OUT_DIR``: a tiny RL-like workload (a base model, three sparse agents, two configs) to
merge at once. The models are `example_models`'; this prints where they went and the next command."""

from __future__ import annotations

from pathlib import Path

import click

from mergekit_ram.cli.common import UsageError

HELP = (
    "Write a tiny bf16 Qwen2 base model, three sparse RL-like agents (code, tool, memory; it prints the share of "
    "each one's weights changed, as a merge's statistics table counts it) and the configs ramplus.yaml and ram.yaml "
    "(absolute paths) into OUT_DIR."
)


def command() -> click.Command:
    @click.command("example", help=HELP)
    @click.argument("out_dir", metavar="OUT_DIR", type=click.Path(path_type=Path))
    @click.option("--force", is_flag=True, help="write into OUT_DIR even if it is not empty")
    def example(out_dir: Path, force: bool) -> None:
        run(out_dir, force)

    return example


def run(out_dir: Path, force: bool) -> None:
    out_dir = out_dir.expanduser().resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UsageError(f"{out_dir} is not empty; pick an empty folder or pass --force")

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
