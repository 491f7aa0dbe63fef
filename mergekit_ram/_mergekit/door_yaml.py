"""The first door (`door.Door`): `mergekit-yaml`, `mergekit-multi`, `run_merge` and a `MergePlanner` driven by hand.

Its inputs are model folders or hub ids, which mergekit's `LoaderCache` resolves; its plan is a `MergePlanner`'s
(`planner.plan`: run_merge's preamble, mergekit alone); mergekit writes the merge's config, card and tokenizer
beside the weights. Built from a config (a merge, `inspect`), or from a finished merge's folder (`verify`:
its `mergekit_config.yml`, each input read where the user's copy is, `input_copies`, or a hub id at the revision
the merge read, `pinned`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mergekit_ram import errors, session
from mergekit_ram._mergekit import counting, planner, surface, tasks
from mergekit_ram.checks import config_checks, input_checks, output_checks, paths
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.reporting import report, versions
from mergekit_ram.session import MergeSession, Mode
from mergekit_ram.verify import folder_checks, hub, input_copies, record_checks

#: ram_stats.json's entry point of a merge through this door
ENTRY_POINT = "run_merge"


class YamlDoor:
    """`run_merge`: inside mergekit's `run_merge` (its wrapper: ram_stats.json written after it returns, tensors
    loaded in linear time), else a planner driven by hand, `inspect` or `verify`; `card`: mergekit writes the
    config into the card (it must be one it can write)."""

    entry_point = ENTRY_POINT
    names = surface.MERGE

    #: `verify` (`of_record`): the record read, the user's copies of inputs, each input now -> as recorded
    record: dict | None = None
    copies: Mapping[str, str] = {}
    labels: Mapping[str, str] = {}
    #: `verify`: the recorded inputs the merge read from a local folder (an identity without a hub revision)
    local: frozenset[str] = frozenset()
    where = planned_from = record_checks.CONFIG_FILE

    def __init__(self, config: Any, options: Any, *, run_merge: bool = False, card: bool = False):
        self.config, self.options = config, options
        self.run_merge, self.card = run_merge, card

    @classmethod
    def of_config(cls, config: Any, options: Any, tensor_union: bool = False, tensor_intersection: bool = False):
        """`inspect` of a config: this door takes neither of `mergekit-pytorch`'s flags."""
        if tensor_union or tensor_intersection:
            raise errors.RamError(
                "--tensor-union and --tensor-intersection are mergekit-pytorch's: they apply to a config whose "
                "models are files"
            )
        return cls(config, options)

    @classmethod
    def of_record(cls, folder: str, recorded: dict, record: dict, options: Any, copies: Mapping[str, str]):
        """The merge in `folder` as its `mergekit_config.yml` says (`verify`), each input where it is read now."""
        path = os.path.join(folder, record_checks.CONFIG_FILE)
        if not os.path.lexists(path):
            raise errors.NotVerifiable(
                f"{folder} holds no {record_checks.CONFIG_FILE}, which says what was merged (mergekit writes it "
                "with the model card; was it merged with --no-write-model-card?)"
            )
        config = _read_config(folder)
        if not recorded.get(record_checks.CONFIG_ONLY) and not resolves_to_ours(config.merge_method):
            raise errors.NotVerifiable(
                f"{path} merges with {config.merge_method!r}, but {output_checks.STATS_FILE} records a ramplus merge"
            )
        config, labels = pinned(config, recorded, copies)
        surface.forget_loaders(config.referenced_models())  # read as the files are now
        from mergekit.io.tasks import LoaderCache

        LoaderCache().setup(options=options)
        door = cls(config, options)
        door.record, door.labels, door.copies, door.where = record, labels, copies, path
        rows = record_checks.recorded_inputs(recorded)
        door.local = frozenset(row.model for row in rows if row.identity and "revision" not in row.identity)
        return door

    def session(
        self, mode: Mode, *, check_parameters: bool = True, labels: Mapping[str, str] | None = None
    ) -> MergeSession:
        record = self.record if self.record is not None else report.run_record(ENTRY_POINT, self.options)
        return MergeSession(
            config=self.config,
            mode=mode,
            check_parameters=check_parameters,
            labels=labels or {},
            record=record,
            in_run_merge=self.run_merge,
            fast_loading=self.run_merge or mode is not Mode.MERGE,  # a planner driven by hand loads as mergekit does
        )

    def check_inputs(self) -> None:
        cached = input_checks.check_input_paths(self.config, getattr(self.options, "transformers_cache", None))
        current = session.current()
        if current is not None and current.owns(self.config):  # hub ids read from the Hub cache (`hub_ids`)
            current.from_cache.update(cached)
        if self.card:
            output_checks.check_config_serialisable(self.config)
        self.check_files()

    def check_files(self) -> None:
        input_checks.check_input_files(self.config)

    def plan(self) -> tasks.Plan:
        return tasks.of_planner(planner.plan(self.config, self.options))

    def models(self) -> dict[str, Any]:
        return {self.labels.get(str(m), str(m)): m for m in config_checks.models_in_order(self.config)}

    def identity(self, model: Any, seen: dict[str, dict]) -> dict:
        from mergekit.io.tasks import LoaderCache

        path = model.model.path
        if not os.path.exists(path) and (
            not paths.hub_id_form(path) or self.labels.get(str(model), str(model)) in self.local
        ):
            said = f"no such folder: {path}{input_copies.missing_hint(self.copies)}"
            raise FileNotFoundError(paths.missing_input(path, "folder", said))  # never asked of the Hub
        LoaderCache().get(model)
        return counting.identity(model, seen)

    def published(self, plan: tasks.Plan) -> dict[str, Any]:
        from mergekit.io.tasks import LoaderCache

        donor = self.config.base_model or config_checks.models_in_order(self.config)[0]
        return {
            "out_config": plan.out_model_config,
            "merge_config": self.config,
            "donor": LoaderCache().get(donor).index.base_path if donor.lora is None else None,
            "code": bool(self.options.trust_remote_code),
        }


