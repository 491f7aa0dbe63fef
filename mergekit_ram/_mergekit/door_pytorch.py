"""The second door (`door.Door`): `mergekit-pytorch`, whose inputs are single weight files.

Its plan is `plan_flat_merge`'s task list (`raw_pytorch.FlatPlan`: the tensors some files lack settled by
`--tensor-union` / `--tensor-intersection`), planned with mergekit's own planner (`surface.plan_flat_as_mergekit`)
inside `raw_pytorch.planning`; its inputs are files, each checked before mergekit opens it and identified by
`cache.file_identity`. It writes the weights only: no config, card or tokenizer. Built from a config (a merge,
`inspect`), or from the `merge` record of a finished merge's `ram_stats.json` (`verify`), which holds its config
and flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mergekit_ram import errors
from mergekit_ram._mergekit import counting, raw_pytorch, surface, tasks
from mergekit_ram.checks import input_checks, paths
from mergekit_ram.core import cache
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.reporting import report
from mergekit_ram.session import MergeSession, Mode
from mergekit_ram.verify import input_copies, record_checks

#: ram_stats.json's entry point of a `mergekit-pytorch` merge
ENTRY_POINT = "mergekit-pytorch"


class PytorchDoor:
    """`tensor_union`, `tensor_intersection`: mergekit-pytorch's flags, part of what it plans (and recorded)."""

    entry_point = ENTRY_POINT
    names = surface.RAW_PYTORCH
    planned_from = "the recorded config"

    #: `verify` (`of_record`): the record read, the user's copies of inputs and what they stand for
    record: dict | None = None
    copies: Mapping[str, str] = {}
    labels: Mapping[str, str] = {}
    where = "the config"

    def __init__(self, config: Any, options: Any, tensor_union: bool = False, tensor_intersection: bool = False):
        self.config, self.options = config, options
        self.tensor_union, self.tensor_intersection = bool(tensor_union), bool(tensor_intersection)

    @classmethod
    def of_record(cls, folder: str, recorded: dict, record: dict, options: Any, copies: Mapping[str, str]):
        """The merge the record of `folder`'s ram_stats.json holds (`verify`), each input where it is read now."""
        from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig

        stats = os.path.join(folder, "ram_stats.json")
        try:
            config = RawPyTorchMergeConfig.model_validate(record_checks.as_recorded(record.get("config"), copies))
        except Exception as error:
            raise errors.Unreadable(f"{stats}: its merge record holds no mergekit-pytorch config") from error
        if not resolves_to_ours(config.merge_method):
            raise errors.NotVerifiable(f"{stats} records a {config.merge_method!r} merge; verify checks ramplus merges")
        door = cls(config, options, bool(record.get("tensor_union")), bool(record.get("tensor_intersection")))
        door.record, door.copies, door.where = record, copies, stats
        door.labels = {local: name for name, local in copies.items()}
        return door

    def _record(self) -> dict[str, Any]:
        """ram_stats.json's `merge` record of a merge through this door: what `verify` plans again."""
        return report.run_record(
            ENTRY_POINT,
            self.options,
            config=self.config.model_dump(mode="json", exclude_none=False),
            tensor_union=self.tensor_union,
            tensor_intersection=self.tensor_intersection,
        )

    def session(
        self, mode: Mode, *, check_parameters: bool = True, labels: Mapping[str, str] | None = None
    ) -> MergeSession:
        return MergeSession(
            config=self.config,
            mode=mode,
            check_parameters=check_parameters,
            labels=labels or {},
            record=self.record if self.record is not None else self._record(),
            fast_loading=True,
        )

    def inputs(self) -> list[str]:
        """The input files, as written, each once (the models', then the base)."""
        paths = [m.model for m in self.config.models] + ([self.config.base_model] if self.config.base_model else [])
        return list(dict.fromkeys(paths))

    def check_inputs(self) -> None:
        """Each input file, before mergekit opens it: there, a file, an intact safetensors or a weights-only pickle
        of tensors; then the integer buffers the files share, equal in each."""
        for path in self.inputs():
            input_checks.check_input_file(path)
        base = self.config.base_model
        input_checks.check_integer_buffers(sorted(self.inputs(), key=lambda path: path != base))

    def check_files(self) -> None:
        present = [path for path in self.inputs() if os.path.exists(path)]
        if len(present) == len(self.inputs()):
            return self.check_inputs()
        for path in present:  # the missing one is named by its identity check
            input_checks.check_input_file(path)

    def plan(self) -> tasks.Plan:
        with raw_pytorch.planning(self.options):  # planned into a writer that never runs: nothing is written
            planned = surface.plan_flat_as_mergekit(
                self.config, self.tensor_union, self.tensor_intersection, self.options
            )
        return raw_pytorch.of_flat(
            planned, self.config, self.options, resolves_to_ours, intersection=self.tensor_intersection
        )

    def models(self) -> dict[str, Any]:
        return {self.labels.get(path, path): path for path in self.inputs()}

    def identity(self, model: Any, seen: dict[str, dict]) -> dict:
        """A copy's under the recorded file's name: the merge reads the file, never its name."""
        path = str(model)
        if not os.path.exists(path):
            hint = input_copies.missing_hint(self.copies)
            raise FileNotFoundError(paths.missing_input(path, "file", f"no such file{hint}"))
        name = os.path.basename(self.labels.get(path, path))
        return counting.identity(path, seen, lambda _: _named(cache.file_identity(path), name))

    def published(self, plan: tasks.Plan) -> dict[str, Any]:
        return {}  # it writes no config, card or tokenizer


def _named(identity: dict, name: str) -> dict:
    """`identity` (`cache.file_identity`: one file) with its file under `name`."""
    (entry,) = identity["files"].values()
    return {**identity, "files": {name: entry}}
