"""Evaluation of the quality benchmark: greedy exact match per item.

Every model is scored on the same fixed eval items of every task (`tasks.eval_set`), so models can be compared
item by item (`benchmarks/paired.py`: standard errors and paired bootstrap intervals over those items).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def score(
    folder,
    items: Mapping[str, Sequence[tuple[str, str]]],
    max_new: Mapping[str, int],
    batch_size: int = 512,
    fmt: dict | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
    """({task: [1/0 per eval item]}, with `fmt` {task: [1/0: the answer follows the format]} else None) of the
    model stored in `folder` (greedy decoding; with `fmt` the answer's content is scored, whatever its format)."""
    import train

    model = train.load_model(folder)
    scored = {name: train.score(model, its, max_new[name], batch_size, fmt) for name, its in items.items()}
    right = {name: r for name, (r, _) in scored.items()}
    return right, ({name: f for name, (_, f) in scored.items()} if fmt else None)  # type: ignore[misc]
