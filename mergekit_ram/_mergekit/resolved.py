"""`mergekit-ram verify`: the inputs a folder records, resolved on this machine as mergekit resolves them.

A hub id at the revision the record holds for it, a local copy where the user names one (`--input
RECORDED=LOCAL`), each input's files checked before mergekit opens them, and its identity
(`report.public_identity`) checked against the recorded one: a changed, missing or unreadable input is
named, and the folder cannot be checked then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mergekit_ram import errors, input_checks, input_copies, record_checks, report, verdict
from mergekit_ram._mergekit import counting


def pinned(config: Any, recorded: dict, copies: Mapping[str, str]) -> tuple[Any, dict[str, str]]:
    """`config` with each input that has a local copy (`copies`) read there, every other hub id whose revision was
    recorded pinned to that commit; and label now -> label recorded.

    A hub id names a branch (`org/name`, `org/name@main`) that may have moved since the merge;
    its recorded revision is the commit the merge read (the snapshot folder's name).
    """
    from mergekit.common import ModelPath

    identities = {row.model: row.identity for row in record_checks.recorded_inputs(recorded)}
    pins = {}
    for model in config.referenced_models():
        if model.lora is not None:
            continue
        if str(model) in copies:
            pins[model] = model.model_copy(update={"model": ModelPath(path=copies[str(model)])})
            continue
        revision = identities.get(str(model), {}).get("revision")
        local = os.path.exists(model.model.path)
        if revision and not local and model.model.revision != revision:
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


def inputs_unchanged(
    config: Any,
    recorded: dict,
    labels: dict[str, str],
    outcome: verdict.Outcome,
    copies: Mapping[str, str],
    seen: dict[str, dict],
) -> bool:
    """Resolve every input the config names and the report records (as mergekit does), and check its identity
    (kept in `seen`, for the statistics pass: each identity read once)."""
    from mergekit.io.tasks import LoaderCache

    try:
        input_checks.check_input_files(config)  # before mergekit opens a file: no FIFO or device is read
    except ValueError as error:
        raise errors.Unreadable(str(error)) from error
    models = {labels.get(str(m), str(m)): m for m in config.referenced_models()}
    for label, name, role, identity in record_checks.recorded_inputs(recorded):
        model = models.get(name)
        if model is None:
            continue  # the config names other inputs: the plan check says so
        path = model.model.path
        try:
            if os.path.isabs(path) and not os.path.exists(path):
                raise FileNotFoundError(f"no such folder: {path}{input_copies.missing_hint(copies)}")
            LoaderCache().get(model)
            found = report.public_identity(counting.identity(model, seen))
        except Exception as error:
            detail = " ".join(str(error).split())[:300] or type(error).__name__
            check = record_checks.InputCheck(name, role, "missing", identity, None, detail, label=label)
            outcome.inputs.append(check)
            continue
        check = record_checks.check_identity(name, role, identity, found, copy=copies.get(name), label=label)
        outcome.inputs.append(check)
    checked = [check for check in outcome.inputs if check.status == "same"]
    if checked:
        outcome.checked.append(f"the identities of {len(checked)} input(s)")
    return not any(check.status in ("changed", "missing") for check in outcome.inputs)
