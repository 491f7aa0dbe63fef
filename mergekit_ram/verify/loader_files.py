"""Which files of a folder each loader reads, for `mergekit-ram verify`: on plain data, knowing nothing of mergekit.

mergekit's, transformers' and transformers' without safetensors choice of weight files (`loader_choices`), the
weight files an index names (`weight_files`) and those it names but the folder lacks, or twice (`absent_shards`),
the pickled ones among them (`pickles`), the files beside them each
loader reads (`beside`: the config, a PEFT adapter (`ADAPTER`), the tokenizer's files mergekit copies (`COPIED`)),
and code (`is_code`). Every file is read through `folder_checks` (regular files inside the folder only), and
`check_files` checks each of them before anything opens one. `published_checks` compares what they hold with what
the merge makes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from mergekit_ram.errors import Unreadable
from mergekit_ram.verify.folder_checks import JSON_LIMIT, check_entries, checked_path, leaves, read_bytes, read_json

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


def check_files(folder: str, choices: Mapping[str, str]) -> None:
    """Every entry directly in `folder` (subfolders aside: `check_entries`) and every weight file a loader's choice
    (`choices`) names, at any depth, is one `checked_path` accepts: before anything opens one."""
    check_entries(folder)
    for choice in sorted(set(choices.values())):
        for name in weight_files(folder, choice):
            checked_path(folder, name)


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
        if leaves(name):
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


def pickles(folder: str, choices: Mapping[str, str]) -> list[str]:
    """The pickled weight files (not safetensors) a loader would read of `folder`."""
    names = {
        n
        for choice in choices.values()
        for n in ([choice] if not choice.endswith(".json") else weight_files(folder, choice))
    }
    return sorted(os.path.join(folder, n) for n in names if not n.endswith(".safetensors"))


def absent_shards(folder: str) -> list[str]:
    """One line per weight file an index of `folder` names that the folder does not hold (plain absence: no link,
    nothing opened), and per tensor an index names twice (JSON keeps the last: a sample would read one of two)."""
    out = []
    for choice in sorted(set(loader_choices(folder).values())):
        if choice.endswith(".index.json"):
            names = weight_files(folder, choice)
            absent = [name for name in names if not os.path.lexists(os.path.join(folder, name))]
            out += [f"{name}: {choice} names it, the folder does not hold it" for name in absent]
            out += [f"{name}: {choice} names it twice" for name in _twice(folder, choice)]
    return out


def _twice(folder: str, choice: str) -> list[str]:
    """The keys of an index's `weight_map` that it holds more than once."""
    seen: list[list[str]] = []

    def pairs(items: list) -> dict:
        seen.append([str(key) for key, _ in items])
        return dict(items)

    json.loads(read_bytes(folder, choice, JSON_LIMIT), object_pairs_hook=pairs)
    return sorted({key for keys in seen for key in keys if keys.count(key) > 1})
