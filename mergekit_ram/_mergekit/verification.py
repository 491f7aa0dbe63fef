"""`mergekit-ram verify OUT_DIR`: a finished `ramplus` merge run again from its folder, compared instead of written.

The folder may be a stranger's (or a merge fetched from the Hub, `hub`): its files are read as `folder_checks`
allows (regular files inside it, JSON and YAML bounded), and its record is evidence, not an instruction
(`record_checks.recorded_options`: no recorded option that lets code run takes effect without the user's flag).
From the folder alone (`ram_stats.json` and, for `run_merge`, mergekit's `mergekit_config.yml`):

1. the inputs are resolved as mergekit resolves them (`resolved`: a hub id at the revision recorded for it,
   a local copy the user names, `input_copies`) and their identities (`report.public_identity`) checked against
   the recorded ones: a changed or missing input is named, and the folder cannot be checked;
2. the config is planned as mergekit plans it, downhill like `inspect` (`planner.plan`, or for a
   `mergekit-pytorch` record `surface.plan_flat_as_mergekit` + `flat.of_flat`, with the recorded options
   that change what is merged), and what it plans is checked against `ram_stats.json`
   (`record_checks.plan_mismatches`): an edited parameter is named, and nothing is recomputed;
3. the merge runs again through the pipeline of a merge (`pipeline.prepare`: rho from the statistics
   cache when it holds the counts, else counted in memory, and injected), on the executor `run_merge` would
   use (`rerun`): where mergekit would save each tensor (`SaveTensor`, cast to its dtype), `CompareTensor`
   compares it with the published one (`PublishedTensor`), so the executor holds what a merge holds (less: no
   output shard is buffered). Tensors in the folder that the merge does not plan are named;
4. the files beside the weights are checked against what the merge makes (`published`).

Nothing is written (`cachedir.read_only`): not into the folder or an input, not into the statistics cache, no
kernel is built. The judging is `record_checks`' and `verdict`'s, on plain data; this module plans, `rerun` runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mergekit_ram import (
    cachedir,
    config_checks,
    errors,
    folder_checks,
    hub,
    input_checks,
    input_copies,
    loader_files,
    record_checks,
    report,
    verdict,
    versions,
)
from mergekit_ram._mergekit import flat, loading, pipeline, published, rerun, resolved, surface, tasks
from mergekit_ram._mergekit.planner import plan
from mergekit_ram.errors import InputError
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import active


def verify(
    folder: str,
    options: Any,
    *,
    trust_remote_code: bool = False,
    inputs: Sequence[str] = (),
    inputs_from: Sequence[str] = (),
    input_dir: str | None = None,
    published: hub.Published | None = None,
) -> verdict.Outcome:
    """Recompute the `ramplus` merge in `folder` and compare it tensor by tensor with what the folder holds.

    `trust_remote_code`: the user's own flag (a recorded one is evidence, never applied without it); `inputs`,
    `inputs_from`, `input_dir`: `--input`, `--inputs-from`, `--input-dir`, local copies of recorded inputs
    (`input_copies`); `published`: `folder` is a merge fetched from the Hub (`hub.fetch`). errors.NotVerifiable: a
    usage error (no such folder, no ram_stats.json, another method's folder, a copy mapping no input or one
    twice). errors.Unreadable: ram_stats.json cannot be read. Otherwise the outcome: identical, differing
    (named), or not checkable (an input missing or changed, a refused option or file, a file unreadable)."""
    refuse_foreign(NAME)
    folder = os.path.abspath(folder)
    outcome = verdict.Outcome(folder=folder, hub=published.as_json() if published else None)
    try:
        recorded = record_checks.read_report(folder)
    except errors.Unreadable as error:
        outcome.error = " ".join(str(error).split())
        return outcome
    record = record_checks.read_merge_record(recorded)
    door = surface.FLAT if record.get("entry_point") == "mergekit-pytorch" else surface.MERGE
    problems = surface.problems(surface.PREPASS) + surface.problems(door) + surface.problems(surface.VERIFY)
    if problems:
        raise errors.NotVerifiable("mergekit-ram cannot verify: " + "; ".join(problems))
    copies = input_copies.local_copies(recorded, inputs, parents=inputs_from, folder=input_dir)
    outcome.entry_point = record.get("entry_point")
    installed = {n: versions.installed(n) for n in report.VERSIONED}
    outcome.notes += record_checks.version_notes(recorded, installed, report.installed_from())
    with cachedir.read_only():  # nothing written: no statistics cache entry, no kernel build
        try:
            _verify(folder, recorded, record, options, trust_remote_code, copies, outcome)
        except (errors.Unreadable, InputError, OSError) as error:
            outcome.error = " ".join(str(error).split()) or type(error).__name__
        except MemoryError as error:  # an address-space limit (ulimit -v) below what mapping a file needs
            outcome.error = f"out of memory while checking {folder} ({' '.join(str(error).split()) or 'MemoryError'})"
    if published is not None:  # the files verify did not fetch
        files, blocked, unread = published.unfetched(bool((record.get("options") or {}).get("trust_remote_code")))
        outcome.files += files
        outcome.cannot_check += blocked
        outcome.not_checked += unread
    return outcome


def _verify(
    folder: str, recorded: dict, record: dict, options: Any, trust: bool, copies: dict[str, str], outcome: Any
) -> None:
    choices = loader_files.loader_choices(folder)
    loader_files.check_files(folder, choices)  # no FIFO, device or link out of the folder is ever opened
    pickled = loader_files.pickles(folder, choices)
    if pickled and record_checks.forced_unsafe():
        outcome.cannot_check.append(
            f"{pickled[0]} is a pickle and {input_checks.FORCE_UNSAFE} is set: mergekit's loader would unpickle it "
            "fully (torch.load without weights_only), which could run code; unset it to verify"
        )
        return
    for file in pickled:  # named without unpickling: what it refers to beyond tensors
        try:
            input_checks.check_pickle(file)
        except ValueError as error:
            outcome.cannot_check.append(str(error).replace("input file ", "", 1))
            return
    options, notes, refused = record_checks.recorded_options(record, options, trust, report.RECORDED_OPTIONS)
    outcome.notes += notes
    if refused is not None:
        outcome.cannot_check.append(refused)
        return
    config_checks.check_devices(options)
    loading.install()
    if record.get("entry_point") == "run_merge":
        _verify_run_merge(folder, recorded, options, copies, outcome)
    elif record.get("entry_point") == "mergekit-pytorch":
        _verify_flat(folder, recorded, record, options, copies, outcome)
    else:
        raise errors.NotVerifiable(
            f"{os.path.join(folder, 'ram_stats.json')} records entry point {record.get('entry_point')!r}, "
            "which this mergekit-ram cannot run again (upgrade mergekit-ram)"
        )


# --------------------------------------------------------------------------- #
# mergekit-yaml, mergekit-multi, run_merge: mergekit_config.yml
# --------------------------------------------------------------------------- #
def _verify_run_merge(folder: str, recorded: dict, options: Any, copies: dict[str, str], outcome: Any) -> None:
    from mergekit.io.tasks import LoaderCache

    path = os.path.join(folder, record_checks.CONFIG_FILE)
    if not os.path.lexists(path):
        raise errors.NotVerifiable(
            f"{folder} holds no {record_checks.CONFIG_FILE}, which says what was merged (mergekit writes it with the "
            "model card; was it merged with --no-write-model-card?)"
        )
    config = _read_config(folder)
    if not resolves_to_ours(config.merge_method):
        raise errors.NotVerifiable(f"{path} merges with {config.merge_method!r}; verify checks ramplus merges")
    config, labels = resolved.pinned(config, recorded, copies)
    surface.forget_loaders([rerun.reference(folder), *config.referenced_models()])  # read as the files are now
    index = rerun.published_index(folder)
    LoaderCache().setup(options=options)
    seen: dict[str, dict] = {}  # each input's identity, read once (here, then the statistics pass)
    if not resolved.inputs_unchanged(config, recorded, labels, outcome, copies, seen):
        return
    names = record_checks.recorded_labels(recorded, labels)
    record = record_checks.read_merge_record(recorded)
    current = pipeline.merge_session(config, options, record=record, mode="verify", fast_loading=True, labels=names)
    with active(current):
        try:
            pipeline.check_config(current)
        except ValueError as error:
            raise InputError(f"{path}: {error}") from error
        try:
            input_checks.check_input_files(config)
            planner = plan(config, options)
            planned = record_checks.as_recorded(_plan_report(tasks.of_planner(planner), names), labels)
            outcome.parameters = record_checks.plan_mismatches(recorded, planned)
            if outcome.parameters:
                return
            pipeline.prepare(tasks.of_planner(planner), current, seen)
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
        assert current.report is not None
        outcome.statistics = current.source
        outcome.parameters = record_checks.rho_mismatches(recorded, record_checks.as_recorded(current.report, labels))
        out_dtype = planner.config.out_dtype
        targets = [
            rerun.compare_task(folder, weight.name, task, weight.optional, weight.force_dtype or out_dtype)
            for weight, task in surface.planned(planner)
        ]
        rerun.run(targets, index, folder, options, outcome)
    donor = config.base_model or config.referenced_models()[0]
    published.check(
        folder,
        recorded,
        record_checks.as_recorded({**current.report, "merge": recorded.get("merge")}, labels),
        outcome,
        out_config=planner.out_model_config,
        merge_config=config,
        donor=LoaderCache().get(donor).index.base_path if donor.lora is None else None,
        code=bool(options.trust_remote_code),
    )


def _read_config(folder: str) -> Any:
    from mergekit.config import MergeConfiguration
    from pydantic import ValidationError

    path = os.path.join(folder, record_checks.CONFIG_FILE)
    found = folder_checks.read_yaml(folder, record_checks.CONFIG_FILE)
    try:
        return MergeConfiguration.model_validate(found)
    except ValidationError as error:  # pydantic's or mergekit's own checks: said without the file's values
        message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in error.errors())[:500]
    except Exception as error:
        message = type(error).__name__
    raise errors.Unreadable(f"{path} is not a mergekit config mergekit can read: {message}")


def _plan_report(plan: tasks.Plan, labels: dict[str, str]) -> dict:
    """The report of what `plan` plans, before anything is counted (parameters, inputs, given rho, tied pairs;
    `labels`: the inputs' recorded labels)."""
    found = tasks.planned(plan, resolves_to_ours)
    if not found:
        raise ValueError("the config plans no ramplus tensor")
    planned = [task for _, task in found]
    tied = tasks.tied_copies(plan.out_model_config, planned)
    summaries = [tasks.summary(task) for task in planned if task.output_weight.name not in tied]
    return report.build(None, summaries, source="not computed", identities={}, labels=labels, tied=tied)


# --------------------------------------------------------------------------- #
# mergekit-pytorch: the record's config
# --------------------------------------------------------------------------- #
def _verify_flat(
    folder: str, recorded: dict, record: dict, options: Any, copies: dict[str, str], outcome: verdict.Outcome
) -> None:
    """A `mergekit-pytorch` folder: its config is the record's, planned downhill as `inspect` plans it
    (`surface.plan_flat_as_mergekit`); its inputs are files, their identities and the plan checked before
    anything is counted."""
    from mergekit.io.tasks import SaveTensor
    from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig

    stats = os.path.join(folder, "ram_stats.json")
    try:
        config = RawPyTorchMergeConfig.model_validate(record_checks.as_recorded(record.get("config"), copies))
    except Exception as error:
        raise errors.Unreadable(f"{stats}: its merge record holds no mergekit-pytorch config") from error
    if not resolves_to_ours(config.merge_method):
        raise errors.NotVerifiable(f"{stats} records a {config.merge_method!r} merge; verify checks ramplus merges")
    labels = {local: name for name, local in copies.items()}
    names = record_checks.recorded_labels(recorded, labels)
    # read as the files are now (mergekit-pytorch has its own loaders)
    surface.forget_loaders([rerun.reference(folder)])
    index = rerun.published_index(folder)
    union, intersection = bool(record.get("tensor_union")), bool(record.get("tensor_intersection"))
    current = flat.merge_session(config, options, union, intersection, recorded=record, mode="verify", labels=names)
    seen: dict[str, dict] = {}  # each input's identity, read once (here, then the statistics pass)
    with active(current):
        try:
            pipeline.check_config(current)
            flat.check_inputs(config)
            with flat.planning(options):  # planned into a writer that never runs: nothing is written
                planned = surface.plan_flat_as_mergekit(config, union, intersection, options)
            plan = flat.of_flat(planned, config, options, resolves_to_ours, intersection=intersection)
            found = tasks.planned(plan, resolves_to_ours)
            if not found:
                raise InputError("planning the mergekit-pytorch merge computed no RAM+ statistics")
            now = record_checks.as_recorded(pipeline.identities(found[0][1], seen, plan.identity), labels)
            for label, name, role, identity in record_checks.recorded_inputs(recorded):
                if name in now:
                    check = record_checks.check_identity(
                        name, role, identity, now[name], copy=copies.get(name), label=label
                    )
                    outcome.inputs.append(check)
            if any(check.status != "same" and check.status != "not recorded" for check in outcome.inputs):
                return
            outcome.checked.append(f"the identities of {len(outcome.inputs)} input(s)")
            outcome.parameters = record_checks.plan_mismatches(
                recorded, record_checks.as_recorded(_plan_report(plan, names), labels), source="the recorded config"
            )
            if outcome.parameters:
                return
            pipeline.prepare(plan, current, seen)
        except (OSError, ValueError) as error:
            missing = [p for p in flat.inputs(config) if not os.path.exists(p)]
            if missing:
                was = labels.get(missing[0], missing[0])
                role = {row.model: row.role for row in record_checks.recorded_inputs(recorded)}.get(was, "input")
                outcome.cannot_check.append(f"input {names.get(was, was)} ({was}, {role}) cannot be read: no such "
                                            f"file{input_copies.missing_hint(copies)}")  # fmt: skip
                return
            raise InputError(str(error) or type(error).__name__) from error
        assert current.report is not None
        found_report = record_checks.as_recorded(current.report, labels)
        outcome.statistics = current.source
        outcome.parameters = record_checks.rho_mismatches(recorded, found_report)
        targets = [
            rerun.compare_task(folder, save.tensor_name, save.tensor_task, save.optional, save.dtype)
            for save in plan.tasks()
            if isinstance(save, SaveTensor)
        ]
        rerun.run(targets, index, folder, options, outcome)
    published.check(folder, recorded, found_report, outcome)
