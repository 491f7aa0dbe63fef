"""What a folder `mergekit-ram verify` is given publishes, against what its merge makes: on plain data, knowing
nothing of mergekit (`other_files` and `ramplus` call these once the merge has run again).

`ram_stats.json`'s statistics against the recomputed report (`report_differences`: exactly, but the diagnostics'
float sums to `SUM_TOLERANCE` of their size), `config.json` against the config the merge writes
(`config_differences`), the card's one visible RAM+ section (`card_problem`), files mergekit copies from an input
(`copied_files`), and the weight files another loader reads against those mergekit reads
(`other_view_differences`). Every file is read through `folder_checks` (regular files inside the folder only); which
files each loader reads is `loader_files`'.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram import errors
from mergekit_ram.errors import Unreadable
from mergekit_ram.verify.folder_checks import JSON_LIMIT, checked_path, read_bytes, read_json
from mergekit_ram.verify.loader_files import COPIED, PICKLES, weight_files

#: ram_stats.json's keys verify does not compare with the recomputed report: the versions and where mergekit-ram came
#: from (the installation's, not the merge's: a note), where the counts came from, the merge record (read to plan),
#: the inputs' labels and identities (checked apart)
NOT_RECOMPUTED = frozenset({"versions", "mergekit_ram_source", "statistics", "merge", "identity"})


#: How far a diagnostic float64 sum may lie from its recount, relative to its scale: the native loops, the torch
#: kernel (a GPU's, or verify's where no kernel is built) and other thread counts add in other orders, whose
#: rounding differs by far less (n·2^-53 of the sum of magnitudes for n terms; 1e-9 allows n up to ~10^7 per
#: block of sums). Counts, rho, lambda and every weight are compared exactly.
SUM_TOLERANCE = 1e-9
_SUMS = re.compile(
    r"(agents\[\d+\]\.magnitude_(unique|shared)|tensors\[\d+\]\.diagnostics\.magnitude\..*\[[01]\]"
    r"|tensors\[\d+\]\.diagnostics\.pairs\[\d+\]\[[56]\])"
)
_SHARES = re.compile(r"agents\[\d+\]\.magnitude_unique_share|pairs\[\d+\]\.cosine")
_PAIR_SUMS = re.compile(r"tensors\[\d+\]\.diagnostics\.pairs\[\d+\]")


def report_differences(recorded: Any, recomputed: Any, path: str = "") -> list[str]:
    """Where ram_stats.json (`recorded`) says otherwise than the report of the merge run again: one
    'path: ram_stats.json records X, recomputed Y' per differing leaf (keys in NOT_RECOMPUTED skipped; a
    diagnostic sum within SUM_TOLERANCE of its scale is the same)."""
    if isinstance(recorded, dict) and isinstance(recomputed, dict):
        found = []
        for key in sorted(set(recorded) | set(recomputed), key=str):
            if key in NOT_RECOMPUTED:
                continue
            where = f"{path}.{key}" if path else str(key)
            if key not in recomputed:
                found.append(f"{where}: ram_stats.json records it, the merge does not")
            elif key not in recorded:
                found.append(f"{where}: ram_stats.json lacks it")
            else:
                found += report_differences(recorded[key], recomputed[key], where)
        return found
    if isinstance(recorded, list) and isinstance(recomputed, list) and len(recorded) == len(recomputed):
        pair = len(recorded) == 7 and _PAIR_SUMS.fullmatch(path) is not None
        found = []
        for i, (a, b) in enumerate(zip(recorded, recomputed, strict=True)):
            if pair and i == 4:  # sum tau_a tau_b, at most sqrt(sum tau_a^2 * sum tau_b^2) in size
                scale = math.sqrt(abs(recorded[5] * recorded[6])) if _floats(recorded[5], recorded[6]) else None
                found += _leaf(a, b, f"{path}[4]", scale)
            else:
                found += report_differences(a, b, f"{path}[{i}]")
        return found
    scale = abs(recorded) if _floats(recorded) and _SUMS.fullmatch(path) else None
    return _leaf(recorded, recomputed, path, 1.0 if _SHARES.fullmatch(path) else scale)


def _floats(*values: Any) -> bool:
    return all(isinstance(v, float) for v in values)


def _leaf(recorded: Any, recomputed: Any, path: str, scale: float | None = None) -> list[str]:
    """[] when the values are the same (a float with a `scale`: within SUM_TOLERANCE of it), else the line."""
    if recorded == recomputed and type(recorded) is type(recomputed):
        return []
    if scale is not None and _floats(recorded, recomputed) and abs(recorded - recomputed) <= SUM_TOLERANCE * scale:
        return []
    return [f"{path}: ram_stats.json records {_brief(recorded)}, recomputed {_brief(recomputed)}"]


def _brief(value: Any) -> str:
    text = json.dumps(value, allow_nan=True)
    return text if len(text) <= 60 else text[:57] + "..."


def config_differences(published: Mapping[str, Any], expected: Mapping[str, Any], *, only: bool = False) -> list[str]:
    """`config.json` as published against the config the merge writes, one line per differing key
    (`only`: the published keys alone, as written: a key the merge does not write is named)."""
    found = []
    for key in sorted(set(published) if only else set(published) | set(expected)):
        if key not in published:
            found.append(f"config.json: {key} is absent, the merge writes {_brief(expected[key])}")
        elif key not in expected:
            found.append(f"config.json: {key} is {_brief(published[key])}, the merge writes none")
        elif published[key] != expected[key]:
            found.append(f"config.json: {key} is {_brief(published[key])}, the merge writes {_brief(expected[key])}")
    return found


_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*$")
_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9-]*)\b[^>]*?(/?)>")
#: HTML elements without content (never left open)
_VOID = frozenset(
    ("area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr")
)
#: what can hide a card's text from a reader while every element is closed
_HIDING = ("<style", "<script")


def front_matter_problems(text: str, expected: dict) -> list[str]:
    """Where the card `text`'s front matter (the YAML block a hub reads at its start) says otherwise than
    `expected` (`card.front_matter`: base_model, base_model_relation, tags) of those keys; one line each. The
    other keys (a license, languages) are the publisher's and are not compared; neither is an order."""
    import yaml

    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return ["it has no front matter; the merge writes one (base_model, base_model_relation, tags)"]
    try:
        meta = yaml.safe_load(text[4:].split("\n---\n", 1)[0])
    except yaml.YAMLError as error:
        return [f"its front matter is not YAML ({errors.said(error)[:120]})"]
    if not isinstance(meta, dict):
        return ["its front matter is not a YAML mapping"]
    found = []
    for key in ("base_model", "base_model_relation", "tags"):
        wanted, there = expected.get(key), meta.get(key)
        same = _as_set(there) == _as_set(wanted) if key != "base_model_relation" else there == wanted
        if not same:
            found.append(
                f"its front matter's {key} is {_said(there)}; the merge writes {_said(wanted)}"
                + (" (its inputs' hub ids: the model tree the Hub shows)" if key == "base_model" else "")
            )
    return found


