"""Plan-time checks of a `ramplus` merge: errors before any weight is read, warnings about dtypes.

- `check_config`: one base model for the whole merge, and parameter names that
  `ramplus` knows, at a place where mergekit honours them (a misspelt or
  misplaced parameter would otherwise be silently ignored);
- `check_output`: the output folder is not inside an input model;
- `warn_stored_dtypes`: masks see tensors as loaded, so say when `dtype:` or
  an agent stored in another dtype than the base hides or inflates updates.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

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
