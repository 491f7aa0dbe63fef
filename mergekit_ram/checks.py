"""Plan-time checks of a `ramplus` merge: errors before any weight is read, warnings about dtypes.

- `check_config`: one base model for the whole merge, and parameter names that
  `ramplus` knows, at a place where mergekit honours them (a misspelt or
  misplaced parameter would otherwise be silently ignored);
- `check_input_files`: every local input folder has a config.json and
  safetensors files whose headers are consistent with their size (a truncated
  download or a lying header is named before mergekit opens it);
- `check_stored_tensors`: every planned tensor is stored as a float of the
  base's shape in every model (an int8/quantized agent would otherwise be cast
  to the merge dtype and merged as garbage);
- `check_output`: the output folder is not inside an input model;
- `warn_stored_dtypes`: masks see tensors as loaded, so say when `dtype:` or
  an agent stored in another dtype than the base hides or inflates updates.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from typing import Any

from mergekit_ram import statistics
from mergekit_ram.method import ramplus

LOG = logging.getLogger("mergekit_ram")


def check_config(config: Any, *, parameters: bool = True) -> None:
    """Plan-time errors for what RAM+ cannot honour or would silently ignore."""
    bases = {config.base_model} if config.base_model else set()
    slices = list(config.slices or [])
    for module in (config.modules or {}).values():
        slices.extend(module.slices or [])
    bases.update(s.base_model for s in slices if s.base_model is not None)
    if not bases:
        raise ValueError("ramplus needs `base_model`: task vectors are measured against it")
    if len(bases) > 1:
        raise ValueError(
            "ramplus needs one base model for the whole merge (rho is counted over the whole model); "
            f"this config uses {len(bases)}: " + ", ".join(sorted(str(b) for b in bases))
        )
    if parameters:
        _check_parameter_names(config)


def _check_parameter_names(config: Any) -> None:
    shared = {p.name for p in ramplus.spec.shared_parameters}
    per_model = {p.name for p in ramplus.spec.input_parameters}
    places: list[tuple[str, dict | None, bool]] = [("parameters", config.parameters, True)]
    for i, m in enumerate(config.models or []):
        places.append((f"models[{i}] ({m.model}).parameters", m.parameters, False))
    groups = [("", config.slices or [])] + [
        (f"modules.{name}.", module.slices or []) for name, module in (config.modules or {}).items()
    ]
    for name, module in (config.modules or {}).items():
        places.append((f"modules.{name}.parameters", module.parameters, True))
        for i, m in enumerate(module.models or []):
            places.append((f"modules.{name}.models[{i}] ({m.model}).parameters", m.parameters, False))
    for prefix, slices in groups:
        for i, s in enumerate(slices):
            places.append((f"{prefix}slices[{i}].parameters", s.parameters, True))
            for j, src in enumerate(s.sources):
                places.append((f"{prefix}slices[{i}].sources[{j}] ({src.model}).parameters", src.parameters, False))
    for where, params, allows_shared in places:
        for key in params or {}:
            if key in per_model or (allows_shared and key in shared):
                _check_value(key, (params or {})[key], where)
                continue
            if key in shared:
                raise ValueError(
                    f"ramplus parameter '{key}' is set under {where}, where mergekit ignores it: it is "
                    f"shared by all models; put it under the top-level `parameters:` (filters allow per-tensor values)"
                )
            close = difflib.get_close_matches(key, sorted(shared | per_model), n=1, cutoff=0.6)
            if close:
                raise ValueError(f"unknown ramplus parameter '{key}' under {where}; did you mean '{close[0]}'?")
            LOG.warning(
                "ramplus: parameter '%s' under %s is not a ramplus parameter and is ignored "
                "(ramplus takes %s; per model: %s)",
                key,
                where,
                ", ".join(sorted(shared)),
                ", ".join(sorted(per_model)),
            )


# bytes per element of the safetensors dtypes we check sizes for (others: left to safetensors)
_WIDTHS = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MAX_HEADER = 100_000_000  # safetensors' own limit


def check_input_files(config: Any) -> None:
    """Refuse local input folders mergekit would fail on obscurely, naming the file."""
    for model in config.referenced_models():
        path = model.model.path
        if not os.path.isdir(path):
            continue  # a hub id: mergekit resolves (and validates) it
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"input model {path} has no config.json (an incomplete download or copy?)")
        files = _safetensors_files(path)
        for file in files:
            check_safetensors(file)
        pickle = os.path.join(path, "pytorch_model.bin")
        if not files and os.path.isfile(pickle):
            check_pickle(pickle)


def check_pickle(file: str) -> None:
    """A .bin checkpoint is a pickle: refuse one that names anything but tensors, without unpickling it.

    mergekit itself loads such files with `weights_only=True` (or its restricted lazy
    unpickler); this says which file and why, before mergekit's bare unpickling error.
    """
    try:
        from torch.serialization import get_unsafe_globals_in_checkpoint
    except ImportError:  # older torch: mergekit's weights_only loading still protects
        return
    try:
        unsafe = get_unsafe_globals_in_checkpoint(file)
    except Exception as error:
        raise ValueError(f"input file {file} is not a readable PyTorch checkpoint: {error}") from error
    if unsafe:
        raise ValueError(
            f"input file {file} is a pickle that refers to {', '.join(unsafe)}: unpickling it could run code, "
            "so it is not loaded (mergekit loads weights only). Convert the model to safetensors."
        )


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"input model index {index} is unreadable: {error!r}") from error
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"input model index {index} names missing shard(s): {', '.join(missing)}")
        return files
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def check_safetensors(file: str) -> None:
    """ValueError naming `file` unless its header describes exactly the bytes that follow it."""

    def bad(reason: str) -> ValueError:
        return ValueError(
            f"input file {file} is not a valid safetensors file: {reason} (a truncated download? fetch it again)"
        )

    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"the header claims {n} bytes, the file holds {size - 8} after the length field")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise bad(f"the header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in [*shape, begin, end]) or end < begin:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name}: malformed entry {info!r}") from None
        width = _WIDTHS.get(dtype)
        if width is None:
            return  # a dtype we do not size (sub-byte floats...): safetensors checks it
        need = math.prod(shape) * width
        if end - begin != need:
            raise bad(f"tensor {name} ({dtype} {shape}) needs {need} bytes, its offsets span {end - begin}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise bad(f"tensor {name} starts at byte {begin} of the data, expected {position} (overlap or gap)")
        position = end
    data = size - 8 - n
    if position != data:
        what = "truncated" if position > data else "trailing bytes"
        raise bad(f"the tensors need {position} bytes of data, the file holds {data} ({what})")


def check_stored_tensors(planner: Any, tasks: list[Any]) -> None:
    """Every planned tensor the base stores is stored by every model, as a float of the base's shape.

    Reads only safetensors headers (once per file). mergekit would cast an integer
    (quantized) tensor to `dtype:` and merge it as numbers, merge an optional tensor
    (an untied `lm_head`) without the models that lack it, and name neither model nor
    tensor on a shape mismatch.
    """
    from mergekit.io.tasks import GatherTensors, LoaderCache

    headers: dict[str, dict] = {}
    for task in tasks:
        stored = {
            model: _stored(LoaderCache().get(model).index, weight, headers)
            for model, weight in _weight_infos(task).items()
        }
        base = stored.get(task.base_model)
        if base is None:
            continue  # converted (fused) or unknown to the index: mergekit resolves it
        name = task.output_weight.name
        vocabulary = not isinstance(task.gather_tensors, GatherTensors) or _has_vocabulary_axis(task.output_weight)
        for model, found in stored.items():
            if model == task.base_model:
                continue
            if found is None:
                raise ValueError(
                    f"ramplus: tensor {name} is in the base model {task.base_model} but not in {model}: "
                    "the models do not share one architecture (tied embeddings in one only?)"
                )
            (dtype, shape), (base_dtype, base_shape) = found, base
            if dtype is None or base_dtype is None or shape is None or base_shape is None:
                continue  # not a safetensors file: the loader checks it
            if _is_float(base_dtype) and not _is_float(dtype):
                raise ValueError(
                    f"ramplus: tensor {name} of {model} is stored as {dtype}, in the base model "
                    f"{task.base_model} as {base_dtype}: only floating-point weights can be merged (a quantized "
                    "or integer checkpoint would be cast and merged as numbers); use an unquantized export"
                )
            if shape != base_shape and not vocabulary:
                raise ValueError(
                    f"ramplus: tensor {name} has shape {tuple(shape)} in {model} but {tuple(base_shape)} in the "
                    f"base model {task.base_model}: the models do not share one architecture"
                )


def _stored(index: Any, weight: Any, headers: dict[str, dict]) -> tuple[str | None, list[int] | None] | None:
    """(dtype, shape) of a weight as stored (None, None outside safetensors); None when absent."""
    for name in [weight.name, *(weight.aliases or ())]:
        path = index.tensor_paths.get(name)
        if path is None:
            continue
        path = path if os.path.isabs(path) else os.path.join(index.base_path, path)
        if not path.endswith(".safetensors"):
            return None, None
        if path not in headers:
            try:
                with open(path, "rb") as f:
                    headers[path] = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            except (OSError, ValueError):
                headers[path] = {}
        info = headers[path].get(name)
        return (info["dtype"], list(info["shape"])) if isinstance(info, dict) else (None, None)
    return None


def _is_float(dtype: str) -> bool:
    return dtype.startswith("F") or dtype == "BF16"


def _has_vocabulary_axis(weight: Any) -> bool:
    return bool(getattr(weight, "is_embed", False)) or getattr(weight, "vocabulary_axis", None) is not None


_CHOICES = {"rho_scope": statistics.SCOPES, "lambda_rule": statistics.LAMBDA_RULES}


def _check_value(key: str, setting: Any, where: str) -> None:
    """A value mergekit would coerce or pass on unchecked (a string, a bool, an unknown
    scope) is an error naming the parameter and its place, before any weight is read."""
    for value in _scalars(setting):
        if key in _CHOICES:
            if value not in _CHOICES[key]:
                choices = ", ".join(_CHOICES[key])
                raise ValueError(f"ramplus parameter '{key}' under {where} must be one of {choices}, got {value!r}")
            continue
        number = _number(value)
        if number is None:
            raise ValueError(f"ramplus parameter '{key}' under {where} must be a number, got {value!r}")
        if key == "rho":
            if math.isnan(number) or number < 0:
                raise ValueError(f"ramplus parameter 'rho' under {where} must be a number >= 0, got {value!r}")
        else:
            statistics.check_parameter(key, number, upper=key != "epsilon")


def _scalars(setting: Any) -> list[Any]:
    """Every value a setting holds, through mergekit's filters and gradients."""
    if isinstance(setting, dict) and "value" in setting:
        return _scalars(setting["value"])
    if hasattr(setting, "filter") and hasattr(setting, "value"):
        return _scalars(setting.value)
    if isinstance(setting, (list, tuple)):
        return [v for item in setting for v in _scalars(item)]
    return [setting]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None  # `r: yes` is not 1.0
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def check_config_serialisable(config: Any) -> None:
    """mergekit writes `config.to_yaml()` into the card, after the weights, when it was given no YAML text.

    mergekit 0.1.5's `ModelReference` serialiser returns itself for a path holding a space or
    a double quote, which pydantic reports as "Circular reference detected" once the whole
    model is written (plain mergekit methods too). Say so before any weight is read.
    """
    try:
        config.to_yaml()
    except ValueError as error:
        odd = [str(m) for m in config.referenced_models() if " " in str(m) or '"' in str(m)]
        where = f"model path(s) {' and '.join(sorted(odd))}" if odd else "this configuration"
        raise ValueError(
            f"mergekit cannot write {where} into the model card ({error}; mergekit 0.1.5 fails on paths "
            "with a space or a double quote). Pass the YAML text as run_merge(..., config_source=TEXT) "
            "(mergekit-yaml does), turn the card off, or use a path without them."
        ) from error


