"""The mode merge: the mergekit functions we wrap, each merge one body (`_merge`) over its door (`door_yaml`,
`door_pytorch`) on the door-free `pipeline` (other merge methods pass through).

- `mergekit.merge.run_merge`: a `ramplus` merge runs as one `MergeSession`
  (made current for this thread or task), checks its input files first, loads
  tensors in linear time (`loading`), and writes `ram_stats.json` last, after
  mergekit's config, card and tokenizer: its presence marks a finished merge,
  so an interrupted one (killed, disk full) never looks complete;
- `MergePlanner._plan`: check the config, let mergekit plan, then run the
  statistics pass on the planned tasks (`pipeline.prepare`);
- `MergePlanner.plan_to_disk`: refuse an output folder inside an input model,
  drop a stale `ram_stats.json` there, and queue the new one;
- `mergekit.merge.generate_card`: list the models in the config's order (`door_yaml.InConfigOrder`), write the
  front matter from the report and append the "RAM+ statistics" section;
- `mergekit.tokenizer.build.build_union_tokenizer`: a union's added tokens in one order (`tokenizer_order`);
- `ModelReference.local_path` and `mergekit.card.is_hf`, in a `ramplus` merge: `hub_ids`;
- `mergekit.scripts.merge_raw_pytorch.plan_flat_merge` (`mergekit-pytorch`, whose `main` looks it up
  in its module when it runs): a `ramplus` config is planned as one
  `MergeSession` on the same pipeline: input files and the output folder
  checked, statistics counted, rho in every task, `ram_stats.json` a task after the model;
- `ramplus._execute` (mergekit's `GroupMergeMethod._execute`, on our method object only):
  hand the dtype a tensor is written in to the kernel, which rounds once, to it.

A `ramplus` merge also ends by removing the weight files an earlier merge left in its output
folder (`output_checks`); another method's merge removes only a stale `ram_stats.json` of an
earlier `ramplus` merge there, and `merge_method: ramplus` owned by another package is refused.

`install` also makes an uncaught error of ours one line on stderr (`one_line_errors`, `errors`), and, in a command's
process, our warnings `mergekit-ram: warning: ...` lines; a `ramplus` merge silences transformers' `torch_dtype`
deprecation line (`errors.quiet_deprecated_dtype`).
`install` patches only after `surface` accepted the installed mergekit (`surface.check_prepass`, which
keeps the verdict); otherwise it logs why, and `ramplus` with r > 0 says so when it needs rho.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from mergekit_ram import errors, method, session
from mergekit_ram._mergekit import (
    door_pytorch,
    door_yaml,
    hub_ids,
    loading,
    pipeline,
    raw_pytorch,
    surface,
    tasks,
    tokenizer_order,
)
from mergekit_ram.checks import config_checks, output_checks
from mergekit_ram.method import resolves_to_ours
from mergekit_ram.reporting import card
from mergekit_ram.session import Mode

LOG = logging.getLogger("mergekit_ram")


def install() -> None:
    """Wrap the planner (and, once loaded, mergekit.merge). Idempotent."""
    from mergekit.plan import MergePlanner

    one_line_errors()
    errors.show_warnings_as_lines()
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
    hub_ids.install()  # hub ids offline from the Hub cache; the card's question about the Hub
    build: Any = sys.modules.get("mergekit.tokenizer.build")  # imported by mergekit.merge
    if build is not None and not surface.marked(build.build_union_tokenizer, surface.HOOKED):
        surface.wrap(build, "build_union_tokenizer", tokenizer_order.union_in_order, surface.HOOKED)


def install_flat() -> None:
    """Wrap `plan_flat_merge` of `mergekit.scripts.merge_raw_pytorch` (`mergekit-pytorch`), once it is loaded.
    Idempotent; patches nothing when the names the pre-pass or this door need have changed."""
    import sys

    module: Any = sys.modules.get("mergekit.scripts.merge_raw_pytorch")  # loaded by mergekit-pytorch only
    plan_flat_merge = getattr(module, "plan_flat_merge", None)
    if plan_flat_merge is None or surface.marked(plan_flat_merge, surface.HOOKED):
        return
    errors.show_warnings_as_lines()
    method.ask_why_prepass_unavailable(surface.unavailable_reason)
    try:
        surface.check_prepass()
        surface.check(surface.RAW_PYTORCH)
    except surface.IncompatibleMergekit as error:
        LOG.warning("mergekit-ram: RAM+ statistics pre-pass disabled for mergekit-pytorch: %s", error)
        return
    surface.wrap(module, "plan_flat_merge", _plan_flat_merge, surface.HOOKED)
    round_once(method.ramplus)


def _merge(door: Any, out_path: str | None, run: Callable[[session.MergeSession, Any], Any]) -> Any:
    """One `ramplus` merge through `door` (a `door.Door`) as one `MergeSession`, made current: the config, the
    device flags and the input files checked before any file is opened, tensors loaded in linear time;
    `run(current, before)` is the rest, as mergekit shapes it at this door (`before`: the output folder's weight
    files, for the removal of an earlier merge's stale ones)."""
    errors.quiet_deprecated_dtype()  # transformers' line mergekit causes, before mergekit reads a config
    current = door.session(Mode.MERGE)
    with session.active(current):
        pipeline.check_config(current)
        config_checks.check_devices(door.options)
        door.check_inputs()
        loading.install()  # linear-time tensor loading, while this session is current (fast_loading)
        return run(current, output_checks.weight_files(out_path))


def _run_merge(run_merge: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's `run_merge` merges inside: `_plan` counts and `_plan_to_disk` queues the statistics there; then
    an earlier merge's stale weights are removed and `ram_stats.json` is written, last."""

    def run_merge_wrapper(merge_config: Any, *args: Any, **kwargs: Any) -> Any:
        out_path = args[0] if args else kwargs.get("out_path")
        if not resolves_to_ours(merge_config.merge_method):
            method.refuse_foreign(merge_config.merge_method)  # `ramplus` owned by another package
            output_checks.remove_foreign_statistics(out_path)
            return run_merge(merge_config, *args, **kwargs)
        options = args[1] if len(args) > 1 else kwargs.get("options")
        config_source = args[2] if len(args) > 2 else kwargs.get("config_source")
        card = config_source is None and getattr(options, "write_model_card", False)

        def run(current: session.MergeSession, before: Any) -> Any:
            try:
                result = run_merge(merge_config, *args, **kwargs)
                output_checks.remove_stale_weights(out_path, before)
                for folder, payload in current.pending:  # last: the marker of a finished merge
                    pipeline.write_statistics(folder, payload)
                return result
            except BaseException as error:
                if out_path and os.path.isdir(out_path) and current.pending:
                    LOG.error(
                        "mergekit-ram: the merge into %s stopped (%s: %s); the folder holds an incomplete model "
                        "(a finished ramplus merge ends by writing %s)",
                        out_path,
                        type(error).__name__,
                        error,
                        output_checks.STATS_FILE,
                    )
                raise

        return _merge(door_yaml.YamlDoor(merge_config, options, run_merge=True, card=card), out_path, run)

    return run_merge_wrapper


def _plan_flat_merge(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """mergekit-pytorch's `plan_flat_merge` only plans (its `main` runs the tasks): the output folder checked, its
    stale `ram_stats.json` removed, planned by mergekit, counted (or from the cache), rho in every merge task, the
    table printed; `ram_stats.json` (and the removal of an earlier merge's stale weight files) a task after
    mergekit's `FinalizeModel`."""

    def plan_flat_merge(
        config: Any, out_path: str, tensor_union: bool, tensor_intersection: bool, options: Any
    ) -> list[Any]:  # mergekit's own signature: callers pass these by keyword
        if not resolves_to_ours(config.merge_method):
            method.refuse_foreign(config.merge_method)  # `ramplus` owned by another package
            output_checks.remove_foreign_statistics(out_path)
            return original(config, out_path, tensor_union, tensor_intersection, options)
        door = door_pytorch.PytorchDoor(config, options, tensor_union, tensor_intersection)

        def run(current: session.MergeSession, before: Any) -> list[Any]:
            output_checks.check_output_files(door.inputs(), out_path, getattr(options, "transformers_cache", None))
            output_checks.remove_stale_statistics(out_path)
            with raw_pytorch.planning(options):
                planned = original(config, out_path, door.tensor_union, door.tensor_intersection, options)
            plan = raw_pytorch.of_flat(
                planned, config, options, resolves_to_ours, intersection=door.tensor_intersection
            )
            pipeline.prepare(plan, current)
            to_run = plan.tasks()
            if current.report is not None:
                pipeline.queue_statistics(current, to_run, out_path, before)
            return to_run

        return _merge(door, out_path, run)

    return plan_flat_merge


def _generate_card(generate: Callable[..., str]) -> Callable[..., str]:
    def generate_card(config: Any, *args: Any, **kwargs: Any) -> str:
        current = session.current()
        if current is None or not current.owns(config) or current.report is None:
            return generate(config, *args, **kwargs)
        ordered = door_yaml.InConfigOrder(config)  # the same bytes for the same merge: no set's order
        text: str = generate(ordered, *args, **kwargs)
        text = card.card_front_matter(text, current.report)
        return text.rstrip("\n") + "\n\n" + card.card_section(current.report)

    return generate_card


def _session_for(planner: Any) -> session.MergeSession:
    """The merge session `planner` belongs to; a new one for a planner driven directly (not from run_merge)."""
    current = session.current()
    if current is None or not current.owns(planner.config):
        current = door_yaml.YamlDoor(planner.config, planner.options).session(Mode.MERGE)
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
        output_checks.check_output(planner.config, out_path, getattr(planner.options, "transformers_cache", None))
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