def _as_set(value: Any) -> set[str] | bool | None:
    """A front matter value as a set of names (a hub takes one name or a list); False for anything else (a
    stranger's nested or aliased YAML is never printed or walked)."""
    if value is None:
        return None
    names = value if isinstance(value, list) else [value]
    return {v for v in names if isinstance(v, str)} if all(isinstance(v, str) for v in names) else False


def _said(value: Any) -> str:
    found = _as_set(value)
    if found is None:
        return "none"
    if found is False:
        return f"a {type(value).__name__} that is not a list of names"
    return f"[{', '.join(value)}]" if isinstance(value, list) else repr(value)[:200]


def card_problem(text: str, section: str) -> str | None:
    """None when the card `text` holds exactly one RAM+ section where a reader sees it (not in an HTML comment,
    a code block or an HTML element left open before it; no <style> or <script>), and that section (its heading
    to the next heading of its level or above) is `section`, the one the merge writes. Else what is wrong."""
    lines = _COMMENT.sub("", text).split("\n")
    fence: str | None = None
    headings: list[tuple[int, int]] = []  # (line, level) of every heading a reader sees, outside code
    found = []  # the RAM+ sections' first lines
    for i, line in enumerate(lines):
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        atx = _ATX.match(line)
        setext = i > 0 and _SETEXT.match(line) and lines[i - 1].strip() and not _ATX.match(lines[i - 1])
        if atx:
            headings.append((i, len(atx.group(1))))
            title = (atx.group(2) or "").strip()
        elif setext:
            headings.append((i - 1, 1 if line.strip()[0] == "=" else 2))
            title = lines[i - 1].strip()
        else:
            continue
        if title.lower() == "ram+ statistics":
            found.append(headings[-1][0])
    if not found:
        return "it has no RAM+ statistics section a reader sees, which the merge writes"
    if len(found) > 1:
        return f"it has {len(found)} RAM+ statistics sections a reader sees; the merge writes one"
    start = found[0]
    open_elements = _open_elements("\n".join(lines[:start]))
    if open_elements:
        return f"its RAM+ statistics section lies inside <{open_elements[0]}>, left open before it"
    visible = "\n".join(lines).lower()
    hiding = [tag for tag in _HIDING if tag in visible]
    if hiding:
        return f"it carries {hiding[0]}>, which can hide its RAM+ statistics section"
    level = next(lvl for i, lvl in headings if i == start)
    stop = next((i for i, lvl in headings if i > start and lvl <= level), len(lines))
    if "\n".join(lines[start:stop]).strip() != section.strip():
        return "its RAM+ statistics section is not the one this merge writes"
    return None


