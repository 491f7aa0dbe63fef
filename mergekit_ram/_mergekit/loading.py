"""Linear-time tensor loading for many-tensor checkpoints, active only while `ramplus` merges.

mergekit 0.1.5 loads each tensor in time proportional to the checkpoint's tensor count,
so a mixture-of-experts model with thousands of per-expert tensors costs the square of
that count, once per pass. Two places do it:

- `LazyTensorLoader.get_tensor` asks the open safetensors shard for `keys()` (a new list
  of every name) to test one name;
- `LoadTensor._load_converted_tensor` hands every tensor of the model to
  `convert_checkpoint_tensors`, which natural-sorts and regex-matches all of them for
  each fused target (`experts.gate_up_proj` and friends).

While a `ramplus` merge runs, the first tests membership in a set made once per opened
shard, and the second passes `convert_checkpoint_tensors` only the checkpoint tensors
that can reach the target (found once per model by running mergekit's own name matching
over all names), so the conversion itself and its result are mergekit's. Should the
filtered call find nothing, the full call runs. Both replacements are installed only
when mergekit's originals are byte-for-byte the ones they were written against (their
source hashes are in `surface.NAMES`), and only divert while the current `MergeSession`
asks for fast loading (a `ramplus` run_merge or `inspect`, in that thread); other merge
methods always run mergekit's code.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from mergekit_ram import session
from mergekit_ram._mergekit import surface

LOG = logging.getLogger("mergekit_ram")

_status: str | None = None  # None: not tried yet; "" installed; else why not
#: caches of what a loader's names imply, per mergekit loader object (weak: they go with the loader)
_plans: weakref.WeakKeyDictionary[Any, tuple[str | None, dict[str, list[str]]]] = weakref.WeakKeyDictionary()
_names: weakref.WeakKeyDictionary[Any, tuple[Any, frozenset]] = weakref.WeakKeyDictionary()


def install() -> str:
    """Install the replacements once; returns "" or why mergekit's own loading stays in use."""
    global _status
    if _status is not None:
        return _status
    try:
        found = surface.problems(surface.LOADING)
        if found:
            _status = "; ".join(found)
        else:
            from mergekit.io.lazy_tensor_loader import LazyTensorLoader
            from mergekit.io.tasks import LoadTensor

            # looked up at call time, so the replacement is this module's current function
            _divert(LazyTensorLoader, "get_tensor", lambda *a, **k: _get_tensor(*a, **k))
            _divert(LoadTensor, "_load_converted_tensor", lambda *a, **k: _load_converted_tensor(*a, **k))
            _status = ""
    except Exception as error:  # never let a speed-up break a merge
        _status = f"could not inspect mergekit's loader: {error!r}"
    if _status:
        LOG.info("mergekit-ram: fast tensor loading unavailable, using mergekit's own: %s", _status)
    return _status


def _fast() -> bool:
    current = session.current()
    return current is not None and current.fast_loading


def _divert(cls, name: str, fast) -> None:
    """Route cls.name to `fast` while the current session loads fast; to mergekit's otherwise."""

    def make(original):
        def method(self, *args, **kwargs):
            if _fast():
                return fast(original, self, *args, **kwargs)
            return original(self, *args, **kwargs)

        return method

    surface.wrap(cls, name, make, surface.DIVERTED)


def _get_tensor(original, self, key, device="cpu", aliases=None, raise_on_missing=True):
    """mergekit's `LazyTensorLoader.get_tensor` with a set of the open shard's names."""
    import os

    from mergekit.io.loader import TensorLoader

    if aliases and key not in self.index.tensor_paths:
        for alias in aliases:
            if alias in self.index.tensor_paths:
                key = alias
                break

    with self.lock:
        if self.current_shard is None or key not in _shard_names(self):
            if key not in self.index.tensor_paths:
                if raise_on_missing:
                    raise KeyError(key)
                return None

            self.current_shard = None
            self.current_keys = None

            shard_file = self.index.tensor_paths[key]
            shard_full_path = os.path.join(self.index.base_path, shard_file)
            logging.debug(f"Opening shard {shard_full_path}")
            self.current_shard = TensorLoader.get(shard_full_path, use_lazy_unpickle=self.lazy_unpickle, device=device)
        return self.current_shard.get_tensor(key).to(device)


def _shard_names(loader) -> frozenset:
    """The open shard's names, listed once per opened shard (mergekit lists them on every read)."""
    shard = loader.current_shard
    cached = _names.get(loader)
    if cached is None or cached[0] is not shard:
        cached = (shard, frozenset(shard.keys()))
        _names[loader] = cached
    return cached[1]


def _load_converted_tensor(original, self, loader):
    """mergekit's `LoadTensor._load_converted_tensor`, given only the tensors that can reach the target."""
    from mergekit.architecture.conversion import convert_checkpoint_tensors
    from mergekit.io.tasks import LoaderCache

    if loader not in _plans:  # once per model: mergekit re-reads config.json and rescans every name per tensor
        model_type = self.model.config(trust_remote_code=LoaderCache().trust_remote_code).model_type
        _plans[loader] = (model_type, reachable(model_type, list(loader.index.tensor_paths)))
    model_type, sources = _plans[loader]
    for target in [self.tensor, *(self.aliases or ())]:
        keys = sources.get(target)
        if not keys:
            continue
        source_tensors = {key: (lambda key=key: loader.get_tensor(key, device=self.device or "cpu")) for key in keys}
        tensor = convert_checkpoint_tensors(model_type, source_tensors, target)
        if tensor is not None:
            return tensor.to(self.device or "cpu")
    return original(self, loader)  # nothing found among the filtered names: mergekit's full search


def reachable(model_type: str | None, names: list[str]) -> dict[str, list[str]]:
    """For every name a conversion can produce, the source names that can contribute to it.

    Runs `convert_checkpoint_tensors`' own matching (`_iter_transform_matches`,
    `_expanded_target_keys`) over names alone, once for all targets: a renamed name
    inherits its sources, a converter's targets gather the sources of every match
    that expands to them, and later transforms see both. The sets over-approximate
    (a renaming's last source wins in mergekit, all are kept here), which leaves the
    conversion's result unchanged: it only ever uses the matches of its target.
    """
    from mergekit.architecture.conversion import _expanded_target_keys, _iter_transform_matches
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_checkpoint_conversion_mapping(model_type) if model_type else None
    if not transforms:
        return {}
    origin: dict[str, set] = {name: {name} for name in names}
    for transform in transforms:
        produced: dict[str, set] = {}
        for match in _iter_transform_matches(transform, {name: name for name in origin}):
            roots = origin[match.source_key]
            if isinstance(transform, WeightRenaming):
                produced.setdefault(match.renamed_key, set()).update(roots)
            else:
                for target in _expanded_target_keys(match.renamed_key, transform.target_patterns):
                    produced.setdefault(target, set()).update(roots)
        for name, roots in produced.items():
            origin.setdefault(name, set()).update(roots)
    order = {name: i for i, name in enumerate(names)}
    return {target: sorted(roots, key=order.__getitem__) for target, roots in origin.items() if roots != {target}}
