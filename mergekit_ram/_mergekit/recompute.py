"""`verify`'s recompute interface (`verify.recompute`) on mergekit: a recorded merge planned through its door and
run again, each tensor compared where mergekit would save it, or slice by slice for a sample.

`open` builds the door the record names (`door.of_record`: `mergekit_config.yml`, or mergekit-pytorch's recorded
config) and holds its session while verify plans (`Merge.planned`, mergekit's planner, downhill) and counts again
(`pipeline.prepare`, rho never read from the statistics cache). `Merge.compare` runs the plan on the executor
`run_merge` would use, a `CompareTensor` where mergekit plans a `SaveTensor` (cast to its dtype): it compares with
the published tensor (`PublishedTensor`, read through mergekit's loader), so the executor holds what a merge holds
(less: no output shard is buffered). For `--sample`, `Merge.compare_slices` runs each drawn tensor's own merge task
on the drawn elements of its inputs, read by byte ranges: a ramplus output entry depends only on the same entry of
the inputs and on lambda, so `ExecuteMergeMethodTask.execute` given flat slices computes exactly those entries of
the merged tensor (the same dtype alignment, method, rounding and cast as a merge). A task is sliced only where that
holds (`_whole`): its inputs are read as stored (`GatherTensors`, or mergekit-pytorch's plain loads), from
safetensors files, under the output's name or an alias, every input holding it in one shape; anything else (a
vocabulary mapped by row through a union tokenizer, a pickled input, a tensor copied or converted under another
name) is checked whole, and the verdict says why.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from mergekit_ram import errors, files
from mergekit_ram._mergekit import comparing, counting, door, door_yaml, loading, methods, pipeline, surface, tasks
from mergekit_ram.core import cache, statistics
from mergekit_ram.errors import InputError, NonFiniteResultError
from mergekit_ram.method import NAME, refuse_foreign, resolves_to_ours
from mergekit_ram.session import Mode, active
from mergekit_ram.verify import any_method, bitwise, recompute, record_checks, sample, verdict

#: why a tensor of a pickled published merge (`pytorch_model.bin`) is checked whole
PICKLED = "the published merge is a pickle, which has no byte ranges"


class Mergekit:
    """`verify.recompute.Recompute` on mergekit 0.1.5 (the one instance: `MERGEKIT`)."""

    def check_method(self) -> None:
        refuse_foreign(NAME)

    def missing(self, entry_point: str | None) -> list[str]:
        names = door.DOORS.get(str(entry_point), door.DOORS["run_merge"]).names
        return surface.problems(surface.PREPASS) + surface.problems(names) + surface.problems(surface.VERIFY)

    def config_record(self, folder: str) -> dict:
        """What a folder without ram_stats.json records: its `mergekit_config.yml`'s method and inputs (in the
        config's order, base first), with no identity (`door_yaml.config_record`)."""
        return door_yaml.config_record(folder)

    @contextlib.contextmanager
    def open(
        self, folder: str, recorded: dict, record: dict, options: Any, copies: Mapping[str, str]
    ) -> Iterator[MergekitMerge]:
        loading.install()
        through = door.of_record(folder, recorded, record, options, dict(copies))
        surface.forget_loaders([comparing.reference(folder)])  # read as the files are now
        merge = MergekitMerge(through, folder, recorded)
        with active(merge.session):
            try:
                if resolves_to_ours(getattr(through.config, "merge_method", NAME)):  # another method's: mergekit's
                    pipeline.check_config(merge.session)
            except ValueError as error:
                raise InputError(f"{through.where}: {error}") from error
            try:
                through.check_files()  # before anything opens one: no FIFO or device is read
            except ValueError as error:
                raise errors.Unreadable(str(error)) from error
            yield merge


MERGEKIT = Mergekit()


