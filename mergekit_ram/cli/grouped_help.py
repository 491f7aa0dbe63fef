"""A click command whose ``--help`` lists its options under headings (`verify`'s four: what it checks, where the
inputs are, how it recomputes, what it prints). Plain click: it knows nothing of mergekit."""

from __future__ import annotations

from typing import ClassVar

import click


class Grouped(click.Command):
    """A command whose --help lists its options under headings (`groups`: heading -> parameter names, in order); an
    option in no group is listed last, under "Other options", so none is ever left out of --help by mistake."""

    groups: ClassVar[dict[str, tuple[str, ...]]] = {}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        shown = self.get_help_option(ctx)
        records = {
            "help" if p is shown else p.name: p.get_help_record(ctx)
            for p in self.get_params(ctx)
            if isinstance(p, click.Option)
        }
        placed = {name for names in self.groups.values() for name in names}
        other = tuple(name for name in records if name not in placed)
        for heading, names in (*self.groups.items(), ("Other options", other)):
            rows = [record for name in names if (record := records.get(name)) is not None]
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)


def grouped(groups: dict[str, tuple[str, ...]]) -> type[click.Command]:
    """A `Grouped` command class whose --help has `groups`."""
    return type("Grouped", (Grouped,), {"groups": groups})
