"""Every mergekit name mergekit-ram uses, and the one guard that checks them all.

mergekit has no stable plugin API for what RAM+ needs (a whole-model pre-pass),
so the seam relies on names that a new mergekit may move or change. They are
all listed in `NAMES`, each with what breaks without it. `check()` resolves
every one against the installed mergekit (the version, each attribute, method
and task field, and the source of each function `loading` mirrors) and says
precisely what changed; `hooks.install` patches nothing the guard rejects.

The private attributes of mergekit's objects are read and written here only
(`planned`, `replace_planned`), and so are our wrappers' marks and what they wrap
(`wrap`, `unwrapped`, `plan_as_mergekit`, `plan_flat_as_mergekit`), so a new
mergekit means reading one module. `mergekit-pytorch`'s names (`RAW_PYTORCH`) are checked
when its module loads, before its planner is wrapped.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mergekit_ram._mergekit.options import FIELDS
from mergekit_ram.errors import IncompatibleMergekit as IncompatibleMergekit
from mergekit_ram.reporting import versions

SUPPORTED = (0, 1, 5), (0, 2, 0)
SUPPORTED_TEXT = ">=0.1.5,<0.2"

PREPASS = "prepass"  # the statistics pass and rho injection (checked when mergekit.plan loads)
MERGE = "merge"  # run_merge's wrapper, the card, inspect's preamble (checked when mergekit.merge loads)
RAW_PYTORCH = "raw_pytorch"  # mergekit-pytorch's planner wrapped, its tasks read (checked when its module loads)
LOADING = "loading"  # linear-time tensor loading (only a speed-up: mergekit's own loading is used without it)
PUBLIC = "public"  # mergekit's public API (method definition, CLI options)
VERIFY = "verify"  # `mergekit-ram verify`: a merge planned again, compared instead of saved


@dataclass(frozen=True)
class Name:
    """One mergekit name: `module`, dotted `attribute` path in it, what needs it.

    `kind`: "object" (must exist), "field" (a pydantic field of the class), "annotation"
    (a class-level annotation, i.e. an instance attribute), or "source" (the function's
    source must hash to `sha`: `loading` mirrors its body).
    """

    module: str
    attribute: str
    needed_for: str
    kind: str = "object"
    sha: str | None = None

    @property
    def label(self) -> str:
        return f"{self.module}.{self.attribute}"


def _fields(cls: str, module: str, names: str, needed_for: str = PREPASS) -> list[Name]:
    return [Name(module, f"{cls}.{n}", needed_for, "field") for n in names.split()]


def _objects(module: str, names: str, needed_for: str) -> list[Name]:
    return [Name(module, n, needed_for) for n in names.split()]


_PLAN = "mergekit.plan"
_TASKS = "mergekit.io.tasks"
_ADAPTER = "mergekit.merge_methods.task_adapter"
_CONVERSION = "mergekit.architecture.conversion"
_RAW = "mergekit.scripts.merge_raw_pytorch"

NAMES: tuple[Name, ...] = (
    # the planner: wrapped, and read/written between planning and execution
    Name(_PLAN, "MergePlanner", PREPASS),
    Name(_PLAN, "MergePlanner._plan", PREPASS),
    Name(_PLAN, "MergePlanner.plan_to_disk", PREPASS),
    Name(_PLAN, "MergePlanner._tensors", PREPASS, "annotation"),
    Name(_PLAN, "MergePlanner.config", PREPASS, "annotation"),
    Name(_PLAN, "MergePlanner.options", PREPASS, "annotation"),
    # the planned merge tasks: what is counted, and where rho goes
    Name(_ADAPTER, "ExecuteMergeMethodTask", PREPASS),
    *_fields(
        "ExecuteMergeMethodTask",
        _ADAPTER,
        "method_name gather_tensors model_order base_model output_weight parameters input_parameters dtype out_dtype",
    ),
    Name(_PLAN, "MergePlanner.out_model_config", PREPASS, "annotation"),
    Name("mergekit.architecture.base", "WeightInfo.tied_names", PREPASS, "field"),
    Name("mergekit.architecture.base", "WeightInfo.force_dtype", PREPASS, "field"),
    # out_dtype reaches the method's `_execute` (wrapped per method object, so the kernel rounds once)
    Name("mergekit.merge_methods.base", "GroupMergeMethod._execute", PREPASS),
    Name(_ADAPTER, "TensorDictWrapper", PREPASS),
    # running the count tasks on mergekit's own executors
    *_objects("mergekit.graph", "Task Executor", PREPASS),
    Name("mergekit.multigpu_executor", "MultiGPUExecutor", PREPASS),
    *_objects(_TASKS, "LoaderCache GatherTensors FinalizeModel", PREPASS),
    *_objects("mergekit.merge_methods", "TensorEntry TensorMetadata", PREPASS),
    Name("mergekit.merge_methods.dtype", "align_dtype", PREPASS),
    *_objects("mergekit.common", "dtype_from_name ImmutableMap", PREPASS),
    # mergekit-pytorch: its planner wrapped (and called by `inspect`), its tasks read and rebuilt with rho
    Name(_RAW, "plan_flat_merge", RAW_PYTORCH),
    Name(_RAW, "RawPyTorchMergeConfig", RAW_PYTORCH),
    *_fields("RawPyTorchMergeConfig", _RAW, "merge_method models base_model parameters dtype out_dtype", RAW_PYTORCH),
    Name(_RAW, "SimpleLoadTensor", RAW_PYTORCH),
    *_fields("SimpleLoadTensor", _RAW, "model tensor_name dtype", RAW_PYTORCH),
    Name(_RAW, "SimpleLoaderCache", RAW_PYTORCH),
    Name(_TASKS, "SaveTensor", RAW_PYTORCH),
    *_fields("SaveTensor", _TASKS, "tensor_task", RAW_PYTORCH),
    *_fields("FinalizeModel", _TASKS, "tensor_save_tasks", RAW_PYTORCH),
    *_fields("TensorDictWrapper", _ADAPTER, "tensors", RAW_PYTORCH),
    # run_merge's preamble (for `inspect`) and the wrapped card / run_merge
    *_objects("mergekit.merge", "run_merge generate_card _model_out_config", MERGE),
    Name("mergekit.architecture", "get_architecture_info", MERGE),
    # the card asks the Hub whether a model that is a local folder is also a repository: not in a ramplus merge
    Name("mergekit.card", "is_hf", MERGE),
    # a union tokenizer numbers its new tokens in the order each tokenizer lists them: fixed in a ramplus merge
    Name("mergekit.tokenizer.build", "build_union_tokenizer", MERGE),
    # a hub id the Hub cannot be asked about, read from the Hub cache in a ramplus merge (`hub_ids`)
    Name("mergekit.common", "ModelReference.local_path", MERGE),
    # fast loading: functions whose bodies `loading` mirrors, hashed
    Name("mergekit.io.lazy_tensor_loader", "LazyTensorLoader.get_tensor", LOADING, "source", "dd0df1e785f47b7b"),
    Name(_TASKS, "LoadTensor._load_converted_tensor", LOADING, "source", "ee2a16e7a15ea57d"),
    Name(_CONVERSION, "convert_checkpoint_tensors", LOADING, "source", "f964df0da40aa892"),
    Name(_CONVERSION, "_iter_transform_matches", LOADING, "source", "6a2c25a7002bc389"),
    Name(_CONVERSION, "_expanded_target_keys", LOADING, "source", "8eab3e6797ca04ad"),
    Name("mergekit.io.loader", "TensorLoader", LOADING),
    # verify: hub ids pinned to a recorded revision, the published weights read (mergekit-pytorch: RAW_PYTORCH too)
    *_objects("mergekit.common", "ModelReference ModelPath", VERIFY),
    Name(_TASKS, "LoaderCache.loaders", VERIFY, "annotation"),
    # verify --sample: a merge task run on its inputs' slices, loaded as the task's load would cast them
    Name(_ADAPTER, "ExecuteMergeMethodTask.execute", VERIFY),
    *_fields("GatherTensors", _TASKS, "dtype", VERIFY),
    # public API: the method definition, registration, the CLI
    Name("mergekit", "merge_methods", PUBLIC),
    *_objects(
        "mergekit.merge_methods",
        "merge_method register registered_methods get BasePolicy InputContract PerNonBase TensorGroup",
        PUBLIC,
    ),
    Name("mergekit.config", "MergeConfiguration", PUBLIC),
    *_objects("mergekit.options", "MergeOptions add_merge_options", PUBLIC),
    *_fields("MergeOptions", "mergekit.options", " ".join(FIELDS), PUBLIC),  # the flags of inspect and verify
)


def fingerprint(function: Any) -> str:
    """sha256 prefix of a function's source (the `sha` of a "source" Name)."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def resolve(name: Name) -> Any:
    """The object `name` refers to (for a field or annotation: its class)."""
    target: Any = importlib.import_module(name.module)
    parts = name.attribute.split(".")
    if name.kind in ("field", "annotation"):
        parts = parts[:-1]
    for part in parts:
        target = getattr(target, part)
    return getattr(target, "__wrapped__", target) if name.kind == "source" else target


