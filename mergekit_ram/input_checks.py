"""Checks of the input models before any weight is read: files mergekit would fail on obscurely,
and tensors that cannot be merged as floats (each error names the file, model and tensor)."""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram import files

LOG = logging.getLogger("mergekit_ram")


def check_input_files(config: Any) -> None:
    """Refuse local input folders mergekit would fail on obscurely, naming the file."""
    for model in config.referenced_models():
        path = model.model.path
        if not os.path.isdir(path):
            continue  # a hub id: mergekit resolves (and validates) it
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"input model {path} has no config.json (an incomplete download or copy?)")
        weights = _safetensors_files(path)
        for file in weights:
            files.check_safetensors(file)
        pickle = os.path.join(path, "pytorch_model.bin")
        if not weights and os.path.isfile(pickle):
            check_pickle(pickle)


def check_input_file(path: str) -> None:
    """One input file of `mergekit-pytorch` (a model is one file there): it exists and is a file, a
    safetensors file safetensors opens, or a PyTorch pickle that holds tensors only (`check_pickle`)."""
    if not os.path.exists(path):
        raise ValueError(f"input file {path} does not exist")
    if os.path.isdir(path):
        raise ValueError(
            f"input {path} is a folder: mergekit-pytorch merges single files (.safetensors or a PyTorch "
            "checkpoint); merge model folders with mergekit-yaml"
        )
    if path.lower().endswith(".safetensors"):
        files.check_safetensors(path)
    else:
        check_pickle(path)


def check_pickle(file: str) -> None:
    """A .bin/.pt checkpoint is a pickle: refuse one that names anything but tensors, without running its code.

    mergekit itself loads such files with `weights_only=True` (or its restricted lazy
    unpickler); this says which file and why, before mergekit's bare unpickling error.
    A zip checkpoint (torch.save's format) is read for the names it refers to without
    unpickling; an older, non-zip one is loaded by torch's weights-only unpickler onto the
    meta device, which refuses anything but tensors without running it.
    """
    from torch.serialization import get_unsafe_globals_in_checkpoint  # torch >= 2.6, the declared floor

    if not zipfile.is_zipfile(file):
        _check_legacy_pickle(file)
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


def _check_legacy_pickle(file: str) -> None:
    import pickle

    import torch

    try:
        torch.load(file, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"input file {file} is a pickle that holds more than tensors ({first}): unpickling it could run code, "
            "so it is not loaded (mergekit loads weights only). Convert the model to safetensors."
        ) from error
    except Exception as error:
        raise ValueError(f"input file {file} is not a readable PyTorch checkpoint: {error}") from error


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        shards = [os.path.join(path, name) for name in files.indexed_weight_files(index)]
    except FileNotFoundError:
        single = os.path.join(path, "model.safetensors")
        return [single] if os.path.isfile(single) else []
    missing = [shard for shard in shards if not os.path.isfile(shard)]
    if missing:
        raise ValueError(f"input model index {index} names missing shard(s): {', '.join(missing)}")
    return shards


#: How one model stores one tensor: (dtype, shape) from its safetensors header,
#: (None, None) outside safetensors, None when the model does not store it.
Stored = tuple[str | None, list[int] | None] | None


def check_stored_tensors(rows: Sequence[tuple[str, str, bool, Mapping[str, Stored]]]) -> None:
    """Every planned tensor the base stores is stored by every model, as a float of the base's shape.

    `rows`: (tensor, base model, whether the tensor has a vocabulary axis, model -> Stored).
    mergekit would cast an integer (quantized) tensor to `dtype:` and merge it as numbers,
    merge an optional tensor (an untied `lm_head`) without the models that lack it, and
    name neither model nor tensor on a shape mismatch.
    """
    for name, base_model, vocabulary, stored in rows:
        base = stored.get(base_model)
        if base is None:
            continue  # converted (fused) or unknown to the index: mergekit resolves it
        for model, found in stored.items():
            if model == base_model:
                continue
            if found is None:
                raise ValueError(
                    f"ramplus: tensor {name} is in the base model {base_model} but not in {model}: "
                    "the models do not share one architecture (tied embeddings in one only?)"
                )
            (dtype, shape), (base_dtype, base_shape) = found, base
            if dtype is None or base_dtype is None or shape is None or base_shape is None:
                continue  # not a safetensors file: the loader checks it
            if _is_float(base_dtype) and not _is_float(dtype):
                raise ValueError(
                    f"ramplus: tensor {name} of {model} is stored as {dtype}, in the base model "
                    f"{base_model} as {base_dtype}: only floating-point weights can be merged (a quantized "
                    "or integer checkpoint would be cast and merged as numbers); use an unquantized export"
                )
            if shape != base_shape and not vocabulary:
                raise ValueError(
                    f"ramplus: tensor {name} has shape {tuple(shape)} in {model} but {tuple(base_shape)} in the "
                    f"base model {base_model}: the models do not share one architecture"
                )


def _is_float(dtype: str) -> bool:
    return dtype.startswith("F") or dtype == "BF16"


def warn_stored_dtypes(stored: Mapping[str, str], base_model: str, dtype: str | None, itemsize: int | None) -> None:
    """Masks see tensors as loaded: say so when that hides or inflates updates.

    `stored`: model -> safetensors dtype of one tensor; `dtype`/`itemsize`: the config's `dtype:`.
    """
    if itemsize is not None:
        narrow = [m for m, d in stored.items() if _is_float(d) and files.WIDTHS.get(d, 0) > itemsize]
        if narrow:
            LOG.warning(
                "ramplus: `dtype: %s` rounds the stored weights of %s before masking; "
                "updates smaller than one %s ULP become invisible to RAM+",
                dtype,
                ", ".join(narrow),
                dtype,
            )
    base = stored.get(base_model)
    odd = [m for m, d in stored.items() if base is not None and d != base]
    if odd:
        LOG.warning(
            "ramplus: %s stored in a different dtype than the base (%s); rounding "
            "differences count as updates and inflate density",
            ", ".join(odd),
            base,
        )
