"""`mergekit-ram verify`'s local copies of a folder's recorded inputs, on plain data.

A folder names its inputs as its merger's machine had them (`/home/alice/runs/code`, `org/name`); on another
machine, local copies stand for them, their content checked against the recorded identity. Three ways to say
where they lie, combined as the user likes: `--input RECORDED=LOCAL` (one input, by its recorded name or its
label), `--inputs-from RECORDED_PARENT=LOCAL_PARENT` (every input recorded under a folder, at the same place
under another) and `--input-dir DIR` (a folder of copies, each named by its input's label). Each input is
mapped once at most; a value that maps nothing, an input mapped twice, or a copy that two inputs would be read
from is a usage error naming it (`NotVerifiable`). Inputs left unmapped are read as recorded (a hub id at its
recorded revision).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from mergekit_ram.errors import NotVerifiable
from mergekit_ram.verify.record_checks import Recorded, recorded_inputs

#: what a missing input's line suggests
HINT = (
    " (local copies can stand for inputs: --input-dir DIR, --inputs-from RECORDED_PARENT=LOCAL_PARENT or "
    "--input LABEL=COPY)"
)


def local_copies(
    recorded: dict,
    inputs: Mapping[str, str] | Iterable[str] = (),
    *,
    parents: Iterable[str] = (),
    folder: str | None = None,
) -> dict[str, str]:
    """recorded input (as the config names it) -> the absolute path of its local copy. `inputs`: `--input`
    values (or a mapping of recorded name or label -> local copy); `parents`: `--inputs-from` values; `folder`:
    `--input-dir`. NotVerifiable names what maps nothing, or maps an input twice."""
    if isinstance(inputs, Mapping):
        found = {model: (local, f"--input {model}={local}") for model, local in _named(recorded, inputs).items()}
    else:
        found = _pairs(recorded, inputs)
    for value in parents:
        for model, local in _under(recorded, value).items():
            _add(found, model, local, f"--inputs-from {value}")
    if folder is not None:
        held = [(row.model, os.path.join(folder, row.label)) for row in recorded_inputs(recorded)]
        held = [(model, local) for model, local in held if _inside(folder, local) and os.path.lexists(local)]
        if not held:
            labels = ", ".join(row.label for row in recorded_inputs(recorded))
            raise NotVerifiable(f"--input-dir {folder} holds no copy named by an input's label ({labels})")
        for model, local in held:
            _add(found, model, local, f"--input-dir {folder}")
    copies = {model: (os.path.abspath(os.path.expanduser(local)), option) for model, (local, option) in found.items()}
    _one_input_each(recorded, copies)
    return {model: local for model, (local, _) in copies.items()}


def _pairs(recorded: dict, given: Iterable[str]) -> dict[str, tuple[str, str]]:
    """`--input RECORDED=LOCAL` values as recorded input -> (local copy, the value that named it); RECORDED is
    a recorded name or a label. A name may hold `=` (a sweep's folder, `runs/lr=1e-5,seed=1/agent`): each value
    is split after the name it begins with, else at its first `=`. NotVerifiable (a usage error) for no `=`, a
    value two names could begin, a name the record lacks, or one input mapped twice."""
    known = sorted({name for row in recorded_inputs(recorded) for name in (row.model, row.label)})
    found: dict[str, tuple[str, str]] = {}
    for pair in given:
        names = [name for name in known if pair.startswith(name + "=") and len(pair) > len(name) + 1]
        if len(names) > 1:
            raise NotVerifiable(f"--input {pair}: it begins with two recorded inputs, {' and '.join(names)}")
        name, sep, local = (names[0], "=", pair[len(names[0]) + 1 :]) if names else pair.partition("=")
        if not sep or not name or not local:
            raise NotVerifiable(f"--input {pair}: expected RECORDED=LOCAL (a recorded input or label, and its copy)")
        model = next(iter(_named(recorded, {name: local})))
        if model in found:
            raise NotVerifiable(f"--input maps {name} twice ({found[model][0]} and {local}): give one local copy")
        found[model] = (local, f"--input {pair}")
    return found


def _named(recorded: dict, inputs: Mapping[str, str]) -> dict[str, str]:
    """recorded name or label -> copy, as recorded name -> copy; NotVerifiable for a name the record lacks."""
    rows = recorded_inputs(recorded)
    by_name = {row.label: row.model for row in rows} | {row.model: row.model for row in rows}
    for name in inputs:
        if name not in by_name:
            said = ", ".join(f"{row.label} ({row.model})" if row.label != row.model else row.model for row in rows)
            raise NotVerifiable(f"--input {name}=...: ram_stats.json records no input {name} (it records {said})")
    return {by_name[name]: local for name, local in inputs.items()}


def _under(recorded: dict, value: str) -> dict[str, str]:
    """An `--inputs-from RECORDED_PARENT=LOCAL_PARENT` value as recorded input -> copy, for every input recorded
    under RECORDED_PARENT. Split at the one `=` whose left side is a parent of a recorded input (a parent may
    hold `=`)."""
    models = [row.model for row in recorded_inputs(recorded)]
    splits = []
    for i, char in enumerate(value):
        if char != "=" or not value[i + 1 :]:
            continue
        parent, local = value[:i].rstrip("/") or value[:i], value[i + 1 :].rstrip("/")
        under = {m: local + m[len(parent) :] for m in models if m == parent or m.startswith(parent + "/")}
        if under:
            splits.append((parent, under))
    if "=" not in value.strip("="):
        raise NotVerifiable(f"--inputs-from {value}: expected RECORDED_PARENT=LOCAL_PARENT")
    if not splits:
        raise NotVerifiable(
            f"--inputs-from {value}: no recorded input lies under {value.partition('=')[0]} (they are: "
            f"{', '.join(models)})"
        )
    if len(splits) > 1:
        raise NotVerifiable(
            f"--inputs-from {value}: {' and '.join(parent for parent, _ in splits)} could each be the recorded parent"
        )
    return splits[0][1]


def _add(found: dict[str, tuple[str, str]], model: str, local: str, option: str) -> None:
    if model in found:
        was, by = found[model]
        raise NotVerifiable(f"{by} and {option} both map {model} ({was} and {local}): give one local copy")
    found[model] = (local, option)


def _one_input_each(recorded: dict, copies: Mapping[str, tuple[str, str]]) -> None:
    """NotVerifiable (a usage error) when a copy is the place another input is read from: one given for two
    inputs, through two paths or links, or an input's own recorded folder. mergekit knows a model by its path, so
    the two would be planned as one model and the verdict would depend on which of them a set yields first
    (`PYTHONHASHSEED`). Checked in the record's order, the first pair named: the same line every run. Two inputs
    read as recorded are the merge's own business: only pairs with a copy in them are checked."""
    read_from: dict[str, tuple[Recorded, str, bool]] = {}  # real path -> (row, where it is read, whether a copy)
    for row in recorded_inputs(recorded):
        local, how = copies.get(row.model, (row.model, "as recorded"))
        if row.model not in copies and not os.path.exists(local):
            continue  # a hub id, or an input that is gone (its identity check names it)
        real = os.path.realpath(local)
        if real in read_from:
            other, other_how, other_copy = read_from[real]
            if other_copy or row.model in copies:
                raise NotVerifiable(
                    f"inputs {other.label} ({other.model}; {other_how}) and {row.label} ({row.model}; {how}) would "
                    f"both be read from {real}: mergekit would merge them as one model; give each input its own copy"
                )
        read_from.setdefault(real, (row, how, row.model in copies))


def _inside(folder: str, path: str) -> bool:
    """Whether `path` (a label joined to `folder`) stays inside `folder` by its name (a stranger's label may say
    `../x`)."""
    return os.path.commonpath([os.path.abspath(folder), os.path.abspath(path)]) == os.path.abspath(folder)


def missing_hint(copies: Mapping[str, str]) -> str:
    """What to say after a missing input: local copies can stand for the inputs."""
    return "" if copies else HINT
