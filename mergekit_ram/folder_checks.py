"""The files of a folder `mergekit-ram verify` is given, read as a stranger's: on plain data, knowing nothing
of mergekit.

A published folder is untrusted. One rule for every file a loader reads, wherever it lies (the folder's own
entries, the weight files an index names at any depth): it is opened only when it is a regular file inside
the folder (a link may point into the folder, or into a hub cache's blobs beside a snapshot: `homes`); a
FIFO, a device, a socket, a link leading elsewhere, dangling or looping is refused by name without being
opened (`checked_path`, `check_files`), and no byte of a refused or unreadable file is echoed. Our own
reads open with O_NONBLOCK and check the opened file again. JSON and YAML are read with a bounded size and
nesting. What the loaders would read is named here: mergekit's, transformers' and transformers' without
safetensors choice of weight files (`loader_choices`), the files beside them each loader reads (`BESIDE`),
a PEFT adapter (`ADAPTER`), code (`is_code`). The published statistics, `config.json`, the card's RAM+ section
and copied files are compared with what the merge makes (`report_differences`, `config_differences`,
`card_problem`, `copied_files`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram.errors import Unreadable

#: what verify reads of a metadata file at most (ram_stats.json of a large model is a few MB)
JSON_LIMIT = 256 << 20
TEXT_LIMIT = 16 << 20
#: nesting verify reads in JSON or YAML (what mergekit-ram writes is 6 deep)
DEPTH = 64
#: the weight files each loader looks for, in its order: (mergekit's from_disk, transformers' from_pretrained)
SINGLE = ("model.safetensors", "pytorch_model.bin")
#: what transformers' `from_pretrained` reads with `use_safetensors=False`, in its order
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: a PEFT adapter: transformers' `from_pretrained` applies one it finds beside the weights whenever peft is
#: importable (mergekit depends on it); a merge writes none
ADAPTER = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
#: files beside the weights a loader reads: transformers' `from_pretrained` (config, generation config, a PEFT
#: adapter) and a tokenizer's (the files mergekit copies, and the named chat templates of a subfolder)
CHAT_TEMPLATES = "additional_chat_templates"
#: files mergekit's `_copy_tokenizer` copies from the base (or the first model) byte for byte
COPIED = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "added_tokens.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
    "chat_template.json",
    "video_preprocessor_config.json",
)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))  # fmt: skip
    for test, name in kinds:
        if test(mode):
            return name
    return "not a regular file"


def homes(folder: str) -> list[str]:
    """Where a file read from `folder` may lie, links resolved: the folder; for a Hugging Face hub cache's
    snapshot (`.../models--org--name/snapshots/<revision>`, whose files are links to `../../blobs/<hash>`), also
    its repository's `blobs`."""
    real = os.path.realpath(folder)
    found = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        found.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return found


def checked_path(folder: str, name: str) -> str:
    """`folder/name` (`name` relative, at any depth) if it is a regular file inside the folder, links resolved
    into it (or a hub cache's blobs: `homes`); Unreadable naming it otherwise, without opening it: absent, a
    FIFO, a device, a socket, a folder, a name or link leading out of the folder, a dangling link, a loop."""
    path = os.path.join(folder, name)
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise Unreadable(f"{path} lies outside {folder}: not read")
    target = os.path.realpath(path)
    if not any(os.path.commonpath([home, target]) == home for home in homes(folder)):
        raise Unreadable(f"{path} is a link out of {folder}: not read")
    try:
        st = os.stat(path)
    except OSError as error:
        link = os.path.islink(path) or target != os.path.abspath(path)
        why = {errno.ENOENT: "a link to nothing" if link else "absent", errno.ELOOP: "a loop of links"}
        said = why.get(error.errno or 0, error.strerror or "unreadable")
        raise Unreadable(f"{path} is {said}: not read") from error
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(f"{path} is {_kind(st.st_mode)}: not read")
    return path


def check_files(folder: str, choices: Mapping[str, str]) -> None:
    """Every entry directly in `folder` (subfolders aside) and every weight file a loader's choice (`choices`)
    names, at any depth, is one `checked_path` accepts: before anything opens one."""
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if os.path.isdir(full) and not os.path.islink(full):
            continue
        if name.startswith(".") and name.endswith(".tmp"):
            continue  # a write in flight (ours, or mergekit's)
        checked_path(folder, name)
    for choice in sorted(set(choices.values())):
        for name in weight_files(folder, choice):
            checked_path(folder, name)


def read_bytes(folder: str, name: str, limit: int = TEXT_LIMIT) -> bytes:
    """The bytes of `folder/name` (`checked_path`), at most `limit`: Unreadable naming the file beyond that."""
    path = checked_path(folder, name)
    try:  # O_NONBLOCK: a FIFO put there since the check is not waited for, and refused
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # changed since it was checked
                raise Unreadable(f"{path} is not a regular file: not read")
            data = f.read(limit + 1)
    except OSError as error:
        raise Unreadable(f"{path} cannot be read ({error.strerror or type(error).__name__})") from error
    if len(data) > limit:
        raise Unreadable(f"{path} is larger than {limit >> 20} MiB: not read")
    return data


