"""What a `ramplus` merge does of hub ids where mergekit would ask the Hub (other methods keep mergekit's ways):

- `mergekit.common.ModelReference.local_path`: a hub id the Hub could not be asked about (offline, unreachable) is
  read from its snapshot folder in the Hub cache, which the door's input check found and put in the session
  (`checks/hub_cache.py`); mergekit 0.1.5 would list its files on the Hub first and fail, even with it cached;
- `mergekit.card.is_hf` (the card's question whether a model is on the Hub): a model that is a local file or folder
  is local, never asked of the Hub, and a question the Hub cannot answer (offline, unreachable) makes it local too: a
  finished merge is not lost to the card's metadata.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mergekit_ram import session
from mergekit_ram._mergekit import surface


def install() -> None:
    """Wrap `ModelReference.local_path` and, once `mergekit.card` is loaded (by `mergekit.merge`), `is_hf`.
    Idempotent; the caller has checked `surface.MERGE`'s names."""
    import sys

    from mergekit.common import ModelReference

    surface.wrap(ModelReference, "local_path", _local_path, surface.HOOKED)
    card_module: Any = sys.modules.get("mergekit.card")  # imported by mergekit.merge
    if card_module is not None:
        surface.wrap(card_module, "is_hf", _is_hf, surface.HOOKED)


def _local_path(original: Callable[..., str]) -> Callable[..., str]:
    """mergekit's `local_path`, but for a hub id this merge reads from the Hub cache: its snapshot folder."""

    def local_path(model: Any, *args: Any, **kwargs: Any) -> str:
        current = session.current()
        found = None if current is None else current.from_cache.get((model.model.path, model.model.revision))
        if found is None or model.lora is not None:  # a LoRA: mergekit merges it first (and asserts so)
            return original(model, *args, **kwargs)
        return found

    return local_path


def _is_hf(original: Callable[[str], bool]) -> Callable[[str], bool]:
    """mergekit's card links a model to the Hub when `is_hf` says it is a repository: it asks the Hub about a
    path that exists here (`huggingface_hub.repo_exists`), which raises offline or unreachable, after the merge
    wrote every tensor. In a `ramplus` merge, a path that exists is local; an error is "not on the Hub"."""

    def is_hf(path: str) -> bool:
        if session.current() is None:  # another method's merge: mergekit's own answer
            return original(path)
        if os.path.exists(path):
            return False
        try:
            return original(path)  # a path that is not here: a hub id, said without asking
        except Exception:  # the card's link is not worth the merge
            return False

    return is_hf
