"""What `mergekit-ram verify` finds, on plain data: tensors compared bit for bit, a recorded report against
a planned one, an input's recorded identity against the one found, and the outcome as text and JSON.

Knows nothing of mergekit (`_mergekit/verification.py` plans and recomputes; this module judges).

Two tensors are identical when they hold the same bits: -0.0 and 0.0 differ, a NaN equals a NaN
with the same bits. A differing tensor is described by the count of differing elements and the
largest |published - recomputed| among those where neither is NaN (0.0 for -0.0 against 0.0,
inf for a finite number against an infinity); differing elements where either is NaN are counted
apart (`nan`). The comparison streams in chunks, so it needs a few chunk-sized buffers whatever
the tensor's size.

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
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mergekit_ram import files, output_checks

FORMAT = "mergekit-ram/verify"
FORMAT_VERSION = 1
#: ram_stats.json format versions verify can read (1 and 2 have no `merge` record: run_merge, default options)
READABLE = (1, 2, 3)
CONFIG_FILE = "mergekit_config.yml"
CHUNK = 1 << 22
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class NotVerifiable(ValueError):
    """The folder is not one verify can check (no such folder, no ram_stats.json, another method's): a usage error."""


class Unreadable(ValueError):
    """A file verify needs is there but damaged (corrupt JSON, a config mergekit cannot read): a data error."""


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Difference:
    """One tensor compared: `status` "identical", "differs", "dtype", "shape", "missing", "extra", "unreadable"."""

    name: str
    status: str
    elements: int = 0
    differing: int = 0
    nan: int = 0
    max_abs: float | None = None
    published: str | None = None
    recomputed: str | None = None
    detail: str | None = None

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def line(self) -> str:
        if self.status == "differs":
            size = "" if self.max_abs is None else f", max |difference| {_shown(self.max_abs)}"
            nan = f", {self.nan:,} of them NaN against another value" if self.nan else ""
            return f"differs: {self.name}: {self.differing:,} of {self.elements:,} elements{size}{nan}"
        if self.status in ("dtype", "shape"):
            return f"differs: {self.name}: published {self.published}, recomputed {self.recomputed}"
        if self.status == "missing":
            return f"missing: {self.name}: planned by the merge, not in the folder"
        if self.status == "extra":
            where = f" ({self.detail})" if self.detail else ""
            return f"extra: {self.name}: in the folder{where}, not planned by the merge"
        if self.status == "unreadable":
            return f"unreadable: {self.name}: {self.detail}"
        return f"identical: {self.name}"

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "elements": self.elements,
            "differing": self.differing,
            "nan": self.nan,
            "max_abs_difference": None if self.max_abs is None else _number(self.max_abs),
            "published": self.published,
            "recomputed": self.recomputed,
            "detail": self.detail,
        }


def describe(tensor: torch.Tensor) -> str:
    """'bfloat16 [64, 32]'."""
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def compare(name: str, recomputed: torch.Tensor | None, published: torch.Tensor | None) -> Difference:
    """`recomputed` against `published`, bit for bit (None: absent on that side)."""
    if recomputed is None and published is None:
        return Difference(name, "identical")
    if published is None:
        assert recomputed is not None
        return Difference(name, "missing", recomputed.numel(), recomputed=describe(recomputed))
    if recomputed is None:
        return Difference(name, "extra", published.numel(), published=describe(published))
    shown, made = describe(published), describe(recomputed)
    size = published.numel()
    if published.dtype != recomputed.dtype:
        return Difference(name, "dtype", size, size, published=shown, recomputed=made)
    if published.shape != recomputed.shape:
        return Difference(name, "shape", size, size, published=shown, recomputed=made)
    differing, nan, largest = bit_differences(recomputed, published)
    status = "differs" if differing else "identical"
    return Difference(name, status, size, differing, nan, largest, published=shown, recomputed=made)


def bit_differences(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK) -> tuple[int, int, float | None]:
    """(elements whose bits differ, of those where either is NaN, max |a - b| over the others) of two tensors of
    one dtype and shape; the max is None when no difference can be measured (complex or no such element)."""
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    if flat_a.device != flat_b.device:
        flat_b = flat_b.to(flat_a.device)
    measurable = not (a.is_complex() or a.dtype.itemsize not in _INTS)
    differing = nan = 0
    largest: float | None = None
    for start in range(0, flat_a.numel(), chunk):
        x, y = flat_a[start : start + chunk], flat_b[start : start + chunk]
        mask = _bits_differ(x, y)
        found = int(mask.sum())
        if not found:
            continue
        differing += found
        if not measurable:
            continue
        xd, yd = x[mask].to(torch.float64), y[mask].to(torch.float64)
        either_nan = xd.isnan() | yd.isnan()
        nan += int(either_nan.sum())
        numbers = ~either_nan
        if bool(numbers.any()):
            gap = float((xd[numbers] - yd[numbers]).abs().max())
            if math.isnan(gap):  # inf - inf of the same sign has equal bits, so this is +inf against -inf
                gap = math.inf
            largest = gap if largest is None else max(largest, gap)
    return differing, nan, largest