def check_output(config: Any, out_path: str) -> None:
    """Refuse an output folder that is, or is inside, an input model's folder."""
    out = os.path.realpath(out_path)
    for model in config.referenced_models():
        path = model.model.path
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if out == real or out.startswith(real + os.sep):
                raise ValueError(
                    f"output folder {out_path} is inside the input model {model}; "
                    "the merge would overwrite it. Choose another output folder."
                )


def warn_stored_dtypes(planner: Any, task: Any) -> None:
    """Masks see tensors as loaded: say so when that hides or inflates updates."""
    from mergekit.common import dtype_from_name
    from mergekit.io.tasks import LoaderCache

    stored: dict[Any, str] = {}
    for model, weight in _weight_infos(task).items():
        try:
            index = LoaderCache().get(model).index
            name = next(n for n in [weight.name, *(weight.aliases or ())] if n in index.tensor_paths)
            path = index.tensor_paths[name]
            path = path if os.path.isabs(path) else os.path.join(index.base_path, path)
            if not path.endswith(".safetensors"):
                continue
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                stored[model] = f.get_slice(name).get_dtype()
        except Exception:  # best effort: a warning must never stop a merge
            continue
    widths = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
    wanted = dtype_from_name(planner.config.dtype)
    if wanted is not None:
        narrow = [str(m) for m, d in stored.items() if widths.get(d, 0) > wanted.itemsize]
        if narrow:
            LOG.warning(
                "ramplus: `dtype: %s` rounds the stored weights of %s before masking; "
                "updates smaller than one %s ULP become invisible to RAM+",
                planner.config.dtype,
                ", ".join(narrow),
                planner.config.dtype,
            )
    base = stored.get(task.base_model)
    odd = [str(m) for m, d in stored.items() if base is not None and d != base]
    if odd:
        LOG.warning(
            "ramplus: %s stored in a different dtype than the base (%s); rounding "
            "differences count as updates and inflate density",
            ", ".join(odd),
            base,
        )


def _weight_infos(task: Any) -> dict[Any, Any]:
    gather = task.gather_tensors
    while not hasattr(gather, "weight_info") and hasattr(gather, "gather_tensors"):
        gather = gather.gather_tensors
    return dict(gather.weight_info.items()) if hasattr(gather, "weight_info") else {}
