"""Inputs named by label: a short name per input, the same on every machine, by which ram_stats.json, the card,
a merge's table and `inspect` name it (the path or hub id is written once, in the report's inputs table); and a
report written before labels (ram_stats.json formats 1 to 3) read in the labelled shape. On plain data; imports
nothing of the package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: the first ram_stats.json format that names inputs by label
LABELLED = 4


def input_labels(models: Sequence[str], given: Mapping[str, str] | None = None) -> dict[str, str]:
    """A short label per input (`models`: the base first, then the agents), the same on every machine: the last
    part of its path or hub id (no `@revision`; a hub cache snapshot's repository name), with as many parent
    parts as it takes to tell it from the others, then `-2`, `-3`, ... in order. `given`: labels already chosen
    (`verify`: the recorded ones), kept; the others are told apart from them too."""
    chosen = {m: label for m, label in (given or {}).items() if m in models}
    rest = [m for m in dict.fromkeys(models) if m not in chosen]
    names = {tuple(_parts(m)) for m in rest}  # twins (one name at two revisions) are told apart by number
    depth = dict.fromkeys(names, 1)
    while True:
        labels = {name: "/".join(name[-depth[name] :]) for name in names}
        taken = [*chosen.values(), *labels.values()]
        longer = [name for name in names if taken.count(labels[name]) > 1 and depth[name] < len(name)]
        if not longer:
            break
        for name in longer:
            depth[name] += 1
    for m in rest:
        first = label = labels[tuple(_parts(m))]
        n = 2
        while label in chosen.values():
            label, n = f"{first}-{n}", n + 1
        chosen[m] = label
    return {m: chosen[m] for m in models}


def _parts(model: str) -> list[str]:
    """The parts of an input's name a label is made of: its path's (or hub id's), a snapshot's repository id."""
    path = model.replace("\\", "/").rstrip("/")
    repo = hub_id(path)
    parts = [p for p in (repo or path).split("/") if p]
    if parts and not repo:
        parts[-1] = parts[-1].split("@")[0] or parts[-1]  # org/name@revision: the revision is in the inputs table
    return parts or [model]


def hub_id(path: str) -> str | None:
    """The hub id of a hub cache snapshot folder (`.../models--org--name/snapshots/<commit>`), else None."""
    parts = path.replace("\\", "/").rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def upgraded(report: dict) -> dict:
    """A report of format 1 to 3 in format 4's shape (an `inputs` table, the inputs named by label everywhere
    else), labelled as a merge labels them now (`input_labels`); its `format_version` stays the file's. A
    report of format 4 or newer as it is. Only the shape changes: the counts, parameters and identities are
    the file's."""
    version = report.get("format_version")
    if not isinstance(version, int) or version >= LABELLED:
        return report
    found = report.get("base_model")
    base: dict = found if isinstance(found, dict) else {}
    agents = [row for row in report.get("agents") or [] if isinstance(row, dict)]
    models = [str(row.get("model")) for row in (base, *agents)]
    named = input_labels(models)
    roles = ["base", *["agent"] * len(agents)]
    inputs = {
        named[m]: {"role": role, "model": m, "identity": row.get("identity") or {}}
        for m, role, row in zip(models, roles, (base, *agents), strict=True)
    }
    rows = [
        {"label": named[str(row.get("model"))], **{k: v for k, v in row.items() if k not in ("model", "identity")}}
        for row in agents
    ]
    out = {key: value for key, value in report.items() if key not in ("base_model", "agents")}
    out.update(inputs=inputs, base_model=named[models[0]], agents=rows)
    for key in ("rho_by_group", "pairs", "tensors"):
        if key in out:
            out[key] = renamed(out[key], named)
    return out


def renamed(value: Any, names: Mapping[str, str]) -> Any:
    """`value` (a report, or anything in it) with every dict key and string in `names` replaced (an input's
    name by its label; `verify`: a local copy's path by the recorded name)."""
    if isinstance(value, dict):
        return {names.get(k, k) if isinstance(k, str) else k: renamed(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v, names) for v in value]
    return names.get(value, value) if isinstance(value, str) else value
