"""What a ramplus folder records, read and checked on plain data for `mergekit-ram verify`: its
`ram_stats.json` (and merge record) read, its weight files checked for damage and stray tensors, the
config's plan and the recomputed rho against the record, an input's recorded identity against the one
found, and the installed versions against the recorded ones.

Knows nothing of mergekit (the seam's `_mergekit/recompute.py` plans and recomputes; `verdict` holds the outcome).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from mergekit_ram import errors, files
from mergekit_ram.checks import output_checks, paths
from mergekit_ram.errors import NotVerifiable, Unreadable
from mergekit_ram.reporting.labels import renamed, upgraded
from mergekit_ram.verify import folder_checks
from mergekit_ram.verify.bitwise import json_number, shown

#: ram_stats.json format versions verify can read (1 and 2 have no `merge` record: run_merge, default options;
#: 1 to 3 name the inputs by path, read in 4's shape: `labels.upgraded`)
READABLE = (1, 2, 3, 4)
CONFIG_FILE = "mergekit_config.yml"
#: the mark of a record read from `mergekit_config.yml` alone (a merge by one of mergekit's own methods, which
#: writes no ram_stats.json): its inputs carry no identity (`Recompute.config_record`)
CONFIG_ONLY = "config_only"


# --------------------------------------------------------------------------- #
# What the folder says: ram_stats.json, its merge record, and its published tensors
# --------------------------------------------------------------------------- #
def read_report(folder: str) -> dict:
    """The folder's ram_stats.json, checked to be a ramplus report verify can read.

    NotVerifiable (a usage error) for no such folder, no ram_stats.json, another program's or another
    method's file, or a newer format; Unreadable for a file that is not JSON.
    """
    if not os.path.isdir(folder):  # the nearest existing folder offered, as for a name shaped like a hub id
        said = "not a folder" if os.path.exists(folder) else "no such folder"
        raise NotVerifiable(f"{said}: {folder}{paths.where(folder)}")
    path = os.path.join(folder, output_checks.STATS_FILE)
    if not os.path.lexists(path):
        raise NotVerifiable(
            f"{folder} holds no {output_checks.STATS_FILE}: not the output of a finished ramplus merge "
            "(another method's, or a merge that stopped before the end)"
        )
    found = folder_checks.read_json(folder, output_checks.STATS_FILE)
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
    old = version < 4
    for key, kind in (
        ("parameters", dict),
        ("base_model", dict if old else str),
        ("agents", list),
        *(() if old else (("inputs", dict),)),
    ):
        if not isinstance(found.get(key), kind):
            raise Unreadable(f"{path} has no {key!r}: is the folder damaged?")
    found = upgraded(found)
    inputs = found["inputs"]
    rows = [row for row in inputs.values() if isinstance(row, dict) and isinstance(row.get("model"), str)]
    labels = [found["base_model"], *(row.get("label") if isinstance(row, dict) else None for row in found["agents"])]
    if len(rows) != len(inputs) or len(labels) != len(inputs) or set(labels) != set(inputs):
        raise Unreadable(f"{path}: its inputs table does not name the base and the agents: is the folder damaged?")
    return found


def has_report(folder: str) -> bool:
    """Whether `folder` holds a ram_stats.json (else verify reads what `mergekit_config.yml` says)."""
    return os.path.lexists(os.path.join(folder, output_checks.STATS_FILE))


def read_merge_record(report: dict) -> dict:
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
            return f"{path}: {errors.said(error)}"
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
            found.append(f"{name}: {said} {shown(value)}, ram_stats.json records {shown(was)}")
    varying, was_varying = planned["per_tensor_parameters"], recorded.get("per_tensor_parameters") or {}
    for name in sorted(set(varying) | set(was_varying)):
        if not _same(varying.get(name), was_varying.get(name)):
            found.append(
                f"{name} per tensor: {said} {_values(varying.get(name))}, ram_stats.json records "
                f"{_values(was_varying.get(name))}"
            )
    (base, agents), (was_base, was_agents) = _models(planned), _models(recorded)
    if base != was_base:
        found.append(f"base model: {said} {base}, ram_stats.json records {was_base}")
    if agents != was_agents:
        found.append(f"agents: {said} {', '.join(agents)}; ram_stats.json records {', '.join(map(str, was_agents))}")
    else:
        for row, was in zip(planned["agents"], recorded["agents"], strict=True):
            given = row["rho"] if row["rho_source"] == "given" else None
            was_given = was.get("rho") if was.get("rho_source") == "given" else None
            if not _same(given, was_given):
                found.append(
                    f"rho of {was.get('label')}: {source} "
                    + (f"gives {shown(given)}" if given is not None else "gives none (counted)")
                    + ", ram_stats.json records "
                    + (f"{shown(was_given)} given" if was_given is not None else "it counted")
                )
    tied, was_tied = planned.get("tied_counted_once") or {}, recorded.get("tied_counted_once") or {}
    if tied != was_tied:
        found.append(f"tied tensors counted once: {said} {tied or 'none'}, ram_stats.json records {was_tied or 'none'}")
    return found


def _models(report: dict) -> tuple[str, list[str]]:
    """(the base, the agents), each as the config names it (the `inputs` table's `model`)."""
    inputs = report["inputs"]
    return inputs[report["base_model"]]["model"], [inputs[row["label"]]["model"] for row in report["agents"]]


def rho_mismatches(recorded: dict, recomputed: dict) -> list[str]:
    """The rho each agent used, recomputed (`recomputed`: the verify run's report) against the recorded one."""
    found = []
    rows = {row.get("label"): row for row in recorded["agents"]}
    for row in recomputed["agents"]:
        was = rows.get(row["label"])
        if was is not None and not _same(row["rho"], was.get("rho")):
            now, then = shown(row["rho"]), shown(was.get("rho"))
            found.append(f"rho of {row['label']}: recomputed {now}, ram_stats.json records {then}")
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
    #: the input's label (`ram_stats.json`'s inputs table), when it is not its name
    label: str | None = None

    def line(self) -> str:
        named = (
            f"{self.label} ({self.model}, {self.role})"
            if self.label not in (None, self.model)
            else (f"{self.model} ({self.role})")
        )
        if self.status == "missing":
            return f"input {named} cannot be read: {self.detail}"
        if self.status == "changed":
            return f"input {named} changed: {self.detail}"
        return f"input {named}: {self.status}"

    def as_json(self) -> dict:
        return {
            "label": self.label or self.model,
            "model": self.model,
            "role": self.role,
            "status": self.status,
            "recorded": dict(self.recorded),
            "found": None if self.found is None else dict(self.found),
            "detail": self.detail,
        }


def check_identity(
    model: str,
    role: str,
    recorded: Mapping[str, Any],
    found: Mapping[str, Any],
    *,
    copy: str | None = None,
    label: str | None = None,
) -> InputCheck:
    """An input's identity found now against the recorded one (`report.public_identity`: content_id, revision).
    `copy`: a local copy stands for it (`verify --input`): its content is checked, not where it came from."""
    if not recorded.get("content_id"):
        return InputCheck(model, role, "not recorded", recorded, found, label=label)
    keys = ("content_id",) if copy else ("revision", "content_id")
    differ = [
        (f"the copy {copy}: " if copy else "")
        + f"{key} {_short(found.get(key))} now, {_short(recorded.get(key))} recorded"
        for key in keys
        if (recorded.get(key) or None) != (found.get(key) or None)
    ]
    if differ:
        return InputCheck(model, role, "changed", recorded, found, "; ".join(differ), label=label)
    return InputCheck(model, role, "same", recorded, found, label=label)


class Recorded(NamedTuple):
    """One input as `ram_stats.json` records it."""

    label: str
    model: str  # as the config names it
    role: str  # "base" or "agent"
    identity: dict


def recorded_inputs(report: dict) -> list[Recorded]:
    """The base and every agent of a report (format 4's shape: `read_report`), from its inputs table."""
    return [
        Recorded(str(label), str(row["model"]), str(row.get("role")), row.get("identity") or {})
        for label, row in report["inputs"].items()
    ]


def recorded_labels(report: dict, now: Mapping[str, str]) -> dict[str, str]:
    """input -> its recorded label, for the inputs as recorded and as read now (`now`: name now -> recorded name,
    where a local copy or a pinned revision stands for a recorded input)."""
    labels = {row.model: row.label for row in recorded_inputs(report)}
    return labels | {name: labels[was] for name, was in now.items() if was in labels}


def version_notes(recorded: dict, installed: Mapping[str, str], source: Mapping[str, str] | None = None) -> list[str]:
    """A note per package whose installed version is not the recorded one (bits may differ then), and one when
    this mergekit-ram came from elsewhere than the merge's (`source`: `report.installed_from()`)."""
    was = recorded.get("versions") or {}
    notes = [
        f"{name} {installed[name]} is installed; the merge was made with {was[name]} (a difference may come from that)"
        for name in sorted(installed)
        if was.get(name) and was[name] != installed[name]
    ]
    made = recorded.get("mergekit_ram_source")
    if source is not None and isinstance(made, dict) and made != dict(source):
        notes.append(
            f"this mergekit-ram came from {json.dumps(dict(source), sort_keys=True)}; the merge's from "
            f"{json.dumps(made, sort_keys=True)[:200]} (a difference may come from that)"
        )
    return notes


# --------------------------------------------------------------------------- #
# What the record asks, taken as evidence: options, inputs read from local copies
# --------------------------------------------------------------------------- #
#: recorded options that let code run: applied only with the user's own flag (lazy_unpickle: never)
CODE_OPTIONS = ("trust_remote_code", "lazy_unpickle")


def recorded_options(
    record: dict, options: Any, trust: bool, recordable: Iterable[str]
) -> tuple[Any, list[str], str | None]:
    """(`options` with the recorded values of the options that change what is merged (`recordable`: the names,
    `report.RECORDED_OPTIONS`), notes, why not): none that
    lets code run is applied as recorded: `trust_remote_code` only with the user's flag (`trust`; without it
    the options are None and the reason says why verify cannot check), `lazy_unpickle` never (mergekit's
    weights-only loader reads the same tensors). The record is evidence, not an instruction."""
    found = record.get("options") or {}
    stats = output_checks.STATS_FILE
    if not isinstance(found, dict):
        raise Unreadable(f"{stats}: the merge record's options are not a mapping: is the folder damaged?")
    update = {k: v for k, v in found.items() if k in set(recordable) and k not in CODE_OPTIONS}
    notes: list[str] = []
    if found.get("trust_remote_code") not in (None, False):
        if not trust:
            why = (
                f"{stats} records trust_remote_code: true (the merge ran code from its inputs' folders); "
                "verify runs no such code unless you pass --trust-remote-code"
            )
            return None, notes, why
        update["trust_remote_code"] = True
    if found.get("lazy_unpickle") not in (None, False):
        notes.append(
            f"{stats} records lazy_unpickle: true; verify reads pickles weights-only instead (the same tensors)"
        )
    update["lazy_unpickle"] = False
    try:
        checked = type(options).model_validate(update)
    except Exception as error:
        why = ", ".join(str(e.get("loc", ("?",))[0]) for e in getattr(error, "errors", list)()) or "invalid"
        raise Unreadable(f"{stats}: the merge record's options are not mergekit's ({why})") from error
    return options.model_copy(update={k: getattr(checked, k) for k in update}), notes, None


def as_recorded(value: Any, labels: Mapping[str, str]) -> Any:
    """`value` (a report, or anything in it) with every model name in `labels` (now -> recorded) replaced."""
    return renamed(value, labels) if labels else value


def _same(a: Any, b: Any) -> bool:
    """Equal as ram_stats.json writes them (numbers by value, inf as "inf", lists in any order)."""
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(json_number, a), key=str) == sorted(map(json_number, b), key=str)
    return json_number(a) == json_number(b)


def _short(value: Any) -> str:
    """An identity's hash as the card shows it (16 hex digits; a revision whole)."""
    if not value:
        return "none"
    return str(value)[:16] + "…" if len(str(value)) == 64 else str(value)


def _values(values: Iterable[Any] | None) -> str:
    return "one value" if values is None else "[" + ", ".join(shown(v) for v in values) + "]"