def problems(needed_for: str | None = None) -> list[str]:
    """What is missing or changed in the installed mergekit, one line each (empty: all fine)."""
    found: list[str] = []
    installed = versions.installed("mergekit")
    numbers = tuple(int(p) for p in installed.split(".")[:3] if p.isdigit())
    if not (SUPPORTED[0] <= numbers < SUPPORTED[1]):
        found.append(f"mergekit {installed} is installed; mergekit-ram supports mergekit{SUPPORTED_TEXT}")
    for name in NAMES:
        if needed_for is not None and name.needed_for != needed_for:
            continue
        try:
            target = resolve(name)
        except (ImportError, AttributeError) as error:
            found.append(f"{name.label} is gone ({type(error).__name__}: {error})")
            continue
        last = name.attribute.split(".")[-1]
        if name.kind == "field" and last not in getattr(target, "model_fields", {}):
            found.append(f"{name.label}: no such task field")
        elif name.kind == "annotation" and not any(last in getattr(c, "__annotations__", {}) for c in target.__mro__):
            found.append(f"{name.label}: no such attribute")
        elif name.kind == "source":
            try:
                sha = fingerprint(target)
            except (OSError, TypeError) as error:
                found.append(f"{name.label}: source unavailable ({error})")
                continue
            if sha != name.sha:
                found.append(f"{name.label} changed (source {sha}, expected {name.sha})")
    return found


