"""`mergekit-ram verify OUT_DIR`: a finished `ramplus` merge run again from its folder, compared instead of written.

From the folder alone (`ram_stats.json` and, for `run_merge`, mergekit's `mergekit_config.yml`):

1. the inputs are resolved as mergekit resolves them (a hub id at the revision recorded for it) and their
   identities (`report.public_identity`) checked against the recorded ones: a changed or missing input
   is named, and nothing is recomputed;
2. the config is planned as mergekit plans it, downhill like `inspect` (`planner.plan`, with the
   recorded options that change what is merged), and what it plans is checked against `ram_stats.json`
   (`compare.plan_mismatches`): an edited parameter is named, and nothing is recomputed;
3. the merge runs again through the pipeline of a merge (`pipeline.prepare`: rho from the statistics
   cache when it holds the counts, else counted, and injected), on the executor `run_merge` would use
   (`rerun`): where mergekit would save each tensor (`SaveTensor`, cast to its dtype), `CompareTensor`
   compares it with the published one, read from the folder (`PublishedTensor`), so the executor holds
   what a merge holds (less: no output shard is buffered). Tensors in the folder that the merge does not
   plan are named.

Nothing is written into the folder or an input (the statistics cache may gain an entry). The
judging is `compare`'s, on plain data; this module plans, `rerun` runs.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from mergekit_ram import compare, config_checks, input_checks, report, versions
from mergekit_ram._mergekit import counting, loading, pipeline, rerun, surface, tasks
from mergekit_ram._mergekit.planner import plan
from mergekit_ram._mergekit.rerun import InputError
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import MergeSession, active


def verify(folder: str, options: Any) -> compare.Outcome:
    """Recompute the `ramplus` merge in `folder` and compare it tensor by tensor with what the folder holds.

    compare.NotVerifiable: a usage error (no such folder, no ram_stats.json, another method's folder,
    nothing that says how the merge was run). compare.Unreadable or InputError: a file that cannot
    be read. Otherwise the outcome, identical or naming what differs.
    """
    refuse_foreign(NAME)
    folder = os.path.abspath(folder)
    recorded = compare.read_report(folder)
    record = compare.merge_record(recorded)
    door = surface.FLAT if record.get("entry_point") == "mergekit-pytorch" else surface.MERGE
    problems = surface.problems(surface.PREPASS) + surface.problems(door) + surface.problems(surface.VERIFY)
    if problems:
        raise compare.NotVerifiable("mergekit-ram cannot verify: " + "; ".join(problems))
    outcome = compare.Outcome(folder=folder, entry_point=record.get("entry_point"))
    outcome.notes += compare.version_notes(recorded, {n: versions.installed(n) for n in report.VERSIONED})
    options = recorded_options(record, options)
    config_checks.check_devices(options)
    loading.install()
    if record.get("entry_point") == "run_merge":
        _verify_run_merge(folder, recorded, record, options, outcome)
    elif record.get("entry_point") == "mergekit-pytorch":
        _verify_flat(folder, recorded, record, options, outcome)
    else:
        raise compare.NotVerifiable(
            f"{os.path.join(folder, 'ram_stats.json')} records entry point {record.get('entry_point')!r}, "
            "which this mergekit-ram cannot run again (upgrade mergekit-ram)"
        )
    return outcome


def recorded_options(record: dict, options: Any) -> Any:
    """`options` with the recorded values of the options that change what is merged (`report.RECORDED_OPTIONS`)."""
    found = record.get("options") or {}
    update = {k: v for k, v in found.items() if k in report.RECORDED_OPTIONS and k in type(options).model_fields}
    return options.model_copy(update=update) if update else options


# --------------------------------------------------------------------------- #
# mergekit-yaml, mergekit-multi, run_merge: mergekit_config.yml
# --------------------------------------------------------------------------- #
def _verify_run_merge(folder: str, recorded: dict, record: dict, options: Any, outcome: compare.Outcome) -> None:
    from mergekit.io.tasks import LoaderCache

    path = os.path.join(folder, compare.CONFIG_FILE)
    if not os.path.isfile(path):
        raise compare.NotVerifiable(
            f"{folder} holds no {compare.CONFIG_FILE}, which says what was merged (mergekit writes it with the "
            "model card; was it merged with --no-write-model-card?)"
        )
    config = _read_config(path)
    if not resolves_to_ours(config.merge_method):
        raise compare.NotVerifiable(f"{path} merges with {config.merge_method!r}; verify checks ramplus merges")
    surface.forget_loaders([rerun.reference(folder), *config.referenced_models()])  # read as the files are now
    index = rerun.published_index(folder)
    LoaderCache().setup(options=options)
    config, labels = _pinned(config, recorded)
    if not _inputs_unchanged(config, recorded, labels, outcome):
        return
    current = MergeSession(config=config, mode="verify", fast_loading=True, record=record)
    with active(current):
        try:
            pipeline.check_config(current)
        except ValueError as error:
            raise InputError(f"{path}: {error}") from error
        try:
            input_checks.check_input_files(config)
            planner = plan(config, options)
            outcome.parameters = compare.plan_mismatches(recorded, _relabel(_plan_report(planner), labels))
            if outcome.parameters:
                return
            pipeline.prepare(tasks.of_planner(planner), current)
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
        assert current.report is not None
        outcome.statistics = current.source
        outcome.parameters = compare.rho_mismatches(recorded, _relabel(current.report, labels))
        out_dtype = planner.config.out_dtype
        targets = [
            rerun.compare_task(folder, weight.name, task, weight.optional, weight.force_dtype or out_dtype)
            for weight, task in surface.planned(planner)
        ]
        rerun.run(targets, index, folder, options, outcome)


def _read_config(path: str) -> Any:
    import yaml
    from mergekit.config import MergeConfiguration

    try:
        with open(path, encoding="utf-8") as f:
            return MergeConfiguration.model_validate(yaml.safe_load(f))
    except Exception as error:  # YAML, pydantic or mergekit's own checks: the file is what is wrong
        message = " ".join(str(error).split())[:500]
        raise compare.Unreadable(f"{path} is not a mergekit config mergekit can read: {message}") from error


def _pinned(config: Any, recorded: dict) -> tuple[Any, dict[str, str]]:
    """`config` with every hub id whose revision was recorded pinned to that commit, and label now -> label recorded.

    A hub id names a branch (`org/name`, `org/name@main`) that may have moved since the merge;
    its recorded revision is the commit the merge read (the snapshot folder's name).
    """
    from mergekit.common import ModelPath

    identities = {model: identity for model, _, identity in compare.recorded_inputs(recorded)}
    pins = {}
    for model in config.referenced_models():
        revision = identities.get(str(model), {}).get("revision")
        local = os.path.exists(model.model.path)
        if revision and model.lora is None and not local and model.model.revision != revision:
            pins[model] = model.model_copy(update={"model": ModelPath(path=model.model.path, revision=revision)})
    if not pins:
        return config, {}
    return _replaced(config, pins), {str(new): str(old) for old, new in pins.items()}


def _replaced(value: Any, pins: dict[Any, Any]) -> Any:
    """`value` (a config, or anything in it) with each model reference in `pins` replaced, copies where it changed."""
    from mergekit.common import ModelReference
    from pydantic import BaseModel

    if isinstance(value, ModelReference):
        return pins.get(value, value)
    if isinstance(value, BaseModel):
        update = {}
        for key in type(value).model_fields:
            old = getattr(value, key)
            new = _replaced(old, pins)
            if new is not old:
                update[key] = new
        return value.model_copy(update=update) if update else value
    if isinstance(value, (list, tuple)):
        items = [_replaced(v, pins) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        pairs = [(_replaced(k, pins), _replaced(v, pins)) for k, v in value.items()]
        changed = any(a is not k or b is not v for (a, b), (k, v) in zip(pairs, value.items(), strict=True))
        return dict(pairs) if changed else value
    return value


def _inputs_unchanged(config: Any, recorded: dict, labels: dict[str, str], outcome: compare.Outcome) -> bool:
    """Resolve every input the config names and the report records (as mergekit does), and check its identity."""
    from mergekit.io.tasks import LoaderCache

    models = {labels.get(str(m), str(m)): m for m in config.referenced_models()}
    seen: dict[str, dict] = {}
    for label, role, identity in compare.recorded_inputs(recorded):
        model = models.get(label)
        if model is None:
            continue  # the config names other inputs: the plan check says so
        path = model.model.path
        try:
            if os.path.isabs(path) and not os.path.exists(path):
                raise FileNotFoundError(f"no such folder: {path}")
            LoaderCache().get(model)
            found = report.public_identity(counting.identity(model, seen))
        except Exception as error:
            detail = " ".join(str(error).split())[:300] or type(error).__name__
            outcome.inputs.append(compare.InputCheck(label, role, "missing", identity, None, detail))
            continue
        outcome.inputs.append(compare.check_identity(label, role, identity, found))
    return not any(check.status in ("changed", "missing") for check in outcome.inputs)


def _plan_report(planner: Any) -> dict:
    """The report of what `planner` plans, before anything is counted (parameters, inputs, given rho, tied pairs)."""
    found = tasks.planned(tasks.of_planner(planner), resolves_to_ours)
    if not found:
        raise ValueError("the config plans no ramplus tensor")
    planned = [task for _, task in found]
    tied = tasks.tied_copies(planner.out_model_config, planned)
    summaries = [tasks.summary(task) for task in planned if task.output_weight.name not in tied]
    return report.build(None, summaries, source="not computed", identities={}, tied=tied)


def _relabel(found: dict, labels: dict[str, str]) -> dict:
    """A report whose model labels are the recorded ones (a pinned hub id is recorded as the config named it)."""
    if not labels:
        return found
    agents = [{**row, "model": labels.get(row["model"], row["model"])} for row in found["agents"]]
    base = {**found["base_model"], "model": labels.get(found["base_model"]["model"], found["base_model"]["model"])}
    out = {**found, "agents": agents, "base_model": base}
    if "rho_by_group" in found:
        out["rho_by_group"] = {g: {labels.get(a, a): v for a, v in r.items()} for g, r in found["rho_by_group"].items()}
    return out


# --------------------------------------------------------------------------- #
# mergekit-pytorch: the record's config
# --------------------------------------------------------------------------- #
def _verify_flat(folder: str, recorded: dict, record: dict, options: Any, outcome: compare.Outcome) -> None:
    """A `mergekit-pytorch` folder: its config is the record's; its inputs are files, whose identities the
    pipeline's report of the planned merge gives."""
    from mergekit.io.tasks import SaveTensor
    from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig, plan_flat_merge

    stats = os.path.join(folder, "ram_stats.json")
    try:
        config = RawPyTorchMergeConfig.model_validate(record.get("config"))
    except Exception as error:
        raise compare.Unreadable(f"{stats}: its merge record holds no mergekit-pytorch config ({error})") from error
    if not resolves_to_ours(config.merge_method):
        raise compare.NotVerifiable(f"{stats} records a {config.merge_method!r} merge; verify checks ramplus merges")
    # read as the files are now (mergekit-pytorch has its own loaders)
    surface.forget_loaders([rerun.reference(folder)])
    index = rerun.published_index(folder)
    current = MergeSession(config=config, mode="verify", fast_loading=True, record=record)
    # plan_flat_merge plans a writer for its out_path; it never runs here, and nothing is written there
    nowhere = os.path.join(tempfile.gettempdir(), f"mergekit-ram-verify-{os.getpid()}-never-written")
    with active(current):
        try:
            planned = plan_flat_merge(
                config, nowhere, bool(record.get("tensor_union")), bool(record.get("tensor_intersection")), options
            )
        except (OSError, ValueError) as error:
            raise InputError(str(error) or type(error).__name__) from error
        if current.report is None:
            raise InputError("planning the mergekit-pytorch merge computed no RAM+ statistics")
        found = {current.report["base_model"]["model"]: current.report["base_model"]["identity"]}
        found.update({row["model"]: row["identity"] for row in current.report["agents"]})
        for label, role, identity in compare.recorded_inputs(recorded):
            if label in found:
                outcome.inputs.append(compare.check_identity(label, role, identity, found[label]))
        if any(check.status != "same" and check.status != "not recorded" for check in outcome.inputs):
            return
        outcome.parameters = compare.plan_mismatches(recorded, current.report, source="the recorded config")
        if outcome.parameters:
            return
        outcome.statistics = current.source
        outcome.parameters = compare.rho_mismatches(recorded, current.report)
        targets = [
            rerun.compare_task(folder, save.tensor_name, save.tensor_task, save.optional, save.dtype)
            for save in planned
            if isinstance(save, SaveTensor)
        ]
        rerun.run(targets, index, folder, options, outcome)
