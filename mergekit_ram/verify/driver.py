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
import copy
import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram import errors
from mergekit_ram.checks import config_checks, paths
from mergekit_ram.core import cachedir
from mergekit_ram.reporting import report
from mergekit_ram.verify import (
    any_method,
    history,
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
    accept_last_bits: bool = False,
) -> verdict.Outcome:
    """Recompute the merge in `folder` (through `recomputing`: a `ramplus` merge from its record, another method's
    from its `mergekit_config.yml`) and compare it tensor by tensor with what the folder holds.

    `trust_remote_code`: the user's own flag (a recorded one is evidence, never applied without it); `inputs`,
    `inputs_from`, `input_dir`: `--input`, `--inputs-from`, `--input-dir`, local copies of recorded inputs
    (`input_copies`); `published`: `folder` is a merge fetched from the Hub (`hub.fetch`); `sample`: (share, seed) of
    `--sample` (`sample`: a slice of every tensor is recomputed); `accept_last_bits`: `--accept-last-bits`.
    errors.NotVerifiable: a usage error (no such folder, a copy mapping no input or one twice). Otherwise the
    outcome: identical, differing (named), last bits differing as the method's do between machines, or not
    checkable (no record, an input missing or changed, a refused option or file, a file unreadable)."""
    folder = os.path.abspath(folder)
    outcome = verdict.Outcome(folder=folder, hub=published.as_json() if published else None)
    outcome.environment = environment(options)
    try:
        if os.path.isdir(folder) and not record_checks.has_report(folder):  # a merge by one of mergekit's methods
            recorded = recomputing.config_record(folder)
        else:
            recorded = record_checks.read_report(folder)
            recomputing.check_method()
    except errors.Unreadable as error:
        outcome.error = errors.said(error)
        return outcome
    outcome.method = str(recorded.get("method"))
    record = record_checks.read_merge_record(recorded)
    problems = recomputing.missing(record.get("entry_point"))
    if problems:
        raise errors.NotVerifiable("mergekit-ram cannot verify: " + "; ".join(problems))
    copies = input_copies.local_copies(recorded, inputs, parents=inputs_from, folder=input_dir)
    outcome.entry_point = record.get("entry_point")
    outcome.notes += record_checks.version_notes(recorded, report.installed_versions(), report.installed_from())
    run = Attempt(folder, record, copies, options, recomputing, trust_remote_code, published, sample)
    run.accept_last_bits = accept_last_bits
    unpinned = _unpinned(recorded, copies)
    if not unpinned or published is None:  # a folder here: the inputs as they are now (`read_as`)
        return run(outcome, recorded)
    return _inferred(run, outcome, recorded, unpinned)


class Attempt:
    """One check of the merge in a folder against its record (with the inputs a record names pinned)."""

    def __init__(
        self,
        folder: str,
        record: dict,
        copies: dict[str, str],
        options: Any,
        recomputing: recompute.Recompute,
        trust: bool,
        published: hub.Published | None,
        sample: tuple[float, int] | None,
    ):
        self.folder, self.record, self.copies, self.options = folder, record, copies, options
        self.recomputing, self.trust, self.published, self.sample = recomputing, trust, published, sample
        self.accept_last_bits = False

    def __call__(self, outcome: verdict.Outcome, recorded: dict) -> verdict.Outcome:
        folder, published, options, copies = self.folder, self.published, self.options, dict(self.copies)
        stand_ins = (
            tempfile.TemporaryDirectory(prefix="mergekit-ram-sample-") if self.sample else contextlib.nullcontext("")
        )
        with cachedir.read_only(), stand_ins as root:
            try:  # no statistics cache entry read or written, no kernel build; a sample's stand-ins go in `root`
                mirror = None if self.sample is None else ranged.Mirror(root)
                if mirror is not None:  # the Hub's files read by ranges (`ranged`)
                    rows = [(row.model, row.identity) for row in record_checks.recorded_inputs(recorded)]
                    copies |= ranged.input_stand_ins(mirror, rows, copies, options.transformers_cache)
                    if published is not None and published.weights:
                        folder = ranged.published_stand_in(mirror, published)
                seed = getattr(options, "random_seed", None)
                found = Found(folder, recorded, self.record, copies, outcome, seed)
                found.accept_rounding = self.accept_last_bits
                _verify(found, self.recomputing, options, self.trust, self.sample, mirror)
            except errors.CANNOT_CHECK as error:
                outcome.error = errors.said(error)
            except MemoryError as error:  # an address-space limit (ulimit -v) below what mapping a file needs
                outcome.error = f"out of memory while checking {folder} ({errors.said(error)})"
        return self.unfetched(outcome)

    def unfetched(self, outcome: verdict.Outcome) -> verdict.Outcome:
        """`outcome` with the files of a published merge verify did not fetch, named."""
        if self.published is not None:
            trusted = bool((self.record.get("options") or {}).get("trust_remote_code"))
            files, blocked, unread = self.published.unfetched(trusted)
            outcome.files += files
            outcome.cannot_check += blocked
            outcome.not_checked += unread
        return outcome


