"""The hook into mergekit: version guard, wrapped planner methods, model card.

mergekit 0.1.5 has no extension point for a whole-model pre-pass, so we wrap
two `MergePlanner` methods and `mergekit.merge.generate_card`:

- `_plan`: check the config (`mergekit_ram.checks`), let mergekit plan, then
  run the statistics pass (`mergekit_ram.prepass.run`) on the planned tasks;
- `plan_to_disk`: refuse an output folder inside an input model, drop a stale
  `ram_stats.json` there, and have `ram_stats.json` written once the model is;
- `generate_card`: append the "RAM+ statistics" section to the model card;
- `run_merge`: a `ramplus` merge first checks its input files
  (`checks.check_input_files`), runs inside `mergekit_ram.loading.active()`
  (mergekit's tensor loading in linear time), and writes `ram_stats.json` last,
  after mergekit's config, card and tokenizer: its presence marks a finished
  merge, so an interrupted one (killed, disk full) never looks complete. Other
  methods are left alone.

Besides `mergekit_ram.loading` (which guards its own two loader methods by
their source), this module is the only one that patches mergekit. It checks mergekit's
version and the private surface it relies on (`_plan`, `plan_to_disk`,
`ExecuteMergeMethodTask`'s fields) before patching, and says so clearly if
mergekit changed shape; `unavailable_reason()` then tells why.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from mergekit_ram import checks, loading, prepass, report
from mergekit_ram.method import resolves_to_ours

LOG = logging.getLogger("mergekit_ram")

_SUPPORTED = ((0, 1, 5), (0, 2, 0))
_TASK_FIELDS = (
    "method_name",
    "gather_tensors",
    "model_order",
    "base_model",
    "output_weight",
    "parameters",
    "input_parameters",
    "dtype",
)
_MARK = "__mergekit_ram_prepass__"
_unavailable: str | None = None
_card_report: tuple[Any, dict] | None = None  # (config, report) of the merge being planned, for its card
_pending_stats: list[tuple[str, str]] | None = None  # (out_path, payload), written when run_merge returns


class IncompatibleMergekit(RuntimeError):
    """mergekit's private planning surface is not what this release was built for."""


def unavailable_reason() -> str | None:
    """Why the pre-pass could not be installed, or None when it is active."""
    return _unavailable


def check_surface() -> None:
    """Raise IncompatibleMergekit unless mergekit looks like the one we support."""
    from importlib.metadata import version

    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
    from mergekit.plan import MergePlanner

    found = version("mergekit")
    numbers = tuple(int(p) for p in found.split(".")[:3] if p.isdigit())
    if not (_SUPPORTED[0] <= numbers < _SUPPORTED[1]):
        raise IncompatibleMergekit(f"mergekit {found} is installed; mergekit-ram supports >=0.1.5,<0.2")
    missing = [f for f in _TASK_FIELDS if f not in ExecuteMergeMethodTask.model_fields]
    missing += [m for m in ("_plan", "plan_to_disk") if not callable(getattr(MergePlanner, m, None))]
    if missing:
        raise IncompatibleMergekit(
            f"mergekit {found} changed its planner (missing: {', '.join(missing)}); upgrade mergekit-ram"
        )


def install() -> None:
    """Wrap the planner (and, once loaded, mergekit.merge's card). Idempotent."""
    global _unavailable
    from mergekit.plan import MergePlanner

    if not getattr(MergePlanner._plan, _MARK, False):
        try:
            check_surface()
        except IncompatibleMergekit as error:
            _unavailable = str(error)
            LOG.warning("mergekit-ram: global RAM+ pre-pass disabled: %s", error)
            return
        _wrap(MergePlanner, "_plan", _plan)
        _wrap(MergePlanner, "plan_to_disk", _plan_to_disk)
        _unavailable = None
    install_card()


