"""What `mergekit-ram verify` finds, on plain data: the outcome of one folder as text and JSON (`Outcome`,
`dumps`). The module verify's users import: it re-exports the bit for bit comparison of two tensors
(`bitwise`: `Difference`, `compare`, `bit_differences`, `describe`) and the checks of what a folder records
(`record_checks`: `read_report`, `plan_mismatches`, `rho_mismatches`, `check_identity`, ...).

Knows nothing of mergekit (`_mergekit/verification.py` plans and recomputes; this module judges).

JSON (`Outcome.as_json`, `mergekit-ram verify --json`), format "mergekit-ram/verify", format_version 1:

- `folder` (absolute), `entry_point` ("run_merge" or "mergekit-pytorch"; null when unread),
  `result`: "identical" (exit 0), "differs" (exit 1), "error" (exit 1: something could not be
  read; `error` says what). A usage error (exit 2: no such folder, no ram_stats.json, another
  method's folder) prints no JSON, only its line on stderr;
- `merged`: whether the merge was recomputed (false when an input changed or the config does not
  plan what `ram_stats.json` records: nothing is recomputed then);
- `statistics`: where rho came from ("cache", "computed", "not computed"), null when not recomputed;
- `tensors_compared`, `tensors_identical`: counts;
- `inputs[]`: `model`, `role` ("base"/"agent"), `status` ("same", "changed", "missing",
  "not recorded"), `recorded` and `found` identities ({content_id, revision?}; found is null when
  missing), `detail` (one line, or null);
- `parameters[]`: one line per parameter the config plans otherwise than `ram_stats.json` records;
- `tensors[]`: only the tensors that are not identical: `name`, `status` ("differs", "dtype",
  "shape", "missing" (planned, not in the folder), "extra" (in the folder, not planned),
  "unreadable"), `elements`, `differing`, `nan`, `max_abs_difference` (a number, "inf", or null),
  `published` and `recomputed` ("dtype [shape]" or null), `detail` (or null);
- `problems[]`: every finding as one line of text (what the text output prints);
- `notes[]`: what does not decide the result (versions differing from the recorded ones, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mergekit_ram.bitwise import CHUNK, Difference, bit_differences, compare, describe
from mergekit_ram.record_checks import (
    CONFIG_FILE,
    READABLE,
    InputCheck,
    NotVerifiable,
    Unreadable,
    check_identity,
    damaged_weight_file,
    merge_record,
    plan_mismatches,
    read_report,
    recorded_inputs,
    rho_mismatches,
    stray_tensors,
    version_notes,
)

__all__ = [
    "CHUNK",
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE",
    "Difference",
    "InputCheck",
    "NotVerifiable",
    "Outcome",
    "Unreadable",
    "bit_differences",
    "check_identity",
    "compare",
    "damaged_weight_file",
    "describe",
    "dumps",
    "merge_record",
    "plan_mismatches",
    "read_report",
    "recorded_inputs",
    "rho_mismatches",
    "stray_tensors",
    "version_notes",
]

FORMAT = "mergekit-ram/verify"
FORMAT_VERSION = 1


@dataclass
class Outcome:
    """What verify found in one folder."""

    folder: str
    entry_point: str | None = None
    inputs: list[InputCheck] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    merged: bool = False
    statistics: str | None = None
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def add(self, found: Difference) -> None:
        """One compared tensor (identical ones are counted, not kept)."""
        if found.status != "extra":
            self.compared += 1
        if not found.identical:
            self.differences.append(found)

    @property
    def identical(self) -> bool:
        return self.error is None and self.merged and not self.problems()

    @property
    def result(self) -> str:
        return "error" if self.error is not None else ("identical" if self.identical else "differs")

    def problems(self) -> list[str]:
        lines = [check.line() for check in self.inputs if check.status in ("changed", "missing")]
        lines += self.parameters
        lines += [d.line() for d in sorted(self.differences, key=lambda d: d.name)]
        if self.error is not None:
            lines.append(self.error)
        return lines

    def text(self) -> str:
        """What `mergekit-ram verify` prints."""
        where = {"cache": " (rho from the statistics cache)", "computed": " (rho counted again)"}.get(
            str(self.statistics), ""
        )
        if self.identical:
            return f"{self.folder}: bit-identical, {self.compared:,} tensors{where}"
        problems = self.problems()
        lines = [f"{self.folder}: NOT identical ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  {line}" for line in problems]
        if not self.merged:
            lines.append("  (nothing recomputed: the merge was not run again)")
        else:
            same = self.compared - sum(d.status != "extra" for d in self.differences)
            lines.append(f"  {same:,} of {self.compared:,} tensors bit-identical{where}")
        return "\n".join(lines)

    def as_json(self) -> dict:
        identical = self.compared - sum(d.status != "extra" for d in self.differences)
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "folder": self.folder,
            "entry_point": self.entry_point,
            "result": self.result,
            "merged": self.merged,
            "statistics": self.statistics,
            "tensors_compared": self.compared,
            "tensors_identical": identical,
            "inputs": [check.as_json() for check in self.inputs],
            "parameters": list(self.parameters),
            "tensors": [d.as_json() for d in sorted(self.differences, key=lambda d: d.name)],
            "problems": self.problems(),
            "notes": list(self.notes),
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def dumps(outcome: Outcome) -> str:
    return json.dumps(outcome.as_json(), indent=2, allow_nan=False) + "\n"