def _bits_differ(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    width = x.dtype.itemsize
    if width in _INTS and not x.is_complex():
        return x.contiguous().view(_INTS[width]) != y.contiguous().view(_INTS[width])
    bx = x.contiguous().view(torch.uint8).reshape(-1, width)
    by = y.contiguous().view(torch.uint8).reshape(-1, width)
    return (bx != by).any(dim=1)


# --------------------------------------------------------------------------- #
# What the folder says: ram_stats.json, its merge record, and its published tensors
# --------------------------------------------------------------------------- #
def read_report(folder: str) -> dict:
    """The folder's ram_stats.json, checked to be a ramplus report verify can read.

    NotVerifiable (a usage error) for no such folder, no ram_stats.json, another program's or another
    method's file, or a newer format; Unreadable for a file that is not JSON.
    """
    if not os.path.isdir(folder):
        raise NotVerifiable(f"{'not a folder' if os.path.exists(folder) else 'no such folder'}: {folder}")
    path = os.path.join(folder, output_checks.STATS_FILE)
    if not os.path.isfile(path):
        raise NotVerifiable(
            f"{folder} holds no {output_checks.STATS_FILE}: not the output of a finished ramplus merge "
            "(another method's, or a merge that stopped before the end)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Unreadable(f"{path} is unreadable ({error}): is the folder damaged?") from error
    if not isinstance(found, dict) or found.get("format") != output_checks.STATS_FORMAT:
        raise NotVerifiable(f"{path} was not written by mergekit-ram (no format {output_checks.STATS_FORMAT!r})")
    if found.get("method") != "ramplus":
        raise NotVerifiable(f"{path} describes a {found.get('method')!r} merge; verify checks ramplus merges")
    version = found.get("format_version")
    if version not in READABLE:
        raise NotVerifiable(
            f"{path} has format_version {version!r}; this mergekit-ram reads {', '.join(map(str, READABLE))} "
            "(upgrade mergekit-ram)"
        )
    for key, kind in (("parameters", dict), ("base_model", dict), ("agents", list)):
        if not isinstance(found.get(key), kind):
            raise Unreadable(f"{path} has no {key!r}: is the folder damaged?")
    return found


def merge_record(report: dict) -> dict:
    """The report's `merge` record (format_version 1 and 2 have none: a run_merge with default options)."""
    record = report.get("merge")
    return dict(record) if isinstance(record, dict) else {"entry_point": "run_merge"}


def damaged_weight_file(folder: str) -> str | None:
    """'FILE: why' for the first safetensors file directly in `folder` that safetensors cannot open, else None."""
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt"):
                pass
        except (OSError, SafetensorError) as error:
            return f"{path}: {' '.join(str(error).split())}"
    return None


def stray_tensors(folder: str, indexed: Mapping[str, str]) -> dict[str, str]:
    """Tensors a safetensors file of the folder holds that the folder's index does not map to that file
    (a loader would not see them): name -> why. `indexed`: name -> file, as the loader reads the folder."""
    stray: dict[str, str] = {}
    for file in sorted(set(indexed.values())):
        if not file.endswith(".safetensors"):
            continue
        try:
            header = files.read_header(os.path.join(folder, file))[1]
        except (OSError, ValueError):
            continue  # reading the tensors names the file
        for name in header:
            if name != "__metadata__" and indexed.get(name) != file:
                stray[name] = f"in {file}, which the index does not name for it"
    return stray


# --------------------------------------------------------------------------- #
# The config against the report, and the inputs against their recorded identities
# --------------------------------------------------------------------------- #
def plan_mismatches(recorded: dict, planned: dict, *, source: str = CONFIG_FILE) -> list[str]:
    """What `planned` (a report of the plan, `report.build`) says otherwise than `recorded` (ram_stats.json):
    the parameters, the per-tensor ones, the base and agents, given rho and the tied pairs; one line each."""
    found = []
    said = f"{source} plans"
    for name, value in planned["parameters"].items():
        was = recorded["parameters"].get(name)
        if not _same(value, was):
            found.append(f"{name}: {said} {_shown(value)}, ram_stats.json records {_shown(was)}")
    varying, was_varying = planned["per_tensor_parameters"], recorded.get("per_tensor_parameters") or {}
    for name in sorted(set(varying) | set(was_varying)):
        if not _same(varying.get(name), was_varying.get(name)):
            found.append(
                f"{name} per tensor: {said} {_values(varying.get(name))}, ram_stats.json records "
                f"{_values(was_varying.get(name))}"
            )
    base, was_base = planned["base_model"]["model"], recorded["base_model"].get("model")
    if base != was_base:
        found.append(f"base model: {said} {base}, ram_stats.json records {was_base}")
    agents = [row["model"] for row in planned["agents"]]
    was_agents = [row.get("model") for row in recorded["agents"]]
    if agents != was_agents:
        found.append(f"agents: {said} {', '.join(agents)}; ram_stats.json records {', '.join(map(str, was_agents))}")
    else:
        for row, was in zip(planned["agents"], recorded["agents"], strict=True):
            given = row["rho"] if row["rho_source"] == "given" else None
            was_given = was.get("rho") if was.get("rho_source") == "given" else None
            if not _same(given, was_given):
                found.append(
                    f"rho of {row['model']}: {source} "
                    + (f"gives {_shown(given)}" if given is not None else "gives none (counted)")
                    + ", ram_stats.json records "
                    + (f"{_shown(was_given)} given" if was_given is not None else "it counted")
                )
    tied, was_tied = planned.get("tied_counted_once") or {}, recorded.get("tied_counted_once") or {}
    if tied != was_tied:
        found.append(f"tied tensors counted once: {said} {tied or 'none'}, ram_stats.json records {was_tied or 'none'}")
    return found


def rho_mismatches(recorded: dict, recomputed: dict) -> list[str]:
    """The rho each agent used, recomputed (`recomputed`: the verify run's report) against the recorded one."""
    found = []
    rows = {row.get("model"): row for row in recorded["agents"]}
    for row in recomputed["agents"]:
        was = rows.get(row["model"])
        if was is not None and not _same(row["rho"], was.get("rho")):
            now, then = _shown(row["rho"]), _shown(was.get("rho"))
            found.append(f"rho of {row['model']}: recomputed {now}, ram_stats.json records {then}")
    groups, was_groups = recomputed.get("rho_by_group"), recorded.get("rho_by_group")
    if groups is not None and was_groups is not None and groups != was_groups:
        differ = sorted(g for g in set(groups) | set(was_groups) if groups.get(g) != was_groups.get(g))
        found.append(f"rho by group differs from ram_stats.json's for {len(differ)} group(s), first {differ[0]}")
    return found


@dataclass(frozen=True)
class InputCheck:
    """One input's recorded identity against the one found: `status` "same", "changed", "missing", "not recorded"."""

    model: str
    role: str
    status: str
    recorded: Mapping[str, Any]
    found: Mapping[str, Any] | None
    detail: str | None = None

    def line(self) -> str:
        if self.status == "missing":
            return f"input {self.model} ({self.role}) cannot be read: {self.detail}"
        if self.status == "changed":
            return f"input {self.model} ({self.role}) changed: {self.detail}"
        return f"input {self.model} ({self.role}): {self.status}"

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "role": self.role,
            "status": self.status,
            "recorded": dict(self.recorded),
            "found": None if self.found is None else dict(self.found),
            "detail": self.detail,
        }


def check_identity(model: str, role: str, recorded: Mapping[str, Any], found: Mapping[str, Any]) -> InputCheck:
    """An input's identity found now against the recorded one (`report.public_identity`: content_id, revision)."""
    if not recorded.get("content_id"):
        return InputCheck(model, role, "not recorded", recorded, found)
    differ = [
        f"{key} {_short(found.get(key))} now, {_short(recorded.get(key))} recorded"
        for key in ("revision", "content_id")
        if (recorded.get(key) or None) != (found.get(key) or None)
    ]
    if differ:
        return InputCheck(model, role, "changed", recorded, found, "; ".join(differ))
    return InputCheck(model, role, "same", recorded, found)


def recorded_inputs(report: dict) -> list[tuple[str, str, dict]]:
    """(model, role, recorded identity) of the base and every agent of a report."""
    rows = [(report["base_model"].get("model"), "base", report["base_model"].get("identity") or {})]
    rows += [(row.get("model"), "agent", row.get("identity") or {}) for row in report["agents"]]
    return [(str(m), role, identity) for m, role, identity in rows]


def version_notes(recorded: dict, installed: Mapping[str, str]) -> list[str]:
    """A note per package whose installed version is not the recorded one (bits may differ then)."""
    was = recorded.get("versions") or {}
    return [
        f"{name} {installed[name]} is installed; the merge was made with {was[name]} (a difference may come from that)"
        for name in sorted(installed)
        if was.get(name) and was[name] != installed[name]
    ]


# --------------------------------------------------------------------------- #
# The outcome
# --------------------------------------------------------------------------- #
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


def _same(a: Any, b: Any) -> bool:
    """Equal as ram_stats.json writes them (numbers by value, inf as "inf", lists in any order)."""
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(_number, a), key=str) == sorted(map(_number, b), key=str)
    return _number(a) == _number(b)


def _number(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) and value > 0 else f"{value:g}"
    return str(value)


def _short(value: Any) -> str:
    """An identity's hash as the card shows it (16 hex digits; a revision whole)."""
    if not value:
        return "none"
    return str(value)[:16] + "…" if len(str(value)) == 64 else str(value)


def _values(values: Iterable[Any] | None) -> str:
    return "one value" if values is None else "[" + ", ".join(_shown(v) for v in values) + "]"
