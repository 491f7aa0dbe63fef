"""Checks of the input models before any weight is read: files mergekit would fail on obscurely,
and tensors that cannot be merged as floats (each error names the file, model and tensor)."""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram import files
from mergekit_ram.checks import hub_cache, paths
from mergekit_ram.checks.config_checks import models_in_order
from mergekit_ram.errors import RamError

LOG = logging.getLogger("mergekit_ram")
#: torch's variable that makes `torch.load` unpickle fully wherever `weights_only` is not passed
FORCE_UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def forced_unsafe() -> bool:
    """Whether torch is told to unpickle fully wherever `weights_only` is not passed (`FORCE_UNSAFE`, read with the
    words torch reads it with, not ours: `environment`)."""
    return os.environ.get(FORCE_UNSAFE, "0").strip().lower() in ("1", "y", "yes", "true")


#: the weight files (and indexes) mergekit's loader looks for in a model folder
WEIGHT_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_input_paths(config: Any, cache_dir: str | None = None) -> dict[tuple[str, str | None], str]:
    """Each input model (and LoRA) of a `mergekit-yaml` config is a folder, or a hub id the hub knows, before
    mergekit asks the hub for it: a mistyped path was 65 lines and two tracebacks ending in huggingface_hub's
    "Repo id must be in the form ...". A file is `mergekit-pytorch`'s input: said so. `cache_dir`: mergekit's
    `--transformers-cache`, where an offline hub id must be. A relative path is read from the working folder: a
    line about one names that folder, and the same path read from the config's folder where that exists.

    Returns (hub id, revision) -> its snapshot folder in the Hub cache, for each hub id the Hub cannot be asked about
    (offline, unreachable): the merge reads it there (`hub_cache`)."""
    config_dir = paths.config_folder()
    found = {}
    for model in models_in_order(config):  # the first bad input named is the config's first
        for what, path in (("input model", model.model), ("LoRA of input model", model.lora)):
            if path is not None:
                folder = _check_model_path(what, path.path, path.revision, cache_dir, config_dir)
                if folder is not None:
                    found[(path.path, path.revision)] = folder
    return found


def _check_model_path(
    what: str, path: str, revision: str | None, cache_dir: str | None, config_dir: str | None
) -> str | None:
    """None for a folder or a hub id the Hub knows; the snapshot folder of one it cannot be asked about."""
    if os.path.isdir(path):
        return None
    if os.path.lexists(path):
        raise RamError(
            f"{what} {path} is a file, not a model folder: mergekit-yaml merges folders (config.json beside the "
            "weights); for models that are single files (.pt, .safetensors), use mergekit-pytorch with this config"
        )
    here, near = paths.looked(path, "folder", config_dir), paths.nearest(path, "folder")
    if not paths.hub_id_form(path):  # absolute, ./, ../, ~, a/b/c: no hub id
        raise RamError(f"{what} {path}: no such folder{here}{near}")
    known, where = _on_hub(path, revision)
    named = f"{path}@{revision}" if revision else path
    if known is False:
        raise RamError(f"{what} {named} is neither a folder{here} nor {where}{near}")
    if known:
        return None
    # offline or unreachable: mergekit would ask the Hub (and retry), then fail; the Hub cache answers
    if not hub_cache.cached(path, cache_dir):
        cache = f"the hub cache at revision {revision or 'main'} ({hub_cache.repository_folder(path, cache_dir)}"
        why = f"; {OFFLINE})" if where == OFFLINE else f"), and {where}"
        raise RamError(f"{what} {named} is neither a folder{here} nor in {cache}{why}{near}")
    if what != "input model":  # a LoRA: peft reads it from the cache
        return None
    return hub_cache.snapshot(f"{what} {named}", path, revision, cache_dir, where)


#: `_on_hub`'s reason when it asks nothing
OFFLINE = "HF_HUB_OFFLINE is set"