def _unpinned(recorded: dict, copies: Mapping[str, str]) -> list[str]:
    """The inputs of a record without identities (`record_checks.CONFIG_ONLY`) that name a hub id at no revision and
    have no local copy: the merge read the head of their branch then, which may have moved since."""
    if not recorded.get(record_checks.CONFIG_ONLY):
        return []
    return [
        row.model
        for row in record_checks.recorded_inputs(recorded)
        if "@" not in row.model
        and row.model not in copies
        and not os.path.exists(row.model)
        and paths.hub_id_form(row.model)
    ]


def _inferred(run: Attempt, outcome: verdict.Outcome, recorded: dict, unpinned: list[str]) -> verdict.Outcome:
    """A merge published on the Hub whose config names inputs at no revision: each input's commits up to the
    merge's own commit time T (`history`), newest first, checked until one combination reproduces the merge. The
    verdict is that combination's, or, when none does, the newest one's (saying so)."""
    assert run.published is not None
    try:
        when = history.published_time(run.published.repository, run.published.revision)
        found = {name: history.candidates(name, "main", when) for name in unpinned}
    except errors.Unreadable as error:
        outcome.error = errors.said(error)
        return run.unfetched(outcome)  # nothing recomputed
    tried: list[verdict.Outcome] = []

    def reproduces(pins: dict[str, str]) -> bool:
        attempt = copy.deepcopy(outcome)  # each its own lists
        tried.append(run(attempt, _pinned(recorded, pins, history.inferred(when))))
        return attempt.identical

    choice = history.choose(found, reproduces)
    if choice.pins is not None:
        return tried[-1]
    final = tried[0] if tried else outcome
    if not tried:
        final.error = f"the inputs' history at {history.iso(when)}: {choice.reason}"
        run.unfetched(final)
    else:
        final.checked.append(f"the inputs' commits up to {history.iso(when)}: {choice.reason}")
    return final


def _pinned(recorded: dict, pins: Mapping[str, str], how: str) -> dict:
    """`recorded` with each input in `pins` read at that commit, found as `how` says."""
    inputs = {label: dict(row) for label, row in recorded["inputs"].items()}
    for row in inputs.values():
        if row["model"] in pins:
            row["identity"], row["how"] = {"revision": pins[row["model"]]}, how
    return {**recorded, "inputs": inputs}


class Found:
    """What one verify has read and says: the folder, its record, the user's copies of inputs, the outcome."""

    def __init__(
        self,
        folder: str,
        recorded: dict,
        record: dict,
        copies: dict[str, str],
        outcome: verdict.Outcome,
        seed: int | None = None,
    ):
        self.folder, self.recorded, self.record, self.copies, self.outcome = folder, recorded, record, copies, outcome
        #: mergekit's --random-seed, as the user gives it (nothing records the merge's)
        self.seed = seed
        #: `--accept-last-bits`
        self.accept_rounding = False


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
    method = checks_of(recorded)  # what the method records beyond the weights
    prepared = method.prepare(merge, recorded, seen, asked is not None, outcome)
    if prepared is None:  # the config plans otherwise than the record says: nothing is recomputed
        return
    made, stats = prepared
    drawing = _random_tensors(merge, found)
    only: set[str] | None = None
    spans: recompute.Spans = {}
    if asked is not None:
        shapes, whole = merge.shapes()
        if drawing and found.seed is not None:  # each draws what the merge drew only in the merge's order: all whole
            whole = whole | dict.fromkeys(shapes, RANDOM_WHOLE)
        shapes = {name: shape for name, shape in shapes.items() if found.seed is not None or name not in drawing}
        outcome.sample = drawn = sample.draw(shapes, *asked, {n: w for n, w in whole.items() if n in shapes})
        drawn.counted = method.checked_record is not None
        spans = merge.needed(drawn, seen)
        if mirror is not None:
            mirror.fill_all(spans)  # the slices' bytes, before anything reads them
        counted = merge.compare_slices(drawn, outcome)
        if stats is not None:
            method.against_slices(merge, stats, counted, recorded, outcome)
        only = None if drawing and found.seed is not None else set(drawn.whole)
    elif drawing and found.seed is None:
        only = set(merge.shapes()[0]) - set(drawing)
    merge.compare(outcome, only)
    _last_bits(merge, found)
    if outcome.sample is not None:  # bytes and requests read, beside a full verify's bytes
        ranged.account(outcome.sample, spans, mirror)
    other_files.check(found.folder, recorded, made, outcome, method, **merge.beside())
    rows = record_checks.recorded_inputs(recorded) if recorded.get(record_checks.CONFIG_ONLY) else []
    local = [row.model for row in rows if not row.identity and row.model not in found.copies]
    if local and outcome.result == "identical":
        outcome.checked.append(f"the merge reproduced from the files of {len(local)} local folder(s) as they are now")