def install_card() -> None:
    """Append the RAM+ section to the model card `mergekit.merge` writes; load fast during `ramplus` merges."""
    merge: Any = sys.modules.get("mergekit.merge")
    run_merge = getattr(merge, "run_merge", None)
    if run_merge is not None and not getattr(run_merge, _MARK, False):

        def run_merge_wrapper(merge_config: Any, *args: Any, **kwargs: Any) -> Any:
            if not resolves_to_ours(merge_config.merge_method):
                return run_merge(merge_config, *args, **kwargs)
            return _run_ramplus_merge(run_merge, merge_config, *args, **kwargs)

        _mark(run_merge_wrapper, run_merge)
        merge.run_merge = run_merge_wrapper
    current = getattr(merge, "generate_card", None)
    if merge is None or current is None or getattr(current, _MARK, False):
        return

    def generate_card(config: Any, *args: Any, **kwargs: Any) -> str:
        global _card_report
        card: str = current(config, *args, **kwargs)
        pending, _card_report = _card_report, None
        if pending is None or pending[0] is not config:
            return card
        return card.rstrip("\n") + "\n\n" + report.card_section(pending[1])

    _mark(generate_card, current)
    merge.generate_card = generate_card


def _run_ramplus_merge(run_merge: Callable[..., Any], merge_config: Any, *args: Any, **kwargs: Any) -> Any:
    global _pending_stats
    out_path = args[0] if args else kwargs.get("out_path")
    options = args[1] if len(args) > 1 else kwargs.get("options")
    config_source = args[2] if len(args) > 2 else kwargs.get("config_source")
    if config_source is None and getattr(options, "write_model_card", False):
        checks.check_config_serialisable(merge_config)
    checks.check_input_files(merge_config)
    pending: list[tuple[str, str]] = []
    _pending_stats = pending
    try:
        with loading.active():  # linear-time tensor loading, for this merge only
            result = run_merge(merge_config, *args, **kwargs)
        for folder, payload in pending:  # last: the marker of a finished merge
            prepass.write_statistics(folder, payload)
        return result
    except BaseException as error:
        if out_path and os.path.isdir(out_path) and pending:
            LOG.error(
                "mergekit-ram: the merge into %s stopped (%s: %s); the folder holds an incomplete model "
                "(a finished ramplus merge ends by writing %s)",
                out_path,
                type(error).__name__,
                error,
                prepass.STATS_FILE,
            )
        raise
    finally:
        _pending_stats = None


def _wrap(cls: type, name: str, replacement: Callable[..., Any]) -> None:
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(original, self, *args, **kwargs)

    _mark(wrapper, original)
    setattr(cls, name, wrapper)


def _mark(wrapper: Any, original: Callable[..., Any]) -> None:
    wrapper.__qualname__ = f"mergekit_ram[{original.__qualname__}]"
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, _MARK, True)


def _plan(original: Callable[[Any], None], planner: Any) -> None:
    ours = resolves_to_ours(planner.config.merge_method)
    if ours:
        checks.check_config(planner.config)
    original(planner)
    if ours:
        prepass.run(planner)


def _plan_to_disk(original: Callable[[Any, str], list[Any]], planner: Any, out_path: str) -> list[Any]:
    global _card_report
    ours = resolves_to_ours(planner.config.merge_method)
    if ours:
        checks.check_output(planner.config, out_path)
        prepass.remove_stale_statistics(out_path)
    tasks = original(planner, out_path)
    found = getattr(planner, "_mergekit_ram_report", None)
    if ours and found is not None:
        _card_report = (planner.config, found)  # one merge at a time: an older report never reaches a card
        if _pending_stats is not None:  # inside run_merge: written after everything else
            _pending_stats.append((out_path, report.dumps(found)))
        else:  # someone drives the planner directly: after the model, as a task
            from mergekit.io.tasks import FinalizeModel

            finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
            tasks.append(prepass.WriteStatistics(out_path=out_path, payload=report.dumps(found), after=finalize))
    return tasks
