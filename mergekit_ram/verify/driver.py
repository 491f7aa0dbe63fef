"""`mergekit-ram verify OUT_DIR`: a finished merge run again from its folder, compared instead of written.

The folder may be a stranger's (or a merge fetched from the Hub, `hub`): its files are read as `folder_checks`
allows (regular files inside it, JSON and YAML bounded), and its record is evidence, not an instruction
(`record_checks.recorded_options`: no recorded option that lets code run takes effect without the user's flag).
From the folder alone (`ram_stats.json` and, for `run_merge`, mergekit's `mergekit_config.yml`), through the
recompute interface (`recompute.Recompute`, which mergekit implements in the seam and the CLI passes in):

1. the inputs are resolved as mergekit resolves them (a hub id at the revision recorded for it, a local copy
   the user names, `input_copies`) and their identities (`report.public_identity`) checked against the
   recorded ones: a changed or missing input is named, and the folder cannot be checked;
2. the config is planned as mergekit plans it (`Merge.planned`, with the recorded options that change what is
   merged), and what it plans is checked against `ram_stats.json` (`record_checks.plan_mismatches`): an edited
   parameter is named, and nothing is recomputed;
3. the merge runs again as a merge does (`Merge.prepare`: rho counted again in memory, never read from the
   statistics cache, which is no evidence), each tensor compared where mergekit would save it (`Merge.compare`).
   Tensors in the folder that the merge does not plan are named;
4. the files beside the weights are checked against what the merge makes (`other_files`, with `ramplus`'s own:
   the statistics and the card's RAM+ section).

With `--sample` (`sample`), step 3 recomputes a slice of every tensor (`Merge.compare_slices`), the tensors that
cannot be sliced whole, with rho reduced from `ram_stats.json`'s per-tensor counts and the counts checked against
the slices (what the method records is its own checks': `recompute.MethodChecks`, `ramplus.CHECKS`); inputs recorded
as hub ids, and a merge fetched from the Hub, are read by ranges into sparse stand-ins in a temporary folder
(`ranged`), each drawn tensor's bytes fetched before anything reads them.

Nothing is read from the statistics cache and nothing is written (`cachedir.read_only`): not into the folder or
an input, not into the statistics cache, no kernel is built.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from mergekit_ram import errors
from mergekit_ram.checks import config_checks
from mergekit_ram.core import cachedir
from mergekit_ram.reporting import report
from mergekit_ram.verify import (
    hub,
    input_copies,
    loader_files,
    other_files,
    ramplus,
    ranged,
    recompute,
    record_checks,
    sample,
    verdict,
)


def verify(
    folder: str,
    options: Any,
    recomputing: recompute.Recompute,
    *,
    trust_remote_code: bool = False,
    inputs: Sequence[str] = (),
    inputs_from: Sequence[str] = (),
    input_dir: str | None = None,
    published: hub.Published | None = None,
    sample: tuple[float, int] | None = None,
) -> verdict.Outcome:
    """Recompute the `ramplus` merge in `folder` (through `recomputing`) and compare it tensor by tensor with what
    the folder holds.

    `trust_remote_code`: the user's own flag (a recorded one is evidence, never applied without it); `inputs`,
    `inputs_from`, `input_dir`: `--input`, `--inputs-from`, `--input-dir`, local copies of recorded inputs
    (`input_copies`); `published`: `folder` is a merge fetched from the Hub (`hub.fetch`); `sample`: (share, seed) of
    `--sample` (`sample`: a slice of every tensor is recomputed). errors.NotVerifiable: a
    usage error (no such folder, no ram_stats.json, another method's folder, a copy mapping no input or one
    twice). errors.Unreadable: ram_stats.json cannot be read. Otherwise the outcome: identical, differing
    (named), or not checkable (an input missing or changed, a refused option or file, a file unreadable)."""
    recomputing.check_method()
    folder = os.path.abspath(folder)
    outcome = verdict.Outcome(folder=folder, hub=published.as_json() if published else None)
    try:
        recorded = record_checks.read_report(folder)
    except errors.Unreadable as error:
        outcome.error = errors.said(error)
        return outcome
    record = record_checks.read_merge_record(recorded)
    problems = recomputing.missing(record.get("entry_point"))
    if problems:
        raise errors.NotVerifiable("mergekit-ram cannot verify: " + "; ".join(problems))
    copies = input_copies.local_copies(recorded, inputs, parents=inputs_from, folder=input_dir)
    outcome.entry_point = record.get("entry_point")
    outcome.notes += record_checks.version_notes(recorded, report.installed_versions(), report.installed_from())
    stand_ins = tempfile.TemporaryDirectory(prefix="mergekit-ram-sample-") if sample else contextlib.nullcontext("")
    with cachedir.read_only(), stand_ins as root:
        try:  # no statistics cache entry read or written, no kernel build; a sample's stand-ins go in `root`
            mirror = None if sample is None else ranged.Mirror(root)
            if mirror is not None:  # the Hub's files read by ranges (`ranged`)
                rows = [(row.model, row.identity) for row in record_checks.recorded_inputs(recorded)]
                copies |= ranged.input_stand_ins(mirror, rows, copies, options.transformers_cache)
                if published is not None and published.weights:
                    folder = ranged.published_stand_in(mirror, published)
            found = Found(folder, recorded, record, copies, outcome)
            _verify(found, recomputing, options, trust_remote_code, sample, mirror)
        except errors.CANNOT_CHECK as error:
            outcome.error = errors.said(error)
        except MemoryError as error:  # an address-space limit (ulimit -v) below what mapping a file needs
            outcome.error = f"out of memory while checking {folder} ({errors.said(error)})"
    if published is not None:  # the files verify did not fetch
        files, blocked, unread = published.unfetched(bool((record.get("options") or {}).get("trust_remote_code")))
        outcome.files += files
        outcome.cannot_check += blocked
        outcome.not_checked += unread
    return outcome


class Found:
    """What one verify has read and says: the folder, its record, the user's copies of inputs, the outcome."""

    def __init__(self, folder: str, recorded: dict, record: dict, copies: dict[str, str], outcome: verdict.Outcome):
        self.folder, self.recorded, self.record, self.copies, self.outcome = folder, recorded, record, copies, outcome