#: why a sample recomputes every tensor of a merge that draws random numbers whole
RANDOM_WHOLE = "the merge draws random numbers: every tensor recomputed whole, in the merge's order, as its seed drew"


def checks_of(recorded: dict) -> recompute.MethodChecks:
    """What verify checks beyond the weights: ramplus's record (`ram_stats.json`), or the card of a merge by one
    of mergekit's own methods, which records nothing else (`any_method`)."""
    return any_method.CHECKS if recorded.get(record_checks.CONFIG_ONLY) else ramplus.CHECKS


def _random_tensors(merge: recompute.Merge, found: Found) -> dict[str, str]:
    """The tensors whose merge draws random numbers (tensor -> method), said in the outcome: with mergekit's
    `--random-seed` they are checked as that seed draws; without it, every other tensor is, and these are named."""
    drawing = merge.random()
    if not drawing:
        return drawing
    outcome, methods = found.outcome, ", ".join(sorted(set(drawing.values())))
    if found.seed is not None:
        outcome.checked.append(
            f"{len(drawing):,} tensors made by {methods}, which draws random numbers, as mergekit draws them with "
            f"--random-seed {found.seed} (given: a wrong seed makes them differ)"
        )
        return drawing
    outcome.cannot_check.append(
        f"{len(drawing):,} tensors made by {methods}, which draws random numbers from torch's generator, seeded only "
        "by mergekit's --random-seed, which nothing records: give the seed the merge ran with (--random-seed N) "
        "to check them"
    )
    return drawing


def _last_bits(merge: recompute.Merge, found: Found) -> None:
    """When every difference is a number differing in no more of its last bits than the merge's method is measured
    to move between machines, say so (a result of its own, exit 3, or 0 with `--accept-last-bits`): not a forgery,
    and not bit-identical either. Anything larger, a NaN or another dtype or shape stays a difference (exit 1)."""
    outcome, rounding = found.outcome, merge.rounding()
    if rounding is None or not outcome.differences:
        return
    most, why = rounding
    if any(d.status != "differs" or d.nan or d.max_ulp is None for d in outcome.differences):
        return
    largest = max(d.max_ulp or 0 for d in outcome.differences)
    if most is not None and largest > most:
        return
    env = outcome.environment or {}
    here = ", ".join(f"{key} {env[key]}" for key in ("device", "threads", "cpu_capability", "torch") if key in env)
    if most is None:  # not the last bits: no difference of such a merge can be told from another machine's
        outcome.rounding = (
            f"up to {largest:,} units in the last place: {outcome.method}'s result moves with {why}, measured; "
            f"recomputed here on {here}. Check it on a machine like the merge's (its threads, CPU and torch)"
        )
        outcome.machine_bound = True
        return
    outcome.rounding = (
        f"at most {largest} units in the last place: {outcome.method} moves up to {most} with {why}, measured; "
        f"recomputed here on {here}. Check it on a machine like the merge's, or accept it with --accept-last-bits"
    )
    outcome.accept_rounding = found.accept_rounding


def environment(options: Any) -> dict[str, Any]:
    """Where verify recomputes: a difference in the last bit of a whole-tensor reduction may come from these."""
    import torch

    from mergekit_ram.reporting import versions

    return {
        "device": str(getattr(options, "device", None) or "cpu"),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "mergekit": versions.installed("mergekit"),
    }


def read_as(name: str, identity: dict, copy: str | None, how: str | None = None) -> str:
    """Which files of input `name` (as the config names it) a merge without a record was run again from, and how
    they were chosen (`history`'s words): a local copy given, a commit pinned in the config, inferred from the
    input's history (`how`) or the head of its branch today, a local folder."""
    if copy:
        return f"read from {copy}, {history.GIVEN}"
    revision = identity.get("revision")
    if revision:
        return f"commit {revision}, {how or (history.PINNED if '@' in name else history.HEAD)}"
    return history.LOCAL


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
        if found.recorded.get(record_checks.CONFIG_ONLY):  # no identity recorded: what was read, and why that
            how = found.recorded["inputs"].get(label, {}).get("how")
            check = dataclasses.replace(check, detail=read_as(name, now, found.copies.get(name), how))
            outcome.checked.append(f"input {name}: {check.detail}")
        outcome.inputs.append(check)
    checked = [check for check in outcome.inputs if check.status == "same"]
    if checked:
        outcome.checked.append(f"the identities of {len(checked)} input(s)")
    return not any(check.status in ("changed", "missing") for check in outcome.inputs)
