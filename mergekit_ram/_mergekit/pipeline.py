"""The `ramplus` pipeline on mergekit's planned tasks: checks, count or cache, inject rho, report, write.

RAM+'s rho_t is a whole-model quantity, but mergekit merges one tensor at a time. Once
mergekit has planned the tensors, `prepare` turns the planned `ramplus` tasks into plain data
(`tasks`), checks what the models store, counts every planned tensor or takes the counts from
the cache (`counting`), hands each merge task its agents' rho and keeps the report in the
`MergeSession`. `ram_stats.json` is written after the model (`queue_statistics`).

It knows no door: `prepare` works on a `tasks.Plan`, a `MergePlanner`'s (`door_yaml`) or the task list
of `mergekit-pytorch`'s `plan_flat_merge` (`door_pytorch`), in whatever mode the session runs: `hooks`
merges through either door, `inspection` and `recompute` (verify) plan downhill themselves and call `prepare`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from mergekit.graph import Task

from mergekit_ram import files, session
from mergekit_ram._mergekit import counting, tasks
from mergekit_ram.checks import config_checks, input_checks, output_checks
from mergekit_ram.core import statistics
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.reporting import report, tables

LOG = logging.getLogger("mergekit_ram")


def check_config(current: session.MergeSession) -> None:
    """The config's base and parameters, once per session (an `inspect` of another method's config: its base)."""
    if not current.config_checked:
        config_checks.check_config(current.config, parameters=current.check_parameters)
        current.config_checked = True


#: the counts of the planned tasks from elsewhere than a pass (`verify --sample`: ram_stats.json's), and their source
Given = Callable[[list[Any]], tuple[statistics.Statistics | None, str]]


def prepare(
    plan: tasks.Plan,
    current: session.MergeSession,
    seen: dict[str, dict] | None = None,
    given: Given | None = None,
    *,
    count: bool = False,
) -> None:
    """Count (or load), reduce to rho per scope, inject into the planned tasks, keep the report in `current`.
    `seen`: the inputs' identities already read (`verify` reads them first), read once; `given`: the counts
    without a pass (`verify --sample`); `count`: count although the merge needs no rho (`verify` of a record that
    holds counts for such a merge: an earlier mergekit-ram recorded them when its cache held them).

    A merge that needs no rho (r = 0, or rho given for every agent) counts nothing and records no statistics,
    whatever the statistics cache holds: its `ram_stats.json` is the same with a warm, a cold or no cache, and
    `verify`, which never reads the cache, recomputes exactly that."""
    found = tasks.planned(plan, resolves_to_ours)
    if not found:  # nothing to count (inspect says so when it finds no report)
        return
    found = tasks.round_once_to_out_dtype(plan, found)
    planned = [task for _, task in found]
    headers = files.Headers()
    rows = [plan.stored_row(task, headers) for task in planned]
    input_checks.check_stored_tensors(rows)
    tasks.warn_stored_dtypes(plan.config, rows)
    tied = tasks.tied_copies(plan.out_model_config, planned)
    planned = [t for t in planned if t.output_weight.name not in tied]  # a tied pair is counted once
    current.planned = [tasks.summary(task) for task in planned]
    needs = tasks.needing_rho(planned)
    merging = current.mode.injects  # a merge, or verify running one again
    seen = {} if seen is None else seen  # each input's identity, read once (cache key and report)
    counts: tuple[statistics.Statistics | None, str] = (None, "not computed")
    if given is not None:
        counts = given(planned)
    elif needs or not merging or count:
        counts = counting.statistics_of(plan.options, planned, seen, identify=plan.identity)
    current.stats, current.source = counts
    if not needs and merging:
        LOG.info("ramplus: r = 0 or rho given for every agent; no statistics pre-pass")
    if current.stats is not None and merging:
        tasks.inject(plan, found, current.stats, needs, tied)
    if current.mode is not session.Mode.VERIFY:
        warn_same_content(planned[0], seen, plan.identity, current.labels)
    current.report = report.build(
        current.stats,
        current.planned,
        source=current.source,
        identities=identities(planned[0], seen, plan.identity),
        labels=current.labels,
        tied=tied,
        record=current.record,
    )
    if current.stats is not None and current.mode is session.Mode.MERGE:
        _tell(current, plan.options, quiet_table=not needs)


def plan_report(plan: tasks.Plan, labels: dict[str, str]) -> dict:
    """The report of what `plan` plans, before anything is counted (parameters, inputs, given rho, tied pairs;
    `labels`: the inputs' labels): what `verify` checks against the record before it counts."""
    found = tasks.planned(plan, resolves_to_ours)
    if not found:
        raise ValueError("the config plans no ramplus tensor")
    planned = [task for _, task in found]
    tied = tasks.tied_copies(plan.out_model_config, planned)
    summaries = [tasks.summary(task) for task in planned if task.output_weight.name not in tied]
    return report.build(None, summaries, source="not computed", identities={}, labels=labels, tied=tied)


def identities(task: Any, seen: dict[str, dict], identify: counting.Identify) -> dict[str, dict]:
    """model -> its public identity (`report.public_identity`); {} for an input that cannot be read."""
    out = {}
    for model in task.model_order:
        try:
            out[str(model)] = report.public_identity(counting.identity(model, seen, identify))
        except Exception:
            out[str(model)] = {}
    return out


def warn_same_content(task: Any, seen: dict[str, dict], identify: counting.Identify, labels: Mapping[str, str]) -> None:
    """Agents with the same identity by content (their weight files' sizes, headers and samples; not their paths,
    names or links): one model listed twice, each counted as an agent that agrees with the other on every change.
    A warning naming them (inputs whose weights are not sampled, PyTorch pickles in a folder, are not compared)."""
    found: dict[str, list[str]] = {}
    for model in task.model_order:
        if model == task.base_model:
            continue
        try:
            entries = counting.identity(model, seen, identify).get("files", {}).values()
        except Exception:
            continue  # an input that cannot be read is named by the checks
        if any(entry.get("sample_sha256") for entry in entries):
            content = [[e.get("size"), e.get("header_sha256"), e.get("sample_sha256")] for e in entries]
            found.setdefault(json.dumps(sorted(content, key=str)), []).append(str(model))
    for same in found.values():
        if len(same) > 1:
            LOG.warning(
                "ramplus: %s have the same content (their weight files' sizes, headers and samples agree): one "
                "model listed %d times counts as %d agents that agree on every change",
                " and ".join(_named(model, labels) for model in same),
                len(same),
                len(same),
            )


def _named(agent: str, labels: Mapping[str, str]) -> str:
    """An agent as a warning names it to the one merging: its label, then its input where that differs (the
    console is theirs; the tables and the card name only labels)."""
    label = labels.get(agent, agent)
    return label if label == agent else f"{label} ({agent})"


def _tell(current: session.MergeSession, options: Any, *, quiet_table: bool) -> None:
    """A merge's warnings about agents that add nothing, and its statistics table (stderr unless quiet)."""
    assert current.stats is not None and current.report is not None
    totals = current.stats.totals()
    labels = report.labels_of(current.report)
    for agent, s in totals.items():
        if s.active == 0:
            LOG.warning(
                "ramplus: %s changes no weight by more than epsilon; it is identical to the base "
                "and adds nothing to the merge",
                _named(agent, labels),
            )
    params = current.planned[0].parameters
    table = tables.format_table(totals.values(), params["r"], params["alpha"], params["lambda_rule"], labels)
    LOG.info("RAM+ statistics (%s):\n%s", current.source, table)
    if not options.quiet and not quiet_table:
        print(f"RAM+ statistics ({current.source}):\n{table}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# ram_stats.json, written last
# --------------------------------------------------------------------------- #
class WriteStatistics(Task[None]):
    """Writes ram_stats.json after the model itself has been written (a planner driven without run_merge,
    `mergekit-pytorch`); first removes the weight files in `stale` (name -> what `output_checks.weight_files`
    saw before the merge) that the merge did not write again."""

    out_path: str
    payload: str
    after: Any
    stale: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()

    def arguments(self):
        return {"after": self.after}

    def main_thread_only(self) -> bool:
        return True

    def execute(self, **_kwargs) -> None:
        from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]  # mergekit's

        if self.stale:
            ours = logging.getLogger("mergekit_ram")  # a command's shows its own lines (errors.show_warnings_as_lines)
            loggers = [logging.root, *([] if ours.propagate else [ours])]
            with logging_redirect_tqdm(loggers):  # inside mergekit's "Executing graph" bar: each warning on its line
                output_checks.remove_stale_weights(self.out_path, dict(self.stale))
        write_statistics(self.out_path, self.payload)


def queue_statistics(
    current: session.MergeSession,
    planned: list[Any],
    out_path: str,
    stale: dict[str, tuple[int, int, int, int]] | None = None,
) -> None:
    """ram_stats.json of `current`, written last: by `run_merge`'s wrapper (`merge`), or as a task after the model
    (`planned`: the tasks `plan_to_disk` or `plan_flat_merge` returns; `stale`: the output folder's weight files
    before the merge, removed then unless rewritten)."""
    assert current.report is not None
    payload = report.dumps(current.report)
    if current.in_run_merge:
        current.pending.append((out_path, payload))
    else:
        from mergekit.io.tasks import FinalizeModel

        finalize = next(t for t in planned if isinstance(t, FinalizeModel))
        before = tuple(sorted((stale or {}).items()))
        planned.append(WriteStatistics(out_path=out_path, payload=payload, after=finalize, stale=before))


def write_statistics(out_path: str, payload: str) -> None:
    """Write ram_stats.json atomically; a failure names the file and leaves no temp file."""
    os.makedirs(out_path, exist_ok=True)
    files.write_atomic(
        os.path.join(out_path, output_checks.STATS_FILE), payload, private=False
    )  # readable like mergekit's files