def read_json(folder: str, name: str, limit: int = JSON_LIMIT) -> Any:
    """`folder/name` parsed as JSON, bounded in size and nesting; Unreadable naming the file (never its bytes)."""
    path = os.path.join(folder, name)
    data = read_bytes(folder, name, limit)
    _check_depth(path, data, b"[{", b"]}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        where = f" (line {error.lineno}, column {error.colno})" if isinstance(error, json.JSONDecodeError) else ""
        raise Unreadable(f"{path} is not valid JSON{where}: is the folder damaged?") from error


def read_yaml(folder: str, name: str, limit: int = TEXT_LIMIT) -> Any:
    """`folder/name` parsed as YAML (safe_load), bounded in size and nesting; Unreadable naming the file and
    where YAML stopped (never its bytes)."""
    import yaml

    path = os.path.join(folder, name)
    data = read_bytes(folder, name, limit)
    _check_depth(path, data, b"[{", b"]}")
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as error:
        raise Unreadable(f"{path} is not YAML verify can read ({type(error).__name__})") from error
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise Unreadable(f"{path} is not valid YAML{where}") from error


def _check_depth(path: str, data: bytes, opening: bytes, closing: bytes) -> None:
    """Unreadable when brackets nest deeper than DEPTH (counted on the bytes: strings may hold brackets too, which
    only ever over-counts a file no mergekit-ram writes)."""
    depth = deepest = 0
    table = dict.fromkeys(opening, 1) | dict.fromkeys(closing, -1)
    for byte in data.translate(None, bytes(set(range(256)) - set(opening) - set(closing))):
        depth += table[byte]
        deepest = max(deepest, depth)
        if deepest > DEPTH:
            raise Unreadable(f"{path} nests deeper than {DEPTH} levels: not read")


# --------------------------------------------------------------------------- #
# Which weight files the loaders read
# --------------------------------------------------------------------------- #
def loader_choices(folder: str) -> dict[str, str]:
    """What each loader reads of `folder`: {"mergekit": file, "transformers": file, PICKLES: file}, each a single
    weight file or an index (`ShardedTensorIndex.from_disk` prefers an index beside its single file;
    transformers' `from_pretrained` prefers the single file, safetensors first; with `use_safetensors=False`,
    it reads `PICKLED`). A loader that finds nothing is left out."""
    found = {}
    for single in SINGLE:
        index = single + ".index.json"
        if "mergekit" not in found and (_exists(folder, single) or _exists(folder, index)):
            found["mergekit"] = index if _exists(folder, index) else single
        if "transformers" not in found:
            found["transformers"] = single if _exists(folder, single) else (index if _exists(folder, index) else "")
            if not found["transformers"]:
                del found["transformers"]
    pickled = next((name for name in PICKLED if _exists(folder, name)), None)
    if pickled is not None:
        found[PICKLES] = pickled
    return found


#: the loader `loader_choices` names for transformers' `from_pretrained(..., use_safetensors=False)`
PICKLES = "transformers with use_safetensors=False"


def _exists(folder: str, name: str) -> bool:
    return os.path.lexists(os.path.join(folder, name))


def weight_files(folder: str, choice: str) -> list[str]:
    """The weight files `choice` (a single file or an index) names, relative to `folder` (at any depth), each once."""
    if not choice.endswith(".index.json"):
        return [choice]
    index = read_json(folder, choice)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise Unreadable(f"{os.path.join(folder, choice)} has no weight_map of file names: is the folder damaged?")
    for name in set(weight_map.values()):
        if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
            raise Unreadable(f"{os.path.join(folder, choice)} names a weight file outside {folder}: not read")
    return sorted(set(weight_map.values()))


def beside(folder: str) -> list[str]:
    """The files beside the weights that a loader reads, present in `folder` (relative paths): `config.json`,
    `generation_config.json` and a PEFT adapter (transformers' `from_pretrained`), the tokenizer's files
    mergekit copies (`COPIED`) and its named chat templates (`additional_chat_templates/*.jinja`)."""
    names = [n for n in ("config.json", *COPIED, *ADAPTER) if _exists(folder, n)]
    templates = os.path.join(folder, CHAT_TEMPLATES)
    if os.path.islink(templates):
        names.append(CHAT_TEMPLATES)  # a loader follows it: named whole, never listed
    elif os.path.isdir(templates):
        names += [f"{CHAT_TEMPLATES}/{n}" for n in sorted(os.listdir(templates)) if n.endswith(".jinja")]
    return names


def is_code(name: str) -> bool:
    """A Python file: code transformers runs from the folder with `trust_remote_code` (a config's `auto_map`, a
    `custom_generate/`); a merge writes none."""
    return name.endswith(".py")


def files_under(folder: str, limit: int = 10_000) -> list[str]:
    """Every file under `folder` (relative paths; links not followed into folders), at most `limit`."""
    found: list[str] = []
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(top, folder)
        found += [name if rel == "." else os.path.join(rel, name) for name in sorted(names)]
        found += [os.path.join(rel, d) if rel != "." else d for d in dirs if os.path.islink(os.path.join(top, d))]
        if len(found) >= limit:
            return found[:limit]
    return found


# --------------------------------------------------------------------------- #
# What the folder publishes against what the merge makes
# --------------------------------------------------------------------------- #
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
        if not _exists(folder, name) or not os.path.isfile(os.path.join(donor, name)):
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
    from mergekit_ram.bitwise import compare

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


_LOADERS = {"transformers": "transformers' from_pretrained", PICKLES: "transformers' from_pretrained with "
            "use_safetensors=False"}  # fmt: skip


def pickles(folder: str, choices: Mapping[str, str]) -> list[str]:
    """The pickled weight files (not safetensors) a loader would read of `folder`."""
    names = {n for choice in choices.values() for n in ([choice] if not choice.endswith(".json") else
             weight_files(folder, choice))}  # fmt: skip
    return sorted(os.path.join(folder, n) for n in names if not n.endswith(".safetensors"))