def _verify(
    found: Found,
    recomputing: recompute.Recompute,
    options: Any,
    trust: bool,
    asked: tuple[float, int] | None = None,
    mirror: ranged.Mirror | None = None,
) -> None:
    outcome = found.outcome
    absent = loader_files.absent_shards(found.folder) if asked is not None else []
    if absent:  # a sample names the folder's damage (a full verify cannot check it: exit 3)
        outcome.files += absent
        return
    refused = other_files.refusal(found.folder)  # before anything opens a file of the folder
    if refused is not None:
        outcome.cannot_check.append(refused)
        return
    options, notes, refused = record_checks.recorded_options(found.record, options, trust, report.RECORDED_OPTIONS)
    outcome.notes += notes
    if refused is not None:
        outcome.cannot_check.append(refused)
        return
    config_checks.check_devices(options)
    with recomputing.open(found.folder, found.recorded, found.record, options, found.copies) as merge:
        _run_again(merge, found, asked, mirror)


def _run_again(
    merge: recompute.Merge,
    found: Found,
    asked: tuple[float, int] | None = None,
    mirror: ranged.Mirror | None = None,
) -> None:
    """The merge run again, each tensor compared where mergekit would save it (`asked`: --sample's share and seed,
    a slice of each, their bytes fetched into `mirror`'s stand-ins first); then the files beside the weights."""
    recorded, outcome = found.recorded, found.outcome
    seen: dict[str, dict] = {}  # each input's identity, read once (here, then the statistics pass)
    if not _inputs_unchanged(merge, found, seen):
        return
    outcome.parameters = record_checks.plan_mismatches(recorded, merge.planned(), source=merge.planned_from)
    if outcome.parameters:
        return
    method = ramplus.CHECKS  # what the method records beyond the weights (a record of another is refused)
    given = None if asked is None else method.given(recorded, merge.names)
    made, stats, source = merge.prepare(seen, given, count=bool(recorded.get("tensors")))
    made = record_checks.as_recorded({**made, "merge": recorded.get("merge")}, merge.labels)
    outcome.statistics = source
    outcome.parameters = record_checks.rho_mismatches(recorded, made)
    only, spans = None, {}
    if asked is not None:
        shapes, whole = merge.shapes()
        outcome.sample = drawn = sample.draw(shapes, *asked, whole)
        spans = merge.needed(drawn, seen)
        if mirror is not None:
            mirror.fill_all(spans)  # the slices' bytes, before anything reads them
        counted = merge.compare_slices(drawn, outcome)
        if stats is not None:
            method.against_slices(merge, stats, counted, recorded, outcome)
        only = set(drawn.whole)
    merge.compare(outcome, only)
    if outcome.sample is not None:  # bytes and requests read, beside a full verify's bytes
        ranged.account(outcome.sample, spans, mirror)
    other_files.check(found.folder, recorded, made, outcome, method, **merge.beside())


def _inputs_unchanged(merge: recompute.Merge, found: Found, seen: dict[str, dict]) -> bool:
    """Resolve every input the config names and the report records (as mergekit does), and check its identity
    (kept in `seen`, for the statistics pass: each identity read once)."""
    outcome = found.outcome
    for label, name, role, identity in record_checks.recorded_inputs(found.recorded):
        try:
            now = merge.identity(name, seen)
            if now is None:
                continue  # the config names other inputs: the plan check says so
            now = report.public_identity(now)
        except Exception as error:
            detail = errors.said(error)[:300]
            outcome.inputs.append(record_checks.InputCheck(name, role, "missing", identity, None, detail, label=label))
            continue
        check = record_checks.check_identity(name, role, identity, now, copy=found.copies.get(name), label=label)
        outcome.inputs.append(check)
    checked = [check for check in outcome.inputs if check.status == "same"]
    if checked:
        outcome.checked.append(f"the identities of {len(checked)} input(s)")
    return not any(check.status in ("changed", "missing") for check in outcome.inputs)