def check(needed_for: str) -> None:
    """Raise IncompatibleMergekit listing every problem with the names `needed_for` needs."""
    found = problems(needed_for)
    if found:
        raise IncompatibleMergekit("mergekit changed what mergekit-ram relies on: " + "; ".join(found))


#: The verdict of `check_prepass` (process-wide, written there only): why the pre-pass is not installed.
_prepass_unavailable: str | None = None


def check_prepass() -> None:
    """`check(PREPASS)`, keeping its verdict for `unavailable_reason` (`hooks.install` asks before patching)."""
    global _prepass_unavailable
    try:
        check(PREPASS)
    except IncompatibleMergekit as error:
        _prepass_unavailable = str(error)
        raise
    _prepass_unavailable = None


def unavailable_reason() -> str | None:
    """Why the pre-pass could not be installed, or None when it is active or not tried yet."""
    return _prepass_unavailable


# --------------------------------------------------------------------------- #
# The private attributes themselves: read and written here only.
# --------------------------------------------------------------------------- #
def planned(planner: Any) -> list[tuple[Any, Any]]:
    """The planner's (WeightInfo, task) pairs, in planning order."""
    return planner._tensors


def replace_planned(planner: Any, index: int, task: Any) -> None:
    """Swap the task planned at `index` (its WeightInfo stays)."""
    weight, _ = planner._tensors[index]
    planner._tensors[index] = (weight, task)


def forget_loaders(models: Any) -> None:
    """Drop mergekit's loaders of `models` (ModelReferences) from its process-wide `LoaderCache`, so they are
    opened afresh: a loader keeps a file's index and open handle, which a rewrite of the file leaves stale."""
    from mergekit.io.tasks import LoaderCache

    for model in models:
        LoaderCache.loaders.pop(model, None)


def plan_as_mergekit(planner: Any) -> None:
    """mergekit's own planning of `planner` (its `_plan` without our wrapper): the tasks are planned, nothing
    of ours runs (`inspect` checks and counts itself, downhill)."""
    unwrapped(type(planner)._plan)(planner)


# --------------------------------------------------------------------------- #
# Our wrappers around mergekit's functions: marked, and what they wrap, here only.
# --------------------------------------------------------------------------- #
#: the marks of our wrappers: around the planner, run_merge, the card and `_execute` (`hooks`), and
#: around the two loader functions (`loading`)
HOOKED = "__mergekit_ram_prepass__"
DIVERTED = "__mergekit_ram_loading__"


def marked(function: Any, mark: str) -> bool:
    """Whether `function` is our wrapper marked `mark`."""
    return bool(getattr(function, mark, False))


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], mark: str) -> None:
    """Replace `owner.name` by `make(original)`, marked `mark` and wrapping the original (idempotent)."""
    original = getattr(owner, name)
    if marked(original, mark):
        return
    wrapper: Any = make(original)
    wrapper.__qualname__ = f"mergekit_ram[{original.__qualname__}]"
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)


def unwrapped(function: Any) -> Any:
    """`function` without our wrappers around it."""
    while marked(function, HOOKED) or marked(function, DIVERTED):
        function = function.__wrapped__
    return function


def plan_flat_as_mergekit(config: Any, tensor_union: bool, tensor_intersection: bool, options: Any) -> list[Any]:
    """mergekit-pytorch's own planning of `config` (`plan_flat_merge` without our wrapper) for `inspect`: the
    tasks are planned (into a writer that never runs), nothing of ours runs."""
    import os

    from mergekit.scripts.merge_raw_pytorch import plan_flat_merge

    return unwrapped(plan_flat_merge)(config, os.devnull, tensor_union, tensor_intersection, options)


def model_out_config(config: Any, arch_info: Any, options: Any) -> Any:
    from mergekit.merge import _model_out_config

    return _model_out_config(config, arch_info, trust_remote_code=options.trust_remote_code)
