"""`mergekit-ram verify OUT_DIR`: a finished `ramplus` merge run again from its folder, compared instead of written.

The folder may be a stranger's (or a merge fetched from the Hub, `hub`): its files are read as `folder_checks`
allows (regular files inside it, JSON and YAML bounded), and its record is evidence, not an instruction
(`record_checks.recorded_options`: no recorded option that lets code run takes effect without the user's flag).
From the folder alone (`ram_stats.json` and, for `run_merge`, mergekit's `mergekit_config.yml`), in one body over
the door the record names (`door.of_record`: `door_yaml` reads `mergekit_config.yml`, `door_pytorch` the record's
own config):

1. the inputs are resolved as mergekit resolves them (a hub id at the revision recorded for it, a local copy
   the user names, `input_copies`) and their identities (`report.public_identity`) checked against the
   recorded ones: a changed or missing input is named, and the folder cannot be checked;
2. the config is planned as mergekit plans it, downhill like `inspect` (the door's `plan`, with the recorded
   options that change what is merged), and what it plans is checked against `ram_stats.json`
   (`record_checks.plan_mismatches`): an edited parameter is named, and nothing is recomputed;
3. the merge runs again through the pipeline of a merge (`pipeline.prepare`: rho counted again in memory,
   never read from the statistics cache, which is no evidence, and injected), on the executor `run_merge` would
   use (`rerun`): where mergekit would save each tensor (`SaveTensor`, cast to its dtype), `CompareTensor`
   compares it with the published one (`PublishedTensor`), so the executor holds what a merge holds (less: no
   output shard is buffered). Tensors in the folder that the merge does not plan are named;
4. the files beside the weights are checked against what the merge makes (`published`).

With `--sample` (`sampling`), step 3 recomputes only the drawn tensors, with rho reduced from `ram_stats.json`'s
per-tensor counts; inputs recorded as hub ids, and a merge fetched from the Hub, are read by ranges into sparse
stand-ins in a temporary folder (`verify/ranged.py`), each drawn tensor's bytes fetched before anything reads them.

Nothing is read from the statistics cache and nothing is written (`cachedir.read_only`): not into the folder or
an input, not into the statistics cache, no kernel is built. The judging is `record_checks`' and `verdict`'s, on
plain data; this module plans, `rerun` runs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from mergekit_ram import errors
from mergekit_ram._mergekit import door, loading, pipeline, published, rerun, sampling, slicing, surface
from mergekit_ram.checks import config_checks
from mergekit_ram.core import cachedir
from mergekit_ram.errors import InputError
from mergekit_ram.method import NAME, refuse_foreign
from mergekit_ram.reporting import report
from mergekit_ram.session import Mode, active
from mergekit_ram.verify import hub, input_copies, ranged, record_checks, verdict


def verify(
    folder: str,
    options: Any,
    *,
    trust_remote_code: bool = False,
    inputs: Sequence[str] = (),
    inputs_from: Sequence[str] = (),
    input_dir: str | None = None,
    published: hub.Published | None = None,
    sample: tuple[float, int] | None = None,
) -> verdict.Outcome:
    """Recompute the `ramplus` merge in `folder` and compare it tensor by tensor with what the folder holds.

    `trust_remote_code`: the user's own flag (a recorded one is evidence, never applied without it); `inputs`,
    `inputs_from`, `input_dir`: `--input`, `--inputs-from`, `--input-dir`, local copies of recorded inputs
    (`input_copies`); `published`: `folder` is a merge fetched from the Hub (`hub.fetch`); `sample`: (share, seed) of
    `--sample` (`sampling`: only the drawn tensors are recomputed). errors.NotVerifiable: a
    usage error (no such folder, no ram_stats.json, another method's folder, a copy mapping no input or one
    twice). errors.Unreadable: ram_stats.json cannot be read. Otherwise the outcome: identical, differing
    (named), or not checkable (an input missing or changed, a refused option or file, a file unreadable)."""
    refuse_foreign(NAME)
    folder = os.path.abspath(folder)
    outcome = verdict.Outcome(folder=folder, hub=published.as_json() if published else None)
    try:
        recorded = record_checks.read_report(folder)
    except errors.Unreadable as error:
        outcome.error = errors.said(error)
        return outcome
    record = record_checks.read_merge_record(recorded)
    names = door.DOORS.get(str(record.get("entry_point")), door.DOORS["run_merge"]).names
    problems = surface.problems(surface.PREPASS) + surface.problems(names) + surface.problems(surface.VERIFY)
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
            _verify(folder, recorded, record, options, trust_remote_code, copies, outcome, sample, mirror)
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


def _verify(
    folder: str,
    recorded: dict,
    record: dict,
    options: Any,
    trust: bool,
    copies: dict[str, str],
    outcome: Any,
    sample: tuple[float, int] | None = None,
    mirror: ranged.Mirror | None = None,
) -> None:
    absent = sampling.absent_shards(folder) if sample is not None else []
    if absent:  # a sample names the folder's damage (a full verify cannot check it: exit 3)
        outcome.files += absent
        return
    refused = published.refusal(folder)  # before anything opens a file of the folder
    if refused is not None:
        outcome.cannot_check.append(refused)
        return
    options, notes, refused = record_checks.recorded_options(record, options, trust, report.RECORDED_OPTIONS)
    outcome.notes += notes
    if refused is not None:
        outcome.cannot_check.append(refused)
        return
    config_checks.check_devices(options)
    loading.install()
    _run_again(door.of_record(folder, recorded, record, options, copies), folder, recorded, outcome, sample, mirror)


def _run_again(
    through: door.Door,
    folder: str,
    recorded: dict,
    outcome: Any,
    sample: tuple[float, int] | None = None,
    mirror: ranged.Mirror | None = None,
) -> None:
    """The merge run again through its door, each tensor compared where mergekit would save it (`sample`: the
    drawn ones, `sampling`, their bytes fetched into `mirror`'s stand-ins first); then the files beside the
    weights."""
    surface.forget_loaders([rerun.reference(folder)])  # read as the files are now
    index = rerun.published_index(folder)
    names = record_checks.recorded_labels(recorded, through.labels)
    current = through.session(Mode.VERIFY, labels=names)
    seen: dict[str, dict] = {}  # each input's identity, read once (here, then the statistics pass)
    with active(current):
        try:
            pipeline.check_config(current)
        except ValueError as error:
            raise InputError(f"{through.where}: {error}") from error
        try:
            through.check_files()  # before anything opens one: no FIFO or device is read
        except ValueError as error:
            raise errors.Unreadable(str(error)) from error
        if not _inputs_unchanged(through, recorded, outcome, seen):
            return
        try:
            plan = through.plan()
            planned = record_checks.as_recorded(pipeline.plan_report(plan, names), through.labels)
            outcome.parameters = record_checks.plan_mismatches(recorded, planned, source=through.planned_from)
            if outcome.parameters:
                return
            given = None if sample is None else (lambda planned: sampling.recorded_statistics(recorded, planned, names))
            pipeline.prepare(plan, current, seen, given, count=bool(recorded.get("tensors")))  # what it records
        except (OSError, ValueError) as error:
            raise InputError(errors.said(error)) from error
        assert current.report is not None
        found = record_checks.as_recorded({**current.report, "merge": recorded.get("merge")}, through.labels)
        outcome.statistics = current.source
        outcome.parameters = record_checks.rho_mismatches(recorded, found)
        saves, spans = plan.saves(), {}
        if sample is not None:
            outcome.sample = sampling.draw(plan, folder, index, *sample)
            spans = sampling.needed(plan, folder, index, outcome.sample, seen)
            if mirror is not None:
                mirror.fill_all(spans)  # the slices' bytes, before anything reads them
            counted = slicing.check(plan, saves, outcome.sample, folder, index, outcome)
            saves = _sampled(plan, saves, folder, index, recorded, names, current.stats, outcome, counted)
        targets = [rerun.compare_task(folder, *save) for save in saves]
        rerun.run(targets, index, folder, through.options, outcome, [save[0] for save in plan.saves()])
        if outcome.sample is not None:
            remote = mirror.remote if mirror is not None else {}
            outcome.sample.bytes_read = sampling.bytes_read(spans, remote)
            if mirror is not None:
                outcome.sample.bytes_read += mirror.reader.received
                outcome.sample.more_than_needed += mirror.reader.more_than_needed
    published.check(folder, recorded, found, outcome, **through.published(plan))


def _inputs_unchanged(through: door.Door, recorded: dict, outcome: verdict.Outcome, seen: dict[str, dict]) -> bool:
    """Resolve every input the config names and the report records (as mergekit does), and check its identity
    (kept in `seen`, for the statistics pass: each identity read once)."""
    models = through.models()
    for label, name, role, identity in record_checks.recorded_inputs(recorded):
        model = models.get(name)
        if model is None:
            continue  # the config names other inputs: the plan check says so
        try:
            found = report.public_identity(through.identity(model, seen))
        except Exception as error:
            detail = errors.said(error)[:300]
            outcome.inputs.append(record_checks.InputCheck(name, role, "missing", identity, None, detail, label=label))
            continue
        check = record_checks.check_identity(name, role, identity, found, copy=through.copies.get(name), label=label)
        outcome.inputs.append(check)
    checked = [check for check in outcome.inputs if check.status == "same"]
    if checked:
        outcome.checked.append(f"the identities of {len(checked)} input(s)")
    return not any(check.status in ("changed", "missing") for check in outcome.inputs)


def _sampled(
    plan: Any,
    saves: list,
    folder: str,
    index: dict,
    recorded: dict,
    names: dict,
    stats: Any,
    outcome: Any,
    counted: dict,
) -> list:
    """The saves of the tensors checked whole (`slicing.check` compared the slices of the others). Each recorded
    element count is checked against the inputs' headers (a vocabulary mergekit maps: the published header's), each
    tensor's counts against its slice's, and the counts of the tensors checked whole counted again (`sampling`)."""
    chosen = set(outcome.sample.whole)
    if stats is not None:
        outcome.files += sampling.numel_mismatches(plan, stats, folder, index)
        outcome.files += sampling.within_slices(stats, counted, outcome.sample, names)
        outcome.files += sampling.recount(plan, outcome.sample, recorded, names)
        ours = [task for name, task, _optional, _dtype in saves if name in counted]
        if ours and stats.agents:
            lines, outcome.sample.counts = slicing.totals(stats, counted, outcome.sample, ours[0], names)
            outcome.files += lines
    return [save for save in saves if save[0] in chosen]
