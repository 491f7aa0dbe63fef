"""The mergekit functions we wrap, each a thin call into `pipeline` (other merge methods pass through).

- `mergekit.merge.run_merge`: a `ramplus` merge runs as one `MergeSession`
  (made current for this thread or task), checks its input files first, loads
  tensors in linear time (`loading`), and writes `ram_stats.json` last, after
  mergekit's config, card and tokenizer: its presence marks a finished merge,
  so an interrupted one (killed, disk full) never looks complete (`pipeline.merge`);
- `MergePlanner._plan`: check the config, let mergekit plan, then run the
  statistics pass on the planned tasks (`pipeline.prepare`);
- `MergePlanner.plan_to_disk`: refuse an output folder inside an input model,
  drop a stale `ram_stats.json` there, and queue the new one;
- `mergekit.merge.generate_card`: append the "RAM+ statistics" section;
- `mergekit.scripts.merge_raw_pytorch.plan_flat_merge` (`mergekit-pytorch`, whose `main` looks it up
  in its module when it runs): a `ramplus` config is planned as one
  `MergeSession` on the same pipeline (`pipeline.plan_flat`): input files and the output folder
  checked, statistics counted, rho in every task, `ram_stats.json` a task after the model;
- `ramplus._execute` (mergekit's `GroupMergeMethod._execute`, on our method object only):
  hand the dtype a tensor is written in to the kernel, which rounds once, to it.

A `ramplus` merge also ends by removing the weight files an earlier merge left in its output
folder (`output_checks`); another method's merge removes only a stale `ram_stats.json` of an
earlier `ramplus` merge there, and `merge_method: ramplus` owned by another package is refused.

`install` also makes an uncaught error of ours one line on stderr (`one_line_errors`, `errors`).
`install` patches only after `surface` accepted the installed mergekit (`surface.check_prepass`, which
keeps the verdict); otherwise it logs why, and `ramplus` with r > 0 says so when it needs rho.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mergekit_ram import errors, method, output_checks, report, session
from mergekit_ram._mergekit import pipeline, surface, tasks
from mergekit_ram.method import resolves_to_ours

LOG = logging.getLogger("mergekit_ram")


def install() -> None:
    """Wrap the planner (and, once loaded, mergekit.merge). Idempotent."""
    from mergekit.plan import MergePlanner

    one_line_errors()
    method.ask_why_prepass_unavailable(surface.unavailable_reason)
    if not surface.marked(MergePlanner._plan, surface.HOOKED):
        try:
            surface.check_prepass()
        except surface.IncompatibleMergekit as error:
            LOG.warning("mergekit-ram: global RAM+ pre-pass disabled: %s", error)
            return
        wrap(MergePlanner, "_plan", _plan)
        wrap(MergePlanner, "plan_to_disk", _plan_to_disk)
        round_once(method.ramplus)
    install_merge()


def install_merge() -> None:
    """Wrap `run_merge` and `generate_card` of `mergekit.merge`, once it is loaded. Idempotent."""
    import sys

    merge: Any = sys.modules.get("mergekit.merge")  # not imported here: it loads torch and transformers
    run_merge = getattr(merge, "run_merge", None)
    if run_merge is None or surface.marked(run_merge, surface.HOOKED):
        return  # not loaded, still loading (its load hook calls us again), or done
    try:
        surface.check(surface.MERGE)
    except surface.IncompatibleMergekit as error:
        LOG.warning("mergekit-ram: ram_stats.json written by the planner, no card section, no inspect: %s", error)
        return
    surface.wrap(merge, "run_merge", _run_merge, surface.HOOKED)
    if getattr(merge, "generate_card", None) is not None:
        surface.wrap(merge, "generate_card", _generate_card, surface.HOOKED)


def install_flat() -> None:
    """Wrap `plan_flat_merge` of `mergekit.scripts.merge_raw_pytorch` (`mergekit-pytorch`), once it is loaded.
    Idempotent; patches nothing when the names the pre-pass or this door need have changed."""
    import sys

    module: Any = sys.modules.get("mergekit.scripts.merge_raw_pytorch")  # loaded by mergekit-pytorch only
    plan_flat_merge = getattr(module, "plan_flat_merge", None)
    if plan_flat_merge is None or surface.marked(plan_flat_merge, surface.HOOKED):
        return
    method.ask_why_prepass_unavailable(surface.unavailable_reason)
    try:
        surface.check_prepass()
        surface.check(surface.FLAT)
    except surface.IncompatibleMergekit as error:
        LOG.warning("mergekit-ram: RAM+ statistics pre-pass disabled for mergekit-pytorch: %s", error)
        return
    surface.wrap(module, "plan_flat_merge", _plan_flat_merge, surface.HOOKED)
    round_once(method.ramplus)


def _plan_flat_merge(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def plan_flat_merge(
        config: Any, out_path: str, tensor_union: bool, tensor_intersection: bool, options: Any
    ) -> list[Any]:
        if not resolves_to_ours(config.merge_method):
            method.refuse_foreign(config.merge_method)  # `ramplus` owned by another package
            output_checks.remove_foreign_statistics(out_path)
            return original(config, out_path, tensor_union, tensor_intersection, options)
        return pipeline.plan_flat(original, config, out_path, tensor_union, tensor_intersection, options)

    return plan_flat_merge


def _run_merge(run_merge: Callable[..., Any]) -> Callable[..., Any]:
    def run_merge_wrapper(merge_config: Any, *args: Any, **kwargs: Any) -> Any:
        if not resolves_to_ours(merge_config.merge_method):
            method.refuse_foreign(merge_config.merge_method)  # `ramplus` owned by another package
            output_checks.remove_foreign_statistics(args[0] if args else kwargs.get("out_path"))
            return run_merge(merge_config, *args, **kwargs)
        return pipeline.merge(run_merge, merge_config, *args, **kwargs)

    return run_merge_wrapper


def _generate_card(card: Callable[..., str]) -> Callable[..., str]:
    def generate_card(config: Any, *args: Any, **kwargs: Any) -> str:
        text: str = card(config, *args, **kwargs)
        current = session.current()
        if current is None or not current.owns(config) or current.report is None:
            return text
        snapshots = [report.hub_id(str(m.model.path)) for m in config.referenced_models()]
        text = report.card_front_matter(text, [found for found in snapshots if found])
        return text.rstrip("\n") + "\n\n" + report.card_section(current.report)

    return generate_card


def _session_for(planner: Any) -> session.MergeSession:
    """The merge session `planner` belongs to; a new one for a planner driven directly (not from run_merge)."""
    current = session.current()
    if current is None or not current.owns(planner.config):
        current = pipeline.merge_session(planner.config, planner.options)
    return current


def _plan(original: Callable[[Any], None], planner: Any) -> None:
    if not resolves_to_ours(planner.config.merge_method):
        return original(planner)
    current = _session_for(planner)
    with session.active(current):
        pipeline.check_config(current)
        original(planner)
        pipeline.prepare(tasks.of_planner(planner), current)


def _plan_to_disk(original: Callable[[Any, str], list[Any]], planner: Any, out_path: str) -> list[Any]:
    if not resolves_to_ours(planner.config.merge_method):
        return original(planner, out_path)
    current = _session_for(planner)
    with session.active(current):
        output_checks.check_output(planner.config, out_path)
        output_checks.remove_stale_statistics(out_path)
        planned = original(planner, out_path)
        if current.report is not None:
            pipeline.queue_statistics(current, planned, out_path)
    return planned


def round_once(merge_method: Any) -> None:
    """Hand the dtype mergekit writes a tensor in to the kernel (`session.out_dtype`), so it rounds once.

    mergekit's `GroupMergeMethod._execute` computes in the input dtype and casts the result to
    `out_dtype`: bfloat16 inputs with `out_dtype: float32` would be rounded to bfloat16 first.
    Only this method object's `_execute` is wrapped (an attribute of our own instance).
    """

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _execute(*args: Any, out_dtype: Any = None, **kwargs: Any) -> Any:
            with session.writing(out_dtype):
                return original(*args, out_dtype=out_dtype, **kwargs)

        return _execute

    surface.wrap(merge_method, "_execute", make, surface.HOOKED)


def one_line_errors() -> None:
    """mergekit's commands catch no error, so Python prints a traceback for ours, its useful sentence last:
    `sys.excepthook` prints a `RamError` as one line instead (`errors.excepthook`; `-v` or
    `MERGEKIT_RAM_TRACEBACK=1` shows the traceback). Every other exception, one raised from a RamError
    included, goes to the hook that was there, and every exception does when that hook is a program's own."""
    import sys

    surface.wrap(sys, "excepthook", errors.excepthook, surface.HOOKED)


def wrap(cls: type, name: str, replacement: Callable[..., Any]) -> None:
    """Replace `cls.name` by a call of `replacement(original, self, ...)`, marked as ours."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return replacement(original, self, *args, **kwargs)

        return wrapper

    surface.wrap(cls, name, make, surface.HOOKED)