class MergekitMerge:
    """`verify.recompute.Merge` through one of mergekit's doors (`door.Door`)."""

    def __init__(self, through: door.Door, folder: str, recorded: dict):
        self.through, self.folder, self.recorded = through, folder, recorded
        self.labels, self.planned_from = through.labels, through.planned_from
        self.index = comparing.published_index(folder)
        self.names = record_checks.recorded_labels(recorded, through.labels)
        self.session = through.session(Mode.VERIFY, labels=self.names)
        if recorded.get(record_checks.CONFIG_ONLY):  # mergekit's own union order: the one the folder holds
            self.session.vocabulary = any_method.published_vocabulary(folder)
        self.headers = files.Headers()
        self._models = through.models()
        self._plan: tasks.Plan | None = None

    @property
    def plan(self) -> tasks.Plan:
        if self._plan is None:
            self._plan = self.through.plan()
        return self._plan

    def identity(self, name: str, seen: dict[str, dict]) -> dict | None:
        model = self._models.get(name)
        return None if model is None else self.through.identity(model, seen)

    def planned(self) -> dict:
        try:
            found = pipeline.plan_report(self.plan, self.names)
        except (OSError, ValueError) as error:
            raise InputError(errors.said(error)) from error
        return record_checks.as_recorded(found, self.labels)

    def prepare(self, seen: dict[str, dict], given: recompute.Given | None, count: bool) -> tuple[dict, Any, str]:
        def recorded(planned: list[Any]) -> tuple[statistics.Statistics | None, str]:
            assert given is not None
            agents = [str(m) for m in tasks.agents(planned[0])]
            epsilons = {t.output_weight.name: t.parameters["epsilon"] for t in planned}
            return given(agents, epsilons, bool(tasks.needing_rho(planned)))

        try:
            pipeline.prepare(self.plan, self.session, seen, None if given is None else recorded, count=count)
        except (OSError, ValueError) as error:
            raise InputError(errors.said(error)) from error
        assert self.session.report is not None
        return self.session.report, self.session.stats, self.session.source

    def _ours(self) -> list[Any]:
        return [task for _, task in tasks.planned(self.plan, resolves_to_ours)]

    def parameters(self, name: str) -> Mapping[str, Any]:
        return next(task.parameters for task in self._ours() if task.output_weight.name == name)

    def shapes(self) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        shapes, whole = {}, {}
        for name, task, _optional, _dtype in self.plan.saves():
            shape = self._planned_shape(task, name)
            shapes[name] = (_numel(shape), _numel(list(shape or [1])[1:]))
            published = self.index.get(name, "")  # a merge written with --no-safe-serialization: no byte ranges
            why = PICKLED if published and not published.endswith(".safetensors") else self._whole(task)
            if why is not None:
                whole[name] = why
        return shapes, whole

    def _planned_shape(self, task: Any, name: str) -> list[int] | None:
        """The shape of tensor `name` as the merge plans it: its inputs' (`_input_shape`), else the published
        header's, else None."""
        shape = self._input_shape(task)
        if shape is None and name in self.index:
            shape = self.headers.stored(os.path.join(self.folder, self.index[name]), name)[1]
        return shape

    def _input_shape(self, task: Any) -> list[int] | None:
        """The shape of the tensor a merge task reads from its base (else its first input), from the file's header;
        None where mergekit hands the task other rows than the inputs store (`Plan.reshapes`)."""
        if self.plan.reshapes(task):
            return None
        try:
            found = self.plan.sources(task)
        except Exception:  # a task that reads no input (a copied buffer's wrapper): the published header says
            return None
        base = str(getattr(task, "base_model", ""))
        for model in sorted(found, key=lambda m: m != base):
            shape = self.headers.stored(*found[model])[1]
            if shape is not None:
                return shape
        return None

    def _whole(self, task: Any) -> str | None:
        """Why the tensor `task` makes cannot be recomputed slice by slice (None: it can)."""
        from mergekit.io.tasks import GatherTensors
        from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper

        if not isinstance(task, ExecuteMergeMethodTask):
            return f"made by {type(task).__name__}, not by a merge method's task"
        if not resolves_to_ours(task.method_name) and not methods.sliceable(task):
            return f"{task.method_name} merges it from the whole tensor (a sort, a norm or an angle over it)"
        gather = task.gather_tensors
        if not isinstance(gather, (GatherTensors, TensorDictWrapper)):
            return f"mergekit maps its rows ({type(gather).__name__}: a vocabulary aligned through the tokenizer)"
        try:
            found = self.plan.sources(task)
        except Exception as error:
            return f"its inputs cannot be located ({type(error).__name__})"
        if len(found) != len(task.model_order):
            return "an input does not store it under its name (mergekit loads it tied, converted or not at all)"
        if any(not path.lower().endswith(".safetensors") for path, _ in found.values()):
            return "an input is a pickle, which has no byte ranges"
        stored = {tuple(self.headers.stored(path, name)[1] or ()) for path, name in found.values()}
        if len(stored) != 1 or not next(iter(stored)):
            return "its inputs store it in different shapes (the merge names the mismatch)"
        return None

    def needed(self, drawn: sample.Sample, seen: dict[str, dict]) -> recompute.Spans:
        ranges: recompute.Spans = {}

        def add(path: str, name: str | None = None, within: list[tuple[int, int]] | None = None) -> None:
            path = os.path.realpath(path)
            if not path.endswith(".safetensors"):
                ranges.setdefault(path, set()).add((0, os.path.getsize(path)))
                return
            start, _ = self.headers.get(path)
            ranges.setdefault(path, set()).add((0, start))
            placed = self.headers.span(path, name) if name is not None else None
            if placed is not None and name is not None:
                first, last = placed
                if within is None:  # the whole tensor
                    ranges[path].add((first, last))
                    return
                size = (last - first) // max(1, _numel(self.headers.entry(path, name).get("shape")))
                ranges[path].update((min(last, first + a * size), min(last, first + b * size)) for a, b in within)

        for file in sorted(set(self.index.values())):  # ranges fetched, and a damaged file named, in one order
            add(os.path.join(self.folder, file))
        for identity in seen.values():
            for path, size in _identity_files(identity):
                add(path)
                for start in cache.sample_offsets(size):
                    ranges.setdefault(os.path.realpath(path), set()).add((start, min(size, start + cache.SAMPLE)))
        cuts = {s.name: s for s in drawn.slices}
        for name, task, _optional, _dtype in self.plan.saves():
            cut = cuts.get(name)
            if cut is None:
                continue
            within = None if cut.whole is not None else cut.spans()
            if name in self.index:
                add(os.path.join(self.folder, self.index[name]), name, within)
            try:
                found = self.plan.sources(task)
            except Exception:
                continue
            for path, tensor in found.values():
                add(path, tensor, within)
        return ranges

    def compare_slices(self, drawn: sample.Sample, outcome: verdict.Outcome) -> dict[str, statistics.TensorCounts]:
        from mergekit.common import dtype_from_name

        slices = {s.name: s for s in drawn.slices if s.whole is None}
        counted: dict[str, statistics.TensorCounts] = {}
        for name, task, _optional, dtype in self.plan.saves():
            cut = slices.get(name)
            if cut is None:
                continue
            if name not in self.index:
                outcome.add(bitwise.Difference(name, "missing"))
                continue
            spans, found, inputs = cut.spans(), self.plan.sources(task), {}
            for model in task.model_order:
                tensor = comparing.read(*found[str(model)], spans, self.headers)
                wanted = dtype_from_name(_cast(task, model))
                inputs[model] = tensor if wanted is None else tensor.to(dtype=wanted)
            published = os.path.join(self.folder, self.index[name])
            first = task.base_model if task.base_model is not None else task.model_order[0]  # linear has no base
            planned = [int(n) for n in comparing.stored_entry(*found[str(first)], self.headers)["shape"]]
            mismatch = comparing.published_mismatch(published, name, planned, dtype, self.headers)
            if mismatch is not None:
                outcome.add(mismatch)
                continue
            try:
                merged = task.execute(tensors=inputs)
            except errors.NonFiniteResultError as error:
                detail = f"{error} (in its slice; verify stopped here, as the merge does)"
                outcome.add(bitwise.Difference(name, "not finite", detail=detail))
                return counted
            if merged is not None and dtype:
                merged = merged.to(dtype=dtype_from_name(dtype))
            outcome.add(bitwise.compare(name, merged, comparing.read(published, name, spans, self.headers)))
            if not resolves_to_ours(task.method_name):  # another method counts nothing
                continue
            counts = counting.CountTask(merge_task=task).execute(tensors=inputs)
            if counts is not None:
                counted[name] = counts
        return counted

    def rounding(self) -> tuple[int | None, str] | None:
        method = str(getattr(self.through.config, "merge_method", ""))
        return None if resolves_to_ours(method) else methods.LAST_BITS.get(method)

    def random(self) -> dict[str, str]:
        drawing = {}
        for name, task, _optional, _dtype in self.plan.saves():
            method = methods.method_of(task)
            if method is None or resolves_to_ours(method) or not methods.draws_random(task, None):
                continue  # None: drawing for some size; a method that draws for none needs no shape read
            shape = self._planned_shape(task, name)
            if methods.draws_random(task, None if shape is None else _numel(shape)):
                drawing[name] = method
        return drawing

    def planned_numels(self) -> dict[str, int]:
        out = {}
        for task in self._ours():
            name = task.output_weight.name
            shape = self._planned_shape(task, name)
            if shape is not None:
                out[name] = _numel(shape)
        return out

    def count_again(self, names: Collection[str], labels: Mapping[str, str]) -> dict[str, dict | None]:
        planned = self._ours()
        tied = tasks.tied_copies(self.plan.out_model_config, planned)
        wanted = [t for t in planned if t.output_weight.name in names and t.output_weight.name not in tied]
        if not wanted:
            return {}
        agents = [str(m) for m in tasks.agents(wanted[0])]
        found = statistics.Statistics(agents, counting.count(self.plan.options, wanted)).to_json(dict(labels))
        counted = {row["name"]: row for row in found}
        return {t.output_weight.name: counted.get(t.output_weight.name) for t in wanted}

    def compare(self, outcome: verdict.Outcome, only: Collection[str] | None = None) -> None:
        seed = getattr(self.through.options, "random_seed", None)
        if seed is not None:  # as run_merge seeds before its executor runs: each task then draws what it drew
            import transformers

            transformers.trainer_utils.set_seed(seed)
        saves = self.plan.saves()
        targets = [comparing.compare_task(self.folder, *save) for save in saves if only is None or save[0] in only]
        planned = {save[0] for save in saves}
        try:
            for _task, value in counting.run_as_merge(targets, self.through.options, desc="Verifying"):
                if isinstance(value, bitwise.Difference):
                    planned.add(value.name)
                    outcome.add(value)
        except NonFiniteResultError as error:  # the merge stops there, writing nothing: the folder holds it refused
            name = error.tensor or "?"
            detail = f"{error} (verify stopped here, as the merge does)"
            outcome.add(bitwise.Difference(name, "not finite", detail=detail))
            outcome.merged = True
            return
        except (OSError, RuntimeError, ValueError, KeyError) as error:  # what stops a merge stops its recomputation
            raise InputError(f"recomputing the merge failed: {errors.said(error)}") from error
        for name in sorted(set(self.index) - planned):
            outcome.add(bitwise.Difference(name, "extra", detail=f"in {self.index[name]}"))
        for name, why in sorted(record_checks.stray_tensors(self.folder, self.index).items()):
            if name not in self.index:
                outcome.add(bitwise.Difference(name, "extra", detail=why))
        outcome.merged = True

    def beside(self) -> dict[str, Any]:
        return self.through.published(self.plan)


def _numel(shape: list[int] | None) -> int:
    count = 1
    for size in shape or [1]:
        count *= int(size)
    return count


def _identity_files(identity: dict) -> list[tuple[str, int]]:
    """(path, size) of each file whose windows an input's identity samples (`cache`: a folder's safetensors files,
    or the single file of a `mergekit-pytorch` input)."""
    path, named = identity.get("path") or "", identity.get("files") or {}
    if os.path.isfile(path):
        return [(path, int(entry["size"])) for entry in named.values()]
    return [(os.path.join(path, n), int(e["size"])) for n, e in named.items() if n.endswith(".safetensors")]


def _cast(task: Any, model: Any) -> str | None:
    """The dtype mergekit's load of `model`'s tensor casts to (None: as stored)."""
    gather = task.gather_tensors
    loads = getattr(gather, "tensors", None)
    if loads is not None:  # mergekit-pytorch: each input's own load
        return getattr(loads[model], "dtype", None)
    return getattr(gather, "dtype", None)
