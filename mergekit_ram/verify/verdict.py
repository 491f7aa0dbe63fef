"""`mergekit-ram verify`'s verdict on one folder, on plain data: the outcome as text and JSON (`Outcome`,
`dumps`), its exit codes and the `--json` schema. The comparison itself is `bitwise.compare`; the checks of
what a folder records are `record_checks`'. Users import each name from its own module.

Knows nothing of mergekit (the seam's `_mergekit/recompute.py` plans and recomputes; this module judges).

JSON (`Outcome.as_json`, `mergekit-ram verify --json`), format "mergekit-ram/verify", format_version 4 (3 had no
`method`, `environment`, `rounding`, `tensors[].max_ulp` nor the two last-bits results; 2 had `result` "identical"
for a sample too):

- `folder` (absolute), `hub` (a merge verified from the Hugging Face Hub, `mergekit-ram verify ORG/NAME@REV`:
  `repository`, `requested` (the revision asked for) and `revision` (the commit its files were fetched at, null
  when none was); null for a folder), `entry_point` ("run_merge" or "mergekit-pytorch"; null when unread),
  `method` (the merge method the folder records: "ramplus", or one of mergekit's own), `result` and `exit_code`:
  "identical" (0: a full check), "no difference in sample" (0: `--sample`, no difference in what was drawn),
  "differs" (1: the folder is not what it records), "last bits differ" (3: every difference is within the last
  bits the method is measured to move between machines, `rounding` says so; "identical but for the last bits", 0,
  with `--accept-last-bits`), "depends on the machine" (3: a method whose result moves beyond its last bits
  between machines, karcher or arcee_fusion, and every difference a number: `rounding` says what moves it), "cannot
  check"
  (3: an input missing, changed or unreadable, a recorded option refused, a file verify refuses or cannot
  read; `cannot_check` says why, `error` too when verify stopped), with `headline`, the first line of the
  text. A usage error (exit 2: no such folder, no ram_stats.json, another method's folder, a bad option)
  prints no JSON, only its line on stderr;
- `merged`: whether the merge was recomputed (false when an input changed or the config does not
  plan what `ram_stats.json` records: nothing is recomputed then);
- `statistics`: where rho came from ("cache", "computed", "not computed"), null when not recomputed;
- `tensors_compared`, `tensors_identical`: counts;
- `inputs[]`: `label` (as ram_stats.json names the input; its name for a folder written before labels),
  `model` (the path or hub id the merge read), `role` ("base"/"agent"), `status` ("same", "changed", "missing",
  "not recorded"), `recorded` and `found` identities ({content_id, revision?}; found is null when
  missing), `detail` (one line, or null);
- `parameters[]`: one line per parameter the config plans otherwise than `ram_stats.json` records;
- `files[]`: one line per published file other than the weights that says otherwise than the merge
  (ram_stats.json's statistics, the card's RAM+ section, config.json, a copied tokenizer file, a weight file
  another loader reads) or that a loader reads and the merge does not write (an adapter, code, ...);
- `tensors[]`: only the tensors that are not identical: `name`, `status` ("differs", "dtype",
  "shape", "missing" (planned, not in the folder), "extra" (in the folder, not planned),
  "unreadable", "not finite" (finite inputs merge to what the tensor's dtype cannot hold: the merge stops
  there, and so does verify, leaving the tensors after it uncompared)), `elements`, `differing`, `nan`,
  `max_abs_difference` (a number, "inf", or null), `published` and `recomputed` ("dtype [shape]" or null),
  `detail` (or null);
- `checked[]`, `not_checked[]`: what was checked, and what was not (files no check covers, and why);
- `problems[]`: every finding as one line of text (what the text output prints);
- `environment`: where the merge was recomputed: `device`, `threads`, `cpu_capability`, `torch`, `mergekit`;
- `rounding`: the sentence of a "last bits differ" result (the most units in the last place, what moves them),
  else null; `tensors[].max_ulp`: the largest difference in units in the last place (float tensors);
- `notes[]`: what does not decide the result (versions differing from the recorded ones, ...);
- `sample` (only with `verify --sample P`, P < 1): `seed`, `share` (P), `tensors_checked`, `tensors_total` (every
  tensor: a slice of each), `elements_checked`, `elements_total`, `bytes_read` (bytes of weight files read, from disk
  or the network, each byte once), `requests` (HTTP range requests made; 0 when every file is local),
  `full_verify_bytes` (what a full verify reads of the weight files), `full_verify_cheaper` (whether it would likely
  have cost less: the verdict's line), `least_draws` (the fewest runs drawn from a sliced tensor) and `pass_bound`
  (share of differing weights -> the most such a merge passes with: `verify/sample.py`), `tensor_pass_bound` (share
  of a tensor's elements differing -> the most such a tensor passes with, the least drawn), `more_than_needed` (why
  more was read: a server that ignored ranges), `tensors` (names), `runs_per_tensor` (the most), `whole` (tensor ->
  why it was checked whole), `counts` (the counts check, a sentence, or null) and `slices` (tensor -> `share`,
  `run`, `runs`).
  With a sample, `result` is never "identical": "no difference in sample", and the headline says so.

Every exit but a usage error's prints this JSON; a NaN or infinity anywhere in it (a record's value) is a string.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from mergekit_ram.verify.bitwise import Difference
from mergekit_ram.verify.record_checks import InputCheck
from mergekit_ram.verify.sample import Sample

__all__ = ["ACCEPTED", "EXIT", "FORMAT", "FORMAT_VERSION", "LAST_BITS", "MACHINE", "SAMPLED", "Outcome", "dumps"]

FORMAT = "mergekit-ram/verify"
FORMAT_VERSION = 4
#: exit code of each result
#: `result` when every difference is in the last bits a method is measured to move between machines (`rounding`)
LAST_BITS = "last bits differ"
#: ... and the user accepted them (`verify --accept-last-bits`)
ACCEPTED = "identical but for the last bits"
#: `result` when the method's result is measured to move beyond its last bits between machines (karcher,
#: arcee_fusion) and every difference is a number: it cannot be told from another machine's, nor accepted
MACHINE = "depends on the machine"
EXIT = {"identical": 0, "differs": 1, "cannot check": 3, LAST_BITS: 3, ACCEPTED: 0, MACHINE: 3}
#: `--json`'s `result` of a sampled pass that found no difference (exit 0, but no proof of the tensors not drawn)
SAMPLED = "no difference in sample"


@dataclass
class Outcome:
    """What verify found in one folder."""

    folder: str
    #: a merge fetched from the Hub: repository, requested, revision (`hub.Published.as_json`)
    hub: dict[str, Any] | None = None
    entry_point: str | None = None
    inputs: list[InputCheck] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    merged: bool = False
    statistics: str | None = None
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)
    #: published files other than the weights that say otherwise than the merge
    files: list[str] = field(default_factory=list)
    #: why the folder cannot be checked (a refused option, ...), beside `error` and the inputs
    cannot_check: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    #: `--sample`: the draw, its bytes read (`sample.Sample`); None for a full verify
    sample: Sample | None = None
    #: the merge method the folder records ("ramplus", or mergekit's own), None when unread
    method: str | None = None
    #: where the merge was recomputed: device, threads, cpu_capability, torch, mergekit (`driver.environment`)
    environment: dict[str, Any] | None = None
    #: every difference is within the last bits the method moves between machines: the sentence saying so
    rounding: str | None = None
    #: `--accept-last-bits`: such differences are accepted (exit 0)
    accept_rounding: bool = False
    #: the method's result moves beyond the last bits between machines (`MACHINE`): never accepted
    machine_bound: bool = False

    def add(self, found: Difference) -> None:
        """One compared tensor (identical ones are counted, not kept)."""
        if found.status != "extra":
            self.compared += 1
        if not found.identical:
            self.differences.append(found)

    def _differs(self) -> list[str]:
        return [*self.parameters, *self.files, *(d.line() for d in sorted(self.differences, key=lambda d: d.name))]

    def _blocked(self) -> list[str]:
        lines = [check.line() for check in self.inputs if check.status in ("changed", "missing")]
        lines += self.cannot_check
        return lines + ([self.error] if self.error is not None else [])

    @property
    def identical(self) -> bool:
        return self.result == "identical"

    @property
    def result(self) -> str:
        if self._differs():
            if self.rounding is not None and not (self.parameters or self.files or self._blocked()):
                return MACHINE if self.machine_bound else ACCEPTED if self.accept_rounding else LAST_BITS
            return "differs"
        if self._blocked() or not self.merged:
            return "cannot check"
        return "identical"

    @property
    def exit_code(self) -> int:
        return EXIT[self.result]

    def problems(self) -> list[str]:
        return self._blocked() + self._differs()

    def _where(self) -> str:
        return {"cache": " (rho from the statistics cache)", "computed": " (rho counted again)"}.get(
            str(self.statistics), ""
        )

    def name(self) -> str:
        """The folder, or the Hub repository at the commit verified."""
        if self.hub is None:
            return self.folder
        return f"{self.hub['repository']}@{self.hub.get('revision') or self.hub.get('requested')}"

    def headline(self) -> str:
        where = self._where()
        if self.result in (LAST_BITS, ACCEPTED, MACHINE):
            said = "accepted: " if self.result == ACCEPTED else ""
            return f"{self.name()}: {said}{self.result.upper()} in {len(self.differences):,} tensors, {self.rounding}"
        if self.result == "identical" and self.sample is not None:
            return f"{self.name()}: {self.sample.headline()}"
        if self.result == "identical":
            return f"{self.name()}: bit-identical, {self.compared:,} tensors{where}"
        if self.result == "differs":
            found = self._differs()
            return f"{self.name()}: NOT identical ({len(found)} problem{'s' if len(found) != 1 else ''}):"
        blocked = self._blocked()
        return f"{self.name()}: CANNOT CHECK ({len(blocked)} reason{'s' if len(blocked) != 1 else ''}):"

    def summary(self) -> str:
        """What was checked and what was not: a short list, one item a line (`checked: nothing` in one)."""
        unchecked = self.not_checked + (self._unsampled() if self.merged else [])
        lines = [f"checked:{'' if self.checked else ' nothing'}", *(f"  {item}" for item in self.checked)]
        if unchecked:
            lines += ["not checked:", *(f"  {item}" for item in unchecked)]
        return "\n".join(lines)

    def _unsampled(self) -> list[str]:
        """What a sample leaves unchecked."""
        return [] if self.sample is None else self.sample.unchecked()

    def text(self) -> str:
        """What `mergekit-ram verify` prints."""
        lines = [self.headline()]
        if self.result in ("differs", LAST_BITS, ACCEPTED, MACHINE):
            lines += [f"  {line}" for line in self._differs()]
            lines += [f"  {line} (so it was not checked)" for line in self._blocked()]
        elif self.result == "cannot check":
            lines += [f"  {line}" for line in self._blocked()]
        if self.sample is not None and self.merged:
            if self.result != "identical":
                lines.append(f"  sample: {self.sample.headline().replace('no difference in ', '', 1)}")
            lines += [f"  {line}" for line in self.sample.said()]
            lines += [f"  read more than needed: {why}" for why in self.sample.more_than_needed]
        if not self.merged and self.result != "identical":
            lines.append("  (nothing recomputed: the merge was not run again)")
        elif self.result == "differs":
            same = self.compared - sum(d.status != "extra" for d in self.differences)
            lines.append(f"  {same:,} of {self.compared:,} tensors bit-identical{self._where()}")
        lines.append(self.summary())
        return "\n".join(lines)

    def as_json(self) -> dict:
        identical = self.compared - sum(d.status != "extra" for d in self.differences)
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "folder": self.folder,
            "hub": None if self.hub is None else dict(self.hub),
            "entry_point": self.entry_point,
            "method": self.method,
            "result": SAMPLED if self.identical and self.sample is not None else self.result,
            "exit_code": self.exit_code,
            "headline": self.headline(),
            "merged": self.merged,
            "statistics": self.statistics,
            "tensors_compared": self.compared,
            "tensors_identical": identical,
            "inputs": [check.as_json() for check in self.inputs],
            "parameters": list(self.parameters),
            "files": list(self.files),
            "tensors": [d.as_json() for d in sorted(self.differences, key=lambda d: d.name)],
            "cannot_check": self._blocked(),
            "checked": list(self.checked),
            "not_checked": self.not_checked + (self._unsampled() if self.merged else []),
            "problems": self.problems(),
            "notes": list(self.notes),
            "environment": None if self.environment is None else dict(self.environment),
            "rounding": self.rounding,
        }
        if self.sample is not None:
            out["sample"] = self.sample.as_json()
        if self.error is not None:
            out["error"] = self.error
        return _strict(out)


def _strict(value: Any) -> Any:
    """`value` as strict JSON holds it: a float NaN or infinity (a stranger's record may hold one) as a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def dumps(outcome: Outcome) -> str:
    return json.dumps(outcome.as_json(), indent=2, allow_nan=False) + "\n"
