"""A door: one of mergekit's entry points, as each mode (merge, `inspect`, `verify`) needs it.

mergekit has two ways in for a merge: `mergekit-yaml` (and `mergekit-multi`, `run_merge`, a `MergePlanner`
driven by hand), whose inputs are model folders or hub ids (`door_yaml`), and `mergekit-pytorch`, whose
inputs are single weight files (`door_pytorch`). Everything that differs between them is a `Door`'s; the
modes are written once over it (`hooks` merges, `inspection` inspects, `recompute` runs a recorded merge again
for verify) and the pipeline they share knows no door (`pipeline.prepare` takes the door's `tasks.Plan`).

A third door is one new module with a class of this shape, one entry in `DOORS` and, where its config has a type
of its own, one line in `of_config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from mergekit_ram._mergekit import door_pytorch, door_yaml, tasks
from mergekit_ram.errors import NotVerifiable
from mergekit_ram.session import MergeSession, Mode


class Door(Protocol):
    """What a mode needs of one entry point (each implementation's docstring says how it does it)."""

    #: ram_stats.json's `merge.entry_point` of a merge through this door
    entry_point: str
    #: the group of mergekit names its hooks need (`surface.MERGE`, `surface.RAW_PYTORCH`), checked by the guard
    names: str
    config: Any
    options: Any
    #: `verify`: each recorded input -> the user's local copy of it (`input_copies`)
    copies: Mapping[str, str]
    #: `verify`: each input as the config names it now -> as the record names it (a local copy, a pinned hub id)
    labels: Mapping[str, str]
    #: `verify`: where the config was read, for its errors, and how a plan mismatch names it
    where: str
    planned_from: str

    def session(self, mode: Mode, *, check_parameters: bool = True, labels: Mapping[str, str] = ...) -> MergeSession:
        """The session of one run through this door in `mode`: its flags chosen here, once."""
        ...

    def check_inputs(self) -> None:
        """Every input there and its files sound, before mergekit opens one (a merge, `inspect`)."""
        ...

    def check_files(self) -> None:
        """The files of the inputs that are there, before anything opens one (`verify`: a missing input is named
        by its identity check)."""
        ...

    def plan(self) -> tasks.Plan:
        """The config planned by mergekit alone, downhill: nothing of ours runs inside, nothing is written."""
        ...

    def models(self) -> dict[str, Any]:
        """The inputs, by the name the record gives them -> what mergekit's tasks call them."""
        ...

    def identity(self, model: Any, seen: dict[str, dict]) -> dict:
        """`model`'s identity (kept in `seen`: read once), or an error saying why it cannot be read."""
        ...

    def published(self, plan: tasks.Plan) -> dict[str, Any]:
        """What verify's `other_files.check` needs to judge the files this door writes beside the weights."""
        ...


def of_config(config: Any, options: Any, *, tensor_union: bool = False, tensor_intersection: bool = False) -> Door:
    """The door a config comes through: `mergekit-pytorch`'s for its config (`RawPyTorchMergeConfig`), with its
    two flags; else `mergekit-yaml`'s, which takes neither."""
    from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig

    if isinstance(config, RawPyTorchMergeConfig):
        return door_pytorch.PytorchDoor(config, options, tensor_union, tensor_intersection)
    return door_yaml.YamlDoor.of_config(config, options, tensor_union, tensor_intersection)


#: entry point (ram_stats.json's `merge.entry_point`) -> its door
DOORS: dict[str, Any] = {door_yaml.ENTRY_POINT: door_yaml.YamlDoor, door_pytorch.ENTRY_POINT: door_pytorch.PytorchDoor}


def of_record(folder: str, recorded: dict, record: dict, options: Any, copies: dict[str, str]) -> Door:
    """The door a finished merge came through (its record's `entry_point`), built from its folder (`verify`)."""
    door = DOORS.get(str(record.get("entry_point")))
    if door is None:
        raise NotVerifiable(
            f"{os.path.join(folder, 'ram_stats.json')} records entry point {record.get('entry_point')!r}, "
            "which this mergekit-ram cannot run again (upgrade mergekit-ram)"
        )
    built: Door = door.of_record(folder, recorded, record, options, copies)
    return built
