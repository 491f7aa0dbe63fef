"""The interfaces verify's driver is written against: what it needs of mergekit (`Recompute`, `Merge`: a recorded
merge planned and run again), and what a merge method records beyond the weights (`MethodChecks`).

verify judges on plain data; mergekit plans and runs. The one implementation is the seam's
(`mergekit_ram._mergekit.recompute.MERGEKIT`), which the CLI passes to `driver.verify`: someone upgrading
mergekit reads that module, someone changing verify reads this folder. Every name and count here is plain data
(tensor names, input names as the config names them, element counts, byte spans); what a method records beyond
the weights (ramplus's statistics) comes back as the report a merge would write.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from mergekit_ram.core import statistics
from mergekit_ram.verify import sample, verdict

#: the recorded statistics a sample uses instead of counting every tensor: (the agents, each planned tensor's
#: epsilon, whether any agent needs a counted rho) -> (statistics or None, their source)
Given = Callable[[list[str], dict[str, float], bool], tuple[statistics.Statistics | None, str]]
#: file -> (start, stop) byte spans a sample reads
Spans = dict[str, set[tuple[int, int]]]


class Recompute(Protocol):
    """mergekit, as verify uses it."""

    def check_method(self) -> None:
        """errors.RamError when mergekit would run another package's method under this plugin's method name."""
        ...

    def missing(self, entry_point: str | None) -> list[str]:
        """What this mergekit lacks to run a merge of `entry_point` again (empty: nothing)."""
        ...

    def config_record(self, folder: str) -> dict:
        """What a folder without ram_stats.json records, from its `mergekit_config.yml`: the method and the inputs
        as the config names them, none with an identity (`record_checks.CONFIG_ONLY`); errors.Unreadable when it
        cannot say (no config, a method this mergekit lacks, a ramplus merge without its record)."""
        ...

    def open(
        self, folder: str, recorded: dict, record: dict, options: Any, copies: Mapping[str, str]
    ) -> AbstractContextManager[Merge]:
        """The merge `folder` records, ready to plan (its config and inputs' files checked before anything opens
        one): errors.InputError for a config mergekit refuses, errors.Unreadable for a file that cannot be read."""
        ...


class Merge(Protocol):
    """One recorded merge, planned and run again by mergekit."""

    #: each input as the config names it now -> as the record names it; each input -> its recorded label
    labels: Mapping[str, str]
    names: dict[str, str]
    #: how a plan mismatch names what was planned (`mergekit_config.yml`, "the recorded config")
    planned_from: str
    #: the published folder's tensors, as a loader reads them: tensor -> file
    index: dict[str, str]

    def identity(self, name: str, seen: dict[str, dict]) -> dict | None:
        """The identity of the input the record calls `name` as it is read now (kept in `seen`: read once);
        None when the config names no such input; an exception saying why it cannot be read."""
        ...

    def planned(self) -> dict:
        """The report of what the config plans, before anything is counted, labelled as recorded."""
        ...

    def prepare(self, seen: dict[str, dict], given: Given | None, count: bool) -> tuple[dict, Any, str]:
        """Rho counted (or reduced from `given`) and injected as a merge does: (the report a merge writes, its
        statistics, their source)."""
        ...

    def parameters(self, name: str) -> Mapping[str, Any]:
        """The method's parameters of tensor `name` as planned (r, alpha, lambda_rule, rho_scope)."""
        ...

    def shapes(self) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """For a sample's draw: tensor -> (elements, elements per row) as planned; tensor -> why it is checked whole
        (a merge that cannot be recomputed slice by slice)."""
        ...

    def needed(self, drawn: sample.Sample, seen: dict[str, dict]) -> Spans:
        """The byte spans a sample reads: headers, the inputs' identity windows, the drawn slices."""
        ...

    def compare_slices(self, drawn: sample.Sample, outcome: verdict.Outcome) -> dict[str, statistics.TensorCounts]:
        """Each drawn slice recomputed and compared (into `outcome`); the slices' counts, tensor -> counts."""
        ...

    def rounding(self) -> tuple[int | None, str] | None:
        """How far the merge's method is measured to move its bits between machines: (the most units in the last
        place, None for any size; what moved them); None where nothing did (docs/verify.md's table)."""
        ...

    def random(self) -> dict[str, str]:
        """The tensors whose merge draws random numbers (mergekit's `--random-seed` decides them): tensor ->
        method."""
        ...

    def planned_numels(self) -> dict[str, int]:
        """Each counted tensor's element count as planned (what the inputs' or the published header says)."""
        ...

    def count_again(self, names: Collection[str], labels: Mapping[str, str]) -> dict[str, dict | None]:
        """Each of the method's tensors among `names` (a tied copy aside) counted again: tensor -> its
        ram_stats.json row (labelled), None for one the method does not count (a buffer)."""
        ...

    def compare(self, outcome: verdict.Outcome, only: Collection[str] | None = None) -> None:
        """The merge run again, each tensor (`only`: those) compared bit for bit where mergekit would save it;
        then the tensors the folder holds beyond the plan named (into `outcome`)."""
        ...

    def beside(self) -> dict[str, Any]:
        """What `other_files.check` needs to judge the files mergekit writes beside the weights."""
        ...


class MethodChecks(Protocol):
    """What a merge method records beyond its weights, and how verify checks it (`ramplus.CHECKS`): the driver and
    `other_files` call these and know nothing else of the method."""

    #: what `check_statistics` checks, as the verdict's "checked" list says it (None: the method records nothing)
    checked_record: str | None

    def prepare(
        self, merge: Merge, recorded: dict, seen: dict[str, dict], sampled: bool, outcome: verdict.Outcome
    ) -> tuple[dict, Any] | None:
        """Before any tensor is recomputed: the plan checked against the record and what the method needs counted
        (`sampled`: for a sample, reduced from the record where it can be): (the report a merge of the method
        writes, its statistics), or None when the plan differs from the record (said in `outcome`)."""
        ...

    def against_slices(
        self, merge: Merge, stats: Any, counted: dict[str, statistics.TensorCounts], recorded: dict, outcome: Any
    ) -> None:
        """A sample's checks of what the record counts, against the slices' counts (into `outcome`)."""
        ...

    def check_statistics(self, recorded: dict, recomputed: dict, outcome: verdict.Outcome) -> None:
        """The method's record (ram_stats.json) against the report of the merge run again."""
        ...

    def check_card(self, folder: str, recorded: dict, outcome: verdict.Outcome) -> None:
        """The method's part of the model card."""
        ...