class InConfigOrder:
    """`config`, read through, but for `referenced_models()`: its models in the config's order
    (`config_checks.models_in_order`), not a set's. mergekit's card lists them so: with a set's order the same merge
    wrote another README.md in each process."""

    def __init__(self, config: Any):
        self._config = config
        self._models = config_checks.models_in_order(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def referenced_models(self) -> list[Any]:
        return list(self._models)


def config_record(folder: str) -> dict:
    """What a merge folder without ram_stats.json records, read from its `mergekit_config.yml` (mergekit writes
    it with the card): the method, and each input as the config names it (its label), in the config's order, with
    no identity. errors.Unreadable (verify: cannot check) when the folder holds no config, a config mergekit
    cannot read, a method this mergekit lacks, or a ramplus merge, whose record is missing."""
    from mergekit import merge_methods

    path = os.path.join(folder, record_checks.CONFIG_FILE)
    if not os.path.lexists(path):
        raise errors.Unreadable(
            f"{folder} holds neither {output_checks.STATS_FILE} nor {record_checks.CONFIG_FILE}, so nothing says "
            "what was merged (a merge written with --no-write-model-card, or not a merge); the config it was merged "
            f"with, saved there as {record_checks.CONFIG_FILE}, would let verify check it"
        )
    raw = folder_checks.read_yaml(folder, record_checks.CONFIG_FILE)
    method = raw.get("merge_method") if isinstance(raw, dict) else None
    try:
        merge_methods.get(str(method))
    except RuntimeError:
        raise errors.Unreadable(
            f"{path} merges with {str(method)[:80]!r}, a method this mergekit ({versions.installed('mergekit')}) does "
            "not have (another plugin's, or a newer mergekit's): install what made it to check it"
        ) from None
    if resolves_to_ours(str(method)):
        raise errors.Unreadable(
            f"{folder} holds no {output_checks.STATS_FILE}, which every ramplus merge writes with its weights: a "
            "merge that stopped before the end, or a record removed; verify needs it to check a ramplus merge"
        )
    config = _read_config(folder)
    base, models = config.base_model, config_checks.models_in_order(config)
    inputs: dict[str, dict] = {
        str(model): {"model": str(model), "role": "base" if model == base else "input", "identity": _pin(model)}
        for model in models
    }
    names = [ref.path for model in models for ref in (model.model, model.lora) if ref is not None]
    shaped = {name for name in names if name[:1] not in "/~" and name.count("/") <= 1}  # `mergekit.card.is_hf`
    return {
        "method": str(method),
        record_checks.CONFIG_ONLY: True,
        # the hub ids mergekit's card names (`base_model`); `maybe`: shaped so, but folders here too (mergekit asked
        # the Hub whether it had them)
        "hub_ids": {
            "certain": sorted(n for n in shaped if not os.path.exists(n)),
            "maybe": sorted(n for n in shaped if os.path.exists(n)),
        },
        "base_model": None if base is None else str(base),
        "inputs": inputs,
        "merge": {"entry_point": ENTRY_POINT},
    }


def _pin(model: Any) -> dict:
    """The identity a config records of an input: the commit it names (`org/name@<commit>`), else none."""
    revision = model.model.revision if model.lora is None else None
    return {"revision": revision} if revision and hub.COMMIT.fullmatch(revision) else {}


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


def pinned(config: Any, recorded: dict, copies: Mapping[str, str]) -> tuple[Any, dict[str, str]]:
    """`config` with each input that has a local copy (`copies`) read there, every other hub id whose revision was
    recorded pinned to that commit; and label now -> label recorded.

    A hub id names a branch (`org/name`, `org/name@main`) that may have moved since the merge;
    its recorded revision is the commit the merge read (the snapshot folder's name).
    """
    from mergekit.common import ModelPath

    identities = {row.model: row.identity for row in record_checks.recorded_inputs(recorded)}
    pins = {}
    for model in config_checks.models_in_order(config):  # the first bad revision named is the config's first
        if model.lora is not None:
            continue
        if str(model) in copies:
            pins[model] = model.model_copy(update={"model": ModelPath(path=copies[str(model)])})
            continue
        revision = identities.get(str(model), {}).get("revision")
        local = os.path.exists(model.model.path)
        asked = model.model.revision
        if not local and asked and not hub.REVISION.fullmatch(asked):  # a path in the Hub cache, not a revision
            raise errors.Unreadable(f"{record_checks.CONFIG_FILE} names input {model} at {asked[:80]!r}, no revision")
        if revision and not local and asked != revision:
            if not hub.COMMIT.fullmatch(str(revision)):  # it would name a path in the Hub cache
                raise errors.Unreadable(
                    f"{output_checks.STATS_FILE} records {str(revision)[:80]!r} as the revision of input {model}, "
                    "not a commit id (40 hex digits)"
                )
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