def _open_elements(html: str) -> list[str]:
    """The HTML elements `html` opens and does not close (void ones aside), innermost last."""
    stack: list[str] = []
    for closing, name, self_closing in _TAG.findall(html):
        name = name.lower()
        if name in _VOID or self_closing:
            continue
        if not closing:
            stack.append(name)
        elif name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name) :]
    return stack


def copied_files(folder: str, donor: str, names: Sequence[str] = COPIED) -> tuple[list[str], list[str]]:
    """The files of `names` in `folder` that mergekit copies from `donor` (a local folder): (identical to the
    donor's, differing from it). A file the donor lacks is in neither."""
    same: list[str] = []
    differ: list[str] = []
    for name in names:
        if not os.path.lexists(os.path.join(folder, name)) or not os.path.isfile(os.path.join(donor, name)):
            continue
        ours = read_bytes(folder, name, JSON_LIMIT)
        with open(os.path.join(donor, name), "rb") as f:
            theirs = f.read(JSON_LIMIT + 1)
        (same if ours == theirs else differ).append(name)
    return same, differ


def tensor_files(folder: str, choice: str) -> dict[str, str]:
    """tensor -> weight file, as a loader that reads `choice` (a single file or an index) sees `folder`."""
    if choice.endswith(".index.json"):
        weight_files(folder, choice)  # checks the map's file names
        return dict(read_json(folder, choice)["weight_map"])
    return dict.fromkeys(_load(folder, choice), choice)


class _Weights:
    """One weight file, each tensor read when asked: safetensors, or a pickle loaded weights-only (mapped)."""

    def __init__(self, folder: str, name: str):
        import torch
        from safetensors import safe_open

        path = checked_path(folder, name)
        try:
            if name.endswith(".safetensors"):
                self._file: Any = safe_open(path, framework="pt")
                self.names = set(self._file.keys())
            else:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                self._file = dict(loaded.get("state_dict", loaded)) if isinstance(loaded, dict) else {}
                self.names = set(self._file)
        except Exception as error:
            raise Unreadable(f"{path} cannot be read as weights ({type(error).__name__})") from error

    def get(self, name: str) -> Any:
        if name not in self.names:
            return None
        return self._file[name] if isinstance(self._file, dict) else self._file.get_tensor(name)


def _load(folder: str, name: str) -> set[str]:
    return _Weights(folder, name).names


def other_view_differences(folder: str, choices: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Where a loader reads other weight files than mergekit does (transformers a single file beside an index, or
    pickles with `use_safetensors=False`), the tensors it loads against those mergekit reads (which verify compared
    with the merge): (one line per finding, what was checked)."""
    from mergekit_ram.verify.bitwise import compare

    ours = choices.get("mergekit")
    found: list[str] = []
    checked: list[str] = []
    seen = tensor_files(folder, ours) if ours else {}
    loaded: dict[str, _Weights] = {}
    for theirs in sorted({c for loader, c in choices.items() if loader != "mergekit" and c != ours}):
        who = [loader for loader, choice in choices.items() if choice == theirs]
        said = f"{theirs} (what {' and '.join(_LOADERS[w] for w in who)} loads; mergekit reads {ours})"
        read = tensor_files(folder, theirs)
        before = len(found)
        found += [f"{said} lacks {n}" for n in sorted(set(seen) - set(read))[:3]]
        found += [f"{said} holds {n}, which mergekit does not read" for n in sorted(set(read) - set(seen))[:3]]
        differing = []
        for name in sorted(set(seen) & set(read)):
            for file in (seen[name], read[name]):
                if file not in loaded:
                    loaded[file] = _Weights(folder, file)
            if not compare(name, loaded[seen[name]].get(name), loaded[read[name]].get(name)).identical:
                differing.append(name)
        if differing:
            found.append(f"{said}: {len(differing)} tensor(s) differ from those mergekit reads, first {differing[0]}")
        if len(found) == before:
            checked.append(f"{theirs}, which {' and '.join(who)} loads instead of {ours}")
    return found, checked


_LOADERS = {
    "transformers": "transformers' from_pretrained",
    PICKLES: "transformers' from_pretrained with use_safetensors=False",
}
