"""The ``mergekit-ram`` command line.

Each subcommand lives in a ``_add_<name>(subparsers)`` function that
registers its parser and sets ``func``; heavy imports (torch, transformers)
happen inside the handlers so ``mergekit-ram --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

PROG = "mergekit-ram"


class _UsageError(Exception):
    """An error worth one line on stderr and exit code 2, not a traceback."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mergekit-ram")
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------- #
# example
# --------------------------------------------------------------------------- #
def _add_example(subparsers) -> None:
    p = subparsers.add_parser(
        "example",
        help="write a tiny RL-like base model, three agents and ready RAM/RAM+ configs",
        description=(
            "Write a tiny bf16 Qwen2 base model, three sparse RL-like agents "
            "(code 3%, tool 46%, memory 54% of weights changed) and the configs "
            "ramplus.yaml and ram.yaml (absolute paths) into OUT_DIR."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to write (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty")
    p.set_defaults(func=_cmd_example)


def _cmd_example(args: argparse.Namespace) -> int:
    out_dir = args.out_dir.expanduser().resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        raise _UsageError(f"{out_dir} is not empty; pick an empty folder or pass --force")

    from mergekit_ram.synthetic import EXAMPLE_DENSITIES, write_example

    ramplus = write_example(out_dir, overwrite=args.force)
    out = ramplus.parent
    print(f"Wrote an RL-like example workload to {out}:")
    print(f"  base model      {out / 'base'}")
    for name, density in EXAMPLE_DENSITIES.items():
        print(f"  agent {name:<9} {out / 'agents' / name}  ({density:.0%} of weights changed)")
    print(f"  RAM+ config     {ramplus}")
    print(f"  RAM config      {out / 'ram.yaml'}")
    print()
    print("Next, merge with:")
    print(f"  mergekit-yaml {ramplus} {out / 'merged'}")
    return 0


# --------------------------------------------------------------------------- #
# inspect
# --------------------------------------------------------------------------- #
DENSE = 0.9


def _add_inspect(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="count (or reuse cached) RAM+ statistics of a config without merging",
        description=(
            "Run only the RAM+ statistics pass of CONFIG (any merge config with a base_model; "
            "planned as ramplus) and print, per agent, its density, the share of its changed "
            "weights that are unique / shared with 1 / with >=2 other agents, rho and lambda. "
            "Counts are cached like a merge's, so inspecting then merging reads the weights once."
        ),
    )
    p.add_argument("config", metavar="CONFIG.yaml", type=Path)
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the statistics (ram_stats.json schema)")
    p.add_argument("--plot", metavar="FILE.png", type=Path, help="also draw per-layer heat maps (needs matplotlib)")
    p.add_argument("--r", type=float, help="lambda for this r instead of the config's")
    p.add_argument("--alpha", type=float, help="lambda for this alpha instead of the config's")
    p.add_argument("--lambda-rule", choices=["clip", "soft"], help="lambda rule instead of the config's")
    p.add_argument("--cuda", action="store_true", help="count on the GPU (as mergekit-yaml --cuda)")
    p.add_argument("--device", help="device to count on (as mergekit-yaml --device)")
    p.add_argument("--low-cpu-memory", action="store_true")
    p.add_argument("--read-to-gpu", action="store_true")
    p.add_argument("--multi-gpu", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--unsafe-truncate-embeddings", action="store_true")
    p.add_argument("--allow-crimes", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    import logging

    import yaml

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    import mergekit_ram  # noqa: F401  (registers ramplus, installs the pre-pass)
    from mergekit_ram import hook, prepass, report, statistics

    if not args.config.is_file():
        raise _UsageError(f"no such config file: {args.config}")
    for name in ("r", "alpha"):  # before minutes of reading weights
        value = getattr(args, name)
        if value is not None and (not value >= 0 or value == float("inf") or value > statistics.PARAMETER_MAX):
            raise _UsageError(f"--{name} must be a finite number >= 0 and <= {statistics.PARAMETER_MAX:g}, got {value}")
    config = MergeConfiguration.model_validate(yaml.safe_load(args.config.read_text(encoding="utf-8")))
    flags = (
        "cuda",
        "device",
        "low_cpu_memory",
        "read_to_gpu",
        "multi_gpu",
        "trust_remote_code",
        "unsafe_truncate_embeddings",
        "allow_crimes",
        "quiet",
    )
    options = MergeOptions(**{f: getattr(args, f) for f in flags if getattr(args, f) not in (None, False)})
    hook.install()  # idempotent: the start-up hook normally did it already
    found, stats = prepass.inspect_config(config, options)

    params = found["parameters"]
    for name in ("r", "alpha", "lambda_rule"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    totals = stats.totals()
    for row in found["agents"]:
        rho = totals[row["model"]].rho
        row["lambda"] = statistics.lambda_for(rho, params["r"], params["alpha"], params["lambda_rule"])
    labels = _short_labels(stats.agents)
    print(f"RAM+ statistics of {args.config} ({found['statistics']}; rho per {params['rho_scope']}):")
    print(statistics.format_table(totals.values(), params["r"], params["alpha"], params["lambda_rule"], labels))
    base = found["base_model"]["model"]
    print(f"base: {base}; {sum(t.numel for t in stats.tensors):,} parameters in {len(stats.tensors)} tensors")
    for agent, s in totals.items():
        if s.density > DENSE:
            print(
                f"warning: {labels[agent]} changes {100 * s.density:.1f}% of the weights: it looks like SFT "
                "or an fp32 export, not a sparse RL update; RAM then degenerates towards plain averaging",
                file=sys.stderr,
            )
    if args.json:
        args.json.write_text(report.dumps(found), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        from mergekit_ram.plot import heatmap

        try:
            heatmap(stats, args.plot, labels)
        except RuntimeError as error:
            raise _UsageError(str(error)) from error
        print(f"wrote {args.plot}")
    return 0


def _short_labels(agents) -> dict:
    """Folder names when they are distinct, full references otherwise."""
    short = {a: Path(a.split("@")[0].rstrip("/")).name or a for a in agents}
    return short if len(set(short.values())) == len(short) else {a: a for a in agents}


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #
#: Functions that register one subcommand each; extend this list to add more.
SUBCOMMANDS: list[Callable] = [_add_example, _add_inspect]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Helpers for RAM / RAM+ merging with mergekit (merge_method: ramplus).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mergekit-ram``; returns the exit code (0 ok, 2 usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, argparse errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (_UsageError, OSError, ValueError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