def _on_hub(repo: str, revision: str | None) -> tuple[bool | None, str]:
    """Whether the hub has model `repo` at `revision` (None: it cannot tell, offline or unreachable), and where it
    was looked for. Under HF_HUB_OFFLINE nothing is asked. Asked once, never retried."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return None, OFFLINE
    try:
        HfApi().repo_info(repo, revision=revision, repo_type="model")
    except GatedRepoError:  # it exists; mergekit says what access it needs
        return True, ""
    except (RepositoryNotFoundError, RevisionNotFoundError):  # also private without a token: the hub says 401
        return False, "a model on the hub (a private one needs `hf auth login`)"
    except Exception as error:  # no network, a server error: the cache may hold it
        return None, f"the hub at {constants.ENDPOINT} could not be asked ({type(error).__name__})"
    return True, ""


def check_input_files(config: Any) -> None:
    """Refuse local input folders mergekit would fail on obscurely, naming the file."""
    for model in models_in_order(config):  # the first bad input named is the config's first
        path = model.model.path
        if not os.path.isdir(path):
            continue  # a hub id: mergekit resolves (and validates) it
        _refuse_special(path, "config.json", *WEIGHT_NAMES)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise RamError(f"input model {path} has no config.json (an incomplete download or copy?)")
        weights = _safetensors_files(path)
        for file in weights:
            files.check_safetensors(file)
        pickle = os.path.join(path, "pytorch_model.bin")
        if not weights and os.path.isfile(pickle):
            check_pickle(pickle)
        if not weights and not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path)):
            raise RamError(
                f"input model {path} holds no weight file (model.safetensors, shards with an index, or "
                "pytorch_model.bin): an incomplete download or copy?"
            )


#: what a weight file of a model folder is called (any of them: mergekit resolves which it reads)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def check_input_file(path: str) -> None:
    """One input file of `mergekit-pytorch` (a model is one file there): it exists and is a file, a
    safetensors file safetensors opens, or a PyTorch pickle that holds tensors only (`check_pickle`)."""
    if not os.path.exists(path):
        raise RamError(f"input file {path} does not exist{paths.where(path, 'file', paths.config_folder())}")
    if os.path.isdir(path):
        raise RamError(
            f"input {path} is a folder: mergekit-pytorch merges single files (.safetensors or a PyTorch "
            "checkpoint); merge model folders with mergekit-yaml"
        )
    _refuse_special(os.path.dirname(path), os.path.basename(path))
    if path.lower().endswith(".safetensors"):
        files.check_safetensors(path)
    else:
        check_torch_format(path)
        check_pickle(path)
        check_state_dict(path)


def check_torch_format(file: str) -> None:
    """A file `torch.save` wrote begins as a zip archive (`PK`) or a pickle (`\\x80`): anything else (a text
    file named `.pt`, an empty file) is named as not a checkpoint, before torch's unpickling error."""
    with open(file, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PK") or head[:1] == b"\x80":
        return
    what = "is empty" if not head else f"begins with {head!r}"
    raise RamError(
        f"input file {file} is not a PyTorch checkpoint: torch.save writes a zip archive or a pickle, and this "
        f"file {what}; give a file written by torch.save(model.state_dict(), path) or a .safetensors file"
    )


def check_state_dict(file: str) -> None:
    """A weights-only checkpoint (`check_pickle` passed) holds tensors by name: name a training checkpoint's
    nesting (`{"model": state_dict, "step": 100}`) and any other entry that is not a tensor.

    Read with `mmap` (a zip checkpoint) or onto the meta device (an older one): no weight is read."""
    import torch

    zipped = zipfile.is_zipfile(file)
    try:
        data = torch.load(file, map_location="meta" if not zipped else None, mmap=zipped, weights_only=True)
    except Exception:
        return  # check_pickle judged the file; mergekit's loader names what is left
    if not isinstance(data, Mapping):
        raise RamError(
            f"input file {file} holds a {type(data).__name__}, not a state_dict (tensors by name); "
            "save torch.save(model.state_dict(), path)"
        )
    odd = {str(k): v for k, v in data.items() if not isinstance(v, torch.Tensor)}
    nested = [
        k for k, v in odd.items() if isinstance(v, Mapping) and any(isinstance(x, torch.Tensor) for x in v.values())
    ]
    if nested:
        others = ", ".join(repr(k) for k in odd if k not in nested)
        raise RamError(
            f"input file {file} holds a nested dict under {' and '.join(repr(k) for k in nested)}"
            + (f" (beside {others})" if others else "")
            + f": a training checkpoint, not a state_dict; save model.state_dict() (or checkpoint[{nested[0]!r}]) "
            "with torch.save and merge that file"
        )
    if odd:
        name, value = next(iter(odd.items()))
        raise RamError(
            f"input file {file} holds {name!r}, a {type(value).__name__}, not a tensor"
            + (f" (and {len(odd) - 1} more entries that are not tensors)" if len(odd) > 1 else "")
            + ": mergekit-pytorch merges a file of tensors; save model.state_dict() with torch.save"
        )


def check_pickle(file: str) -> None:
    """A .bin/.pt checkpoint is a pickle: refuse one that names anything but tensors, without running its code.

    mergekit itself loads such files with `weights_only=True` (or its restricted lazy
    unpickler); this says which file and why, before mergekit's bare unpickling error.
    A zip checkpoint (torch.save's format) is read for the names it refers to without
    unpickling; an older, non-zip one is loaded by torch's weights-only unpickler onto the
    meta device, which refuses anything but tensors without running it.
    """
    if forced_unsafe():
        raise RamError(
            f"input file {file} is a pickle and {FORCE_UNSAFE} is set: torch would then unpickle it fully where "
            "mergekit does not ask for weights only, which could run code; unset it (or convert to safetensors)"
        )
    from torch.serialization import get_unsafe_globals_in_checkpoint  # torch >= 2.6, the declared floor

    if not zipfile.is_zipfile(file):
        _check_legacy_pickle(file)
        return
    try:
        unsafe = get_unsafe_globals_in_checkpoint(file)
    except Exception as error:
        raise RamError(f"input file {file} is not a readable PyTorch checkpoint: {error}") from error
    if unsafe:
        raise RamError(
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
        raise RamError(
            f"input file {file} is a pickle that holds more than tensors ({first}): unpickling it could run code, "
            "so it is not loaded (mergekit loads weights only). Convert the model to safetensors."
        ) from error
    except Exception as error:
        raise RamError(f"input file {file} is not a readable PyTorch checkpoint: {error}") from error


def _refuse_special(folder: str, *names: str) -> None:
    """RamError naming the first of `names` in `folder` that is there but no regular file (a FIFO, a device):
    reading it could hang or never end, so it is not opened."""
    for name in names:
        full = os.path.join(folder, name)
        if os.path.lexists(full) and not os.path.isfile(full):
            raise RamError(
                f"input {full} is not a regular file (a FIFO, a device, a folder or a broken link): not read"
            )


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        shards = [os.path.join(path, name) for name in files.indexed_weight_files(index)]
    except FileNotFoundError:
        single = os.path.join(path, "model.safetensors")
        return [single] if os.path.isfile(single) else []
    missing = [shard for shard in shards if not os.path.isfile(shard)]
    if missing:
        raise RamError(f"input model index {index} names missing shard(s): {', '.join(missing)}")
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
                raise RamError(
                    f"ramplus: tensor {name} is in the base model {base_model} but not in {model}: "
                    "the models do not share one architecture (tied embeddings in one only?)"
                )
            (dtype, shape), (base_dtype, base_shape) = found, base
            if dtype is None or base_dtype is None or shape is None or base_shape is None:
                continue  # not a safetensors file: the loader checks it
            if _is_float(base_dtype) and not _is_float(dtype):
                raise RamError(
                    f"ramplus: tensor {name} of {model} is stored as {dtype}, in the base model "
                    f"{base_model} as {base_dtype}: only floating-point weights can be merged (a quantized "
                    "or integer checkpoint would be cast and merged as numbers); use an unquantized export"
                )
            if shape != base_shape and not vocabulary:
                raise RamError(
                    f"ramplus: tensor {name} has shape {tuple(shape)} in {model} but {tuple(base_shape)} in the "
                    f"base model {base_model}: the models do not share one architecture"
                )


def _is_float(dtype: str) -> bool:
    return dtype.startswith("F") or dtype == "BF16"


def warn_stored_dtypes(
    rows: Sequence[tuple[str, str, bool, Mapping[str, Stored]]], dtype: str | None, itemsize: int | None
) -> None:
    """Masks see tensors as loaded: say so when that hides or inflates updates.

    `rows`: as `check_stored_tensors` takes them, every planned tensor of every input: each floating tensor is
    looked at (a file whose first tensor is an integer counter, or whose agents differ from the base in one tensor
    only, still warns); `dtype`/`itemsize`: the config's `dtype:`. One warning of each kind, the models in sorted order.
    """
    narrow: dict[str, None] = {}
    odd: dict[str, None] = {}
    bases: dict[str, None] = {}
    for _name, base_model, _vocabulary, stored in rows:
        found = {m: entry[0] for m, entry in stored.items() if entry is not None and entry[0] is not None}
        found = {m: d for m, d in found.items() if _is_float(d)}
        base = found.get(base_model)
        for model, stored_as in found.items():
            if itemsize is not None and files.WIDTHS.get(stored_as, 0) > itemsize:
                narrow[model] = None
            if base is not None and stored_as != base:
                odd[f"{model} ({stored_as})" if stored_as else model] = None
                bases[base] = None
    if narrow:
        LOG.warning(
            "ramplus: `dtype: %s` rounds the stored weights of %s before masking; "
            "updates smaller than one %s ULP become invisible to RAM+",
            dtype,
            ", ".join(sorted(narrow)),
            dtype,
        )
    if odd:
        LOG.warning(
            "ramplus: %s stored in a different dtype than the base (%s); rounding "
            "differences count as updates and inflate density",
            ", ".join(sorted(odd)),
            ", ".join(sorted(bases)),
        )


def check_integer_buffers(paths: Sequence[str]) -> None:
    """`mergekit-pytorch` inputs (checked by `check_input_file`): an integer tensor stored by several files
    (BatchNorm's `num_batches_tracked`) must hold the same value in each, or mergekit refuses it in the middle of
    the merge with its own traceback; named here, before any weight is read. Only non-float tensors are loaded."""
    import torch

    seen: dict[str, tuple[str, Any]] = {}
    for path in paths:
        for name, tensor in _integer_tensors(path).items():
            if name not in seen:
                seen[name] = (path, tensor)
                continue
            first, value = seen[name]
            if value.dtype != tensor.dtype or not torch.equal(value, tensor):
                raise RamError(
                    f"non-float tensor {name} differs between {first} ({_shown(value)}) and {path} "
                    f"({_shown(tensor)}): mergekit copies such a buffer only when every input agrees (it does not "
                    "merge counters such as num_batches_tracked); save the same value in each file, e.g. the base's"
                )


def _integer_tensors(path: str) -> dict[str, Any]:
    if path.lower().endswith(".safetensors"):
        from safetensors import safe_open

        _, header = files.read_header(path)
        names = [k for k, v in header.items() if k != "__metadata__" and not _is_float(v.get("dtype", "F"))]
        if not names:
            return {}
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in names}
    import torch

    zipped = zipfile.is_zipfile(path)
    data = torch.load(path, map_location=None if zipped else "cpu", mmap=zipped, weights_only=True)
    return {str(k): v.clone() for k, v in data.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()}


def _shown(tensor: Any) -> str:
    return f"{tensor.item()}" if tensor.numel() == 1 else f"{tensor.dtype} of shape {tuple(tensor.shape)}"
