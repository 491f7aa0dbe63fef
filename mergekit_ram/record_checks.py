"""What a ramplus folder records, read and checked on plain data for `mergekit-ram verify`: its
`ram_stats.json` (and merge record) read, its weight files checked for damage and stray tensors, the
config's plan and the recomputed rho against the record, an input's recorded identity against the one
found, and the installed versions against the recorded ones.

Knows nothing of mergekit (`_mergekit/verification.py` plans and recomputes); `compare` is the module
users import (it re-exports these).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mergekit_ram import files, folder_checks, input_checks, output_checks
from mergekit_ram.bitwise import json_number, shown
from mergekit_ram.errors import NotVerifiable, Unreadable

#: ram_stats.json format versions verify can read (1 and 2 have no `merge` record: run_merge, default options)
READABLE = (1, 2, 3)
CONFIG_FILE = "mergekit_config.yml"


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
            found.append(f"{name}: {said} {shown(value)}, ram_stats.json records {shown(was)}")
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
                    + (f"gives {shown(given)}" if given is not None else "gives none (counted)")
                    + ", ram_stats.json records "
                    + (f"{shown(was_given)} given" if was_given is not None else "it counted")
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
            now, then = shown(row["rho"]), shown(was.get("rho"))
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


def check_identity(
    model: str, role: str, recorded: Mapping[str, Any], found: Mapping[str, Any], *, copy: str | None = None
) -> InputCheck:
    """An input's identity found now against the recorded one (`report.public_identity`: content_id, revision).
    `copy`: a local copy stands for it (`verify --input`): its content is checked, not where it came from."""
    if not recorded.get("content_id"):
        return InputCheck(model, role, "not recorded", recorded, found)
    keys = ("content_id",) if copy else ("revision", "content_id")
    differ = [
        (f"the copy {copy}: " if copy else "")
        + f"{key} {_short(found.get(key))} now, {_short(recorded.get(key))} recorded"
        for key in keys
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


def forced_unsafe() -> bool:
    """Whether torch is told to unpickle fully wherever `weights_only` is not passed (`input_checks.FORCE_UNSAFE`)."""
    return os.environ.get(input_checks.FORCE_UNSAFE, "0").strip().lower() in ("1", "y", "yes", "true")


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


def input_pairs(recorded: dict, given: Iterable[str]) -> dict[str, str]:
    """`--input RECORDED=LOCAL` values as recorded input -> local copy. A recorded name may hold `=` (a sweep's
    folder, `runs/lr=1e-5,seed=1/agent`): each value is split after the recorded name it begins with, else at
    its first `=`. NotVerifiable (a usage error) for no `=`, a name two recorded inputs could begin, or one
    input mapped twice."""
    known = sorted({label for label, _, _ in recorded_inputs(recorded)})
    found: dict[str, str] = {}
    for pair in given:
        names = [name for name in known if pair.startswith(name + "=") and len(pair) > len(name) + 1]
        if len(names) > 1:
            raise NotVerifiable(f"--input {pair}: it begins with two recorded inputs, {' and '.join(names)}")
        name, sep, local = (names[0], "=", pair[len(names[0]) + 1 :]) if names else pair.partition("=")
        if not sep or not name or not local:
            raise NotVerifiable(f"--input {pair}: expected RECORDED=LOCAL (a recorded input and its local copy)")
        if name in found:
            raise NotVerifiable(f"--input maps {name} twice ({found[name]} and {local}): give one local copy")
        found[name] = local
    return local_copies(recorded, found)


def local_copies(recorded: dict, inputs: Mapping[str, str]) -> dict[str, str]:
    """recorded input -> absolute path of its local copy (`--input`); NotVerifiable for a name the record lacks."""
    known = {label for label, _, _ in recorded_inputs(recorded)}
    for name in inputs:
        if name not in known:
            raise NotVerifiable(
                f"--input {name}=...: ram_stats.json records no input {name} (it records {', '.join(sorted(known))})"
            )
    return {name: os.path.abspath(os.path.expanduser(local)) for name, local in inputs.items()}


def relabel(value: Any, labels: Mapping[str, str]) -> Any:
    """`value` (a report, or anything in it) with every model label in `labels` (now -> recorded) replaced."""
    if not labels:
        return value
    if isinstance(value, dict):
        return {labels.get(k, k) if isinstance(k, str) else k: relabel(v, labels) for k, v in value.items()}
    if isinstance(value, list):
        return [relabel(v, labels) for v in value]
    return labels.get(value, value) if isinstance(value, str) else value


def missing_hint(copies: Mapping[str, str]) -> str:
    """What to say after a missing input: a local copy can stand for it."""
    return "" if copies else " (a local copy can stand for it: --input RECORDED=LOCAL)"


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
